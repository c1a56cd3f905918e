"""Benchmark: how a worker applies a LoRA version's adapters, merged on pull or unmerged.

With adapter-only sync (``lora.sync='adapters'``) a worker holds the base once and receives
each version's adapters. It can fold them in on pull (``lora.merge_program``: ``W + s * A @ B``
once per version, then decode with plain weights), or keep them apart and decode with
``decoder.linear``'s ``low_rank`` path (``x @ W + (x @ A) @ (s * B)`` in every projection of
every step). This measures both on SmolLM2-135M-Instruct (the packaged GGUF, fp32), LoRA rank
``--rank`` on all seven projections with random (nonzero) B, greedy, ``--new_tokens`` per
row, the runs alternated ``--repeats`` times (medians; compilation excluded):

* ``merged_tok_s``: the merged weights in the worker's default engine (on XLA:CPU the
  ``out_in`` layout and, from two slots, the CPU attention kernel) - what a worker runs;
* ``merged_same_engine_tok_s``: the merged weights in the engine the unmerged path needs
  (the model's own ``in_out`` layout and XLA attention: ``Engine`` keeps a ``LoRAModel`` only
  when it does not convert the layout), to separate the adapters' cost from the layout's;
* ``unmerged_tok_s``: the ``LoRAModel`` with its adapters in that engine;
* per version: ``merge_s`` (the jitted merge) and ``place_s`` (``Engine.place_params``, as
  every pull does), and the first row's tokens compared between merged and unmerged.

Prints one JSON object:

    .venv/bin/python benchmarks/lora_apply.py [--batches=1,8] [--rank=16] [--repeats=3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import jax
from rollout_throughput import driver_for, jobs_for, prompts_for, timed

from rlax_llm.models import from_pretrained, smollm2_gguf_path
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.model import split_module


def lora_params(model, params, rank: int, seed: int = 0):
  """``(LoRAModel, params)``: adapters on every projection, B drawn small and nonzero (a
  fresh B is zeros, which would make the adapters a no-op)."""
  lmodel, lparams = lora_lib.create(model, params, lora_lib.LoRAConfig(rank, 2.0 * rank),
                                    seed=seed)
  adapters = lora_lib.adapter_tree(lparams)
  key = jax.random.key(seed + 1)
  for part in adapters['blocks'].values():  # each adapter stacked over the layers
    for adapter in part.values():
      key, draw = jax.random.split(key)
      adapter['b'] = 0.01 * jax.random.normal(draw, adapter['b'].shape, adapter['b'].dtype)
  return lmodel, lora_lib.with_adapters(lora_lib.base_tree(lparams), adapters)


def seconds(fn, repeats: int) -> float:
  """The median wall time of ``fn()`` (its result blocked on), after one warm-up call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--batches', default='1,8', help='comma-separated batch sizes (slots)')
  parser.add_argument('--new_tokens', type=int, default=64, help='tokens generated per row')
  parser.add_argument('--rank', type=int, default=16, help='LoRA rank, all seven projections')
  parser.add_argument('--repeats', type=int, default=3, help='alternated timed runs')
  args = parser.parse_args()

  path = smollm2_gguf_path()
  module, tokenizer = from_pretrained(path)
  model, params = split_module(module)
  lmodel, lparams = lora_params(model, params, args.rank)
  merged = lora_lib.merge_program(lmodel)(lparams)
  own = {'weight_layout': model.config.execution.weight_layout,
         'decode_attention': model.config.execution.decode_attention,
         'layer_loop': model.config.execution.layer_loop}  # the LoRAModel runs as it is
  n = args.new_tokens
  batches = {}
  for batch in [int(b) for b in args.batches.split(',')]:
    prompts = prompts_for(tokenizer, batch)
    drivers = {
        'merged': driver_for(model, merged, batch, len(prompts[0]), n),
        'merged_same_engine': driver_for(model, merged, batch, len(prompts[0]), n, **own),
        'unmerged': driver_for(lmodel, lparams, batch, len(prompts[0]), n, **own),
    }
    assert isinstance(drivers['unmerged'].engine.model, lora_lib.LoRAModel)
    jobs = jobs_for(prompts, [n] * batch)
    outs = {name: driver.run(jobs) for name, driver in drivers.items()}  # compile
    times = {name: [] for name in drivers}
    for _ in range(args.repeats):
      for name, driver in drivers.items():
        t, outs[name] = timed(lambda driver=driver, jobs=jobs: driver.run(jobs))
        times[name].append(t)
    tok_s = {name: statistics.median(batch * n / t for t in ts) for name, ts in times.items()}
    a, b = outs['merged'][0][0].tokens, outs['unmerged'][0][0].tokens
    batches[str(batch)] = {
        **{f'{name}_tok_s': v for name, v in tok_s.items()},
        'merged_over_unmerged': statistics.median(
            u / m for m, u in zip(times['merged'], times['unmerged'])),
        'merged_same_engine_over_unmerged': statistics.median(
            u / m for m, u in zip(times['merged_same_engine'], times['unmerged'])),
        'first_row_tokens_equal': next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                       len(a)),
    }
    print(json.dumps({batch: batches[str(batch)]}), file=sys.stderr, flush=True)  # progress
  engine = drivers['merged'].engine
  merge = lora_lib.merge_program(lmodel)
  per_version = {
      'merge_s': seconds(lambda: merge(lparams), args.repeats),
      'place_s': seconds(lambda: engine.place_params(merged), args.repeats),
      'unmerged_place_s': seconds(lambda: drivers['unmerged'].engine.place_params(lparams),
                                  args.repeats),
  }
  print(json.dumps({
      'benchmark': 'lora_apply', 'model': path.name, 'dtype': 'float32', 'rank': args.rank,
      'targets': list(lora_lib.TARGETS), 'new_tokens': n, 'repeats': args.repeats,
      'devices': str(jax.devices()),
      'adapter_bytes': sum(x.nbytes for x in jax.tree.leaves(lora_lib.adapter_tree(lparams))),
      'base_bytes': sum(x.nbytes for x in jax.tree.leaves(params)),
      'batches': batches, 'per_version': per_version,
  }, indent=2))


if __name__ == '__main__':
  main()
