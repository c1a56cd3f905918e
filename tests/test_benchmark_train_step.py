"""benchmarks/train_step.py in tiny form: both sides run the same work (passes, rows per pass,
lm-head chunks) on the same weights, so the ratio compares equal work."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_tiny(micro_batches: int, logprob_chunk: int) -> dict:
  result = subprocess.run(
      [sys.executable, str(ROOT / 'benchmarks' / 'train_step.py'), '--model=tiny', '--batch=8',
       '--length=16', '--steps=1', f'--micro_batches={micro_batches}',
       f'--logprob_chunk={logprob_chunk}'],
      check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT)))
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout)


@pytest.mark.parametrize('micro_batches, logprob_chunk', [(2, 4), (1, 0)])
def test_both_sides_run_equal_work(micro_batches, logprob_chunk):
  report = run_tiny(micro_batches, logprob_chunk)
  assert report['micro_batches'] == micro_batches
  # The same number of forward passes per step, each over the same rows.
  assert report['ours_passes'] == report['torch_passes'] == micro_batches
  assert report['ours_rows_per_pass'] == report['torch_rows_per_pass'] == [8 // micro_batches]
  # The same lm-head chunking: 15 scored positions, `logprob_chunk` at a time (0: one call).
  chunks = math.ceil(15 / logprob_chunk) if logprob_chunk else 1
  assert report['torch_head_chunks_per_pass'] == [chunks]
  assert report['ours_head_chunks_per_pass'] == chunks
  # The same weights, batch and objective: the same first loss on both sides.
  assert report['first_loss'] == pytest.approx(report['torch_first_loss'], rel=1e-5)
  assert report['ratio'] == pytest.approx(report['ours_tok_s'] / report['torch_tok_s'])
  assert report['ours_tok_s'] > 0 and report['torch_tok_s'] > 0


def test_refuses_a_batch_the_micro_batches_do_not_divide():
  result = subprocess.run(
      [sys.executable, str(ROOT / 'benchmarks' / 'train_step.py'), '--model=tiny', '--batch=8',
       '--micro_batches=3'],
      check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert result.returncode == 2
  assert '--batch=8 must be a multiple of --micro_batches=3' in result.stderr
