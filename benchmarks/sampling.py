"""Benchmark: the sampler's top-k / top-p cut without sorting the vocabulary.

SmolLM2-135M-Instruct (the packaged GGUF), fp32, 49,152-token vocabulary. Two measurements,
each against a reference in the same process (alternating, ``--repeats`` each, medians):

* ``rollouts``: tokens/s of the engine sampling ``--slots`` completions of ``--new_tokens``
  tokens for each sampling spec, with ``policy.transform_logits`` (top-k by ``lax.top_k``;
  top-p without top-k by bisection over the logits' float order) against the same engine
  whose sampler cuts with ``reference_kept`` below, as the sampler once did. ``ratio`` is
  ours over the reference's tokens/s.
* ``transform``: ``policy.transform_logits`` jitted on batches of ``--slots`` rows of
  SmolLM2's real next-token logits (the positions of the completions just sampled; the first
  ``--timed_batches`` timed, all compared) against
  ``reference_kept``, the textbook cut (sort each row, the k-th largest by index, top-p by one
  cumulative sum over the sorted row). ``ratio`` is the reference's time over ours, and
  ``rows_differing`` counts rows whose kept sets differ (float rounding at the top-p
  threshold is the only expected cause). ``support_p50`` / ``support_max``: kept-set sizes.
  ``recorded_ms`` / ``recorded_reference_ms``: the trainer's side, the kept set from the
  recorded support sizes (``transform_logits(x, spec, sizes)``) against the reference's
  sort of each row (equal kept sets checked).

Prints one JSON object:

    {"rollouts": {"<spec>": {"ours_tok_s", "reference_tok_s", "ratio", "ratios"}, ...},
     "transform": {"<spec>": {"ours_ms", "reference_ms", "ratio", "rows",
                              "rows_differing", "support_p50", "support_max",
                              "recorded_ms", "recorded_reference_ms"}, ...}}

    .venv/bin/python benchmarks/sampling.py [--slots=32] [--new_tokens=32] [--repeats=3]
        [--timed_batches=8] [--specs=0,1,2,3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm import policy
from rlax_llm.models import from_pretrained, smollm2_gguf_path
from rlax_llm.models.model import split_module
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.rollout.driver import Job
from rollout_throughput import driver_for, prompts_for

SPECS = {'T1.0 top_p 0.95': SamplingSpec(1.0, top_p=0.95),
         'T0.7 top_k 20 top_p 0.9': SamplingSpec(0.7, top_k=20, top_p=0.9),
         'T1.0 top_k 50': SamplingSpec(1.0, top_k=50),
         # wide nuclei: thousands of tokens, where the sorted prefixes cannot decide
         'T1.0 top_p 0.99': SamplingSpec(1.0, top_p=0.99)}


def reference_kept(logits: jax.Array, spec: SamplingSpec) -> jax.Array:
  """bool ``[B, V]``: top-k then top-p by sorting each whole row (the kept set's definition,
  ``policy`` module docstring; ties at a threshold kept)."""
  scaled = logits.astype(jnp.float32) / spec.temperature
  ordered = -jnp.sort(-scaled, axis=-1)
  kept = jnp.ones(scaled.shape, bool)
  if 0 < spec.top_k < scaled.shape[-1]:
    kept = scaled >= ordered[:, spec.top_k - 1:spec.top_k]
  if spec.top_p < 1.0:
    masked = -jnp.sort(-jnp.where(kept, scaled, -jnp.inf), axis=-1)
    probs = jax.nn.softmax(masked, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < spec.top_p
    kept &= scaled >= jnp.min(jnp.where(keep, masked, jnp.inf), axis=-1, keepdims=True)
  return kept


def reference_recorded(logits: jax.Array, spec: SamplingSpec, sizes: jax.Array) -> jax.Array:
  """bool ``[B, V]``: the ``sizes`` largest scaled logits of each row (ties kept), by a sort."""
  scaled = logits.astype(jnp.float32) / spec.temperature
  kth = jnp.take_along_axis(-jnp.sort(-scaled, axis=-1), sizes[:, None] - 1, axis=-1)
  return scaled >= kth


def reference_transform(logits, spec, support_size=None, **unused):
  """``policy.transform_logits``'s sampler side (no recorded support) by ``reference_kept``."""
  assert support_size is None, 'the sampler records support sizes, it does not take them'
  return logits.astype(jnp.float32) / spec.temperature, reference_kept(logits, spec)


def jobs(prompts, spec, new_tokens):
  keys = [np.asarray(jax.random.key_data(jax.random.key(i)))[None] for i in range(len(prompts))]
  return [Job(tuple(p), 1, spec, new_tokens, (), k) for p, k in zip(prompts, keys)]


def median_ms(fn, arg, repeats):
  jax.block_until_ready(fn(arg))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(arg))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--slots', type=int, default=32)
  parser.add_argument('--new_tokens', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--timed_batches', type=int, default=8,
                      help='transform: batches timed (every batch is compared)')
  parser.add_argument('--specs', default=','.join(str(i) for i in range(len(SPECS))),
                      help='indices into SPECS: ' + ', '.join(SPECS))
  args = parser.parse_args()
  labels = [list(SPECS)[int(i)] for i in args.specs.split(',')]
  specs = {label: SPECS[label] for label in labels}

  module, tokenizer = from_pretrained(smollm2_gguf_path())
  model, params = split_module(module)
  prompts = prompts_for(tokenizer, args.slots)
  shipped = policy.transform_logits
  drivers = {}
  for name, transform in (('ours', shipped), ('reference', reference_transform)):
    policy.transform_logits = transform  # looked up when the engine's programs are traced
    drivers[name] = driver_for(model, params, args.slots, len(prompts[0]), args.new_tokens)
    for spec in specs.values():
      drivers[name].run(jobs(prompts, spec, args.new_tokens))  # compile
  policy.transform_logits = shipped

  result = {'rollouts': {}, 'transform': {}}
  completions = {}
  for label, spec in specs.items():
    times = {name: [] for name in drivers}
    for _ in range(args.repeats):
      for name, driver in drivers.items():
        start = time.perf_counter()
        out = driver.run(jobs(prompts, spec, args.new_tokens))
        times[name].append(time.perf_counter() - start)
    completions[label] = [list(p) + list(o[0].tokens) for p, o in zip(prompts, out)]
    tokens = args.slots * args.new_tokens
    ratios = [r / o for o, r in zip(times['ours'], times['reference'])]
    result['rollouts'][label] = {
        'ours_tok_s': tokens / statistics.median(times['ours']),
        'reference_tok_s': tokens / statistics.median(times['reference']),
        'ratio': statistics.median(ratios), 'ratios': ratios}
    print(json.dumps({label: result['rollouts'][label]}), flush=True)

  forward = jax.jit(lambda tokens: model.apply(params, tokens))
  for label, spec in specs.items():
    rows = np.concatenate([np.asarray(forward(jnp.asarray([seq]))[0, len(prompts[0]) - 1:-1])
                           for seq in completions[label]])
    rows = rows[:len(rows) // args.slots * args.slots].reshape(-1, args.slots, rows.shape[-1])
    ours = jax.jit(lambda x, spec=spec: policy.transform_logits(x, spec)[1])
    theirs = jax.jit(lambda x, spec=spec: reference_kept(x, spec))
    recorded = jax.jit(lambda x, n, spec=spec: policy.transform_logits(x, spec, n)[1])
    recorded_theirs = jax.jit(lambda x, n, spec=spec: reference_recorded(x, spec, n))
    ours_ms, ref_ms, rec_ms, rec_ref_ms, differing, sizes = [], [], [], [], 0, []
    for i, batch in enumerate(rows):
      batch = jnp.asarray(batch)
      a, b = np.asarray(ours(batch)), np.asarray(theirs(batch))
      n = jnp.asarray(a.sum(-1), jnp.int32)
      if i < args.timed_batches:
        ours_ms.append(median_ms(ours, batch, args.repeats))
        ref_ms.append(median_ms(theirs, batch, args.repeats))
        rec_ms.append(median_ms(lambda x: recorded(x, n), batch, args.repeats))
        rec_ref_ms.append(median_ms(lambda x: recorded_theirs(x, n), batch, args.repeats))
      assert np.array_equal(np.asarray(recorded(batch, n)), a), 'recorded sizes lost the set'
      assert np.array_equal(np.asarray(recorded_theirs(batch, n)), a), 'reference disagrees'
      differing += int(np.sum(np.any(a != b, axis=-1)))
      sizes.extend(a.sum(-1).tolist())
    result['transform'][label] = {
        'ours_ms': statistics.median(ours_ms), 'reference_ms': statistics.median(ref_ms),
        'ratio': statistics.median(r / o for o, r in zip(ours_ms, ref_ms)),
        'rows': len(sizes), 'rows_differing': differing,
        'support_p50': float(np.median(sizes)), 'support_max': int(max(sizes)),
        'recorded_ms': statistics.median(rec_ms),
        'recorded_reference_ms': statistics.median(rec_ref_ms)}
    print(json.dumps({label: result['transform'][label]}), flush=True)
  print(json.dumps(result, indent=2))


if __name__ == '__main__':
  main()
