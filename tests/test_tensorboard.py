"""Watching a run: a short run's TensorBoard events hold the scalars, histograms and sampled
completions that rlax_llm/metrics.py documents; the console shows progress and a summary."""

import os
import pathlib
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Every reward, loss diagnostic, staleness and throughput figure of a GRPO step.
SCALARS = (
    'reward/mean', 'reward/std', 'loss', 'grad_norm', 'entropy', 'clip_fraction',
    'staleness/mean', 'staleness/max', 'staleness/frac_0', 'time/step_s', 'time/rollout_s',
    'time/train_s', 'time/rollout_tokens_per_s', 'time/trainer_busy_fraction',
    'completion/length_mean', 'eval/accuracy', 'sync/bytes',
)


@pytest.fixture(scope='module')
def short_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('tb') / 'run'
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/default.py:smoke',
       '--config.total_steps=2', '--config.log.text_every=2', f'--workdir={workdir}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  events = EventAccumulator(str(workdir), size_guidance={'scalars': 0, 'histograms': 0,
                                                         'tensors': 0})
  events.Reload()
  return events, result.stdout


def test_events_hold_the_scalars_histograms_and_samples(short_run):
  events, _ = short_run
  tags = events.Tags()
  missing = [t for t in SCALARS if t not in tags['scalars']]
  assert not missing, (missing, sorted(tags['scalars']))
  assert [e.step for e in events.Scalars('reward/mean')] == [1, 2]
  for tag in ('advantages', 'staleness', 'reward', 'completion/length', 'log_ratio'):
    assert tag in tags['histograms'], sorted(tags['histograms'])
  (advantages, _) = events.Histograms('advantages')
  # smoke: 4 prompts x 4 samples; group-normalised advantages sum to ~0.
  assert advantages.step == 1 and advantages.histogram_value.num == 16
  assert abs(advantages.histogram_value.sum) < 1e-4
  # On-policy (k=1) with the sampler's own policy: log pi_theta - log pi_behaviour ~ 0, so
  # every token lands in the two bins around 0 (edges -0.05, 0, 0.05).
  log_ratio = events.Histograms('log_ratio')[0].histogram_value
  assert log_ratio.num == pytest.approx(1.0)
  assert (log_ratio.min, log_ratio.max) == (pytest.approx(-0.05), pytest.approx(0.05))
  (text,) = events.Tensors('samples/text_summary')  # text_every=2: step 2 only
  assert text.step == 2
  table = text.tensor_proto.string_val[0].decode()
  assert table.startswith('| prompt | completion | reward | version |')
  assert len(table.splitlines()) == 2 + 4  # header + the first row of 4 groups


def test_console_prints_progress_with_eta_and_a_summary_table(short_run):
  _, stdout = short_run
  lines = stdout.splitlines()
  assert lines[0].startswith('step 1/2 (50%) | reward/mean ')
  assert ' | ETA ' not in lines[0]  # no rate yet after one step
  assert lines[1].startswith('step 2/2 (100%) | reward/mean ')
  table = lines[lines.index('run summary'):]
  assert table[1].split() == ['metric', 'first', 'last', 'min', 'max']
  assert any(row.split()[0] == 'reward/mean' and len(row.split()) == 5 for row in table)
  assert any(row.split()[0] == 'eval/improvement' for row in table)
