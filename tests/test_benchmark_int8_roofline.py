"""benchmarks/int8_roofline.py's bytes model against SmolLM2-135M's shapes counted by hand."""

import importlib.util
import pathlib

import pytest

from rlax_llm.models import presets

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location('int8_roofline',
                                               ROOT / 'benchmarks' / 'int8_roofline.py')
roofline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)

CONFIG = presets.get_preset('smollm2-135m')
# 30 layers of q, k, v, o (576 <-> 576, 576 -> 3 x 64 twice), gate, up (576 -> 1536), down.
PROJECTION_WEIGHTS = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
OUTPUT_CHANNELS = 30 * (576 + 192 + 192 + 576 + 1536 + 1536 + 576)


def test_smollm2_decode_step_bytes():
  fp32 = roofline.step_bytes(CONFIG, 'fp32', batch=1, context=64)
  int8 = roofline.step_bytes(CONFIG, 'int8', batch=1, context=64)
  kv8 = roofline.step_bytes(CONFIG, 'int8+int8kv', batch=1, context=64)
  bf16 = roofline.step_bytes(CONFIG, 'bf16', batch=1, context=64)
  # Tied embeddings: the lm head reads the whole table; every weight once per step.
  assert fp32['weight_bytes'] == 4 * presets.count_params(CONFIG) == 538_060_032
  assert bf16['weight_bytes'] == fp32['weight_bytes'] // 2
  assert int8['int8_weights'] == PROJECTION_WEIGHTS == 106_168_320
  # int8 projections: one byte per weight and a float32 scale per output channel.
  assert int8['weight_bytes'] == (fp32['weight_bytes'] - 3 * PROJECTION_WEIGHTS
                                  + 4 * OUTPUT_CHANNELS)
  assert fp32['kv_bytes'] == int8['kv_bytes'] == 64 * 30 * 3 * 2 * 64 * 4
  assert kv8['kv_bytes'] == 64 * 30 * 3 * 2 * (64 + 4)
  assert fp32['flops'] == 2 * 134_515_008 + 4 * 64 * 30 * 9 * 64


@pytest.mark.parametrize('chip', sorted(roofline.CHIPS))
def test_batch_one_decode_is_memory_bound_and_int8_reads_less(chip):
  row = {m: roofline.step_bytes(CONFIG, m, batch=1, context=64) for m in ('fp32', 'int8')}
  rates = {m: roofline.roofline(row[m], m, roofline.CHIPS[chip], 1) for m in row}
  assert rates['fp32']['bound'] == rates['int8']['bound'] == 'memory'
  ratio = rates['int8']['tokens_s'] / rates['fp32']['tokens_s']
  total = lambda r: r['weight_bytes'] + r['kv_bytes']  # noqa: E731
  assert ratio == pytest.approx(total(row['fp32']) / total(row['int8']))
  assert 2.3 < ratio < 2.5  # the fp32 tied embedding, read whole by the head, caps it
