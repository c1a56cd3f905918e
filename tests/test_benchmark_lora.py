"""benchmarks/lora.py in tiny form: its JSON object's keys, and figures that make sense."""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip('peft')

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_tiny(*flags: str) -> dict:
  result = subprocess.run(
      [sys.executable, str(ROOT / 'benchmarks' / 'lora.py'), '--model=tiny', '--batch=4',
       '--length=8', '--micro_batches=2', '--repeats=1', '--rank=4', *flags],
      check=False, cwd=ROOT, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT)))
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout)


@pytest.fixture(scope='module')
def report():
  return run_tiny()


def test_train_step_figures(report):
  train = report['train']
  assert report['rank'] == 4 and report['targets'] == 'q,k,v,o,gate,up,down'
  assert train['ours_tok_s'] > 0 and train['peft_tok_s'] > 0 and train['ratio'] > 0
  assert len(train['ratios']) == 1
  # Same adapters on both sides: rank x (in + out) per adapted weight.
  assert train['trained_params'] == train['peft_trained_params'] > 0
  # One objective, batch and set of weights on both sides (B = 0 at the first step).
  assert train['first_loss'] == pytest.approx(train['peft_first_loss'], rel=1e-5)


def test_memory_figures(report):
  memory = report['memory']
  for side in ('lora', 'full', 'peft'):
    row = memory[side]
    assert all(v > 0 for v in row.values()), (side, row)
    assert row['total_bytes'] == sum(v for k, v in row.items() if k != 'total_bytes')
  # The adapters' optimizer state is smaller than the whole model's.
  assert memory['lora']['optimizer_bytes'] < memory['full']['optimizer_bytes']
  assert memory['lora']['params_bytes'] > memory['full']['params_bytes']  # base + adapters
  assert 0 < memory['lora_over_full_total']


def test_sync_figures(report):
  sync = report['sync']
  lora_bytes = sync['lora_adapters']['bytes']
  assert 0 < lora_bytes < sync['full_fp32_bytes']
  assert lora_bytes == sync['adapter_bytes_by_rank']['4']
  assert 0 < sync['full_bf16_delta']['bytes'] < sync['full_fp32_bytes']
  assert sync['lora_over_full_fp32'] == lora_bytes / sync['full_fp32_bytes']
  assert sync['lora_over_bf16_delta'] > 0 and 0 < sync['bf16_delta_over_full_fp32'] < 1
  # lora.sync_dtype='bfloat16': half the bytes whole; a delta from the previous version
  # carries no more than the whole (it is sent whole when denser than pays).
  bf16 = sync['lora_adapters_bf16']
  assert bf16['bytes'] == lora_bytes // 2
  assert sync['lora_bf16_over_full_fp32'] == bf16['bytes'] / sync['full_fp32_bytes']
  assert 0 < bf16['from_previous']['bytes'] <= bf16['bytes']
  assert 0 < bf16['from_previous']['changed_fraction'] <= 1
  # lora.sync_dtype='int8': a quarter of the bytes, plus a float32 scale per rank component
  # of every factor (rank 4, 2 factors per adapter); the merged changes off by under 1%
  # (bfloat16's rounding: under 0.5%), and not exactly equal.
  int8 = sync['lora_adapters_int8']
  num_factors = 2 * 2 * 7  # the tiny model: 2 layers, all 7 targets
  assert int8['bytes'] == lora_bytes // 4 + num_factors * 4 * 4
  assert sync['lora_int8_over_full_fp32'] == int8['bytes'] / sync['full_fp32_bytes']
  assert 0 < int8['from_previous']['bytes'] <= int8['bytes']
  assert 0 < bf16['weight_change_error'] < 0.005
  assert bf16['weight_change_error'] < int8['weight_change_error'] < 0.01
  sizes = [sync['adapter_bytes_by_rank'][r] for r in ('1', '2', '4', '8', '16')]
  assert sizes == [sizes[0] * r for r in (1, 2, 4, 8, 16)]


def test_bfloat16_base(report):
  """--dtype=bfloat16: the LoRA step on a bfloat16 base on both sides; the base's bytes
  halve, the adapters (and their optimizer state) stay float32."""
  bf16 = run_tiny('--dtype=bfloat16')
  assert report['dtype'] == 'float32' and bf16['dtype'] == 'bfloat16'
  assert bf16['train']['ours_tok_s'] > 0 and bf16['train']['peft_tok_s'] > 0
  assert bf16['train']['trained_params'] == report['train']['trained_params']
  base = report['memory']['full']['params_bytes']  # the fp32 base alone
  adapters = report['memory']['lora']['params_bytes'] - base
  assert adapters == report['sync']['lora_adapters']['bytes']
  assert bf16['memory']['lora']['params_bytes'] == base // 2 + adapters
  assert bf16['memory']['lora']['optimizer_bytes'] == report['memory']['lora']['optimizer_bytes']
  assert bf16['memory']['peft']['params_bytes'] == base // 2 + adapters


def test_shared_prefix_batch(report):
  """--shared_prefix: groups of 8 rows sharing a prompt, our step scoring the completion
  windows (rl.shared_prefix), peft the whole rows: the same loss on the same batch."""
  shared = run_tiny('--shared_prefix', '--batch=8', '--new_tokens=4')
  assert shared['shared_prefix'] and shared['new_tokens'] == 4 and shared['batch'] == 8
  assert not report['shared_prefix'] and report['new_tokens'] is None
  train = shared['train']
  assert train['ratio'] > 0 and train['trained_params'] == report['train']['trained_params']
  assert train['first_loss'] == pytest.approx(train['peft_first_loss'], rel=1e-5)
  assert train['first_loss'] != pytest.approx(report['train']['first_loss'], rel=1e-3)


@pytest.mark.parametrize('flags, message', [
    (['--batch=12'], 'a multiple of 8 (got 12)'),
    (['--batch=8', '--new_tokens=8'], '0 < --new_tokens < --length (got 8, 8)'),
])
def test_shared_prefix_batch_shape_errors(flags, message):
  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import lora  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(shared_prefix=True, batch=8, length=8, new_tokens=4)
  for flag in flags:
    key, value = flag[2:].split('=')
    setattr(args, key, int(value))
  with pytest.raises(ValueError, match=re.escape(message)):
    lora.benchmark_batch(args, vocab=32)
