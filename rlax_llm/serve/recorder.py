"""Episodes recorded from endpoint calls, stitched into token-faithful trajectories.

An agent harness that talks to the OpenAI-compatible endpoint (``rlax_llm.serve.openai_api``)
makes several calls per episode. Each call is recorded as a ``Call``: the prompt ids the
engine was fed, the exact ids it sampled (never re-tokenised text), their behaviour
log-probs and the weight version of every sampled token.

Stitching (``stitch``): calls are taken in the order they were recorded. A call whose prompt
ids *extend* the tokens of the trajectory so far (the previous call's prompt + completion,
and everything before it) continues that trajectory: the ids in between are the environment's
and tools' tokens (a tool result, the template's turn markers, the next user message), added
with loss mask 0, then the call's sampled ids with loss mask 1. A call whose prompt does not
extend it (the harness edited, truncated or summarised its history) closes that trajectory
and starts a new one with its prompt as the prompt. So an episode gives one trajectory per
run of matching calls, in order, each exactly the token sequence the model saw and sampled.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Call:
  """One endpoint call: ``prompt_ids`` fed to the engine and what it sampled.

  ``completion_ids`` are the sampled ids, a stop token included; ``logprobs`` (float32) their
  behaviour log-probs under the call's sampling transform; ``versions`` the weight version
  that drew each; ``finish_reason`` the driver's ('stop', 'length', 'cancelled').
  """

  prompt_ids: tuple[int, ...]
  completion_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  versions: tuple[int, ...]
  finish_reason: str

  def __post_init__(self):
    n = len(self.completion_ids)
    if len(self.logprobs) != n or len(self.versions) != n:
      raise ValueError(f'Call: {n} completion ids but {len(self.logprobs)} log-probs and '
                       f'{len(self.versions)} versions; record one of each per sampled id.')


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """A token-faithful multi-turn trajectory: ``T`` tokens, host numpy arrays.

  This module defines it for the endpoint's episodes: the fields a multi-turn trajectory
  needs (docs/architecture.md "Data that flows").

  Attributes:
    episode_id: the episode it belongs to.
    tokens: int32 [T]: the prompt, then per turn the environment's tokens and the sampled ids.
    loss_mask: bool [T]: True on sampled ids only (prompt, environment and tool tokens False).
    logprobs: float32 [T]: behaviour log-prob of each sampled id, 0 elsewhere.
    versions: int32 [T]: weight version of each sampled id, -1 elsewhere.
    token_turn: int32 [T]: the turn (call within this trajectory, from 0) whose prompt or
      completion brought the token.
    turn_bounds: int32 [turns, 2]: each turn's sampled ids are ``tokens[start:end]``.
    prompt_length: tokens before the first sampled id (the first call's prompt).
    finish_reasons: each turn's finish reason.
    reward: the episode's reward (None until it is closed with one).
    turn_rewards: float32 [turns] or None: per-turn rewards where the closer gave them.
  """

  episode_id: str
  tokens: np.ndarray
  loss_mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  token_turn: np.ndarray
  turn_bounds: np.ndarray
  prompt_length: int
  finish_reasons: tuple[str, ...]
  reward: float | None = None
  turn_rewards: np.ndarray | None = None

  def __len__(self) -> int:
    return len(self.tokens)

  @property
  def num_turns(self) -> int:
    return len(self.turn_bounds)


def stitch(episode_id: str, calls: Sequence[Call]) -> list[Trajectory]:
  """The trajectories of an episode's ``calls`` (in call order), stitched where each call's
  prompt extends the tokens so far and split where it does not (the module docstring).

  Returns one ``Trajectory`` per run of matching calls; none for no calls.
  """
  trajectories, current = [], None
  for call in calls:
    if current is not None and _extends(call.prompt_ids, current['tokens']):
      _add_turn(current, call.prompt_ids[len(current['tokens']):], call)
      continue
    if current is not None:
      trajectories.append(_finish(episode_id, current))
    current = collections.defaultdict(list)
    current['prompt_length'] = len(call.prompt_ids)
    _add_turn(current, call.prompt_ids, call)
  if current is not None:
    trajectories.append(_finish(episode_id, current))
  return trajectories


def _extends(prompt: Sequence[int], tokens: Sequence[int]) -> bool:
  return len(prompt) >= len(tokens) and tuple(prompt[:len(tokens)]) == tuple(tokens)


def _add_turn(parts, environment: Sequence[int], call: Call) -> None:
  """Appends ``environment`` ids (mask 0) and ``call``'s sampled ids (mask 1) as a turn."""
  turn = len(parts['finish'])
  n = len(call.completion_ids)
  start = len(parts['tokens']) + len(environment)
  parts['tokens'] += list(environment) + list(call.completion_ids)
  parts['mask'] += [False] * len(environment) + [True] * n
  parts['logprobs'] += [0.0] * len(environment) + list(call.logprobs)
  parts['versions'] += [-1] * len(environment) + list(call.versions)
  parts['turn'] += [turn] * (len(environment) + n)
  parts['bounds'].append((start, start + n))
  parts['finish'].append(call.finish_reason)


def _finish(episode_id: str, parts) -> Trajectory:
  return Trajectory(
      episode_id=episode_id, tokens=np.asarray(parts['tokens'], np.int32),
      loss_mask=np.asarray(parts['mask'], bool),
      logprobs=np.asarray(parts['logprobs'], np.float32),
      versions=np.asarray(parts['versions'], np.int32),
      token_turn=np.asarray(parts['turn'], np.int32),
      turn_bounds=np.asarray(parts['bounds'], np.int32).reshape(-1, 2),
      prompt_length=parts['prompt_length'], finish_reasons=tuple(parts['finish']))


@dataclasses.dataclass(frozen=True)
class Episode:
  """A closed episode: its calls, their trajectories (``stitch``) and its reward."""

  episode_id: str
  calls: tuple[Call, ...]
  trajectories: tuple[Trajectory, ...]
  reward: float


# ``reward_fn(episode_id, calls) -> float``: the reward of an episode closed without one.
RewardFn = Callable[[str, Sequence[Call]], float]


class EpisodeRecorder:
  """Records calls under episode ids until the episode is closed (thread-safe).

  ``close(episode_id, reward)`` stitches the episode (``stitch``), gives every trajectory the
  reward and puts the ``Episode`` on ``finished`` (a queue the trainer's side drains with
  ``take``). With ``reward=None`` the reward is ``reward_fn(episode_id, calls)``; a
  ``reward_fn`` that raises gives reward 0, counted in ``stats['reward_errors']``, never an
  exception in the endpoint.
  """

  def __init__(self, reward_fn: RewardFn | None = None):
    self.reward_fn = reward_fn
    self._lock = threading.Lock()
    self._open: dict[str, list[Call]] = {}
    self.finished: collections.deque[Episode] = collections.deque()
    self.stats: collections.Counter[str] = collections.Counter()

  def record(self, episode_id: str, call: Call) -> int:
    """Adds ``call`` to ``episode_id`` (opening it); returns the call's index in it."""
    with self._lock:
      calls = self._open.setdefault(episode_id, [])
      calls.append(call)
      self.stats['calls'] += 1
      return len(calls) - 1

  def calls(self, episode_id: str) -> tuple[Call, ...]:
    """The calls recorded so far under ``episode_id`` (KeyError if none is open)."""
    with self._lock:
      if episode_id not in self._open:
        raise KeyError(episode_id)
      return tuple(self._open[episode_id])

  def close(self, episode_id: str, reward: float | None = None,
            turn_rewards: Sequence[float] | None = None) -> Episode:
    """Closes ``episode_id`` with ``reward`` (None: ``reward_fn``'s) and returns it.

    ``turn_rewards``: one per call, put on each trajectory's turns. Raises KeyError when no
    such episode is open, ValueError when ``reward_fn`` is needed but missing or
    ``turn_rewards`` does not have one value per call (the episode stays open).
    """
    with self._lock:
      if episode_id not in self._open:
        raise KeyError(episode_id)
      calls = tuple(self._open[episode_id])
      if reward is None and self.reward_fn is None:
        raise ValueError(f'episode {episode_id!r} was closed without a reward and the '
                         'endpoint has no reward_fn; post {"reward": <number>}.')
      if turn_rewards is not None and len(turn_rewards) != len(calls):
        raise ValueError(f'episode {episode_id!r} has {len(calls)} calls but '
                         f'{len(turn_rewards)} turn_rewards were given; give one per call.')
      del self._open[episode_id]
    if reward is None:
      try:
        reward = float(self.reward_fn(episode_id, calls))
      except Exception:  # noqa: BLE001  (a user function never crashes the endpoint)
        reward = 0.0
        self.stats['reward_errors'] += 1
    trajectories, first = [], 0
    for trajectory in stitch(episode_id, calls):
      turns = trajectory.num_turns
      rewards = (None if turn_rewards is None
                 else np.asarray(turn_rewards[first:first + turns], np.float32))
      trajectories.append(dataclasses.replace(trajectory, reward=float(reward),
                                              turn_rewards=rewards))
      first += turns
    episode = Episode(episode_id, calls, tuple(trajectories), float(reward))
    with self._lock:
      self.finished.append(episode)
      self.stats['episodes'] += 1
      self.stats['trajectories'] += len(trajectories)
      self.stats['splits'] += len(trajectories) - 1
    return episode

  def take(self) -> list[Episode]:
    """The closed episodes not taken yet, oldest first."""
    with self._lock:
      taken = list(self.finished)
      self.finished.clear()
      return taken
