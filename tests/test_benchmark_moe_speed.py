"""benchmarks/moe_speed.py in tiny form: ours and transformers' Qwen3-MoE run the same
computation on the same weights (the same train loss and greedy tokens), and every figure the
report names is there."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_tiny_benchmark_runs_equal_work_and_prints_every_figure():
  result = subprocess.run(
      [sys.executable, str(ROOT / 'benchmarks' / 'moe_speed.py'), '--layers=1', '--hidden=32',
       '--heads=2', '--kv_heads=1', '--moe_mlp=16', '--vocab=64', '--experts=4', '--top_k=2',
       '--batch=2', '--length=8', '--prompt=4', '--new_tokens=3', '--points=4x2',
       '--repeats=1'],
      check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT)))
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout)
  assert report['shapes']['experts'] == 4 and report['shapes']['top_k'] == 2
  assert {'load_average_start', 'load_average_end', 'versions'} <= set(report)
  # The same weights and tokens: the same loss on both sides, the same greedy tokens.
  assert report['loss'] == pytest.approx(report['torch_loss'], rel=1e-5)
  assert report['decode']['greedy_tokens_equal'] == 1.0
  for step, tokens in (('train', 2 * 8), ('decode', 2 * 3)):
    figures = report[step]
    assert figures['speedup'] == pytest.approx(figures['torch_s'] / figures['ours_s'])
    assert figures['ours_tok_s'] == pytest.approx(tokens / figures['ours_s'])
  (point,) = report['impls']
  assert (point['experts'], point['top_k']) == (4, 2)
  assert point['train_dense_over_ragged'] == pytest.approx(
      point['dense_train_s'] / point['ragged_train_s'])
  assert point['decode_forward_dense_over_ragged'] > 0
  # The engine with its decode steps dense (model.inference_moe_impl='dense_decode').
  assert point['engine_decode_dense_over_ragged'] == pytest.approx(
      point['dense_engine_decode_s'] / point['ragged_engine_decode_s'])
  assert point['engine_greedy_tokens_equal'] == 1.0
  # The blocked path beside them, and the head-to-head's paths named (XLA:CPU's fastest).
  assert (report['moe_impl'], report['decode_moe_impl']) == ('blocked', 'blocked')
  assert point['train_blocked_over_ragged'] == pytest.approx(
      point['blocked_train_s'] / point['ragged_train_s'])
  assert point['decode_forward_blocked_over_ragged'] > 0
  assert point['engine_decode_blocked_over_ragged'] == pytest.approx(
      point['blocked_engine_decode_s'] / point['ragged_engine_decode_s'])
  assert point['engine_blocked_greedy_tokens_equal'] == 1.0
