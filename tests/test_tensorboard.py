"""rlax_llm.tensorboard_writer, and watching a run: a short run's TensorBoard events hold the
scalars, histograms and sampled completions that rlax_llm/tensorboard_writer.py documents; the
console shows progress and a summary."""

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlax_llm.tensorboard_writer import HISTOGRAM_BIN_EDGES, TensorBoardWriter, check_bins

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


def test_histograms_drop_non_finite_values_and_text_is_stored(tmp_path):
  writer = TensorBoardWriter(tmp_path)
  writer.write_histogram(3, 'advantages', np.array([[1.0, -1.0], [np.nan, 0.5]]))
  writer.write_histogram(3, 'empty', np.array([np.inf]))
  writer.write_text(3, 'samples', '| a | b |')
  writer.close()
  events = EventAccumulator(str(tmp_path), size_guidance={'histograms': 0, 'tensors': 0})
  events.Reload()
  assert events.Tags()['histograms'] == ['advantages']
  (hist,) = events.Histograms('advantages')
  assert (hist.step, hist.histogram_value.num, hist.histogram_value.sum) == (3, 3, 0.5)
  (text,) = events.Tensors('samples/text_summary')
  assert text.tensor_proto.string_val[0].decode() == '| a | b |'


def test_scalars_and_binned_histograms_and_the_purge_on_resume(tmp_path):
  bins = len(HISTOGRAM_BIN_EDGES['hist/log_ratio']) - 1
  fractions = np.zeros(bins)
  fractions[20] = 1.0  # the bin [0, 0.05)
  writer = TensorBoardWriter(tmp_path)
  for step in (1, 2, 3):
    writer.write(step, {'loss': float(step)}, {'hist/log_ratio': fractions})
  writer.write(4, {'loss': 4.0}, {'hist/log_ratio': np.zeros(bins)})  # empty: no histogram
  writer.close()
  time.sleep(1.1)  # event file names hold the second they were opened in: a new file
  writer = TensorBoardWriter(tmp_path, resume_step=2)  # steps 3 and 4 are written again
  writer.write(3, {'loss': 30.0}, {})
  writer.close()
  events = EventAccumulator(str(tmp_path), size_guidance={'scalars': 0, 'histograms': 0})
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars('loss')] == [(1, 1.0), (2, 2.0), (3, 30.0)]
  assert [h.step for h in events.Histograms('log_ratio')] == [1, 2]
  (first, _) = events.Histograms('log_ratio')
  assert (first.histogram_value.min, first.histogram_value.max) == (0.0, pytest.approx(0.05))


def test_check_bins_names_the_key_and_the_expected_shape():
  bins = len(HISTOGRAM_BIN_EDGES['hist/log_ratio']) - 1
  assert check_bins('hist/log_ratio', [0.5] * bins).dtype == np.float64
  with pytest.raises(ValueError, match=rf"has shape \(3,\); its edges make {bins} bins"):
    check_bins('hist/log_ratio', np.ones(3))
  with pytest.raises(ValueError, match='add its edges to rlax_llm.tensorboard_writer.HISTOGRAM'):
    check_bins('hist/other', np.ones(3))
