"""Benchmark: the engine's weight layout on XLA:CPU, ``'out_in'`` against ``'in_out'``.

SmolLM2-135M-Instruct (the packaged GGUF), fp32, default numerics, in two engines that
differ only in ``Engine(weight_layout=...)``: ``'out_in'`` (what the engine picks on
XLA:CPU; a decode step's products run as ``w @ x.T``, ``numerics.flipped_product``) and
``'in_out'`` (the trainer's layout, ``x @ w``). For each slot count, in the same process,
alternating (``--repeats`` each, median of the paired ratios):

* ``decode_step``: ``DECODE_STEPS`` decode steps over all slots attending to the whole cache;
* ``prefill``: one prefill of as many chat prompts as slots (the engine's longest bucket);

and whether the two engines' greedy tokens agree over ``--new_tokens``.

Prints one JSON object:

    {"slots": {"32": {"decode_step": {"in_out_s", "out_in_s", "ratio", "ratios"},
                      "prefill": {...}, "greedy_tokens_equal": [int per row]}, ...}}

``ratio`` is ``in_out`` over ``out_in`` seconds: above 1, the engine's layout is faster.

    .venv/bin/python benchmarks/engine_layout.py [--slots=1,8,32,64] [--repeats=7]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import numpy as np

from batch_invariant import DECODE_STEPS, alternate, decode_steps
from rlax_llm.models import from_pretrained, smollm2_gguf_path
from rlax_llm.models.model import split_module
from rollout_throughput import driver_for, jobs_for, prompts_for

LAYOUTS = ('in_out', 'out_in')


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--slots', default='1,8,32,64')
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--new_tokens', type=int, default=32)
  args = parser.parse_args()

  module, tokenizer = from_pretrained(smollm2_gguf_path())
  model, params = split_module(module)
  result = {'backend': jax.default_backend(), 'decode_steps': DECODE_STEPS, 'slots': {}}
  for slots in [int(s) for s in args.slots.split(',')]:
    prompts = prompts_for(tokenizer, slots)
    drivers = {layout: driver_for(model, params, slots, len(prompts[0]), args.new_tokens,
                                  weight_layout=layout) for layout in LAYOUTS}
    outputs = {layout: driver.run(jobs_for(prompts, [args.new_tokens] * slots))
               for layout, driver in drivers.items()}
    equal = [next((i for i, (a, b) in enumerate(zip(x[0].tokens, y[0].tokens)) if a != b),
                  len(x[0].tokens)) for x, y in zip(outputs['in_out'], outputs['out_in'])]
    steps, prefills = {}, {}
    for layout, driver in drivers.items():
      engine, placed = driver.engine, driver.holder.get()[1]  # placed by driver_for
      steps[layout] = decode_steps(engine, placed)
      prefills[layout] = lambda engine=engine, placed=placed: jax.block_until_ready(
          engine.prefill(placed, prompts))
    entry = {'greedy_tokens_equal': equal}
    for phase, fns in (('decode_step', steps), ('prefill', prefills)):
      times = alternate(fns, args.repeats)
      per = DECODE_STEPS if phase == 'decode_step' else 1
      ratios = [a / b for a, b in zip(times['in_out'], times['out_in'])]
      entry[phase] = {'in_out_s': statistics.median(times['in_out']) / per,
                      'out_in_s': statistics.median(times['out_in']) / per,
                      'ratio': statistics.median(ratios), 'ratios': ratios}
    result['slots'][str(slots)] = entry
    print(json.dumps({slots: entry}), flush=True)
  print(json.dumps(result, indent=2))


if __name__ == '__main__':
  main()
