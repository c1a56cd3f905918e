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
The trajectories are ``rlax_llm.data_types.Trajectory``, the multi-turn episode runner's
(``rlax_llm.rollout.episodes``), so they batch for the trainer the same way
(``make_trajectory_batch``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlax_llm.data_types import Trajectory
from rlax_llm.rollout.episodes import state_id


@dataclasses.dataclass(frozen=True)
class Call:
  """One endpoint call: ``prompt_ids`` fed to the engine and what it sampled.

  ``completion_ids`` are the sampled ids, a stop token included; ``logprobs`` (float32) their
  behaviour log-probs under the call's sampling transform; ``supports`` the size of the
  support each was drawn from; ``versions`` the weight version that drew each;
  ``finish_reason`` the driver's ('stop', 'length'); ``text`` the decoded completion.
  """

  prompt_ids: tuple[int, ...]
  completion_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  supports: tuple[int, ...]
  versions: tuple[int, ...]
  finish_reason: str
  text: str = ''

  def __post_init__(self):
    n = len(self.completion_ids)
    if not len(self.logprobs) == len(self.supports) == len(self.versions) == n:
      raise ValueError(f'Call: {n} completion ids but {len(self.logprobs)} log-probs, '
                       f'{len(self.supports)} supports and {len(self.versions)} versions; '
                       'record one of each per sampled id.')


def stitch(calls: Sequence[Call], *, episode_id: int = 0, group_id: int = 0,
           prompt_id: int = -1, reward: float = 0.0,
           turn_rewards: Sequence[float] | None = None, termination: str = 'done'
           ) -> list[Trajectory]:
  """The trajectories of an episode's ``calls`` (in call order), stitched where each call's
  prompt extends the tokens so far and split where it does not (the module docstring).

  Each is a ``rlax_llm.data_types.Trajectory`` (the multi-turn runner's shape) with
  ``episode_id``, ``group_id``, ``prompt_id`` and ``episode_return=reward`` (an episode split
  in several gives each the episode's reward); ``turn_rewards``: one per call (default 0);
  every turn's ``turn_mask`` True; ``state_ids[n]``: ``state_id`` of the ids before turn
  ``n`` (equal histories, equal states); ``termination`` (``data_types.TERMINATIONS``) why
  the episode ended. No calls: ``[]``.
  Raises ValueError when ``turn_rewards`` does not hold one value per call.
  """
  if turn_rewards is not None and len(turn_rewards) != len(calls):
    raise ValueError(f'{len(calls)} calls but {len(turn_rewards)} turn_rewards; give one per '
                     'call.')
  rewards = [0.0] * len(calls) if turn_rewards is None else [float(r) for r in turn_rewards]
  trajectories, current = [], None
  for call, turn_reward in zip(calls, rewards):
    if current is None or not _extends(call.prompt_ids, current['tokens']):
      if current is not None:
        trajectories.append(_finish(current, episode_id, group_id, prompt_id, reward,
                                    termination))
      current = collections.defaultdict(list)
    _add_turn(current, call.prompt_ids[len(current['tokens']):], call, turn_reward)
  if current is not None:
    trajectories.append(_finish(current, episode_id, group_id, prompt_id, reward, termination))
  return trajectories


def _extends(prompt: Sequence[int], tokens: Sequence[int]) -> bool:
  return len(prompt) >= len(tokens) and tuple(prompt[:len(tokens)]) == tuple(tokens)


def _add_turn(parts, environment: Sequence[int], call: Call, turn_reward: float) -> None:
  """Appends ``environment`` ids (mask 0) and ``call``'s sampled ids (mask 1) as a turn."""
  turn = len(parts['starts'])
  n, e = len(call.completion_ids), len(environment)
  parts['tokens'] += list(environment)
  start = len(parts['tokens'])
  parts['states'].append(state_id(np.asarray(parts['tokens'], np.int32).tobytes().hex()))
  parts['tokens'] += list(call.completion_ids)
  parts['mask'] += [False] * e + [True] * n
  parts['logprobs'] += [0.0] * e + list(call.logprobs)
  parts['supports'] += [0] * e + list(call.supports)
  parts['versions'] += [-1] * e + list(call.versions)
  parts['turn'] += [-1] * e + [turn] * n
  parts['starts'].append(start)
  parts['ends'].append(start + n)
  parts['rewards'].append(turn_reward)
  parts['texts'].append(call.text)


def _finish(parts, episode_id: int, group_id: int, prompt_id: int, reward: float,
            termination: str) -> Trajectory:
  turns = len(parts['starts'])
  return Trajectory(
      episode_id=episode_id, group_id=group_id, prompt_id=prompt_id,
      tokens=np.asarray(parts['tokens'], np.int32), loss_mask=np.asarray(parts['mask'], bool),
      behaviour_logprobs=np.asarray(parts['logprobs'], np.float32),
      support_sizes=np.asarray(parts['supports'], np.int32),
      versions=np.asarray(parts['versions'], np.int32),
      token_turn=np.asarray(parts['turn'], np.int32),
      turn_starts=np.asarray(parts['starts'], np.int32),
      turn_ends=np.asarray(parts['ends'], np.int32),
      turn_rewards=np.asarray(parts['rewards'], np.float32),
      turn_mask=np.ones(turns, bool), state_ids=np.asarray(parts['states'], np.int64),
      episode_return=float(reward), termination=termination, texts=tuple(parts['texts']))


@dataclasses.dataclass(frozen=True)
class RecordedEpisode:
  """A closed episode: its id (the harness's string and the recorder's int), its calls, their
  trajectories (``stitch``) and its reward."""

  name: str
  episode_id: int
  calls: tuple[Call, ...]
  trajectories: tuple[Trajectory, ...]
  reward: float


# ``reward_fn(name, calls) -> float``: the reward of an episode closed without one.
RewardFn = Callable[[str, Sequence[Call]], float]


class EpisodeRecorder:
  """Records calls under episode names until the episode is closed (thread-safe).

  An episode is named by the harness (a string: the ``X-Episode-Id`` header or the ``user``
  field) and numbered by the recorder (``Trajectory.episode_id``: 0, 1, ... in order of each
  episode's first call), unless it was ``open``-ed beforehand with its ids (a training run's
  harness episodes). ``close(name, reward)`` stitches it (``stitch``) and puts the
  ``RecordedEpisode`` on ``finished``, a queue the trainer's side drains with ``take``. With
  ``reward=None`` the reward is ``reward_fn(name, calls)``; a ``reward_fn`` that raises gives
  reward 0, counted in ``stats['reward_errors']``, never an exception in the endpoint.

  Memory is bounded: at most ``max_open`` episodes are open at once; opening one more drops
  the open episode whose last call is the oldest (its calls are lost, counted in
  ``stats['evicted']``), and an episode with no call for ``ttl_s`` seconds is dropped the
  same way the next time one opens (a harness that never posts its reward does not keep its
  calls for ever).
  """

  def __init__(self, reward_fn: RewardFn | None = None, *, max_open: int = 4096,
               ttl_s: float = 3600.0):
    if max_open < 1 or not ttl_s > 0:
      raise ValueError(f'max_open={max_open} must be >= 1 and ttl_s={ttl_s} > 0.')
    self.reward_fn = reward_fn
    self.max_open = max_open
    self.ttl_s = float(ttl_s)
    self._lock = threading.Lock()
    # name -> its episode; dict order: least recently called first.
    self._open: dict[str, _Open] = {}
    self._next_id = 0
    self.finished: collections.deque[RecordedEpisode] = collections.deque()
    self.stats: collections.Counter[str] = collections.Counter()

  def open(self, name: str, *, episode_id: int | None = None, group_id: int | None = None,
           prompt_id: int = -1) -> int:
    """Opens episode ``name`` before its first call, with the ids its trajectories get
    (``episode_id`` None: the next number; ``group_id`` None: the episode's own id;
    ``prompt_id``: the task instance). Returns its episode id; ValueError if it is open."""
    with self._lock:
      if name in self._open:
        raise ValueError(f'episode {name!r} is open already; close it first.')
      return self._admit(name, episode_id, group_id, prompt_id).episode_id

  def _admit(self, name: str, episode_id: int | None, group_id: int | None, prompt_id: int
             ) -> _Open:
    """Opens ``name`` (the lock held), first dropping expired episodes and, at ``max_open``,
    the least recently called one."""
    now = time.monotonic()
    for stale, episode in list(self._open.items()):
      if now - episode.last_call <= self.ttl_s and len(self._open) < self.max_open:
        break
      del self._open[stale]
      self.stats['evicted'] += 1
    if episode_id is None:
      episode_id = self._next_id
      self._next_id += 1
    episode = _Open(episode_id, episode_id if group_id is None else group_id, prompt_id, now)
    self._open[name] = episode
    return episode

  def record(self, name: str, call: Call) -> int:
    """Adds ``call`` to episode ``name`` (opening it); returns the call's index in it."""
    with self._lock:
      episode = self._open.pop(name, None) or self._admit(name, None, None, -1)
      self._open[name] = episode  # the most recently called last
      episode.calls.append(call)
      episode.last_call = time.monotonic()
      self.stats['calls'] += 1
      return len(episode.calls) - 1

  def attach(self, name: str, value: Any) -> None:
    """Keeps ``value`` with open episode ``name`` (the endpoint's chat state), dropped with
    the episode; KeyError if none is open."""
    with self._lock:
      self._open[name].attached = value

  def attached(self, name: str) -> Any:
    """What was ``attach``-ed to open episode ``name`` (None: nothing, or no such episode)."""
    with self._lock:
      episode = self._open.get(name)
      return None if episode is None else episode.attached

  def calls(self, name: str) -> tuple[Call, ...]:
    """The calls recorded so far in episode ``name`` (KeyError if none is open)."""
    with self._lock:
      return tuple(self._open[name].calls)

  def close(self, name: str, reward: float | None = None,
            turn_rewards: Sequence[float] | None = None, *, group_id: int | None = None,
            prompt_id: int | None = None, termination: str = 'done') -> RecordedEpisode:
    """Closes episode ``name`` with ``reward`` (None: ``reward_fn``'s) and returns it.

    ``turn_rewards``: one per call. ``group_id``: the group whose returns are compared (GRPO;
    default: the one it was opened with, else the episode's own id, a group of one);
    ``prompt_id``: the task instance (default: the one it was opened with, else -1);
    ``termination``: why it ended (``data_types.TERMINATIONS``). Raises KeyError when no such
    episode is open, ValueError when ``reward_fn`` is needed but missing or ``turn_rewards``
    does not hold one value per call (the episode stays open).
    """
    with self._lock:
      episode = self._open[name]
      calls = tuple(episode.calls)
      if reward is None and self.reward_fn is None:
        raise ValueError(f'episode {name!r} was closed without a reward and the endpoint has '
                         'no reward_fn; post {"reward": <number>}.')
      if turn_rewards is not None and len(turn_rewards) != len(calls):
        raise ValueError(f'episode {name!r} has {len(calls)} calls but {len(turn_rewards)} '
                         'turn_rewards were given; give one per call.')
      del self._open[name]
    if reward is None:
      try:
        reward = float(self.reward_fn(name, calls))
      except Exception:  # noqa: BLE001  (a user function never crashes the endpoint)
        reward = 0.0
        self.stats['reward_errors'] += 1
    trajectories = stitch(calls, episode_id=episode.episode_id,
                          group_id=episode.group_id if group_id is None else group_id,
                          prompt_id=episode.prompt_id if prompt_id is None else prompt_id,
                          reward=reward, turn_rewards=turn_rewards, termination=termination)
    closed = RecordedEpisode(name, episode.episode_id, calls, tuple(trajectories),
                             float(reward))
    with self._lock:
      self.finished.append(closed)
      self.stats['episodes'] += 1
      self.stats['trajectories'] += len(trajectories)
      self.stats['splits'] += max(0, len(trajectories) - 1)
    return closed

  def take(self) -> list[RecordedEpisode]:
    """The closed episodes not taken yet, oldest first."""
    with self._lock:
      taken = list(self.finished)
      self.finished.clear()
      return taken


@dataclasses.dataclass
class _Open:
  """An open episode: its ids, when its last call was recorded (``time.monotonic``), its
  calls so far and what the endpoint keeps with it (``EpisodeRecorder.attach``)."""

  episode_id: int
  group_id: int
  prompt_id: int
  last_call: float
  calls: list[Call] = dataclasses.field(default_factory=list)
  attached: Any = None
