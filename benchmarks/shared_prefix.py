"""Benchmark: the GRPO train step with and without shared-prefix scoring (``rl.shared_prefix``,
Prefix Grouper, arXiv 2506.05433), same process, same batch, same trainer otherwise.

SmolLM2-135M's architecture (random-initialised: the values do not change the cost), fp32,
AdamW, the GRPO clipped objective. The batch has the controller's layout: ``--groups`` groups
of ``--group_size`` consecutive rows sharing a prompt (lengths drawn in ``[prompt/2, prompt]``)
followed by completions of up to ``--new`` tokens (lengths drawn in ``[1, new]``), right-padded
to ``prompt + new``. Three shapes by default: the SmolLM2 addition recipe (4 x 8 rows, 48 + 16
tokens) with 4 micro-batches and in one pass, and a longer-prompt one (2 x 8 rows, 192 + 64,
2 micro-batches).

Per shape: one untimed step per trainer (compilation), then ``--steps`` timed steps of each,
alternating (so both see the same machine load); tokens/s = rows x (prompt + new) / median
step time. Prints one JSON object: per shape ``unshared_tok_s``, ``shared_tok_s``, ``ratio``
(shared / unshared) and the first step's loss and grad norm of each (equal to rounding: the
same update).

    .venv/bin/python benchmarks/shared_prefix.py [--steps=3]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import jax
import numpy as np

from rlax_llm import losses
from rlax_llm.data_types import TrainBatch
from rlax_llm.models import presets
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer import objectives
from rlax_llm.trainer.trainer import Trainer, make_optimizer

SHAPES = {
    'recipe': dict(groups=4, group_size=8, prompt=48, new=16, micro_batches=4),
    'recipe_one_pass': dict(groups=4, group_size=8, prompt=48, new=16, micro_batches=1),
    'long_prompt': dict(groups=2, group_size=8, prompt=192, new=64, micro_batches=2),
}


def make_batch(groups: int, group_size: int, prompt: int, new: int, vocab: int,
               seed: int = 0) -> TrainBatch:
  rng = np.random.RandomState(seed)
  rows, length = groups * group_size, prompt + new
  tokens = np.zeros((rows, length), np.int32)
  mask = np.zeros((rows, length), np.float32)
  for g in range(groups):
    size = rng.randint(prompt // 2, prompt + 1)
    shared = rng.randint(1, vocab, size)
    for r in range(group_size):
      b = g * group_size + r
      n = rng.randint(1, new + 1)
      tokens[b, :size] = shared
      tokens[b, size:size + n] = rng.randint(1, vocab, n)
      mask[b, size:size + n] = 1.0
  return TrainBatch(
      tokens=tokens, loss_mask=mask,
      behaviour_logprobs=(np.log(rng.uniform(1e-5, 1e-3, (rows, length))) * mask).astype(
          np.float32),
      support_sizes=np.where(mask > 0, vocab, 0).astype(np.int32),
      advantages=rng.randn(rows).astype(np.float32),
      versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(groups), group_size).astype(np.int32))


def run_shape(shape: dict, steps: int) -> dict:
  config = dataclasses.replace(presets.PRESETS['smollm2-135m'],
                               max_seq_len=shape['prompt'] + shape['new'])
  model, params = create_model(config, seed=0)
  batch = make_batch(shape['groups'], shape['group_size'], shape['prompt'], shape['new'],
                     config.vocab_size)
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  loss = losses.LossConfig(loss='grpo').resolve()
  policy = Policy(model, SamplingSpec(temperature=0.7))
  micro = shape['micro_batches']
  trainers, first = {}, {}
  for name, (scoring, check) in (
      ('unshared', ({}, None)),
      ('shared', objectives.shared_prefix_scoring(shape['new'], shape['group_size'], micro))):
    objective = functools.partial(objectives.rl_objective, policy, loss, **scoring)
    trainers[name] = Trainer(model, params, make_optimizer(1e-6), objective, mesh,
                             micro_batches=micro, totals_fn=objectives.loss_totals,
                             check_batch=check)
    metrics = trainers[name].step(batch)  # compilation + warm-up
    first[name] = {'loss': metrics['loss'], 'grad_norm': metrics['grad_norm']}
  times = {name: [] for name in trainers}
  for _ in range(steps):
    for name, trainer in trainers.items():
      start = time.perf_counter()
      trainer.step(batch)
      times[name].append(time.perf_counter() - start)
  tokens = batch.tokens.size
  out = dict(shape)
  for name in trainers:
    out[f'{name}_step_s'] = statistics.median(times[name])
    out[f'{name}_tok_s'] = tokens / out[f'{name}_step_s']
    out[f'{name}_first_loss'] = first[name]['loss']
    out[f'{name}_first_grad_norm'] = first[name]['grad_norm']
  out['ratio'] = out['shared_tok_s'] / out['unshared_tok_s']
  return out


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--shapes', default=','.join(SHAPES))
  args = parser.parse_args()
  result = {'dtype': 'float32', 'steps': args.steps, 'shapes': {}}
  for name in args.shapes.split(','):
    result['shapes'][name] = run_shape(SHAPES[name], args.steps)
  print(json.dumps(result))


if __name__ == '__main__':
  main()
