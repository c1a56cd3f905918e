"""Supervised warm-up: teacher-forced training on a task's demonstrations.

Gives a tiny model partial competence before RL (the RL starting point of the default run).
Uses the same ``Trainer`` (mesh, shardings, jitted step, non-finite guard) as RL with
``sft_objective``; the batches come from ``rlax_llm.data.sft_batch``.
"""

from __future__ import annotations

import functools
import logging
import time

import optax
from jax.sharding import Mesh

from rlax_llm import console
from rlax_llm.data import sft_batch
from rlax_llm.models.model import Model, Params
from rlax_llm.tasks import Task
from rlax_llm.errors import Preempted
from rlax_llm.tokenization import Tokenizer
from rlax_llm.trainer.objectives import sft_objective
from rlax_llm.errors import NonFiniteError
from rlax_llm.trainer.trainer import Trainer, make_optimizer


def supervised_warmup(model: Model, params: Params, task: Task, tokenizer: Tokenizer,
                      mesh: Mesh, *, steps: int, batch_size: int, learning_rate: float,
                      warmup_steps: int = 0, log_every: int = 50,
                      max_nonfinite_updates: int = 3, stop=None
                      ) -> tuple[Params, dict[str, float]]:
  """Runs ``steps`` SFT updates (cosine-decayed AdamW). Returns ``(host params, metrics)``.

  ``stop``: an event checked after every step; when set, raises ``checkpoint.Preempted`` (the
  warm-up is deterministic, so a preempted one is simply run again on relaunch; its result is
  checkpointed once it ends).
  """
  if steps <= 0:
    return params, {}
  console.phase(f'warm-up: {steps} supervised steps on the task\'s demonstrations')
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, min(warmup_steps, steps // 2), steps, end_value=0.1 * learning_rate)
  trainer = Trainer(model, params, make_optimizer(schedule),
                    functools.partial(sft_objective, model), mesh,
                    max_nonfinite_updates=max_nonfinite_updates)
  start = time.perf_counter()
  metrics: dict[str, float] = {}
  for step in range(steps):
    try:
      metrics = trainer.step(sft_batch(task, tokenizer, step * batch_size, batch_size))
    except NonFiniteError as e:
      raise NonFiniteError(f'warm-up step {step + 1}: {e}') from None
    if stop is not None and stop.is_set():
      raise Preempted(f'preempted during the warm-up (step {step + 1} of {steps}); it runs '
                      'again on relaunch.')
    if (step + 1) % log_every == 0 or step + 1 == steps:
      logging.info('warmup step %d/%d | loss %.4f | token accuracy %.3f', step + 1, steps,
                   metrics['loss'], metrics['accuracy'])
  metrics = {'warmup/loss': metrics['loss'], 'warmup/token_accuracy': metrics['accuracy'],
             'warmup/time_s': time.perf_counter() - start}
  return trainer.host_params(), metrics
