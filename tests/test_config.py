"""Config contract: every config in configs/ has the keys users rely on and validates."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from rlax_llm.cli import (DEFAULT_CONFIG_PATH, check_config_spec, check_override_keys,
                          config_variants, load_config_file)
from rlax_llm.config import REQUIRED_KEYS, RunSpec, check_resume_config, run_spec, validate_config
from rlax_llm.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted(ROOT.glob('configs/*.py'))


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
  """Config specs like 'configs/default.py' are relative to the repository root."""
  monkeypatch.chdir(ROOT)


CASES = [(path, variant) for path in CONFIGS for variant in (None, *config_variants(path))]


@pytest.mark.parametrize('path, variant', CASES,
                         ids=lambda x: x.name if isinstance(x, pathlib.Path) else str(x))
def test_every_config_and_variant_validates_and_prepares(path, variant):
  """Every shipped config passes every check a launch makes before compute, model files and
  tokenizer included (roles.prepare)."""
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
  roles.prepare(config)


def test_missing_key_names_it():
  config = load_config_file(str(CONFIGS[0]))
  del config.rl['group_size']
  with pytest.raises(ConfigError, match=r"'rl.group_size' is missing.*fields there"):
    validate_config(config)


def test_bad_staleness():
  config = load_config_file(str(CONFIGS[0]))
  config.staleness.k = 0
  with pytest.raises(ConfigError, match='staleness'):
    validate_config(config)


def test_staleness_schedule():
  """'deterministic' is the default; 'free' is refused where it cannot work (inline roles:
  nothing is pushed while a batch is generated; checkpoints: a run that depends on timing
  cannot be resumed exactly), and the error names the value and the fix."""
  config = load_config_file(str(CONFIGS[0]))
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
  config = load_config_file(str(CONFIGS[0]))
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
