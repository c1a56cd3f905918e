"""The controller's schedule as pure decisions: inputs in, a decision out, no jax, no roles.

``ControllerSettings`` holds what the controller schedules (``RunSpec.controller``, built
from a validated config by ``rlax_llm.config.run_spec``); the functions below decide, from
those settings and from what the controller has seen, everything it does that is not moving
data.
``rlax_llm.controller`` calls them in a fixed order; tests/test_schedule.py checks each.

Staleness (RLAX's ``(j, k)``, docs/architecture.md): batch ``i`` (trained at step ``i``) is
sampled with the params after step ``v_i = max(0, j * floor((i - (k - j)) / j))``
(``sampling_version``), so its staleness ``i - v_i`` stays in ``[k - j, k - 1]`` once the
pipeline is full (below before). Versions count *applied* updates; when a step applies none
(every group filtered, or a non-finite update skipped) the params after it keep the previous
version, so staleness in versions is at most staleness in steps; the worker's weights change
in steps of ``j`` versions, and a rollout is trained only if ``i - v < k``. ``(1, 1)`` gives
``v_i = i``: the synchronous, on-policy lockstep. Generation of batch ``i`` starts as soon as
version ``v_i`` exists (``launch_due``), so with ``k > 1`` it overlaps the training of earlier
batches (up to ``k`` batches are in flight: the queue is bounded by the schedule).

Free-running mode (``schedule='free'``, ``staleness.schedule``): no version is named. A
worker samples with the newest weights it holds and, at the start of a batch and between any
two decode steps, pulls the server's latest version when it is ``j`` or more ahead of its own
(``reload_due``; the driver's per-step swap), so one sequence may mix versions and every
token records its own. Batch ``i`` launches once at most ``k - j`` batches are ahead of the
trainer (``launch_due``): the worker then holds a version at most ``j - 1`` behind the
trainer's at launch, and the trainer moves at most ``k - j`` versions before training the
batch, so no token is ``k`` or more versions old when trained; the acceptance window is also
enforced at training time (``select_groups`` drops a group whose oldest token is, and counts
it). Fresher data (a version pushed mid-batch is used at once; measured, the deterministic
schedule's goodput: benchmarks/RESULTS.md) at the price of reproducibility: which version
draws which token depends on timing.

Also decided here:
* several inference workers: a batch's requests are split into contiguous chunks, one per
  live worker (``chunk_bounds``); a sample's tokens depend only on its own key, so which
  worker runs it changes nothing;
* dynamic sampling (DAPO, arXiv 2503.14476): with ``oversample > 0`` each batch asks for
  ``ceil(prompts_per_step * (1 + oversample))`` prompts; groups whose rewards are all equal
  (no learning signal) are dropped and counted; the first ``prompts_per_step`` remaining
  groups are trained; the surplus is recycled into the next batch if it is still fresh
  enough (``t - v < k``), else dropped and counted (after APRIL's over-provisioning,
  arXiv 2509.18521, at the granularity of finished groups). A batch with fewer than
  ``prompts_per_step`` informative groups is handled by ``short_batches``: ``'pad'`` tops
  it up with its filtered ones (``rollout/padding_groups``; zero advantage under a
  group-mean baseline) so that every update has one shape and the trainer never recompiles
  (a batch with none skips the update); ``'wait'`` (DAPO's "keep sampling until the batch
  is full") skips the update and keeps the informative groups for the next batch, so every
  update trains ``prompts_per_step`` informative groups and no compute goes to padding
  (a skipped update leaves the version unchanged, so the kept groups stay fresh).
  Every generated group is counted once: trained, padding, filtered, dropped as stale, or
  still recycled (or still unfinished, below). (``select_groups``.)
* prompt replay (``replay > 0``): a prompt whose group had unequal rewards (a learning
  signal under the current policy) joins a FIFO pool of ``4 * requested_groups``; each batch
  re-asks ``floor(replay * new prompts)`` of them, oldest first, with fresh samples, ahead of
  the stream's prompts (``rollout/replayed_groups``; the ledger lists them apart). When most
  groups have equal rewards (an easy task, a sharp policy) this raises the share of
  informative groups per generated group; it re-visits training prompts only, never the
  held-out split. The pool is part of the controller's state. (``replay_count``.)
* partial rollouts (APRIL, arXiv 2509.18521): with ``stop_after_groups = n > 0`` a batch's
  generation stops as soon as ``n`` of its groups have every sample finished (each worker
  stops at its share of its chunk, ``chunk_stop``); the unfinished groups, with the tokens
  drawn so far and their keys, are carried into the next batch launched after this one is
  gathered, ahead of new prompts, and continued there (``rollout/carried_groups``). Their
  tokens keep the versions that drew them, so a continued group may mix versions; a carried
  group that could be too stale when trained (the trainer's version may be at most one
  higher per step) is regenerated from scratch instead (``rollout/restarted_groups``,
  ``continue_carried``): on-policy (``k = 1``) that is every carried group that saw an
  update, so continuation pays off with ``k >= 2``. ``rollout/unfinished_groups`` counts the
  groups waiting to be continued.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from rlax_llm.loss_spec import BASELINE_FREE, ESTIMATORS, NORMS, TURN_ESTIMATORS
from rlax_llm.sampling_spec import SamplingSpec

T = TypeVar('T')


SCHEDULES = ('deterministic', 'free')
# What a worker does when the weights change under a rollout in flight (``rollout.on_swap``):
# continue it with the new version (PipelineRL) or discard it and start over (RLAX).
ON_SWAP = ('continue', 'discard')
# A batch with fewer informative groups than ``prompts_per_step`` (``rollout.short_batches``):
# train it padded, or wait for more groups.
SHORT_BATCHES = ('pad', 'wait')


def sampling_version(i: int, j: int, k: int) -> int:
  """The policy version that samples batch ``i`` under RLAX staleness ``(j, k)``."""
  return max(0, j * math.floor((i - (k - j)) / j))


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
  """What an environment run plays (``env.*``, ``agent.*`` and the turn estimators' knobs
  ``rl.turn_*``; docs/environments.md, "Training on an environment"): every prompt of the
  stream is an environment seed, played ``group_size`` times as a multi-turn episode.

  Attributes:
    env: the ``env`` config group (``name`` and the environment's keyword arguments).
    max_turns: a cap on turns over the environment's own ``max_turns`` (None: its own).
    max_concurrent_episodes: episodes a worker plays at once (at most its slots).
    timeout_s: wall-clock seconds an episode may take.
    max_turn_tokens: the most tokens one turn may sample.
    length: the longest trajectory in tokens: the KV cache's (first prompt + the rest of the
      conversation, ``sampling.max_prompt_len + sampling.max_new_tokens``) plus the last
      sampled token, never written to it; train rows are this wide.
    num_eval: held-out seeds (greedy episodes) per evaluation.
    eval_seed_start: the first held-out seed (the train stream's seeds lie below it).
    gamma, omega, norm: the multi-turn estimators' discount, GiGPO's step weight and
      ``F_norm`` (``losses.multi_turn``).
  """

  env: dict[str, Any]
  max_turns: int | None
  max_concurrent_episodes: int
  timeout_s: float
  max_turn_tokens: int
  length: int
  num_eval: int
  eval_seed_start: int
  gamma: float = 0.95
  omega: float = 1.0
  norm: str = 'std'

  def __post_init__(self):
    """Messages name the config keys (``rl.turn_gamma``, ``rl.turn_omega``, ...)."""
    for key, value, high in (('rl.turn_gamma', self.gamma, 1.0),
                             ('rl.turn_omega', self.omega, math.inf)):
      if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
          or not 0.0 <= value <= high):
        raise ValueError(f'{key}={value!r} must be a number in [0, {high}].')
    if self.norm not in NORMS:
      raise ValueError(f'rl.turn_norm={self.norm!r} is not valid; choose one of '
                       f'{list(NORMS)}.')

  def runner_kwargs(self) -> dict[str, Any]:
    """The ``InferenceWorker.play_at`` keywords these settings fix."""
    return {'max_concurrent_episodes': self.max_concurrent_episodes,
            'max_turn_tokens': self.max_turn_tokens, 'timeout_s': self.timeout_s,
            'max_turns': self.max_turns}


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
  """What the controller schedules, validated when built (``rlax_llm.config`` builds it before
  any compute): staleness, rollouts, evaluation, and whether the advantage estimator suits
  the rollouts (a multi-turn estimator needs episodes; ``oversample`` drops only groups a
  group baseline ignores)."""

  total_steps: int
  prompts_per_step: int
  group_size: int
  staleness_j: int
  staleness_k: int
  eval_every: int
  seed: int  # config.seed: held-out evaluation's keys (and, rl_seed None, the RL sampling's)
  sampling: SamplingSpec
  max_new_tokens: int
  advantage_estimator: str = 'grpo'
  oversample: float = 0.0
  worker_timeout_s: float = 600.0
  eval_samples: int = 0  # sampled draws per held-out prompt for mean@k / pass@k (0: none)
  reward: dict[str, Any] | None = None  # the reward config group (rlax_llm.rewards); None: task
  stop_after_groups: int = 0  # APRIL: stop a batch once this many groups finished (0: never)
  short_batches: str = 'pad'  # fewer informative groups than prompts_per_step: 'pad' | 'wait'
  replay: float = 0.0  # fraction of a batch's new prompts re-asked from the replay pool
  schedule: str = 'deterministic'  # 'deterministic' (versions named) | 'free' (SCHEDULES)
  episodes: EpisodeSettings | None = None  # an environment run's (None: single-turn task)
  rl_seed: int | None = None  # config.rl.seed: the RL sampling keys' seed (None: ``seed``)

  @property
  def sampling_seed(self) -> int:
    """The seed of the RL batches' sampling keys: ``rl_seed``, or ``seed`` when unset."""
    return self.seed if self.rl_seed is None else self.rl_seed

  @property
  def replay_capacity(self) -> int:
    """Prompts the replay pool holds (the oldest leave first): four batches' worth."""
    return 4 * self.requested_groups

  @property
  def requested_groups(self) -> int:
    """Groups each batch asks for: ``prompts_per_step``, over-provisioned by ``oversample``."""
    return self.prompts_per_step if self.oversample == 0 else math.ceil(
        self.prompts_per_step * (1 + self.oversample))

  @property
  def versions_kept(self) -> int:
    """Versions the parameter server holds: ``k + 2``, the ``k`` the schedule may still
    sample with, plus the older ones a worker may hold as the base of its next delta (a
    worker whose base was dropped gets whole leaves instead)."""
    return self.staleness_k + 2

  def __post_init__(self):
    """Messages name the config keys (``staleness.j``, ``rollout.oversample``, ...)."""
    j, k = self.staleness_j, self.staleness_k
    for name, value in (('j', j), ('k', k)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'staleness.{name}={value!r} must be an int >= 1.')
    if j > k:
      raise ValueError(f'staleness (j, k) = ({j}, {k}): j must be <= k (a worker that reloads '
                       'every j versions samples data up to j - 1 versions old, which k must '
                       'accept).')
    if (isinstance(self.oversample, bool) or not isinstance(self.oversample, (int, float))
        or not 0.0 <= self.oversample <= 4.0):
      raise ValueError(f'rollout.oversample={self.oversample!r} must be in [0, 4].')
    if not self.worker_timeout_s > 0:
      raise ValueError(f'rollout.worker_timeout_s={self.worker_timeout_s!r} must be > 0.')
    if (isinstance(self.replay, bool) or not isinstance(self.replay, (int, float))
        or not 0.0 <= self.replay < 1.0):
      raise ValueError(f'rollout.replay={self.replay!r} must be in [0, 1) (the fraction of '
                       "each batch's new prompts re-asked from the replay pool; 0: off).")
    if (isinstance(self.eval_samples, bool) or not isinstance(self.eval_samples, int)
        or self.eval_samples < 0):
      raise ValueError(f'eval.samples={self.eval_samples!r} must be an int >= 0 (draws per '
                       'held-out prompt for mean@k and pass@k; 0: greedy accuracy only).')
    if self.schedule not in SCHEDULES:
      raise ValueError(f'staleness.schedule={self.schedule!r} is not valid; choose one of '
                       f'{list(SCHEDULES)} (deterministic: reproducible, the default).')
    if self.short_batches not in SHORT_BATCHES:
      raise ValueError(f"rollout.short_batches={self.short_batches!r} is not valid; choose "
                       "'pad' or 'wait'.")
    self._check_estimator()
    n = self.stop_after_groups
    if isinstance(n, bool) or not isinstance(n, int) or (
        n != 0 and not self.prompts_per_step <= n <= self.requested_groups):
      raise ValueError(
          f'rollout.stop_after_groups={n!r} must be 0 (off) or an int in [rl.prompts_per_step'
          f', groups requested per batch] = [{self.prompts_per_step}, '
          f'{self.requested_groups}]; raise rollout.oversample to request more groups.')
    self.sampling.check_for_rollouts()


  def _check_estimator(self) -> None:
    estimator = self.advantage_estimator
    if estimator in TURN_ESTIMATORS and self.episodes is None:
      raise ValueError(
          f'rl.advantage_estimator={estimator!r} is a multi-turn estimator: it needs a '
          "trajectory batch's turn_rewards, turn_mask, state_ids and token_turn (docs/losses.md, "
          '"Multi-turn credit"), but a task (no env.name) gives single-turn rollouts, which '
          f'carry none; choose one of {list(ESTIMATORS)}, or train on an environment '
          '(env.name, docs/environments.md).')
    if self.oversample and estimator in BASELINE_FREE:
      raise ValueError(
          f'rollout.oversample={self.oversample!r} drops groups whose rewards are all equal, '
          f'but under the {estimator!r} advantage estimator (no group baseline) those groups '
          'train too (an all-wrong group is pushed down); set rollout.oversample=0 or use a '
          'group-relative estimator.')


def launch_due(index: int, step: int, s: ControllerSettings) -> bool:
  """Whether batch ``index`` can be launched after ``step`` steps: it is part of the run and
  the version that samples it exists (at most ``k`` batches ahead of the trainer); in
  free-running mode, it is at most ``k - j`` batches ahead (``k - j + 1`` in flight)."""
  if index >= s.total_steps:
    return False
  if s.schedule == 'free':
    return index - step <= s.staleness_k - s.staleness_j
  return sampling_version(index, s.staleness_j, s.staleness_k) <= step


def reload_due(latest: int, held: int, j: int) -> bool:
  """RLAX's reload threshold: whether a worker holding version ``held`` (-1: none) pulls the
  server's ``latest`` version, i.e. it holds none or ``latest`` is ``j`` or more ahead."""
  return held < 0 or latest - held >= j


def eval_due(step: int, s: ControllerSettings) -> bool:
  """Whether held-out evaluation runs after ``step`` steps: every ``eval_every`` (0: never)
  and after the last."""
  return step == s.total_steps or (s.eval_every > 0 and step % s.eval_every == 0)


def continue_carried(oldest_versions: Sequence[int | None], version_bound: int,
                     k: int) -> list[bool]:
  """APRIL: for each carried partial group (its oldest token's version, None: no tokens
  yet), whether it continues (True) or is regenerated from scratch (False) because it could
  be too stale when trained, the trainer's version then being at most ``version_bound``."""
  return [oldest is None or version_bound - oldest < k for oldest in oldest_versions]


def replay_count(pool_size: int, replay: float, open_slots: int) -> int:
  """Prompts re-asked from the replay pool: ``floor(replay * open_slots)`` (the batch's
  groups not taken by carried ones), at most what the pool holds."""
  return min(pool_size, int(replay * open_slots))


def chunk_bounds(requests: int, workers: int) -> list[tuple[int, int]]:
  """A batch's ``requests`` split into contiguous ``[start, end)`` chunks, one per worker
  in order (equal sizes rounded up; a worker left without requests gets no chunk)."""
  per = -(-requests // workers)
  return [(n * per, min(requests, (n + 1) * per)) for n in range(workers)
          if n * per < requests]


def chunk_stop(stop_after: int, chunk: int, batch: int) -> int | None:
  """A chunk's share of the batch's APRIL stop: ``ceil(stop_after * chunk / batch)`` of its
  ``chunk`` groups, of the batch's ``batch`` (None: run it to the end)."""
  if not stop_after:
    return None
  return min(chunk, math.ceil(stop_after * chunk / batch))


@dataclasses.dataclass(frozen=True)
class Selection(Generic[T]):
  """What one step trains (``select_groups``).

  Attributes:
    train: the groups to train on, recycled ones first, then padding; None: skip the update.
    recycled: ``(version, group)`` kept for the next step, oldest first.
    stats: ``rollout/...`` counts (trained, padding, filtered, recycled, dropped as stale).
  """

  train: list[T] | None
  recycled: list[tuple[int, T]]
  stats: dict[str, int]


def select_groups(groups: Sequence[tuple[int, T, bool]], recycled: Sequence[tuple[int, T]],
                  trainer_version: int, s: ControllerSettings) -> Selection[T]:
  """Dynamic sampling with recycling (see the module docstring); with ``oversample == 0``
  every group of the batch trains, in order. Either way a group of this batch whose oldest
  token is ``k`` or more versions behind ``trainer_version`` is dropped and counted
  (``rollout/dropped_stale_groups``): the acceptance window at training time, which the
  deterministic schedule never reaches and free-running mode enforces (a batch left with
  none skips the update).

  Args:
    groups: this batch's finished groups in order, ``(version, group, informative)``: the
      version of the group's oldest token, the group, whether its rewards are unequal.
    recycled: groups recycled by earlier steps, ``(version, group)``.
    trainer_version: the version the update would apply to.
    s: the settings (``prompts_per_step``, ``staleness_k``, ``short_batches``).
  """
  accepted = [(v, g, i) for v, g, i in groups if trainer_version - v < s.staleness_k]
  stats = {'rollout/filtered_groups': 0, 'rollout/recycled_groups': 0,
           'rollout/dropped_stale_groups': len(groups) - len(accepted),
           'rollout/padding_groups': 0, 'rollout/trained_groups': len(accepted)}
  groups = accepted
  if s.oversample == 0:
    return Selection([g for _, g, _ in groups] or None, list(recycled), stats)
  fresh = [(v, g) for v, g in recycled if trainer_version - v < s.staleness_k]
  stats['rollout/dropped_stale_groups'] += len(recycled) - len(fresh)
  fresh += [(v, g) for v, g, informative in groups if informative]
  filtered = [g for _, g, informative in groups if not informative]
  keep, rest = fresh[:s.prompts_per_step], fresh[s.prompts_per_step:]
  if s.short_batches == 'wait' and len(keep) < s.prompts_per_step:
    # No update: the informative groups wait for the next batch (versions unchanged).
    rest = keep + rest
    stats.update({'rollout/recycled_groups': len(rest), 'rollout/trained_groups': 0,
                  'rollout/filtered_groups': len(filtered)})
    return Selection(None, rest, stats)
  # A short batch is topped up with filtered groups of this batch (there are always enough:
  # it holds >= prompts_per_step groups), so every update has the same shape and the
  # trainer compiles once. Under a group-mean baseline their advantages are 0. A batch
  # with no informative group skips the update (no padding).
  padding = filtered[:s.prompts_per_step - len(keep)] if keep else []
  stats.update({'rollout/recycled_groups': len(rest), 'rollout/trained_groups': len(keep),
                'rollout/padding_groups': len(padding),
                'rollout/filtered_groups': len(filtered) - len(padding)})
  return Selection([g for _, g in keep] + padding if keep else None, rest, stats)
