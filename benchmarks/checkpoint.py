"""Benchmark: how long an asynchronous checkpoint blocks the train loop, and restore time, on
a SmolLM2-135M-sized trainer state (params + AdamW moments, fp32: about 1.6 GB).

The reference is the train step itself, measured in the same run: a GRPO step of the
SmolLM2-135M architecture on ``--batch`` x ``--length`` tokens. Measured:

* ``blocked_s``: time ``Checkpointer.save`` keeps the caller (the trainer's process, which
  the controller waits on, between two steps) waiting: the device-to-host copy and
  dispatch; the files are written in the background.
* ``blocked_fraction``: ``blocked_s / step_s`` (goal <= 5%).
* ``step_s_during_save / step_s``: how much a step slows down while the background write
  runs (it shares the host's cores and memory bandwidth).
* ``background_write_s``: from the save call until the files are on disk.
* ``sync_save_s``: a synchronous save of the same state, for reference.
* ``restore_s``: restoring the latest step onto the trainer's shardings.

    .venv/bin/python benchmarks/checkpoint.py [--batch=8 --length=128]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import tempfile
import time

import jax
import numpy as np

from rlax_llm import losses
from rlax_llm.checkpoint import Checkpointer
from rlax_llm.data_types import TrainBatch
from rlax_llm.models import presets
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer import objectives
from rlax_llm.trainer.trainer import Trainer, make_optimizer


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--length', type=int, default=128)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--micro_batches', type=int, default=1)
  args = parser.parse_args()

  config = dataclasses.replace(presets.PRESETS['smollm2-135m'], max_seq_len=args.length)
  model, params = create_model(config, seed=0)
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, config.vocab_size, (args.batch, args.length)).astype(np.int32)
  mask = np.zeros(tokens.shape, np.float32)
  mask[:, args.length // 2:] = 1
  batch = TrainBatch(
      tokens=tokens, loss_mask=mask,
      behaviour_logprobs=(np.log(rng.uniform(1e-5, 1e-3, tokens.shape)) * mask).astype(
          np.float32),
      support_sizes=np.where(mask > 0, config.vocab_size, 0).astype(np.int32),
      advantages=rng.randn(args.batch).astype(np.float32),
      versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(args.batch // 4), 4).astype(np.int32))
  objective = functools.partial(objectives.rl_objective, Policy(model, SamplingSpec()),
                                losses.LossConfig(loss='grpo').resolve(), logprob_chunk=64)
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  trainer = Trainer(model, params, make_optimizer(1e-6), objective, mesh,
                    micro_batches=args.micro_batches, totals_fn=objectives.loss_totals)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves((trainer.params, trainer.opt_state)))

  def step() -> float:
    start = time.perf_counter()
    trainer.step(batch)
    return time.perf_counter() - start

  step()  # compile
  step_s = float(np.median([step() for _ in range(args.steps)]))

  root = tempfile.mkdtemp(prefix='rlax_ckpt_bench_')
  try:
    checkpointer = Checkpointer(root, keep=2)
    save = lambda s: checkpointer.save(s, params=trainer.params, opt_state=trainer.opt_state,
                                       trainer=trainer.counters(), controller={'step': s},
                                       rollouts={})
    save(0)  # first save: Orbax's own set-up (directories, metadata), not measured
    checkpointer.wait()
    blocked, during, writes = [], [], []
    for s in range(1, args.steps + 1):
      start = time.perf_counter()
      save(s)
      blocked.append(time.perf_counter() - start)
      during.append(step())  # the next step runs while the files are written
      checkpointer.wait()
      writes.append(time.perf_counter() - start)
    sync = Checkpointer(root + '_sync', keep=1, async_save=False)
    start = time.perf_counter()
    sync.save(1, params=trainer.params, opt_state=trainer.opt_state, trainer={},
              controller={}, rollouts={})
    sync_save_s = time.perf_counter() - start
    sync.close()
    start = time.perf_counter()
    restored = Checkpointer(root).restore(trainer.params, trainer.opt_state)
    jax.block_until_ready(restored.params)
    restore_s = time.perf_counter() - start
    checkpointer.close()
  finally:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root + '_sync', ignore_errors=True)

  blocked_s = float(np.median(blocked))
  print(json.dumps({
      'state_bytes': state_bytes, 'batch': args.batch, 'length': args.length,
      'micro_batches': args.micro_batches,
      'step_s': step_s, 'blocked_s': blocked_s, 'blocked_fraction': blocked_s / step_s,
      'step_s_during_save': float(np.median(during)),
      'step_slowdown_during_save': float(np.median(during)) / step_s,
      'background_write_s': float(np.median(writes)), 'sync_save_s': sync_save_s,
      'restore_s': restore_s, 'restored_step': restored.step,
  }))


if __name__ == '__main__':
  main()
