"""Benchmark: rollout generation throughput, rlax_llm's engine vs transformers.generate.

SmolLM2-135M-Instruct (the packaged GGUF), fp32, greedy, 128 new tokens per row, the same
weights loaded by both in the same process. For each batch size the two are run alternately
``--repeats`` times (the machine is shared and noisy: each ratio compares neighbouring runs)
and the medians are reported; compilation is excluded (a warm-up run first). Every row
generates exactly ``--new_tokens`` tokens (no early stop on either side), and the first
row's tokens are compared.

Also measured in the same process:
* a variable-length workload: ``--requests`` requests whose completion lengths are drawn from
  a heavy-tailed (Pareto) distribution, through ``--slots`` slots, continuous batching vs
  static batching (a new batch only when every slot is free), same tokens either way;
* the fp32 matmul peak of this machine (a 2048^3 ``jnp.dot``), and the fraction of it our
  decoding reaches (``2 * matmul params * tokens/s``);
* this machine's memory read bandwidth (the best of a jitted sum and two matmuls over 512 MiB
  of fp32, ``memory_bandwidth_gbs``); the rate at which our decoding streams the weights
  (every decode step reads all of them once: ``param bytes * steps/s``) and its fraction of
  that bandwidth; and the tokens/s of a decoder that did nothing but read its weights once
  per step (``bandwidth_bound_tok_s``: an upper bound for any fp32 implementation at that
  batch size, since the weights are far larger than the caches);
* the tokens/s of a decoder that did nothing but its weight matmuls (``gemm_bound_tok_s``):
  one decode step's GEMMs at the batch's row count (every layer's q, k, v, o, gate, up and
  down projections and the lm head, through the model's own ``linear`` and ``head_logits``,
  so the batch-invariant mode's products too), jitted alone and timed; and
  ``gemm_bound_ratio``, that rate over transformers' from the same run: the best ratio any
  decoding on this backend could reach if attention, sampling, the prefill and the driver
  took no time;
* the int8 engine (``Engine(quant='int8')``, ``model.inference_quant='int8'``: int8
  weight-only projections with per-output-channel scales, docs/rollout.md) at each batch size,
  timed alternately with the fp32 engine and transformers: ``int8_tok_s``, ``int8_over_fp32``
  (the median of the neighbouring runs' ratios; goal >= 1.8 at batch 1) and
  ``int8_over_transformers``; ``--quant=none`` skips it.

Prints one JSON object:

    {"batches": {"1": {"ours_tok_s", "transformers_tok_s", "ratio", ...}, "8": ..., "32": ...,
                 "64": ...},
     "variable_length": {"continuous_tok_s", "static_tok_s", "ratio", ...},
     "matmul_peak_gflops": ..., "memory_bandwidth_gbs": ..., ...}

    .venv/bin/python benchmarks/rollout_throughput.py [--batches=1,8,32,64] [--repeats=3]
        [--batch_invariant [--invariant_rows=floor]] [--requests=0] [--quant=none]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rlax_llm.models import from_pretrained, smollm2_gguf_path  # noqa: E402
from rlax_llm.models.decoder import head_logits, linear  # noqa: E402
from rlax_llm.models.decoder_config import DecoderConfig  # noqa: E402
from rlax_llm.models.model import abstract_model, split_module  # noqa: E402
from rlax_llm.models.presets import count_params  # noqa: E402
from rlax_llm.sampling_spec import GREEDY  # noqa: E402
from rlax_llm.rollout.driver import Driver, Job, VersionedParams  # noqa: E402
from rlax_llm.rollout.engine import Engine  # noqa: E402
from rlax_llm.sharding import make_mesh  # noqa: E402

QUESTIONS = ['Tell me a story about a cat.', 'Explain how rain forms.',
             'Write a poem about the sea.', 'Describe a busy market.']


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
  a = jnp.ones((n, n), jnp.float32)
  dot = jax.jit(lambda a, b: a @ b)
  dot(a, a).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    out = dot(a, a)
  out.block_until_ready()
  return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e9


def prompts_for(tokenizer, batch: int) -> list[list[int]]:
  """``batch`` chat prompts, cut to the length of the shortest so that every row has the same
  length (transformers then needs no padding)."""
  rows = [tokenizer.apply_chat_template([{'role': 'user', 'content': QUESTIONS[i % 4]}],
                                        add_generation_prompt=True, tokenize=True)
          for i in range(batch)]
  shortest = min(len(r) for r in rows)
  return [r[len(r) - shortest:] for r in rows]  # keep the assistant header at the end


def driver_for(model, params, slots: int, max_prefill: int, max_new: int, continuous=True,
               **engine_kwargs):
  engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=slots,
                  max_prefill_length=max_prefill, max_decode_length=max_new, pad_id=0,
                  **engine_kwargs)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  return Driver(engine, holder, continuous=continuous)


def jobs_for(prompts, lengths) -> list[Job]:
  keys = np.zeros((1, 2), np.uint32)
  return [Job(tuple(p), 1, GREEDY, n, (), keys) for p, n in zip(prompts, lengths)]


def heavy_tailed_lengths(rng: np.random.RandomState, n: int, longest: int = 128) -> list[int]:
  """``n`` completion lengths from a Pareto tail (shape 1.2, scale 8), clipped to
  ``[4, longest]``: most are short, a few run to the cap."""
  return np.clip((8 * (1 + rng.pareto(1.2, n))).astype(int), 4, longest).tolist()


def timed(fn) -> tuple[float, object]:
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def memory_bandwidth_gbs(gib: float = 0.5, repeats: int = 5) -> dict[str, float]:
  """Read rates (GB/s) of ``gib`` GiB of fp32 through three jitted programs: a sum, and a
  matmul of 1 and of 32 rows by a ``[4096, n]`` matrix (how decoding reads its weights).
  ``best`` is the largest: the bandwidth this machine showed."""
  n = int(gib * 2 ** 30) // 4 // 4096
  w = jnp.ones((4096, n), jnp.float32)
  programs = {'sum': (jax.jit(jnp.sum), ()),
              'matmul_1_row': (jax.jit(lambda x, w: x @ w), (jnp.ones((1, 4096)),)),
              'matmul_32_rows': (jax.jit(lambda x, w: x @ w), (jnp.ones((32, 4096)),))}
  rates = {}
  for name, (fn, args) in programs.items():
    fn(*args, w).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
      out = fn(*args, w)
    out.block_until_ready()
    rates[name] = w.nbytes * repeats / (time.perf_counter() - start) / 1e9
  rates['best'] = max(rates.values())
  return rates


def gemm_step_seconds(config: DecoderConfig, rows: int, steps: int = 5,
                      repeats: int = 5) -> float:
  """Seconds of one decode step's weight matmuls alone at ``rows`` rows: every layer's
  q, k, v, o, gate, up and down projections and the lm head, with random weights of the
  shapes (and so the weight layout) of ``config``'s params; pass the engine's model's. The
  projections depend on each other as in the model (q, k, v from the same input, o after
  them, gate and up, then down); the median over ``repeats`` calls of ``steps`` chained
  steps."""
  c = config
  abstract = abstract_model(c).abstract_params()
  names = [('attn', 'wq'), ('attn', 'wk'), ('attn', 'wv'), ('attn', 'wo'), ('mlp', 'w_gate'),
           ('mlp', 'w_up'), ('mlp', 'w_down')]
  keys = iter(jax.random.split(jax.random.key(0), len(names) * c.num_layers + 2))
  normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape, c.execution.dtype)
  layers = [[normal(abstract['blocks'][block][name].shape[1:]) for block, name in names]
            for _ in range(c.num_layers)]
  head = normal(abstract['embed' if c.tie_embeddings else 'lm_head'].shape)

  @jax.jit
  def run(x, layers, head):
    total = jnp.zeros((), jnp.float32)
    for _ in range(steps):
      h = x
      for wq, wk, wv, wo, wg, wu, wd in layers:
        a = linear(h, wq, c)
        # k and v feed attention (omitted); their sums keep them in the program
        h = h + linear(a, wo, c) + 1e-3 * (linear(h, wk, c).sum() + linear(h, wv, c).sum())
        h = h + linear(jax.nn.silu(linear(h, wg, c)) * linear(h, wu, c), wd, c)
      logits = head_logits(h, head, c)
      total, x = total + logits.max(), x + 1e-3 * logits[:, :1]
    return total

  x = normal((rows, c.embed_dim))
  run(x, layers, head).block_until_ready()  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run(x, layers, head).block_until_ready()
    times.append((time.perf_counter() - start) / steps)
  return statistics.median(times)


def variable_length(model, params, tokenizer, args) -> dict:
  """Heavy-tailed completion lengths through ``args.slots`` slots: continuous vs static
  batching, the same tokens either way."""
  rng = np.random.RandomState(0)
  lengths = heavy_tailed_lengths(rng, args.requests)
  prompts = prompts_for(tokenizer, args.requests)
  jobs = jobs_for(prompts, lengths)
  drivers = {mode: driver_for(model, params, args.slots, len(prompts[0]), max(lengths),
                              continuous=mode == 'continuous',
                              decode_attention=args.decode_attention)
             for mode in ('continuous', 'static')}
  for d in drivers.values():
    d.run(jobs)  # compile
  times = {mode: [] for mode in drivers}
  steps = {}
  for _ in range(args.repeats):
    for mode, d in drivers.items():
      elapsed, _ = timed(lambda d=d: d.run(jobs))
      times[mode].append(elapsed)
      steps[mode] = d.stats['steps']
  total = sum(lengths)
  return {
      'requests': args.requests, 'slots': args.slots, 'total_tokens': total,
      'length_mean': float(np.mean(lengths)), 'length_max': int(max(lengths)),
      'length_p50': float(np.median(lengths)),
      'continuous_tok_s': total / statistics.median(times['continuous']),
      'static_tok_s': total / statistics.median(times['static']),
      'ratio': statistics.median(s / c for c, s in zip(times['continuous'], times['static'])),
      'continuous_steps': steps['continuous'], 'static_steps': steps['static'],
  }


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--batches', default='1,8,32,64')
  parser.add_argument('--new_tokens', type=int, default=128)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--requests', type=int, default=192, help='0: skip the workload')
  parser.add_argument('--slots', type=int, default=32)
  parser.add_argument('--torch_threads', type=int, default=0, help='0: torch default')
  parser.add_argument('--batch_invariant', action='store_true',
                      help='our model with batch-invariant numerics (docs/models.md)')
  parser.add_argument('--decode_attention', default=None, choices=('xla', 'cpu_kernel'),
                      help="Engine(decode_attention=...); default: the engine's choice")
  parser.add_argument('--invariant_rows', default='chunks', choices=('chunks', 'floor'),
                      help='with --batch_invariant: Execution.invariant_rows')
  parser.add_argument('--quant', default='int8', choices=('none', 'int8'),
                      help="also time Engine(quant='int8') beside the fp32 engine")
  args = parser.parse_args()

  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  path = smollm2_gguf_path()
  module, tokenizer = from_pretrained(path, batch_invariant=args.batch_invariant,
                                      invariant_rows=args.invariant_rows)
  model, params = split_module(module)
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  reference.generation_config.eos_token_id = None  # exactly new_tokens tokens, as ours
  reference.generation_config.pad_token_id = tokenizer.pad_id
  n = args.new_tokens
  flops_per_token = 2 * count_params(model.config)
  peak = matmul_peak_gflops()
  bandwidths = memory_bandwidth_gbs()
  bandwidth = bandwidths['best']
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

  batches = {}
  for batch in [int(b) for b in args.batches.split(',')]:
    prompts = prompts_for(tokenizer, batch)
    driver = driver_for(model, params, batch, len(prompts[0]), n,
                        decode_attention=args.decode_attention)
    jobs = jobs_for(prompts, [n] * batch)
    inputs = torch.tensor(prompts)

    def theirs():
      with torch.no_grad():
        return reference.generate(inputs, attention_mask=torch.ones_like(inputs),
                                  max_new_tokens=n, do_sample=False)
    ours = lambda: driver.run(jobs)
    quantised = None
    if args.quant != 'none' and not args.batch_invariant:
      int8_driver = driver_for(model, params, batch, len(prompts[0]), n, quant=args.quant,
                               decode_attention=args.decode_attention)
      quantised = lambda: int8_driver.run(jobs)
      quantised()  # compile
    ours()  # compile
    theirs()
    pairs, int8_times = [], []
    for _ in range(args.repeats):
      t_ours, out = timed(ours)
      if quantised is not None:
        t_int8, int8_out = timed(quantised)
        int8_times.append(t_int8)
      t_theirs, ref = timed(theirs)
      pairs.append((t_ours, t_theirs))
    ours_tok_s = statistics.median(batch * n / a for a, _ in pairs)
    theirs_tok_s = statistics.median(batch * n / b for _, b in pairs)
    ref_tokens = ref[0, len(prompts[0]):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(out[0][0].tokens, ref_tokens)) if a != b),
                len(ref_tokens))
    batches[str(batch)] = {
        'ours_tok_s': ours_tok_s, 'transformers_tok_s': theirs_tok_s,
        'ratio': statistics.median(b / a for a, b in pairs),
        'ratios': [b / a for a, b in pairs],
        'prompt_tokens': len(prompts[0]),
        'decode_attention': driver.engine.decode_attention_note,
        'first_row_tokens_equal': same,
        'ours_matmul_gflops': ours_tok_s * flops_per_token / 1e9,
        'ours_fraction_of_matmul_peak': ours_tok_s * flops_per_token / 1e9 / peak,
        'ours_weight_stream_gbs': param_bytes * ours_tok_s / batch / 1e9,
        'ours_fraction_of_memory_bandwidth': param_bytes * ours_tok_s / batch / 1e9 / bandwidth,
        'bandwidth_bound_tok_s': batch * bandwidth * 1e9 / param_bytes,
    }
    if int8_times:
      int8_tok_s = statistics.median(batch * n / t for t in int8_times)
      int8_same = next((i for i, (a, b) in enumerate(zip(out[0][0].tokens,
                                                         int8_out[0][0].tokens)) if a != b),
                       len(out[0][0].tokens))
      batches[str(batch)].update(
          int8_tok_s=int8_tok_s,
          int8_over_fp32=statistics.median(a / t for (a, _), t in zip(pairs, int8_times)),
          int8_over_fp32_ratios=[a / t for (a, _), t in zip(pairs, int8_times)],
          int8_over_transformers=statistics.median(
              b / t for (_, b), t in zip(pairs, int8_times)),
          int8_first_row_tokens_equal_fp32=int8_same)
    gemm_tok_s = batch / gemm_step_seconds(driver.engine.model.config, batch)
    batches[str(batch)].update(gemm_bound_tok_s=gemm_tok_s,
                               gemm_bound_ratio=gemm_tok_s / theirs_tok_s)
    print(json.dumps({batch: batches[str(batch)]}), file=sys.stderr, flush=True)  # progress

  variable = variable_length(model, params, tokenizer, args) if args.requests else None
  print(json.dumps({
      'benchmark': 'rollout_throughput', 'model': path.name, 'dtype': 'float32',
      'new_tokens': n, 'repeats': args.repeats, 'torch_threads': torch.get_num_threads(),
      'batch_invariant': args.batch_invariant, 'invariant_rows': args.invariant_rows,
      'devices': str(jax.devices()), 'matmul_peak_gflops': peak,
      'memory_bandwidth_gbs': bandwidths, 'param_bytes': param_bytes,
      'batches': batches, 'variable_length': variable,
      'goals': {'ratio_at_32': '>= 2.0', 'ratio_at_1': '>= 1.7',
                'continuous_over_static': '>= 2.0', 'int8_over_fp32_at_1': '>= 1.8'},
  }, indent=2))


if __name__ == '__main__':
  main()
