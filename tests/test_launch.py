"""The launch CLI end to end: a short run writes the workdir contract; bad flags fail fast."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from rlax_llm.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _launch(*args, timeout=300, env=None):
  env = dict(os.environ) | (env or {})
  env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
  return subprocess.run([sys.executable, '-m', 'rlax_llm.launch', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope='module')
def smoke_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('run') / 'wd'
  result = _launch('--config=configs/default.py:smoke', '--config.total_steps=4',
                   f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, result


def test_run_writes_config_metrics_and_events(smoke_run):
  workdir, _ = smoke_run
  config = json.loads((workdir / 'config.json').read_text())
  assert config['total_steps'] == 4 and config['rl']['loss'] == 'grpo'
  rows = read_metrics(workdir / 'metrics.jsonl')
  assert [r['step'] for r in rows] == [1, 2, 3, 4]
  for row in rows:
    for key in ('reward/mean', 'loss', 'time/step_s', 'staleness/mean', 'entropy',
                'clip_fraction', 'grad_norm'):
      assert key in row, (key, row)
    assert 0.0 <= row['reward/mean'] <= 1.0
    assert row['staleness/mean'] == 0.0  # synchronous: every rollout is on-policy
    assert row['version'] == row['step']
  # eval every 2 steps (smoke variant) and at the end, with the start/final figures last.
  assert 'eval/accuracy' in rows[1] and 'eval/accuracy' not in rows[0]
  last = rows[-1]
  assert last['eval/improvement'] == pytest.approx(
      last['eval/final_accuracy'] - last['eval/start_accuracy'])
  assert list(workdir.glob('events.out.tfevents.*')), 'no TensorBoard event file'
  summary = json.loads((workdir / 'summary.json').read_text())
  assert summary['steps'] == 4
  assert summary['eval/final_accuracy'] == pytest.approx(last['eval/final_accuracy'])


def test_run_prints_progress_and_final_accuracy(smoke_run):
  _, result = smoke_run
  assert 'step 4/4 (100%) |' in result.stdout
  assert 'held-out greedy accuracy: RL start' in result.stdout


def test_relaunch_of_a_finished_run_resumes_and_repeats_nothing(smoke_run):
  workdir, _ = smoke_run
  before = (workdir / 'metrics.jsonl').read_text()
  result = _launch('--config=configs/default.py:smoke', f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'resuming the run' in result.stderr
  assert (workdir / 'metrics.jsonl').read_text() == before  # no step twice, none lost


def test_relaunch_with_another_config_is_refused_and_overwrites_nothing(smoke_run):
  workdir, _ = smoke_run
  config_before = (workdir / 'config.json').read_text()
  result = _launch('--config=configs/default.py:smoke', f'--workdir={workdir}',
                   '--config.rl.learning_rate=0.1')
  assert result.returncode != 0
  assert "differs in what it computes (rl.learning_rate: 0.0003 -> 0.1)" in result.stderr
  assert (workdir / 'config.json').read_text() == config_before


@pytest.mark.parametrize('flag, message', [
    ('--config.rl.los=grpo', "unknown config key 'rl.los'. Did you mean rl.loss"),
    ('--config.nope=1', "unknown config key 'nope'"),
    ('--config.total_steps=abc', "expected type int"),
    ('--config.rl.loss=trpo', "config.rl.loss='trpo' is not valid; choose one of ['cispo', 'dapo'"),
    ('--config.backend=slurm', "config.backend='slurm' is not valid"),
    ('--config.rl.group_size=0', 'config.rl.group_size=0 must be an int >= 1'),
])
def test_bad_override_fails_before_compute(tmp_path, flag, message):
  workdir = tmp_path / 'wd'
  result = _launch('--config=configs/default.py:smoke', flag, f'--workdir={workdir}',
                   timeout=60)
  assert result.returncode != 0
  assert message in result.stderr, result.stderr[-2000:]
  assert not (workdir / 'metrics.jsonl').exists()
  assert 'Traceback' not in result.stderr


def test_diverging_run_exits_non_zero_naming_the_step(tmp_path):
  """A learning rate of 1e10 blows the params up; the guard skips the non-finite updates and
  stops the run, naming the step."""
  workdir = tmp_path / 'wd'
  result = _launch('--config=configs/default.py:smoke', '--config.warmup.learning_rate=1e10',
                   '--config.warmup.steps=50', '--config.log.tensorboard=false',
                   f'--workdir={workdir}', timeout=120)
  assert result.returncode != 0
  assert 'error: the run diverged. warm-up step ' in result.stderr, result.stderr[-2000:]
  assert '3 consecutive updates were non-finite' in result.stderr
  assert 'Traceback' not in result.stderr


def test_a_second_launch_on_a_busy_workdir_is_refused(tmp_path):
  """Two launches on one workdir: the second is refused while the first runs, and the first
  run's files are its own."""
  workdir = tmp_path / 'wd'
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  first = subprocess.Popen(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/default.py:smoke',
       '--config.total_steps=40', '--config.eval.every_steps=0', '--config.seed=3',
       f'--workdir={workdir}'], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 120
    while not (workdir / 'metrics.jsonl').exists():  # the first run is training
      assert first.poll() is None and time.time() < deadline, first.stderr.read()
      time.sleep(0.2)
    second = _launch('--config=configs/default.py:smoke', '--config.seed=4',
                     f'--workdir={workdir}', timeout=60)
    assert first.poll() is None, 'the first run finished before the second was tried'
  finally:
    out, err = first.communicate(timeout=300)
  assert second.returncode != 0
  assert f'is in use by another run (pid {first.pid}' in second.stderr, second.stderr[-2000:]
  assert first.returncode == 0, err[-3000:]
  assert json.loads((workdir / 'config.json').read_text())['seed'] == 3
  assert [r['step'] for r in read_metrics(workdir / 'metrics.jsonl')] == list(range(1, 41))
  assert len(list(workdir.glob('events.out.tfevents.*'))) == 1


def test_unknown_variant_fails(tmp_path):
  result = _launch('--config=configs/default.py:bogus', f'--workdir={tmp_path}/wd', timeout=60)
  assert result.returncode != 0
  assert "Unknown variant 'bogus'" in result.stderr


def test_help_lists_every_config_with_its_variants_and_the_flags():
  from rlax_llm.cli import config_variants  # pylint: disable=import-outside-toplevel
  result = _launch('--help', timeout=60)
  assert result.returncode == 0, result.stderr[-2000:]
  out = result.stdout
  assert out.startswith('usage: python -m rlax_llm.launch')
  for path in sorted((ROOT / 'configs').glob('*.py')):
    variants = ', '.join(config_variants(path)) or '(none)'
    assert f'configs/{path.name}' in out and f'variants: {variants}' in out, out
  assert 'configs/default.py (the default)  variants: smoke' in out
  for flag in ('--config=PATH[:VARIANT]', '--config.KEY=VALUE', '--workdir=DIR',
               '--print_config', '--helpfull', 'launch/README.md'):
    assert flag in out, flag


def test_helpfull_lists_the_launchers_own_flags_beside_absls():
  """``--helpfull`` is absl's (app.run answers it from flags.FLAGS); the launcher's flags,
  parsed on their own FlagValues by cli.command_line, are listed there too."""
  result = _launch('--helpfull', timeout=60)
  assert result.returncode == 1, result.stderr[-2000:]  # absl's help flags exit 1
  ours = result.stdout.split('\nrlax_llm.launch:\n')[1].split('\n\n')[0]
  for flag in ('--config: Config file, PATH[:VARIANT]', '--[no]print_config', '--workdir'):
    assert flag in ours, ours
  assert 'absl.logging:' in result.stdout  # absl's own flags are still listed


def test_help_works_even_when_the_config_is_broken():
  result = _launch('--config=configs/no_such_file.py', '-h', timeout=60)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'variants: smoke' in result.stdout


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path):
  workdir = tmp_path / 'wd'
  result = _launch('--config=configs/default.py:smoke', '--config.rl.loss=dapo',
                   '--config.total_steps=7', "--config.ray.trainer_resources={'TPU': 4}",
                   '--print_config', f'--workdir={workdir}', timeout=60)
  assert result.returncode == 0, result.stderr[-2000:]
  config = json.loads(result.stdout)
  assert config['name'] == 'default_smoke' and config['rl']['loss'] == 'dapo'
  # The values the run uses, not the placeholders (null) the loss fills in: DAPO's own.
  rl = config['rl']
  assert (rl['eps_low'], rl['eps_high'], rl['aggregation']) == (0.2, 0.28, 'token-mean')
  assert (rl['advantage_estimator'], rl['kl_estimator']) == ('grpo', 'k3')
  assert config['total_steps'] == 7 and config['ray']['trainer_resources'] == {'TPU': 4}
  assert not workdir.exists() and result.stderr == ''


@pytest.mark.parametrize('flag, message', [
    ('--config.rl.group_size=0', 'error: config.rl.group_size=0 must be an int >= 1.'),
    ('--config.mesh.trainer.fsdp=3', 'error: config.mesh.trainer:'),
    ('--config.rl.los=grpo', "unknown config key 'rl.los'"),
])
def test_print_config_of_an_invalid_config_fails_with_the_key(flag, message):
  result = _launch('--config=configs/default.py:smoke', flag, '--print_config', timeout=60)
  assert result.returncode != 0 and result.stdout == ''
  assert message in result.stderr and 'Traceback' not in result.stderr, result.stderr[-2000:]


def test_print_config_takes_a_hub_model_id_without_fetching_it(tmp_path):
  # Offline with an empty hub cache: validating must not need the model's files.
  result = _launch('--config=configs/default.py:smoke', '--config.model.name=auto',
                   '--config.model.path=Qwen/Qwen2.5-0.5B-Instruct',
                   '--config.model.revision=main', '--print_config', timeout=60,
                   env={'HF_HUB_OFFLINE': '1', 'HF_HUB_CACHE': str(tmp_path / 'hub')})
  assert result.returncode == 0, result.stderr[-2000:]
  model = json.loads(result.stdout)['model']
  assert (model['name'], model['path'], model['revision']) == (
      'auto', 'Qwen/Qwen2.5-0.5B-Instruct', 'main')
  assert not (tmp_path / 'hub').exists()


def _corrupt_gguf(tmp_path):
  path = tmp_path / 'model.gguf'
  path.write_bytes(b'\x00' * 64)
  return path, 'is not a GGUF file'


def _corrupt_hf_dir(tmp_path):
  (tmp_path / 'hf').mkdir()
  (tmp_path / 'hf' / 'config.json').write_text('{"model_type": "llama", ')
  return tmp_path / 'hf', 'config.json is not valid JSON'


@pytest.mark.parametrize('make', [_corrupt_gguf, _corrupt_hf_dir])
def test_a_corrupt_model_file_fails_with_one_line_not_a_traceback(tmp_path, make):
  path, message = make(tmp_path)
  result = _launch('--config=configs/smollm2.py:smoke', f'--config.model.path={path}',
                   f'--workdir={tmp_path}/wd', timeout=120)
  assert result.returncode == 1, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
  assert 'Traceback' not in result.stderr, result.stderr[-2000:]
