"""benchmarks/checkpoint.py in tiny form: a save's cost is its whole window against a baseline
window of the same steps, the blocked time and the slower steps after an asynchronous save
included."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def report():
  result = subprocess.run(
      [sys.executable, str(ROOT / 'benchmarks' / 'checkpoint.py'), '--model=tiny', '--batch=4',
       '--length=16', '--repeats=2', '--window=2'],
      check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT)))
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout)


def test_each_cost_is_its_window_against_the_baseline(report):
  assert len(report['rounds']) == 2 and report['window'] == 2
  for r in report['rounds']:
    # The asynchronous window holds the blocked save, the steps while the write runs and the
    # wait for the rest of it; its cost is all of that less the same steps without a save.
    assert r['async_window_s'] >= r['blocked_s'] + r['step_s_after_async_save']
    assert r['async_cost_s'] == pytest.approx(r['async_window_s'] - r['baseline_s'])
    assert r['sync_window_s'] >= r['sync_save_s'] > 0
    assert r['sync_cost_s'] == pytest.approx(r['sync_window_s'] - r['baseline_s'])
    assert r['baseline_s'] == pytest.approx(2 * r['step_s'])  # two steps: median = mean


def test_fractions_are_of_a_baseline_step(report):
  step = report['step_s']
  for key in ('async_cost', 'sync_cost', 'blocked'):
    assert report[f'{key}_fraction'] == pytest.approx(report[f'{key}_s'] / step)
  assert report['step_slowdown_after_async_save'] == pytest.approx(
      report['step_s_after_async_save'] / step)
  assert report['restored_step'] == 2 and report['restore_s'] > 0
  assert report['state_bytes'] > 0
