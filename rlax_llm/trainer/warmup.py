"""Supervised warm-up: teacher-forced training on a task's synthetic examples.

Gives a tiny model partial competence before RL (the RL starting point of the default run).
Uses the same ``Trainer`` (mesh, shardings, jitted step) as RL with ``sft_objective``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import optax
from jax.sharding import Mesh

from rlax_llm.models.model import Model, Params
from rlax_llm.tasks import Task
from rlax_llm.trainer.objectives import sft_objective
from rlax_llm.trainer.trainer import Trainer, make_optimizer


def sft_batch(task: Task, start: int, batch_size: int) -> dict[str, np.ndarray]:
  """Examples ``start .. start + batch_size - 1`` as ``[bos] prompt completion [eos]`` rows
  (bos only if the tokenizer's ``add_bos_token`` says so).

  Returns ``tokens`` int32 ``[B, T]`` and ``loss_mask`` float32 ``[B, T]`` (1 on the
  completion and eos tokens, the targets the model must learn to produce).
  """
  tok = task.tokenizer
  rows, masks = [], []
  for i in range(start, start + batch_size):
    prompt, completion = task.sft_example(i)
    p = tok.encode(prompt, add_bos=tok.add_bos_token)
    c = tok.encode(completion, add_eos=True)
    rows.append(p + c)
    masks.append([0.0] * len(p) + [1.0] * len(c))
  length = max(len(r) for r in rows)
  tokens = np.full((batch_size, length), tok.pad_id, np.int32)
  loss_mask = np.zeros((batch_size, length), np.float32)
  for i, (r, m) in enumerate(zip(rows, masks)):
    tokens[i, :len(r)] = r
    loss_mask[i, :len(m)] = m
  return {'tokens': tokens, 'loss_mask': loss_mask}


def supervised_warmup(model: Model, params: Params, task: Task, mesh: Mesh, *, steps: int,
                      batch_size: int, learning_rate: float, warmup_steps: int = 0,
                      log_every: int = 50) -> tuple[Params, dict[str, float]]:
  """Runs ``steps`` SFT updates (cosine-decayed AdamW). Returns ``(host params, metrics)``."""
  if steps <= 0:
    return params, {}
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, min(warmup_steps, steps // 2), steps, end_value=0.1 * learning_rate)
  trainer = Trainer(model, params, make_optimizer(schedule), sft_objective, mesh)
  start = time.perf_counter()
  metrics: dict[str, float] = {}
  for step in range(steps):
    metrics = trainer.step(sft_batch(task, step * batch_size, batch_size))
    if (step + 1) % log_every == 0 or step + 1 == steps:
      logging.info('warmup step %d/%d | loss %.4f | token accuracy %.3f', step + 1, steps,
                   metrics['loss'], metrics['accuracy'])
  metrics = {'warmup/loss': metrics['loss'], 'warmup/token_accuracy': metrics['accuracy'],
             'warmup/time_s': time.perf_counter() - start}
  return trainer.host_params(), metrics
