"""Model (not a measurement): what the int8 engine's decode step should do on chips that take
int8 operands, from the bytes and FLOPs of the real parameter trees.

Issue 46 asks the int8 weight-only engine (``model.inference_quant='int8'``) for >= 1.8x the
fp32 engine's tokens/s at batch 1. XLA:CPU cannot get there (``benchmarks/rollout_throughput.py``:
0.14x, profiled in benchmarks/RESULTS.md: the int8 -> float32 convert is its own loop that
writes the whole weight as float32 before the dot). This script states what the same program
needs on an accelerator whose matmul units read int8 directly, where a decode step at small
batch is bound by reading the weights and the KV cache from HBM.

For each model (``--models``, presets of ``rlax_llm.models.presets``), mode and batch, one
decode step (one token per row, ``--context`` positions already in the KV cache) reads:

* the weights the engine holds (``Model.abstract_params``; for int8, ``quant.quantize_params``
  of them: int8 projections plus a float32 scale per output channel; the embedding, the lm
  head and the norms stay in the param dtype), once per step whatever the batch, except an
  untied embedding table, of which only the batch's rows are read;
* the KV cache of the batch (``presets.kv_cache_bytes``; float32 or bfloat16 by the compute
  dtype, or int8 with ``model.kv_cache_quant='int8'``).

FLOPs: ``2 * batch * (weights read)`` for the matmuls plus ``4 * batch * context * layers *
heads * head_dim`` for attention. The step's time is ``max(bytes / HBM bandwidth, FLOPs /
peak)`` (a roofline: no launch or per-op overhead, which a 135M model's small steps do have on
any chip, so its absolute figures are upper bounds; the ratios between modes are what matter).
Peaks: the chips' published HBM bandwidth and dense bf16 / int8 matmul rates; float32 matmuls
are counted at a sixth of the bf16 rate (``precision=HIGHEST``: six bf16 passes), which only
matters where the step is compute-bound.

``cpu_unfused``: the same bytes model for XLA:CPU's program as profiled, where each int8
projection weight is read (1 byte), written as float32 (4) and read back (4) per step: the
ratio a bandwidth-bound CPU could reach with that program (the measured 0.14x is lower still:
the convert loop is also compute-bound on 2 cores).

``--tpu-compiler`` (needs libtpu: ``pip install -e '.[tpu]'``): the bytes and FLOPs are not
counted by hand but read from the TPU compiler's cost analysis of the engine's real decode
step (``launch.recipes.compile.compile_engine_decode``: one v5e chip, ``batch`` slots, a cache
of ``context`` positions rounded up to the engine's blocks, read whole), which also says how
many of the step's products take the int8 weights as ``s8`` operands; the TPU chips' rows
then use those bytes (the H100 row too: the same program's bytes, a TPU's layouts).

    PYTHONPATH=. .venv/bin/python benchmarks/int8_roofline.py [--models=smollm2-135m,...]
        [--batches=1,32] [--context=64] [--tpu-compiler]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlax_llm.models import presets, quant
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import abstract_model

# Published per-chip figures: HBM bytes/s, dense bf16 and int8 matmul ops/s.
# Cloud TPU system architecture pages (v5e, v5p, v6e); NVIDIA H100 SXM datasheet.
CHIPS = {
    'tpu-v5e': {'hbm_bytes_s': 819e9, 'bf16_flops': 197e12, 'int8_ops': 394e12},
    'tpu-v5p': {'hbm_bytes_s': 2765e9, 'bf16_flops': 459e12, 'int8_ops': 918e12},
    'tpu-v6e': {'hbm_bytes_s': 1640e9, 'bf16_flops': 918e12, 'int8_ops': 1836e12},
    'h100-sxm': {'hbm_bytes_s': 3350e9, 'bf16_flops': 989e12, 'int8_ops': 1979e12},
}
FP32_PASSES = 6  # float32 matmuls as bf16 passes (precision=HIGHEST)
# mode -> (param dtype of the held weights, int8 projections, KV-cache quantisation)
MODES = {
    'fp32': ('float32', False, 'none'),
    'bf16': ('bfloat16', False, 'none'),
    'int8': ('float32', True, 'none'),
    'int8+int8kv': ('float32', True, 'int8'),
}


def step_bytes(config: DecoderConfig, mode: str, batch: int, context: int) -> dict:
  """Bytes one decode step reads (weights, KV cache) and its FLOPs, for ``mode``."""
  dtype, int8, kv_quant = MODES[mode]
  cfg = config.with_execution(param_dtype=jnp.dtype(dtype), dtype=jnp.dtype(dtype))
  model = abstract_model(cfg)
  params = model.abstract_params()
  elements = sum(math.prod(x.shape) for x in jax.tree.leaves(params))  # presets.count_params
  if int8:
    params = jax.eval_shape(lambda p: quant.quantize_params(p, model), params)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  nbytes = lambda x: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize  # noqa: E731
  weights = int8_weights = 0
  for path, leaf in leaves:
    if path[0].key == 'embed' and not cfg.tie_embeddings:
      weights += batch * nbytes(leaf) // leaf.shape[0]  # the batch's rows of the table
      continue
    weights += nbytes(leaf)
    if jnp.dtype(leaf.dtype) == jnp.int8:
      int8_weights += math.prod(leaf.shape)
  kv = presets.kv_cache_bytes(cfg, slots=batch, length=context, quant=kv_quant)
  matmul_params = elements - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim)
  flops = 2 * batch * matmul_params
  flops += 4 * batch * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
  return {'weight_bytes': int(weights), 'kv_bytes': int(kv), 'flops': float(flops),
          'int8_weights': int(int8_weights)}


def compiled_step(config: DecoderConfig, mode: str, batch: int, context: int) -> dict:
  """``step_bytes``' figures from the TPU compiler: the engine's decode step in ``mode``
  compiled for one TPU v5e chip; ``bytes_accessed`` and ``flops`` from its cost analysis,
  ``s8_products`` the products that take int8 operands."""
  # The TPU compile path (launch/, libtpu): imported only when asked for.
  from launch.recipes import compile as compile_lib  # pylint: disable=import-outside-toplevel
  from launch.recipes import program_report  # pylint: disable=import-outside-toplevel
  from launch.recipes.slices import get_slice  # pylint: disable=import-outside-toplevel
  from rlax_llm import sharding  # pylint: disable=import-outside-toplevel
  from rlax_llm.rollout.engine import Engine  # pylint: disable=import-outside-toplevel
  from rlax_llm.sampling_spec import SamplingSpec  # pylint: disable=import-outside-toplevel
  dtype, int8, kv_quant = MODES[mode]
  cfg = config.with_execution(param_dtype=jnp.dtype(dtype), dtype=jnp.dtype(dtype))
  slice_ = get_slice('v5e-4')
  mesh = sharding.make_mesh({'data': 1}, list(compile_lib.tpu_devices(slice_))[:1])
  run = cfg.execution
  engine = Engine(abstract_model(cfg), mesh, slots=batch, max_prefill_length=context,
                  max_decode_length=1, pad_id=0, quant='int8' if int8 else 'none',
                  kv_cache_quant=kv_quant, weight_layout=run.weight_layout,
                  decode_attention=run.decode_attention)
  report, hlo = compile_lib.compile_engine_decode(engine, SamplingSpec(), slice_)
  return {'bytes_accessed': report.bytes_accessed, 'flops': report.flops,
          's8_products': len(program_report.s8_dot_lines(hlo)),
          'cache_positions': engine.attend_buckets[-1], 'compile_s': round(report.compile_s, 1)}


def roofline(row: dict, mode: str, chip: dict, batch: int) -> dict:
  """Tokens/s of one step on ``chip`` (``max`` of its memory and compute times): the bytes
  ``row`` counts (weights and KV cache), or the compiler's ``bytes_accessed`` when it has
  them (``compiled_step``)."""
  rate = {'fp32': chip['bf16_flops'] / FP32_PASSES, 'bf16': chip['bf16_flops']}.get(
      mode, chip['int8_ops'])
  total = row.get('bytes_accessed', row.get('weight_bytes', 0) + row.get('kv_bytes', 0))
  memory_s = total / chip['hbm_bytes_s']
  compute_s = row['flops'] / rate
  return {'tokens_s': batch / max(memory_s, compute_s),
          'bound': 'memory' if memory_s >= compute_s else 'compute'}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default='smollm2-135m,qwen2.5-1.5b,llama-3.1-8b')
  parser.add_argument('--batches', default='1,32')
  parser.add_argument('--context', type=int, default=64,
                      help='positions in the KV cache (the SmolLM2 recipe: 64)')
  parser.add_argument('--tpu-compiler', action='store_true',
                      help='bytes and FLOPs from the TPU compiler (libtpu) instead of by hand')
  args = parser.parse_args()
  out = {'benchmark': 'int8_roofline', 'kind': 'model (no measurement)',
         'bytes': 'TPU compiler (v5e cost analysis)' if args.tpu_compiler else 'counted by hand',
         'context': args.context, 'chips': CHIPS, 'models': {}}
  for name in args.models.split(','):
    config = presets.get_preset(name)
    per_batch = {}
    for batch in (int(b) for b in args.batches.split(',')):
      rows = {mode: step_bytes(config, mode, batch, args.context) for mode in MODES}
      compiled = ({mode: compiled_step(config, mode, batch, args.context) for mode in MODES}
                  if args.tpu_compiler else None)
      chips = {}
      for chip_name, chip in CHIPS.items():
        rates = {mode: roofline((compiled or rows)[mode], mode, chip, batch) for mode in MODES}
        chips[chip_name] = {
            'tokens_s': {m: round(r['tokens_s'], 1) for m, r in rates.items()},
            'bound': {m: r['bound'] for m, r in rates.items()},
            'int8_over_fp32': rates['int8']['tokens_s'] / rates['fp32']['tokens_s'],
            'int8_over_bf16': rates['int8']['tokens_s'] / rates['bf16']['tokens_s']}
      fp32, int8 = rows['fp32'], rows['int8']
      unfused = (fp32['weight_bytes'] - 4 * int8['int8_weights']  # what stays float32
                 + 9 * int8['int8_weights'] + fp32['kv_bytes'])
      per_batch[batch] = {
          'bytes': rows, 'compiled': compiled, 'chips': chips,
          'int8_over_fp32_bytes': ((int8['weight_bytes'] + int8['kv_bytes'])
                                   / (fp32['weight_bytes'] + fp32['kv_bytes'])),
          'cpu_unfused_int8_over_fp32': ((fp32['weight_bytes'] + fp32['kv_bytes'])
                                         / unfused)}
    out['models'][name] = {'params': presets.count_params(config),
                           'tie_embeddings': config.tie_embeddings, 'batches': per_batch}
  print(json.dumps(out, indent=2))


if __name__ == '__main__':
  main()
