"""Optional dependencies (rlax_llm/extras.py): each is an extra of pyproject.toml, a missing one
is a one-line ``MissingExtra`` naming it at every import site and before a launch's compute,
and the default config runs with none of them.

A missing package is simulated in-process with ``sys.modules[name] = None`` (an import of it
then fails) and in a subprocess with a ``sys.meta_path`` finder that refuses it (``_BLOCKED``).
"""

import importlib
import inspect
import pathlib
import subprocess
import sys
import tomllib

import pytest

from rlax_llm import extras, storage
from rlax_llm.errors import MissingExtra, RlaxError
from rlax_llm.tasks import MathTask
from smoke_config import smoke_config  # tests/smoke_config.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
# The distributions of the optional packages (pip names) that the core install must not hold.
OPTIONAL_DISTRIBUTIONS = ('ray', 'gcsfs', 'gymnasium', 'math-verify', 'fastapi', 'uvicorn',
                          'openai', 'pyarrow')


def _block(monkeypatch, *modules: str) -> None:
  """Makes ``modules`` (and their loaded submodules) fail to import in this process."""
  for name in list(sys.modules):
    if name.partition('.')[0] in modules:
      monkeypatch.setitem(sys.modules, name, None)
  for name in modules:
    monkeypatch.setitem(sys.modules, name, None)


def _one_line(error: BaseException) -> str:
  message = str(error)
  assert '\n' not in message, message
  return message


# --- the table and pyproject.toml ---


def test_every_extra_is_in_pyproject_and_the_core_holds_none_of_them():
  optional = PROJECT['optional-dependencies']
  assert set(extras.MODULES) <= set(optional), sorted(set(extras.MODULES) - set(optional))
  core = [r.split('[')[0].split('>')[0].split('<')[0].split('=')[0].strip()
          for r in PROJECT['dependencies']]
  assert not set(core) & set(OPTIONAL_DISTRIBUTIONS), core
  assert optional['ray'][0].startswith('ray>=')
  assert optional['gcs'][0].startswith('gcsfs>=')
  assert optional['envs'][0].startswith('gymnasium>=')
  assert optional['math'][0].startswith('math-verify>=')
  assert optional['all'] == ['rlax_llm[ray,gcs,envs,math,serve,data]']
  assert 'rlax_llm[all]' in optional['test']  # the tests exercise every optional feature


def test_gcs_paths_and_the_math_default_agree_with_their_owners():
  for url in ('gs://bucket/run', 'gcs://bucket/run', '/tmp/run', 'runs/gs://x'):
    assert storage.is_gcs(url) == ('gcs' in extras.needed({}, [url])), url
  assert inspect.signature(MathTask).parameters['scorer'].default == 'math'


def test_install_command_names_the_extras_and_jetstreams_second_step():
  assert extras.install_command('ray') == "pip install 'rlax_llm[ray]'"
  assert extras.install_command('ray', 'envs', 'ray') == "pip install 'rlax_llm[ray,envs]'"
  assert extras.install_command('jetstream') == (
      "pip install 'rlax_llm[jetstream]' and pip install --no-deps 'google-jetstream==0.2.2'")
  with pytest.raises(ValueError, match=r"unknown or no extras \['gym'\]"):
    extras.install_command('gym')
  assert extras.extra_of('gymnasium.envs.toy_text') == 'envs'
  with pytest.raises(ValueError, match="no extra installs 'numpy'"):
    extras.extra_of('numpy')


# --- require ---


def test_require_imports_an_installed_package():
  assert extras.require('gymnasium.envs.toy_text.frozen_lake', 'x').__name__ == (
      'gymnasium.envs.toy_text.frozen_lake')


def test_require_names_the_extra_in_one_line(monkeypatch):
  _block(monkeypatch, 'ray')
  with pytest.raises(MissingExtra) as caught:
    extras.require('ray', "backend='ray'")
  assert _one_line(caught.value) == "backend='ray' needs the ray extra: pip install 'rlax_llm[ray]'"
  assert isinstance(caught.value, RlaxError) and isinstance(caught.value, ImportError)


def test_require_says_what_an_installed_package_failed_to_import(monkeypatch, tmp_path):
  package = tmp_path / 'rlax_fake_optional'
  package.mkdir()
  (package / '__init__.py').write_text('import rlax_fake_missing_dependency\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(extras.EXTRAS, 'rlax_fake_optional', 'serve')
  with pytest.raises(MissingExtra) as caught:
    extras.require('rlax_fake_optional', 'the test')
  assert _one_line(caught.value) == (
      "the test needs the serve extra: pip install 'rlax_llm[serve]' (rlax_fake_optional is "
      "installed but does not import: No module named 'rlax_fake_missing_dependency')")


def test_available_looks_without_importing(monkeypatch):
  monkeypatch.delitem(sys.modules, 'math_verify', raising=False)
  assert extras.available('math_verify') and 'math_verify' not in sys.modules
  _block(monkeypatch, 'math_verify')
  assert not extras.available('math_verify')
  assert not extras.available('rlax_no_such_package')


# --- each import site ---


def test_ray_backend_without_ray(monkeypatch):
  from rlax_llm.backends import ray as ray_backend
  _block(monkeypatch, 'ray')
  with pytest.raises(MissingExtra) as caught:
    ray_backend.import_ray()
  assert _one_line(caught.value) == (
      "backend='ray' needs the ray extra: pip install 'rlax_llm[ray]'")


def test_gs_path_without_gcsfs(monkeypatch):
  _block(monkeypatch, 'gcsfs')
  monkeypatch.setattr(storage, '_FS', {})
  with pytest.raises(MissingExtra) as caught:
    storage.path('gs://bucket/run')
  assert _one_line(caught.value) == (
      "a gs:// path needs the gcs extra: pip install 'rlax_llm[gcs]'")
  assert storage.path('local/run').name == 'run'  # local paths need nothing


def test_grid_env_without_gymnasium(monkeypatch):
  from rlax_llm.envs import GridEnv, make_env
  _block(monkeypatch, 'gymnasium')
  with pytest.raises(MissingExtra) as caught:
    make_env({'name': 'grid'})
  assert _one_line(caught.value) == (
      "env.name='grid' needs the envs extra: pip install 'rlax_llm[envs]'")
  with pytest.raises(MissingExtra):
    GridEnv(size=3)


@pytest.mark.parametrize('module, blocked', [
    ('rlax_llm.serve.http_server', 'fastapi'),
    ('rlax_llm.serve.http_server', 'uvicorn'),
    ('rlax_llm.serve.openai_api', 'fastapi'),
])
def test_endpoint_without_the_serve_extra(monkeypatch, module, blocked):
  for name in ('rlax_llm.serve.http_server', 'rlax_llm.serve.openai_api'):
    monkeypatch.delitem(sys.modules, name, raising=False)
  _block(monkeypatch, blocked)
  with pytest.raises(MissingExtra) as caught:
    importlib.import_module(module)
  assert _one_line(caught.value) == (
      "the OpenAI-compatible endpoint needs the serve extra: pip install 'rlax_llm[serve]'")


def test_harness_runner_without_openai(monkeypatch):
  importlib.import_module('rlax_llm.serve.openai_api')  # its own packages are there
  monkeypatch.delitem(sys.modules, 'rlax_llm.serve.harness_runner', raising=False)
  _block(monkeypatch, 'openai')
  with pytest.raises(MissingExtra) as caught:
    importlib.import_module('rlax_llm.serve.harness_runner')
  assert _one_line(caught.value) == (
      "env.name='harness' needs the serve extra: pip install 'rlax_llm[serve]'")


def test_jetstream_adapter_without_jetstream(monkeypatch):
  from rlax_llm.rollout import jetstream_adapter
  _block(monkeypatch, 'jetstream')
  with pytest.raises(MissingExtra) as caught:
    jetstream_adapter.import_jetstream()
  assert _one_line(caught.value) == (
      "the JetStream adapter needs the jetstream extra: pip install 'rlax_llm[jetstream]' and "
      "pip install --no-deps 'google-jetstream==0.2.2'")


def test_parquet_without_pyarrow(monkeypatch, tmp_path):
  from rlax_llm.tasks import files
  path = tmp_path / 'train.parquet'
  path.write_bytes(b'PAR1')
  _block(monkeypatch, 'pyarrow')
  with pytest.raises(MissingExtra) as caught:
    files.load_records(str(path), ['question'])
  assert _one_line(caught.value) == (
      f"reading the Parquet file {path} needs the data extra: pip install 'rlax_llm[data]'")


# --- what a config needs ---


def test_the_default_config_needs_no_extra():
  assert extras.needed(smoke_config(), ['runs/x']) == {}
  extras.check_config(smoke_config(), ['runs/x', None])


def test_needed_follows_the_config():
  config = smoke_config(backend='ray', env__name='grid')
  assert extras.needed(config, ['gs://b/run']) == {
      'ray': "backend='ray'", 'gcs': "the gs:// path 'gs://b/run'",
      'envs': "env.name='grid'"}
  assert extras.needed(config, backend=False) == {'envs': "env.name='grid'"}
  assert list(extras.needed(smoke_config(model__path='gs://b/model'))) == ['gcs']
  assert extras.needed(smoke_config(env__name='harness')) == {
      'serve': "env.name='harness' (the endpoint its agent harness calls)"}
  math = smoke_config()
  math.task = {'name': 'math', 'path': 'train.jsonl'}  # MathTask's default scorer: 'math'
  assert list(extras.needed(math)) == ['math']
  math.task['scorer'] = 'exact'
  assert extras.needed(math) == {}


def test_parquet_data_and_hub_datasets_need_the_data_extra():
  def task(**fields):
    return {'backend': 'local', 'task': {'name': 'math', 'scorer': 'exact', **fields}}

  assert extras.needed(task(path='data/train-*.parquet', eval_path='test.jsonl')) == {
      'data': "the Parquet data 'data/train-*.parquet'"}
  # A list of files: any Parquet one counts.
  assert extras.needed(task(path=['a.jsonl', 'b.pq'])) == {'data': "the Parquet data 'b.pq'"}
  assert extras.needed(task(path='hf://datasets/org/mbpp@main')) == {
      'data': "the hub dataset 'hf://datasets/org/mbpp@main'"}
  assert extras.needed(task(path='train.jsonl.gz', eval_path='test.json')) == {}
  from rlax_llm.tasks import files, hub_datasets  # the suffixes and prefix the tasks read
  assert hub_datasets.is_hub_url('hf://datasets/org/mbpp')
  assert not any(name.endswith(extras.PARQUET_SUFFIXES) for name in files.JSONL_SUFFIXES)


def test_check_config_refuses_parquet_data_without_pyarrow(monkeypatch):
  _block(monkeypatch, 'pyarrow')
  config = smoke_config()
  config.task = {'name': 'math', 'scorer': 'exact', 'path': 'hf://datasets/org/gsm8k'}
  with pytest.raises(MissingExtra) as caught:
    extras.check_config(config)
  assert _one_line(caught.value) == (
      "the hub dataset 'hf://datasets/org/gsm8k' needs the data extra: "
      "pip install 'rlax_llm[data]'")


def test_check_config_refuses_every_missing_extra_in_one_line(monkeypatch):
  _block(monkeypatch, 'ray', 'gymnasium', 'math_verify')
  config = smoke_config(backend='ray', env__name='grid')
  with pytest.raises(MissingExtra) as caught:
    extras.check_config(config, ['gs://bucket/run'])  # gcsfs is installed
  assert _one_line(caught.value) == (
      "backend='ray' needs the ray extra, env.name='grid' needs the envs extra: "
      "pip install 'rlax_llm[ray,envs]'")
  with pytest.raises(MissingExtra, match=r"rlax_llm\[envs\]'$"):
    extras.check_config(config, backend=False)


def test_evaluation_checks_before_it_validates(monkeypatch):
  from rlax_llm import evaluate
  _block(monkeypatch, 'gymnasium')
  with pytest.raises(MissingExtra, match="env.name='grid' needs the envs extra"):
    evaluate.policy_worker(smoke_config(env__name='grid'))


# --- the command line, with the optional packages refused ---

_BLOCKED = '''
import runpy, sys
BLOCKED = set(sys.argv[1].split(','))
class Refuse:
  def find_spec(self, name, path=None, target=None):
    if name.partition('.')[0] in BLOCKED:
      raise ModuleNotFoundError(f'No module named {name!r} (refused)', name=name)
    return None
sys.meta_path.insert(0, Refuse())
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
'''


def _run_without(blocked, module, *args, timeout=170):
  return subprocess.run([sys.executable, '-c', _BLOCKED, ','.join(blocked), module, *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_default_launch_path_needs_no_extra(tmp_path):
  """The default config's smoke variant, every optional package refused: it builds the run,
  evaluates and finishes (0 RL steps: the RL step's compile is test_launch.py's)."""
  result = _run_without(
      extras.EXTRAS, 'rlax_llm.launch', '--config=configs/default.py:smoke',
      '--config.total_steps=0', '--config.warmup.steps=0', '--config.task.num_eval=4',
      '--config.checkpoint.every_steps=0', '--config.checkpoint.every_seconds=0',
      '--config.log.tensorboard=false', '--config.rollout.slots=8', f'--workdir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'held-out greedy accuracy' in result.stdout, result.stdout


@pytest.mark.slow
def test_the_default_smoke_run_needs_no_extra(tmp_path):
  """The whole smoke variant (warm-up, one RL step, checkpoints) with every optional package
  refused; test_the_default_launch_path_needs_no_extra is its CI counterpart."""
  result = _run_without(extras.EXTRAS, 'rlax_llm.launch', '--config=configs/default.py:smoke',
                        '--config.total_steps=1', f'--workdir={tmp_path}', timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'held-out greedy accuracy' in result.stdout, result.stdout


def test_a_ray_launch_without_ray_fails_in_one_line(tmp_path):
  result = _run_without(['ray'], 'rlax_llm.launch', '--config=configs/default.py:smoke',
                        '--config.backend=ray', f'--workdir={tmp_path / "run"}', timeout=120)
  assert result.returncode == 1, (result.stdout, result.stderr[-3000:])
  assert result.stderr.splitlines()[-1] == (
      "error: backend='ray' needs the ray extra: pip install 'rlax_llm[ray]'"), result.stderr
  assert 'Traceback' not in result.stderr, result.stderr
  assert not (tmp_path / 'run').exists()  # refused before the workdir is claimed


def test_the_endpoint_without_the_serve_extra_fails_in_one_line():
  result = _run_without(['fastapi'], 'rlax_llm.serve', '--config=configs/default.py:smoke',
                        timeout=120)
  assert result.returncode == 1, (result.stdout, result.stderr[-3000:])
  assert result.stderr.splitlines()[-1] == (
      "error: the OpenAI-compatible endpoint needs the serve extra: "
      "pip install 'rlax_llm[serve]'"), result.stderr
  assert 'Traceback' not in result.stderr, result.stderr
