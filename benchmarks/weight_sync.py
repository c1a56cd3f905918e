"""Benchmark: weight synchronisation per update, whole params vs lossless sparse deltas.

SmolLM2-135M-Instruct (the packaged GGUF) is trained with real GRPO updates (AdamW, the
trainer's jitted step, rollouts sampled by the engine) at RL learning rates; after each
update the new version is encoded against the previous one (``rlax_llm.paramserver.delta``)
in two representations: the fp32 master weights, and a bf16 cast (what a bf16 inference
worker would hold). Reported per update and representation: bytes whole vs delta, the
fraction of elements whose bits changed, and seconds to encode, to apply, and to move the
payload through pickle (protocol 5, a stand-in for a transport), whole vs delta, all measured
in the same run.

    .venv/bin/python benchmarks/weight_sync.py [--lrs=1e-6,1e-5] [--steps=3]
"""

from __future__ import annotations

import argparse
import functools
import json
import pickle
import statistics
import time

import jax
import ml_dtypes
import numpy as np

from rlax_llm.data_types import GenerationRequest, make_train_batch
from rlax_llm.losses import LossConfig, group_advantages
from rlax_llm.models import from_pretrained, smollm2_gguf_path
from rlax_llm.models.model import split_module
from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sharding import make_mesh
from rlax_llm.tasks import ArithmeticTask
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.trainer import Trainer, make_optimizer


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def measure(base, new) -> dict:
  encode_s, delta = timed(lambda: delta_lib.encode(base, new, base_version=0, version=1))
  apply_s, rebuilt = timed(lambda: delta_lib.apply(base, delta))
  exact = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(rebuilt, new))
  full_s, _ = timed(lambda: pickle.loads(pickle.dumps(new, protocol=5)))
  delta_s, _ = timed(lambda: pickle.loads(pickle.dumps(delta, protocol=5)))
  full_bytes = sum(x.nbytes for x in new)
  return {'full_bytes': full_bytes, 'delta_bytes': delta.nbytes,
          'bytes_ratio': delta.nbytes / full_bytes, 'changed_fraction': delta.density,
          'encode_s': encode_s, 'apply_s': apply_s, 'bit_exact': exact,
          'move_full_s': full_s, 'move_delta_s': delta_s}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--lrs', default='1e-6,1e-5')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--prompts', type=int, default=4)
  parser.add_argument('--samples', type=int, default=4)
  args = parser.parse_args()

  module, tokenizer = from_pretrained(smollm2_gguf_path())
  model, params0 = split_module(module)
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  spec = SamplingSpec(1.0)
  task = ArithmeticTask(format='chat', answer_format='last_integer', num_eval=4)
  worker = InferenceWorker(model, tokenizer, mesh, max_prompt_len=64, max_new_tokens=24,
                           slots=args.prompts * args.samples)
  worker.load(0, params0)
  rollouts = worker.generate(
      [GenerationRequest(task.train_prompt(i), args.samples, spec, 24)
       for i in range(args.prompts)], jax.random.key(0))
  rewards = np.asarray([task.score(task.train_prompt(g), c)
                        for g, c in zip(rollouts.group_ids, rollouts.completions)], np.float32)
  rewards = rewards + 0.1 * np.random.RandomState(0).randn(len(rewards)).astype(np.float32)
  batch = make_train_batch(rollouts, np.asarray(group_advantages(rewards, rollouts.group_ids)))

  results = {}
  for lr in [float(x) for x in args.lrs.split(',')]:
    trainer = Trainer(model, params0, make_optimizer(lr),
                      functools.partial(rl_objective, Policy(model, spec), LossConfig()), mesh)
    previous = [np.asarray(x) for x in jax.tree.leaves(trainer.host_params())]
    updates = []
    for _ in range(args.steps):
      trainer.step(batch)
      current = [np.asarray(x) for x in jax.tree.leaves(trainer.host_params())]
      updates.append({
          'float32': measure(previous, current),
          'bfloat16': measure([x.astype(ml_dtypes.bfloat16) for x in previous],
                              [x.astype(ml_dtypes.bfloat16) for x in current]),
      })
      previous = current
    summary = {}
    for rep in ('float32', 'bfloat16'):
      rows = [u[rep] for u in updates]
      summary[rep] = {key: statistics.median(r[key] for r in rows)
                      for key in rows[0] if key != 'bit_exact'}
      summary[rep]['bit_exact'] = all(r['bit_exact'] for r in rows)
    results[f'{lr:g}'] = {'updates': updates, 'median': summary}
    print(json.dumps({lr: summary}), flush=True)
  print(json.dumps({'benchmark': 'weight_sync', 'model': 'SmolLM2-135M-Instruct',
                    'steps': args.steps, 'batch_rows': len(rollouts),
                    'learning_rates': results}, indent=2))


if __name__ == '__main__':
  main()
