"""The completions kind: a task's prompts, ``group_size`` completions each, scored by its
verifier (``RolloutKind`` of ``rlax_llm.controller.protocols``).

It owns what only single-turn completions have (``rlax_llm.schedule``): the partial groups
APRIL carries into the next batch (``unfinished``), the groups dynamic sampling recycles
(``recycled``), the replay pool (``replay``) and the reward shaping of ``rlax_llm.rewards``.

On-policy distillation (``Distillation``, issue 63): the teacher scores each trained batch's
tokens in the controller's deterministic order, and the per-token advantages become
``A_task + lambda * (log pi_teacher - log pi_behaviour)`` on the student's sampled tokens
(``losses.distill``); the trainer's loss then applies its ratios, clipping and TIS to them.
With GKD the batch carries the teacher's top-k instead, for the trainer's GKD term.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm import losses, rewards, schedule
from rlax_llm.loss_spec import DistillConfig
from rlax_llm.controller.protocols import Batch, Made, Run, WorkerHandle, done
from rlax_llm.controller.state import ControllerState
from rlax_llm.data_types import (FollowLatest, GenerationRequest, Rollouts, TrainBatch,
                                 make_train_batch)
from rlax_llm.evaluation import evaluate_policy
from rlax_llm.schedule import ControllerSettings
from rlax_llm.tasks import Prompt, Task
from rlax_llm.verifiers import score_rollouts


@dataclasses.dataclass(frozen=True)
class Distillation:
  """On-policy distillation's teacher as the controller holds it: ``teacher.score(tokens,
  loss_mask)`` returns the teacher's per-token log-probs aligned with the tokens, and its
  top-k for GKD (``trainer.teacher.Teacher``), ``config`` how they enter the batch."""

  teacher: Any
  config: DistillConfig


def distill_batch(batch: TrainBatch, distillation: Distillation
                  ) -> tuple[TrainBatch, dict[str, float]]:
  """``batch`` with the teacher's signal, and the metrics ``distill/reverse_kl`` (the mean over
  the sampled tokens of ``log pi_behaviour - log pi_teacher``: a Monte-Carlo estimate of the
  per-token KL(student || teacher)) and ``distill/teacher_logp``.

  ``kind='reverse_kl'``: per-token advantages ``[B, T]``, its task advantages (``[B]``;
  dropped with ``with_reward=False``) plus ``weight`` times the reverse-KL advantages
  ``log pi_teacher - log pi_behaviour`` on its loss tokens (``losses.mix_advantages``).
  ``kind='gkd'``: the teacher's top-k ids and log-probs per position
  (``TrainBatch.teacher_top_ids`` / ``teacher_top_logp``, ``[B, T, K]``) for the trainer's GKD
  term (``trainer.objectives.rl_objective``); the advantages stay the task's (0 with
  ``with_reward=False``)."""
  config = distillation.config
  mask = np.asarray(batch.loss_mask)
  scores = distillation.teacher.score(batch.tokens, mask)
  teacher_logp = scores.logp
  on = mask > 0
  reverse_kl = np.where(on, np.asarray(batch.behaviour_logprobs) - teacher_logp, 0.0)
  metrics = {'distill/reverse_kl': float(reverse_kl[on].mean()) if on.any() else 0.0,
             'distill/teacher_logp': float(teacher_logp[on].mean()) if on.any() else 0.0}
  if config.kind == 'gkd':
    advantages = (batch.advantages if config.with_reward
                  else np.zeros_like(np.asarray(batch.advantages)))
    return (dataclasses.replace(batch, advantages=np.asarray(advantages, np.float32),
                                teacher_top_ids=scores.top_ids,
                                teacher_top_logp=scores.top_logp), metrics)
  distill = losses.reverse_kl_advantages(teacher_logp, batch.behaviour_logprobs, mask)
  advantages = losses.mix_advantages(batch.advantages if config.with_reward else None,
                                     distill, mask, config.weight)
  return (dataclasses.replace(batch, advantages=np.asarray(advantages, np.float32)),
          metrics)


class Completions:
  """Completions of ``task``'s prompts under ``settings`` (see the module docstring);
  ``teacher``: a ``Distillation`` (on-policy distillation) or None."""

  def __init__(self, settings: ControllerSettings, task: Task,
               teacher: Distillation | None = None):
    self.settings = settings
    self.task = task
    self.teacher = teacher
    # Reward shaping (rlax_llm.rewards): None trains on the verifier's reward as it is.
    self._reward_components = (rewards.make_components(settings.reward, task,
                                                       settings.max_new_tokens)
                               if settings.reward else None)
    self.recycled: list[tuple[int, Rollouts]] = []  # (oldest token version, one group)
    self.unfinished: list[tuple[Prompt, Rollouts]] = []  # partial groups to continue
    # Prompts whose last group had unequal rewards, re-asked by later batches (oldest first).
    self.replay: collections.deque[Prompt] = collections.deque(
        maxlen=settings.replay_capacity)

  def submit(self, worker: WorkerHandle, requests: list[GenerationRequest],
             rng_data: np.ndarray, version: int | FollowLatest, stop_after: int | None,
             first: int):
    return worker.generate(requests, rng_data, version, stop_after, first)

  def counted(self, result: Rollouts, count: Callable[[dict[str, float]], dict[str, float]]
              ) -> Rollouts:
    timings = count(result.timings)
    if len(timings) == len(result.timings):
      return result
    return dataclasses.replace(result, timings=timings)

  def merge(self, parts: list[Rollouts]) -> Rollouts:
    return Rollouts.concatenate(parts)

  def compose(self, count: int, version_bound: int, draw: Callable[[], Prompt]
              ) -> tuple[list[Prompt], list[Rollouts | None], dict[str, int]]:
    """Partial groups carried from earlier batches first (continued, or restarted when they
    could be too stale at ``version_bound``), then prompts re-asked from the replay pool
    (``replay``), then new prompts from the stream."""
    s = self.settings
    carried, self.unfinished = self.unfinished[:count], self.unfinished[count:]
    goes_on = schedule.continue_carried([group.oldest_version for _, group in carried],
                                        version_bound, s.staleness_k)
    # A group too stale to continue is regenerated with this batch's keys.
    resumes = [group if go else None for (_, group), go in zip(carried, goes_on)]
    prompts = [prompt for prompt, _ in carried]
    replayed = schedule.replay_count(len(self.replay), s.replay, count - len(carried))
    prompts += [self.replay.popleft() for _ in range(replayed)]
    prompts += [draw() for _ in range(count - len(prompts))]
    return prompts, resumes, dict(carried=len(carried), restarted=goes_on.count(False),
                                  replayed=replayed)

  def make(self, batch: Batch, merged: Rollouts, trainer_version: int) -> Made:
    """Keeps APRIL's unfinished groups for a later batch, scores the rest (shaped by
    ``reward``), feeds the replay pool, selects the groups to train (``_select``) and gives
    them their group advantages (``rl.advantage_estimator``)."""
    s = self.settings
    rollouts = merged
    unfinished = rollouts.unfinished_groups
    for g in unfinished:  # APRIL: continued in the next batch launched
      self.unfinished.append((batch.prompts[g], rollouts.select(rollouts.group_ids == g)))
    if unfinished.size:
      rollouts = rollouts.select(~np.isin(rollouts.group_ids, unfinished))
    rollouts = score_rollouts(self.task, batch.prompts, rollouts)
    reward_parts = {}
    if self._reward_components is not None:  # train on the shaped reward, log each part
      total, reward_parts = rewards.shape_rewards(rollouts, self._reward_components,
                                                  batch.prompts)
      rollouts = dataclasses.replace(rollouts, rewards=total)
    if s.replay:  # prompts with a learning signal now are asked again by a later batch
      self.replay.extend(batch.prompts[g] for g in rollouts.informative_groups)
    trained, selection = self._select(batch, rollouts, trainer_version)
    metrics = {
        'reward/mean': float(rollouts.rewards.mean()),
        'reward/std': float(rollouts.rewards.std()),
        **{f'reward/{name}': float(part.mean()) for name, part in reward_parts.items()},
        'completion/length_mean': float(rollouts.completion_mask.sum(1).mean()),
        'completion/truncated_fraction': float(1.0 - rollouts.finished.mean()),
        'verifier/errors': rollouts.verifier_errors,
        'sampling_version': (batch.version if batch.version is not None
                             else rollouts.oldest_version),
        **selection,
        **({'rollout/mixed_version_samples': int(rollouts.mixed_versions.sum())}
           if s.schedule == 'free' else {}),
        **({'rollout/carried_groups': batch.carried,
            'rollout/restarted_groups': batch.restarted,
            'rollout/unfinished_groups': len(self.unfinished)}
           if s.stop_after_groups else {}),
        **({'rollout/replayed_groups': batch.replayed, 'rollout/replay_pool': len(self.replay)}
           if s.replay else {}),
    }
    if trained is None:
      return Made(metrics, None, [], [], rollouts.timings.get('tokens_per_s', 0.0),
                  rollouts=(batch.prompts, rollouts, None))
    advantages = np.asarray(losses.group_advantages(
        trained.rewards, trained.group_ids, s.advantage_estimator))
    train_batch = make_train_batch(trained, advantages)
    if self.teacher is not None:
      train_batch, distill_metrics = distill_batch(train_batch, self.teacher)
      metrics.update(distill_metrics)
    return Made(
        metrics, train_batch,
        trained_prompt_ids=[int(i) for i in dict.fromkeys(trained.prompt_ids.tolist())],
        trained_versions=sorted({int(v) for v in np.unique(trained.versions) if v >= 0}),
        tokens_per_s=rollouts.timings.get('tokens_per_s', 0.0),
        rollouts=(batch.prompts, rollouts, advantages))

  def log(self, writer, step: int, made: Made, staleness: np.ndarray | None) -> None:
    """The step's rollouts, advantages and staleness as TensorBoard histograms and samples
    (``MetricsWriter.write_rollouts``)."""
    writer.write_rollouts(step, *made.rollouts, staleness)

  def evaluate(self, run: Run, prompts: Sequence[Prompt], key: jax.Array) -> dict[str, float]:
    """``evaluation.evaluate_policy``: greedy ``eval/accuracy``; with ``eval_samples``
    mean@k and pass@k."""
    s = self.settings
    return evaluate_policy(self.task, prompts, run, sampling=s.sampling,
                           samples=s.eval_samples, max_new_tokens=s.max_new_tokens, key=key)

  def state(self) -> dict[str, Any]:
    return {'replay': [p.to_dict() for p in self.replay]}

  def snapshot(self, state: ControllerState, arrays: dict[str, dict[str, np.ndarray]],
               in_flight: Sequence[Batch], gather: Callable[[Batch], Rollouts]) -> None:
    """Waits for the batches ``in_flight`` and stores their rollouts (switching each batch to
    its stored result, so nothing is generated twice), then the recycled and unfinished
    groups (arrays under ``inflight_<n>``, ``recycled_<n>``, ``unfinished_<n>``)."""
    for n, batch in enumerate(in_flight):
      rollouts = gather(batch)
      batch.chunks = [(batch.chunks[0][0], [], done(rollouts))]
      arrays[f'inflight_{n}'], meta = rollouts.to_state()
      state.inflight.append({'index': batch.index, 'version': batch.version,
                             'prompts': [p.to_dict() for p in batch.prompts],
                             'rollouts': meta, 'stop_after': batch.stop_after,
                             'carried': batch.carried, 'restarted': batch.restarted,
                             'replayed': batch.replayed})
    for n, (version, group) in enumerate(self.recycled):
      arrays[f'recycled_{n}'], meta = group.to_state()
      state.recycled.append({'version': version, 'rollouts': meta})
    for n, (prompt, group) in enumerate(self.unfinished):
      arrays[f'unfinished_{n}'], meta = group.to_state()
      state.unfinished.append({'prompt': prompt.to_dict(), 'rollouts': meta})

  def restore(self, state: ControllerState, arrays: dict[str, dict[str, np.ndarray]]
              ) -> list[Batch]:
    in_flight = [
        Batch(index=batch['index'], version=batch['version'],
              prompts=[Prompt.from_dict(p) for p in batch['prompts']],
              chunks=[(0, [], done(Rollouts.from_state(arrays[f'inflight_{n}'],
                                                       batch['rollouts'])))],
              stop_after=batch.get('stop_after', 0), carried=batch.get('carried', 0),
              restarted=batch.get('restarted', 0), replayed=batch.get('replayed', 0))
        for n, batch in enumerate(state.inflight)]
    self.recycled = [(group['version'],
                      Rollouts.from_state(arrays[f'recycled_{n}'], group['rollouts']))
                     for n, group in enumerate(state.recycled)]
    self.unfinished = [(Prompt.from_dict(group['prompt']),
                        Rollouts.from_state(arrays[f'unfinished_{n}'], group['rollouts']))
                       for n, group in enumerate(state.unfinished)]
    self.replay = collections.deque((Prompt.from_dict(p) for p in state.replay),
                                    maxlen=self.settings.replay_capacity)
    return in_flight

  def _select(self, batch: Batch, rollouts: Rollouts, trainer_version: int
              ) -> tuple[Rollouts | None, dict[str, float]]:
    """The groups to train on (``schedule.select_groups``: the acceptance window, dynamic
    sampling, recycling; recycled groups from earlier batches first) and their counts; None:
    skip the update."""
    informative = set(rollouts.informative_groups.tolist())
    groups = []
    for g in np.unique(rollouts.group_ids):
      group = rollouts.select(rollouts.group_ids == g)
      oldest = group.oldest_version  # a continued group holds tokens older than the batch
      groups.append((batch.version if oldest is None else oldest, group, g in informative))
    selection = schedule.select_groups(groups, self.recycled, trainer_version, self.settings)
    self.recycled = selection.recycled
    if selection.train is None:
      return None, selection.stats
    if (self.settings.oversample == 0
        and not selection.stats['rollout/dropped_stale_groups']):  # every group, as generated
      return rollouts, selection.stats
    return Rollouts.concatenate(selection.train), selection.stats
