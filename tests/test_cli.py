"""The command-line boundary (rlax_llm/cli.py): jax-free, one loader for every entry point, the
packaged configs, and a run's saved config.json read back with its types."""

import json
import pathlib
import subprocess
import sys

import pytest

from rlax_llm import cli
from rlax_llm.config import validate_config
from rlax_llm.errors import ConfigError, Preempted
from rlax_llm.run_config import config_changes, saved_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize('module', ['rlax_llm.config', 'rlax_llm.cli'])
def test_importing_the_config_boundary_loads_no_jax_flax_or_model_code(module):
  code = (f'import sys, {module}\n'
          "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')\n"
          "               or m.startswith(('rlax_llm.models', 'rlax_llm.losses')))\n"
          'print(heavy)')
  result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
  assert result.stdout.strip() == '[]', result.stdout


def test_the_default_config_ships_in_the_package_and_configs_links_to_it():
  assert cli.DEFAULT_CONFIG_PATH == ROOT / 'rlax_llm' / 'configs' / 'default.py'
  assert cli.DEFAULT_CONFIG_PATH.is_file()
  assert (ROOT / 'configs').resolve() == cli.CONFIG_DIR
  assert cli.load_config_file('configs/default.py:smoke').name == 'default_smoke'


def test_split_config_args_keeps_the_rest_in_order():
  ours, rest = cli.split_config_args(
      ['--workdir=/w', '--config', 'c.py:v', '--config.seed=3', '--print_config',
       '--config=d.py', '--', '--config.x=1'])
  assert ours == ['--config', 'c.py:v', '--config.seed=3', '--config=d.py']
  assert rest == ['--workdir=/w', '--print_config', '--', '--config.x=1']


def test_load_config_applies_overrides_and_locks():
  config = cli.load_config([f'--config={cli.DEFAULT_CONFIG_PATH}:smoke', '--config.seed=7',
                            "--config.ray.trainer_resources={'TPU': 4}"])
  assert config.name == 'default_smoke' and config.seed == 7
  assert config.ray.trainer_resources.to_dict() == {'TPU': 4}
  with pytest.raises(AttributeError):
    config.new_key = 1  # locked: a typo cannot add a field
  assert cli.load_config([]).name == 'default'  # no --config: the packaged default
  with pytest.raises(SystemExit, match="error: --config.rl.los: unknown config key 'rl.los'"):
    cli.load_config(['--config.rl.los=grpo'])
  with pytest.raises(SystemExit, match="error: --config.seed='x': expected type int"):
    cli.load_config(['--config.seed=x'])


def test_a_saved_config_reads_back_equal_typed_and_overridable():
  """A run's config.json becomes the config it was (validates, compares equal), its null
  placeholders keep their types, so overrides of them parse, and a task with other fields
  than the default's keeps exactly its own."""
  for spec in ('configs/default.py:smoke', 'configs/smollm2.py:countdown'):
    original = cli.load_config_file(spec)
    saved = json.loads(original.to_json_best_effort())
    config = saved_config(saved)
    assert json.loads(config.to_json_best_effort()) == saved, spec
    assert not config_changes(saved, config, ())
    validate_config(config)
  config = cli.load_config(['--config.model.path=/x.gguf', '--config.eval.samples=4'],
                           base=saved_config(saved))
  assert config.model.path == '/x.gguf' and config.eval.samples == 4
  assert config.task.name == 'countdown' and 'max_operand' not in config.task
  saved['rl']['retired_option'] = 3  # a key this version no longer reads
  assert 'retired_option' not in saved_config(saved).rl


def test_a_config_file_missing_a_schema_key_or_with_an_unknown_one_is_refused():
  config = cli.load_config_file('configs/default.py:smoke')
  del config.rollout['replay']
  with pytest.raises(ConfigError, match=r"'rollout.replay' is missing: 'rollout' has no field "
                                        r"'replay'"):
    validate_config(config)
  config = cli.load_config_file('configs/default.py:smoke')
  config.rl.group_sise = 4
  with pytest.raises(ConfigError, match=r"config key 'rl.group_sise' is not a config field.*"
                                        r'Did you mean rl.group_size'):
    validate_config(config)


def _define(values):
  from absl import flags  # pylint: disable=import-outside-toplevel
  return {'checkpoint': cli.checkpoint_flag(values, 'evaluate'),
          'port': flags.DEFINE_integer('port', 8000, 'Port.', flag_values=values)}


def test_a_command_line_splits_config_arguments_from_the_entry_points_flags():
  command = cli.command_line(['prog', '--config=configs/default.py:smoke', '--port=9',
                              '--config.seed=3', '--checkpoint=/tmp/run'],
                             lambda: 'usage', _define)
  assert command.config_args == ['--config=configs/default.py:smoke', '--config.seed=3']
  assert command.values == {'checkpoint': '/tmp/run', 'port': 9}
  assert command.rest == []


def test_a_command_line_asking_for_help_prints_the_usage_before_reading_anything(capsys):
  assert cli.command_line(['prog', '--config=no_such_file.py', '--port=x', '-h'],
                          lambda: 'usage: prog\n', _define) is None
  assert capsys.readouterr().out == 'usage: prog\n'
  assert cli.command_line(['prog', '--', '--help'], lambda: 'usage', _define,
                          known_only=True).rest == ['--', '--help']


@pytest.mark.parametrize('flag', ['--helpfull', '--helpshort'])
def test_absls_help_flags_print_the_usage_where_app_run_does_not_answer_them(capsys, flag):
  """evaluate and serve run without absl's app.run: its help flags print their usage
  (they were refused as unknown flags); launch (known_only) leaves them to app.run."""
  assert cli.command_line(['prog', flag], lambda: 'usage: prog\n', _define) is None
  assert capsys.readouterr().out == 'usage: prog\n'
  assert cli.command_line(['prog', flag], lambda: 'usage', _define,
                          known_only=True).rest == [flag]


def test_a_bad_flag_exits_with_one_line_unless_left_to_absl():
  with pytest.raises(SystemExit, match=r"^error: flag --port=x: invalid literal for int"):
    cli.command_line(['prog', '--port=x'], lambda: 'usage', _define)
  with pytest.raises(SystemExit, match=r"^error: .*Unknown command line flag 'workdirr'"):
    cli.command_line(['prog', '--workdirr=/tmp'], lambda: 'usage', _define)
  command = cli.command_line(['prog', '--verbosity=1', '--port=9'], lambda: 'usage', _define,
                             known_only=True)
  assert command.rest == ['--verbosity=1'] and command.values['port'] == 9


def test_one_line_errors_turns_an_rlax_error_into_exit_1_and_prints_a_preemption(capsys):
  with pytest.raises(SystemExit) as exit_info:
    with cli.one_line_errors():
      raise ConfigError('config.rl.loss is wrong; set it to grpo.')
  assert exit_info.value.code == 'error: config.rl.loss is wrong; set it to grpo.'
  with cli.one_line_errors():
    raise Preempted('preempted after step 3.')
  assert capsys.readouterr().out == 'preempted after step 3.\n'
  with pytest.raises(ValueError, match='not ours'):  # anything else is a bug: a traceback
    with cli.one_line_errors():
      raise ValueError('not ours')
