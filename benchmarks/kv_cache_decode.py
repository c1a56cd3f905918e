"""Benchmark: KV-cache decoding (the engine and driver) vs recomputing the full forward pass
per token.

Both decode the same greedy continuation of the same prompts with the same model (checked
token for token); the reference (full recompute, O(T^2) work per sequence) is timed in the
same run, so the printed ``speedup`` is a ratio, robust to a noisy shared machine.

    .venv/bin/python benchmarks/kv_cache_decode.py
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import GREEDY
from rlax_llm.rollout.driver import generate
from rlax_llm.rollout.engine import Engine
from rlax_llm.sharding import make_mesh


def full_recompute_greedy(model, params, prompt, prompt_len, new_tokens):
  """Greedy decoding that re-runs the whole sequence for every new token (no cache)."""
  batch, width = prompt.shape
  seq = jnp.concatenate([prompt, jnp.zeros((batch, new_tokens), jnp.int32)], axis=1)

  def body(i, seq):
    logits = model.apply(params, seq)
    pos = prompt_len + i
    nxt = jnp.argmax(jnp.take_along_axis(logits, (pos - 1)[:, None, None], 1)[:, 0], -1)
    return jax.vmap(lambda s, p, t: s.at[p].set(t))(seq, pos, nxt.astype(jnp.int32))

  seq = jax.lax.fori_loop(0, new_tokens, body, seq)
  return jax.vmap(lambda s, p: jax.lax.dynamic_slice(s, (p,), (new_tokens,)))(seq, prompt_len)


def timeit(fn, repeats):
  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--prompt_len', type=int, default=32)
  parser.add_argument('--new_tokens', type=int, default=96)
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  config = DecoderConfig(vocab_size=512, num_layers=4, embed_dim=128, num_heads=4,
                         num_kv_heads=2, head_dim=32, mlp_dim=512,
                         max_seq_len=args.prompt_len + args.new_tokens)
  model, params = create_model(config, seed=0)
  rng = np.random.RandomState(0)
  prompt = jnp.asarray(rng.randint(3, 512, (args.batch, args.prompt_len)), jnp.int32)
  prompt_len = jnp.asarray(rng.randint(args.prompt_len // 2, args.prompt_len + 1, args.batch),
                           jnp.int32)
  engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=args.batch,
                  max_prefill_length=args.prompt_len, max_decode_length=args.new_tokens,
                  pad_id=0)
  prompts = [np.asarray(prompt)[i, :int(prompt_len[i])].tolist() for i in range(args.batch)]
  naive = jax.jit(functools.partial(full_recompute_greedy, model,
                                    new_tokens=args.new_tokens))
  run_cached = lambda: np.asarray([
      s.tokens for s in generate(model, params, prompts, GREEDY,
                                 max_new_tokens=args.new_tokens, engine=engine)])
  run_naive = lambda: naive(params, prompt, prompt_len)
  same = bool(np.array_equal(np.asarray(run_cached()), np.asarray(run_naive())))
  t_cached = timeit(run_cached, args.repeats)
  t_naive = timeit(run_naive, args.repeats)
  tokens = args.batch * args.new_tokens
  print(json.dumps({
      'benchmark': 'kv_cache_decode',
      'devices': str(jax.devices()),
      'shape': vars(args),
      'identical_tokens': same,
      'cached_tokens_per_s': tokens / t_cached,
      'full_recompute_tokens_per_s': tokens / t_naive,
      'speedup': t_naive / t_cached,
  }, indent=2))


if __name__ == '__main__':
  main()
