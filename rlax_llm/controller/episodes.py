"""The episodes kind: an environment run (``settings.episodes``; docs/environments.md,
"Training on an environment"), a ``RolloutKind`` of ``rlax_llm.controller.protocols``.

Each prompt is an environment seed; the workers ``play`` its ``group_size`` episodes where
they would ``generate`` completions (same keys, versions, chunks and failure handling), the
environment's returns are the rewards (no verifier), advantages come from
``advantage_estimator`` (a group estimator over returns, or a multi-turn one broadcast to the
turns' tokens, ``[B, T]``), and held-out evaluation is greedy episode success
(``evaluation.evaluate_episodes``). Episodes in flight at a checkpoint are not stored: they
are played again on resume with the same keys and version. With a teacher (on-policy
distillation, ``completions.distill_batch``) the teacher reads whole conversations and only
the model's sampled tokens (the loss mask; never the environment's observations) get the
reverse-KL advantage, added to the per-token or per-episode task advantages.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm import losses
from rlax_llm.controller.completions import Distillation, distill_batch
from rlax_llm.controller.protocols import Batch, Made, Run, WorkerHandle
from rlax_llm.controller.state import ControllerState
from rlax_llm.data_types import (
  TERMINATIONS,
  GenerationRequest,
  TrainBatch,
  Trajectory,
  make_trajectory_batch,
)
from rlax_llm.evaluation import episode_metrics, evaluate_episodes
from rlax_llm.schedule import ControllerSettings
from rlax_llm.tasks import Prompt

Played = tuple[list[Trajectory], dict[str, float]]  # the trajectories and the runner's figures


class Episodes:
  """Episodes of an environment under ``settings`` (see the module docstring)."""

  def __init__(self, settings: ControllerSettings, teacher: Distillation | None = None):
    if settings.episodes is None:
      raise ValueError('Episodes needs settings.episodes (an environment run\'s '
                       'EpisodeSettings), got None; a task run uses Completions.')
    self.settings = settings
    self.teacher = teacher

  def submit(self, worker: WorkerHandle, requests: list[GenerationRequest],
             rng_data: np.ndarray, version: int, stop_after: int | None, first: int):
    del stop_after  # an episode is played whole (APRIL is refused for environment runs)
    return worker.play(requests, rng_data, version, first)

  def counted(self, result: Played, count: Callable[[dict[str, float]], dict[str, float]]
              ) -> Played:
    trajectories, figures = result
    return trajectories, count(figures)

  def merge(self, parts: list[Played]) -> Played:
    """The chunks' trajectories in order and their runners' figures, summed (``wall_s``: the
    longest chunk's)."""
    trajectories, figures = [], collections.Counter()
    for part, stats in parts:
      trajectories += part
      figures.update({k: v for k, v in stats.items() if k != 'wall_s'})
      figures['wall_s'] = max(figures['wall_s'], stats.get('wall_s', 0.0))
    return trajectories, dict(figures)

  def compose(self, count: int, version_bound: int, draw: Callable[[], Prompt]
              ) -> tuple[list[Prompt], list[None], dict[str, int]]:
    """``count`` new seeds from the stream (nothing is carried or replayed)."""
    del version_bound
    return [draw() for _ in range(count)], [], {}

  def make(self, batch: Batch, merged: Played, trainer_version: int) -> Made:
    """The batch's episodes (``group_size`` per environment seed) with the environment's
    rewards and their advantages (``_train_batch``), every one trained."""
    del trainer_version  # every episode is sampled by the version the schedule names
    trajectories, figures = merged
    returns = np.asarray([x.episode_return for x in trajectories])
    metrics = {'reward/mean': float(returns.mean()), 'reward/std': float(returns.std()),
               **episode_metrics(trajectories, 'episode/'),
               **{f'termination/{reason}': float(np.mean([x.termination == reason
                                                          for x in trajectories]))
                  for reason in TERMINATIONS},
               'sampling_version': batch.version}
    train_batch, credit = self._train_batch(trajectories)
    metrics.update(credit)
    if self.teacher is not None:  # only the model's sampled tokens (the loss mask) get a signal
      train_batch, distill_metrics = distill_batch(train_batch, self.teacher)
      metrics.update(distill_metrics)
    return Made(
        metrics, train_batch,
        trained_prompt_ids=[int(i) for i in dict.fromkeys(x.prompt_id for x in trajectories)],
        trained_versions=sorted({int(v) for x in trajectories
                                 for v in np.unique(x.versions) if v >= 0}),
        tokens_per_s=figures.get('model_tokens', 0.0) / max(figures.get('wall_s', 0.0), 1e-9))

  def log(self, writer, step: int, made: Made, staleness: np.ndarray | None) -> None:
    """Nothing beyond the metrics: the TensorBoard rollout histograms are of completions."""
    del writer, step, made, staleness

  def evaluate(self, run: Run, prompts: Sequence[Prompt], key: jax.Array) -> dict[str, float]:
    """``evaluation.evaluate_episodes``: greedy held-out episode success."""
    return evaluate_episodes(prompts, lambda requests, k: run(requests, k)[0],
                             max_new_tokens=self.settings.max_new_tokens, key=key)

  def state(self) -> dict[str, Any]:
    return {}

  def snapshot(self, state: ControllerState, arrays: dict[str, dict[str, np.ndarray]],
               in_flight: Sequence[Batch], gather: Callable[[Batch], Played]) -> None:
    """Stores the batches ``in_flight`` by prompts and version only (played again on
    resume, with the same keys), without waiting for them."""
    del arrays, gather
    state.inflight += [{'index': batch.index, 'version': batch.version,
                        'prompts': [p.to_dict() for p in batch.prompts]}
                       for batch in in_flight]

  def restore(self, state: ControllerState, arrays: dict[str, dict[str, np.ndarray]]
              ) -> list[Batch]:
    del arrays
    return [Batch(index=batch['index'], version=batch['version'],
                  prompts=[Prompt.from_dict(p) for p in batch['prompts']], chunks=[])
            for batch in state.inflight]

  def _train_batch(self, trajectories: list[Trajectory]) -> tuple[TrainBatch, dict[str, float]]:
    """The trainer's rows of ``trajectories``, ``episodes.length`` wide (one shape every
    step), with their advantages: ``rl.advantage_estimator`` a group estimator
    (``losses.ESTIMATORS``, e.g. GRPO over episode returns: ``[B]``) or a multi-turn one
    (``losses.TURN_ESTIMATORS``: per-turn advantages broadcast to the turns' tokens,
    ``[B, T]``). Environment state keys become dense ids per batch (``losses.multi_turn``).
    An episode ended by its wall-clock deadline (``'timeout'``) gets advantage 0 and joins
    no group: the machine's load, not its actions, ended it, so its 0 return is no failure
    to learn from (on a loaded host the longest episodes, those still walking to the goal,
    were the ones cut). Also returns what the credit holds (``losses.credit_metrics``)."""
    s = self.settings
    e = s.episodes
    returns = np.asarray([x.episode_return for x in trajectories], np.float32)
    group_ids = np.asarray([x.group_id for x in trajectories], np.int32)
    timely = np.asarray([x.termination != 'timeout' for x in trajectories])
    if s.advantage_estimator not in losses.TURN_ESTIMATORS:
      advantages = np.asarray(losses.group_advantages(returns, group_ids,
                                                      s.advantage_estimator, valid=timely))
      packed = make_trajectory_batch(trajectories, advantages, length=e.length)
      turn_mask = packed.turn_mask & timely[:, None]
      per_turn = np.where(turn_mask, advantages[:, None], 0.0)
      return packed.train, losses.credit_metrics(per_turn, turn_mask, group_ids, returns)
    packed = make_trajectory_batch(trajectories, np.zeros(len(trajectories), np.float32),
                                   length=e.length)
    _, dense = np.unique(packed.state_ids, return_inverse=True)
    state_ids = dense.reshape(packed.state_ids.shape).astype(np.int32)
    turn_mask = packed.turn_mask & timely[:, None]
    per_turn = losses.turn_advantages(
        s.advantage_estimator, episode_returns=packed.episode_returns, group_ids=group_ids,
        turn_rewards=packed.turn_rewards, turn_mask=turn_mask, state_ids=state_ids,
        gamma=e.gamma, omega=e.omega, norm=e.norm)
    tokens = losses.broadcast_turn_advantages(per_turn, packed.token_turn)
    step_ids = (losses.step_group_ids(group_ids, state_ids, turn_mask)
                if s.advantage_estimator == 'gigpo' else None)
    credit = losses.credit_metrics(np.asarray(per_turn), turn_mask, group_ids, returns,
                                   None if step_ids is None else np.asarray(step_ids))
    return packed.train.replace(advantages=np.asarray(tokens, np.float32)), credit
