"""Benchmark: what a checkpoint costs the train loop, asynchronous and synchronous, and restore
time, on a SmolLM2-135M-sized trainer state (params + AdamW moments, fp32: about 1.6 GB).

The reference is the train step itself, measured in the same run: a GRPO step of the
SmolLM2-135M architecture on ``--batch`` x ``--length`` tokens. Each of ``--repeats`` rounds
runs three windows of ``--window`` steps, alternately (the machine may be shared: each cost
compares neighbouring windows):

1. **baseline**: ``--window`` steps, no save;
2. **async**: ``Checkpointer.save`` (asynchronous, the default), the ``--window`` steps while
   the files are written in the background, then ``wait()`` for whatever of the write is left;
3. **sync**: a synchronous save (``async_save=False``) of the same state, then the steps.

A save's cost is its window's wall time minus the baseline window's: everything the loop
lost, the blocked time and the slower steps while the background write shares the host's
cores and memory bandwidth included. Printed (medians over rounds):

* ``async_cost_s`` / ``async_cost_fraction`` (of a step): the asynchronous save's whole cost;
* ``sync_cost_s`` / ``sync_cost_fraction``: the synchronous save's;
* ``blocked_s`` / ``blocked_fraction``: the part of the asynchronous cost spent in ``save``
  itself (the device-to-host copy and dispatch), the rest being slower steps and the wait;
* ``step_s``: a baseline step; ``step_s_after_async_save`` / ``step_slowdown_after_async_save``:
  the first step after an asynchronous save, and its ratio to ``step_s``;
* ``restore_s``: restoring the latest step onto the trainer's shardings.

    .venv/bin/python benchmarks/checkpoint.py [--batch=8 --length=128] [--micro_batches=1]
        [--repeats=3] [--window=2] [--model=smollm2|tiny]

Prints one JSON object. ``--model=tiny``: a 2-layer decoder (the test's smoke run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=wrong-import-position
from train_step import model_config, timed, train_batch  # this folder (sys.path[0])

from rlax_llm import losses
from rlax_llm.checkpoint import Checkpointer
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer import objectives
from rlax_llm.trainer.scoring import Policy
from rlax_llm.trainer.trainer import Trainer, make_optimizer


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--model', default='smollm2', choices=('smollm2', 'tiny'))
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--length', type=int, default=128)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--window', type=int, default=2,
                      help='steps after each save counted in its cost (and in the baseline)')
  parser.add_argument('--micro_batches', type=int, default=1)
  args = parser.parse_args()
  if args.window < 1 or args.repeats < 1:
    parser.error(f'--window={args.window} and --repeats={args.repeats} must be >= 1')

  config = model_config(args.model, args.length)
  model, params = create_model(config, seed=0)
  batch = train_batch(args.batch, args.length, config.vocab_size)
  objective = functools.partial(objectives.rl_objective, Policy(model, SamplingSpec()),
                                losses.LossConfig(loss='grpo').resolve(), logprob_chunk=64)
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  trainer = Trainer(model, params, make_optimizer(1e-6), objective, mesh,
                    micro_batches=args.micro_batches, totals_fn=objectives.loss_totals)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves((trainer.params, trainer.opt_state)))

  def steps() -> list[float]:
    return [timed(functools.partial(trainer.step, batch)) for _ in range(args.window)]

  timed(functools.partial(trainer.step, batch))  # compile
  root = tempfile.mkdtemp(prefix='rlax_ckpt_bench_')
  load_start = os.getloadavg()[0]
  try:
    saving = {'async': Checkpointer(root, keep=2),
              'sync': Checkpointer(root + '_sync', keep=2, async_save=False)}
    save = lambda which, s: saving[which].save(
        s, params=trainer.params, opt_state=trainer.opt_state, trainer=trainer.counters(),
        controller={'step': s}, rollouts={})
    for which in saving:  # first save: Orbax's own set-up (directories, metadata), not measured
      save(which, 0)
      saving[which].wait()
    rounds = []
    for s in range(1, args.repeats + 1):
      baseline = steps()
      start = time.perf_counter()
      blocked = timed(functools.partial(save, 'async', s))
      after_async = steps()
      saving['async'].wait()
      async_window = time.perf_counter() - start
      start = time.perf_counter()
      save('sync', s)
      sync_save = time.perf_counter() - start
      sync_window = sync_save + sum(steps())
      rounds.append({'step_s': float(np.median(baseline)), 'baseline_s': sum(baseline),
                     'blocked_s': blocked, 'step_s_after_async_save': after_async[0],
                     'async_window_s': async_window, 'sync_window_s': sync_window,
                     'async_cost_s': async_window - sum(baseline),
                     'sync_save_s': sync_save, 'sync_cost_s': sync_window - sum(baseline)})
    for checkpointer in saving.values():
      checkpointer.close()
    start = time.perf_counter()
    restored = Checkpointer(root).restore(trainer.params, trainer.opt_state)
    jax.block_until_ready(restored.params)
    restore_s = time.perf_counter() - start
  finally:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root + '_sync', ignore_errors=True)

  median = lambda key: float(np.median([r[key] for r in rounds]))
  step_s = median('step_s')
  out = {'state_bytes': state_bytes, 'model': args.model, 'batch': args.batch,
         'length': args.length, 'micro_batches': args.micro_batches, 'window': args.window,
         'repeats': args.repeats, 'step_s': step_s}
  for key in ('async_cost_s', 'sync_cost_s', 'blocked_s'):
    out[key] = median(key)
    out[key[:-len('_s')] + '_fraction'] = out[key] / step_s
  out.update({
      'step_s_after_async_save': median('step_s_after_async_save'),
      'step_slowdown_after_async_save': median('step_s_after_async_save') / step_s,
      'sync_save_s': median('sync_save_s'), 'restore_s': restore_s,
      'restored_step': restored.step, 'rounds': rounds,
      'load_average_start': load_start, 'load_average_end': os.getloadavg()[0]})
  print(json.dumps(out))


if __name__ == '__main__':
  main()
