"""Tests for rlax_llm.console: the progress line, the summary table, phase lines, and a
command-line run whose terminal says what it is doing and shows no noise."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

from rlax_llm import console
from rlax_llm.console import ConsoleProgress

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What a run's terminal must not show (issue 42): jax's libtpu warning on a machine without
# TPUs, absl's prefixed INFO lines (warm-up progress every 50 steps), Orbax's chatter and its
# missing-metadata warning when evaluate reads a checkpoint.
NOISE = ("Unable to initialize backend 'tpu'", 'libtpu.so', '_CHECKPOINT_METADATA',
         'warmup step 50/80', 'orbax')
ABSL_INFO_PREFIX = re.compile(r'^I\d{4} \d\d:\d\d:\d\d\.\d+ ', re.MULTILINE)


def test_progress_line_has_an_eta_from_the_rate_of_written_steps(capsys, monkeypatch):
  clock = iter([100.0, 102.0, 104.0, 106.0])
  monkeypatch.setattr('rlax_llm.console.time.perf_counter', lambda: next(clock))
  progress = ConsoleProgress(total_steps=70, tty=False)
  for step in (10, 11, 12):  # a resumed run: the rate counts this process's steps
    progress.write(step, {'loss': 1.0})
  assert capsys.readouterr().out.splitlines() == [
    'step 10/70 (14%) | loss 1',
    'step 11/70 (15%) | loss 1 | ETA 1m58s',  # 2 s/step x 59 steps
    'step 12/70 (17%) | loss 1 | ETA 1m56s',
  ]


def test_progress_line_shows_the_keys_in_order_every_n_steps(capsys):
  progress = ConsoleProgress(every=2, keys=('kl', 'n', 'absent'), tty=False)
  for step in range(4):
    progress.write(step, {'n': 3, 'kl': 1234567.0, 'loss': 1.0})
  assert capsys.readouterr().out.splitlines() == ['step 0 | kl 1.235e+06 | n 3',
                                                  'step 2 | kl 1.235e+06 | n 3']


def test_on_a_terminal_the_line_is_rewritten_until_the_last_step(capsys):
  progress = ConsoleProgress(total_steps=3, tty=True)
  progress.write(1, {'loss': 1.0})
  progress.end_line()
  progress.end_line()  # only one newline for one open line
  progress.write(3, {'loss': 0.5})
  progress.end_line()  # nothing open: the last step ended its line
  assert capsys.readouterr().out == ('\r\033[Kstep 1/3 (33%) | loss 1\n'
                                     '\r\033[Kstep 3/3 (100%) | loss 0.5\n')


def test_summary_table_counts_finite_values_and_lists_the_summary_scalars(capsys):
  progress = ConsoleProgress(tty=True, total_steps=4)
  for step, loss in enumerate([2.0, float('nan'), -1.0, 0.5], 1):
    progress.write(step, {'loss': loss, 'grad_norm': 3, 'other': 1.0})
  capsys.readouterr()
  progress.print_summary({'steps': 4, 'diverged': False, 'model': 'tiny', 'time/total_s': 12.5})
  assert capsys.readouterr().out.splitlines() == [
    'run summary',
    '  metric          first       last        min        max',
    '  loss                2        0.5         -1          2',
    '  grad_norm           3          3          3          3',
    '  steps                  4',
    '  time/total_s        12.5',
  ]


@pytest.mark.parametrize('kwargs, message', [
    ({'every': 0}, 'console_every must be an int >= 1, got 0'),
    ({'every': True}, 'console_every must be an int >= 1, got True'),
    ({'keys': 'loss'}, "console_keys must be a sequence of keys, got the string 'loss'"),
])
def test_progress_arguments_are_validated(kwargs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    ConsoleProgress(**kwargs)


def _record(name, msg, args=(), level=logging.INFO, pathname='x.py'):
  return logging.LogRecord(name, level, pathname, 1, msg, args, None)


def test_the_dropped_records_are_exactly_the_noise(monkeypatch):
  drop = console._DROPPED  # pylint: disable=protected-access
  tpu = _record('jax._src.xla_bridge', "Unable to initialize backend '%s': %s",
                ('tpu', 'INTERNAL: Failed to open libtpu.so: ...'))
  monkeypatch.setattr(console, '_has_tpu_devices', lambda: False)
  assert drop['jax._src.xla_bridge'](tpu)
  assert not drop['jax._src.xla_bridge'](_record('jax._src.xla_bridge', 'other news'))
  monkeypatch.setattr(console, '_has_tpu_devices', lambda: True)
  assert not drop['jax._src.xla_bridge'](tpu)  # on a TPU host it explains a CPU fallback
  progress = 'warmup step %d/%d | loss %.4f | token accuracy %.3f'
  assert drop[''](_record('root', progress, (50, 2000, 1.0, 0.5)))
  assert not drop[''](_record('root', progress, (2000, 2000, 0.1, 0.9)))  # the result stays
  assert not drop[''](_record('root', 'RL starting point: %s', ({},)))
  orbax = '/site-packages/orbax/checkpoint/_src/checkpointer.py'
  assert drop['absl'](_record('absl', 'Finished saving', pathname=orbax))
  assert not drop['absl'](_record('absl', 'slow', level=logging.WARNING, pathname=orbax))


@pytest.mark.parametrize('case, expected', [
    ('no chips, libtpu installed', 'cpu'),
    ('user chose', 'tpu'),  # JAX_PLATFORMS set: left as it is
    ('tpu chips', None),
    ('no libtpu', None),
    ('gpu plugin', None),
])
def test_cpu_is_chosen_only_where_libtpu_could_only_print_errors(monkeypatch, case, expected):
  """libtpu installed on a machine without TPU chips prints start-up errors before jax falls
  back to the CPU: there (and only there, with nothing chosen by the user) the entry points
  set JAX_PLATFORMS=cpu."""
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  monkeypatch.delenv('JAX_FORCE_TPU_INIT', raising=False)
  if case == 'user chose':
    monkeypatch.setenv('JAX_PLATFORMS', 'tpu')
  monkeypatch.setattr(console, '_has_tpu_devices', lambda: case == 'tpu chips')
  real_find_spec = console.importlib.util.find_spec
  def find_spec(name):
    if name == 'libtpu':
      return None if case == 'no libtpu' else object()
    if name == 'jax_plugins':
      return object() if case == 'gpu plugin' else None
    return real_find_spec(name)
  monkeypatch.setattr(console.importlib.util, 'find_spec', find_spec)
  monkeypatch.setattr(console.importlib.metadata, 'entry_points', lambda group: [])
  # In this process jax runs on the CPU already (tests/conftest.py): a config update is a no-op.
  console._cpu_where_no_accelerator()  # pylint: disable=protected-access
  assert os.environ.get('JAX_PLATFORMS') == expected


def test_phase_is_an_info_record_of_the_phase_logger(caplog):
  with caplog.at_level(logging.INFO, logger=console.PHASE_LOGGER):
    console.phase('loading the model tiny')
  assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
      (console.PHASE_LOGGER, logging.INFO, 'loading the model tiny')]


def _run(module, *args):
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  env.pop('JAX_PLATFORMS', None)  # as a user runs it: jax tries (and fails) to open libtpu
  env.pop('RLAX_LLM_WARMUP_CACHE', None)  # and with no warm-up cache (tests/conftest.py's)
  result = subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


@pytest.fixture(scope='module')
def smoke_run_and_evaluate(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('console') / 'run'
  run = _run('rlax_llm.launch', '--config=configs/default.py:smoke', '--config.total_steps=1',
             f'--workdir={workdir}')
  evaluation = _run('rlax_llm.evaluate', '--config=configs/default.py:smoke',
                    f'--checkpoint={workdir}')
  return run, evaluation


def test_a_run_says_what_it_is_doing_and_shows_no_noise(smoke_run_and_evaluate):
  run, _ = smoke_run_and_evaluate
  for noise in NOISE:
    assert noise.lower() not in (run.stdout + run.stderr).lower(), (noise, run.stderr)
  assert not ABSL_INFO_PREFIX.search(run.stderr), run.stderr
  phases = [line for line in run.stderr.splitlines() if line.startswith('rlax_llm: ')]
  assert phases == [
      'rlax_llm: loading the model tiny',
      "rlax_llm: warm-up: 80 supervised steps on the task's demonstrations",
      'rlax_llm: evaluating on 16 held-out prompts (greedy)',  # the RL starting point
      'rlax_llm: compiling the first RL step (this takes a minute on CPU for a real model)',
      'rlax_llm: evaluating on 16 held-out prompts (greedy)',  # the final evaluation
  ], run.stderr
  assert 'warmup step 80/80 | loss ' in run.stderr  # the warm-up's result stays
  assert run.stdout.startswith('step 1/1 (100%) | reward/mean ')


def test_evaluating_a_checkpoint_says_what_it_does_and_shows_no_noise(smoke_run_and_evaluate):
  _, evaluation = smoke_run_and_evaluate
  for noise in NOISE:
    assert noise.lower() not in (evaluation.stdout + evaluation.stderr).lower(), noise
  assert evaluation.stderr.splitlines() == [
      'rlax_llm: loading the model tiny',
      'rlax_llm: evaluating on 16 held-out prompts (greedy)']
  assert json.loads(evaluation.stdout)['eval/accuracy'] >= 0.0  # stdout: one JSON line
