"""Supervised warm-up: teacher-forced training on a task's or an environment's demonstrations.

Gives a model partial competence before RL (the RL starting point of the default run). Uses
the same ``Trainer`` (mesh, shardings, jitted step, non-finite guard) as RL with
``sft_objective``; the batches come from ``rlax_llm.data.sft_batch`` (a task's
``sft_example``) or ``demo_batch`` (an environment's oracle episodes, rendered token for token
as the episode runner records them, ``rlax_llm.envs.conversation``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import chex
import numpy as np
import optax
from jax.sharding import Mesh

from rlax_llm import console
from rlax_llm.data import padded_rows
from rlax_llm.envs.base import Environment
from rlax_llm.envs.seeds import DEMO_SEED_START
from rlax_llm.errors import NonFiniteError, Preempted
from rlax_llm.models.model import Model, Params
from rlax_llm.envs.conversation import demonstration
from rlax_llm.tokenization import Tokenizer
from rlax_llm.trainer.objectives import sft_objective
from rlax_llm.trainer.trainer import Bound, Trainer, make_optimizer


def supervised_warmup(model: Model, params: Params,
                      batches: Callable[[int, int], dict[str, np.ndarray]], mesh: Mesh, *,
                      steps: int, batch_size: int, learning_rate: float,
                      warmup_steps: int = 0, log_every: int = 50,
                      max_nonfinite_updates: int = 3, stop=None, source: str = 'demonstrations'
                      ) -> tuple[Params, dict[str, float]]:
  """Runs ``steps`` SFT updates (cosine-decayed AdamW). Returns ``(host params, metrics)``.

  ``batches(start, batch_size)``: demonstrations ``start .. start + batch_size - 1`` as
  ``tokens`` int32 [B, T] and ``loss_mask`` float32 [B, T] (``data.sft_batch`` or
  ``demo_batch`` with its first arguments bound); step ``s`` trains on those from
  ``s * batch_size``. ``source``: what they are, for the console. Each batch is right-padded
  (``widened``) to the longest seen so far in this warm-up, so the jitted step compiles once
  per new longest batch instead of once per distinct length (the smoke config's 80 batches
  are 7 or 8 tokens wide: one train-step program instead of two); the padding is masked out
  of the loss, and a causal model's real positions never see it.

  ``stop``: an event checked after every step; when set, raises ``errors.Preempted`` (the
  warm-up is deterministic, so a preempted one is simply run again on relaunch; its result is
  checkpointed once it ends).
  """
  if steps <= 0:
    return params, {}
  console.phase(f'warm-up: {steps} supervised steps on {source}')
  schedule = _schedule(learning_rate, min(warmup_steps, steps // 2), steps)
  trainer = Trainer(model, params, make_optimizer(schedule), Bound(sft_objective, model), mesh,
                    max_nonfinite_updates=max_nonfinite_updates)
  start = time.perf_counter()
  metrics: dict[str, float] = {}
  width = 0
  for step in range(steps):
    batch = batches(step * batch_size, batch_size)
    width = max(width, batch['tokens'].shape[1])
    try:
      metrics = trainer.step(widened(batch, width))
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


@functools.lru_cache(maxsize=16)
def _schedule(learning_rate: float, warmup_steps: int, steps: int) -> optax.Schedule:
  """The warm-up's learning rate: linear warm-up over ``warmup_steps``, then a cosine decay to
  a tenth at ``steps``. One object per settings, so equal warm-ups get equal optimizers
  (``make_optimizer``) and share their compiled step (``trainer.Trainer``)."""
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, steps,
                                            end_value=0.1 * learning_rate)


def widened(batch: dict[str, np.ndarray], width: int) -> dict[str, np.ndarray]:
  """``batch`` (``tokens`` int32 [B, T], ``loss_mask`` float32 [B, T]) right-padded to
  ``width >= T`` columns: ``tokens`` repeats each row's last id, ``loss_mask`` is 0 there."""
  tokens, loss_mask = batch['tokens'], batch['loss_mask']
  chex.assert_rank([tokens, loss_mask], 2)
  chex.assert_equal_shape([tokens, loss_mask])
  pad = width - tokens.shape[1]
  if pad < 0:
    raise ValueError(f'cannot widen a batch of {tokens.shape[1]} columns to {width}: the '
                     'width must be at least the batch\'s own.')
  return dict(batch, tokens=np.pad(tokens, ((0, 0), (0, pad)), mode='edge'),
              loss_mask=np.pad(loss_mask, ((0, 0), (0, pad))))


def demo_batch(make_env: Callable[[], Environment], tokenizer: Tokenizer, start: int,
               batch_size: int, *, max_turns: int | None = None
               ) -> dict[str, np.ndarray]:
  """An environment run's warm-up rows: demonstrations ``start .. start + batch_size - 1``,
  demonstration ``i`` the oracle's episode of a fresh ``make_env()`` from seed
  ``DEMO_SEED_START + i`` (``envs.conversation.demonstration``: the ids and loss mask the
  episode runner records for those actions; ``max_turns`` caps its turns as ``agent.max_turns``
  does).

  Returns ``tokens`` int32 ``[B, T]`` and ``loss_mask`` float32 ``[B, T]`` (1 on the model's
  turns and the eos ending each).
  """
  rows, masks = [], []
  for i in range(start, start + batch_size):
    ids, mask = demonstration(make_env(), DEMO_SEED_START + i, tokenizer, max_turns)
    rows.append(ids)
    masks.append([float(m) for m in mask])
  return padded_rows(rows, masks, tokenizer.pad_id)
