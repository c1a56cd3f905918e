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
from collections.abc import Callable, Sequence

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
           turn_rewards: Sequence[float] | None = None) -> list[Trajectory]:
  """The trajectories of an episode's ``calls`` (in call order), stitched where each call's
  prompt extends the tokens so far and split where it does not (the module docstring).

  Each is a ``rlax_llm.data_types.Trajectory`` (the multi-turn runner's shape) with
  ``episode_id``, ``group_id``, ``prompt_id`` and ``episode_return=reward`` (an episode split
  in several gives each the episode's reward); ``turn_rewards``: one per call (default 0);
  every turn's ``turn_mask`` True; ``state_ids[n]``: ``state_id`` of the ids before turn
  ``n`` (equal histories, equal states); ``termination`` 'done'. None for no calls: ``[]``.
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
        trajectories.append(_finish(current, episode_id, group_id, prompt_id, reward))
      current = collections.defaultdict(list)
    _add_turn(current, call.prompt_ids[len(current['tokens']):], call, turn_reward)
  if current is not None:
    trajectories.append(_finish(current, episode_id, group_id, prompt_id, reward))
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


def _finish(parts, episode_id: int, group_id: int, prompt_id: int, reward: float
            ) -> Trajectory:
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
      episode_return=float(reward), termination='done', texts=tuple(parts['texts']))


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
  episode's first call). ``close(name, reward)`` stitches it (``stitch``) and puts the
  ``RecordedEpisode`` on ``finished``, a queue the trainer's side drains with ``take``. With
  ``reward=None`` the reward is ``reward_fn(name, calls)``; a ``reward_fn`` that raises gives
  reward 0, counted in ``stats['reward_errors']``, never an exception in the endpoint.
  """

  def __init__(self, reward_fn: RewardFn | None = None):
    self.reward_fn = reward_fn
    self._lock = threading.Lock()
    self._open: dict[str, tuple[int, list[Call]]] = {}
    self._next_id = 0
    self.finished: collections.deque[RecordedEpisode] = collections.deque()
    self.stats: collections.Counter[str] = collections.Counter()

  def record(self, name: str, call: Call) -> int:
    """Adds ``call`` to episode ``name`` (opening it); returns the call's index in it."""
    with self._lock:
      if name not in self._open:
        self._open[name] = (self._next_id, [])
        self._next_id += 1
      calls = self._open[name][1]
      calls.append(call)
      self.stats['calls'] += 1
      return len(calls) - 1

  def calls(self, name: str) -> tuple[Call, ...]:
    """The calls recorded so far in episode ``name`` (KeyError if none is open)."""
    with self._lock:
      return tuple(self._open[name][1])

  def close(self, name: str, reward: float | None = None,
            turn_rewards: Sequence[float] | None = None, *, group_id: int | None = None,
            prompt_id: int = -1) -> RecordedEpisode:
    """Closes episode ``name`` with ``reward`` (None: ``reward_fn``'s) and returns it.

    ``turn_rewards``: one per call. ``group_id``: the group whose returns are compared (GRPO;
    default: the episode's own id, a group of one); ``prompt_id``: the task instance (-1:
    none named). Raises KeyError when no such episode is open, ValueError when ``reward_fn``
    is needed but missing or ``turn_rewards`` does not hold one value per call (the episode
    stays open).
    """
    with self._lock:
      episode_id, calls = self._open[name]
      calls = tuple(calls)
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
    trajectories = stitch(calls, episode_id=episode_id,
                          group_id=episode_id if group_id is None else group_id,
                          prompt_id=prompt_id, reward=reward, turn_rewards=turn_rewards)
    episode = RecordedEpisode(name, episode_id, calls, tuple(trajectories), float(reward))
    with self._lock:
      self.finished.append(episode)
      self.stats['episodes'] += 1
      self.stats['trajectories'] += len(trajectories)
      self.stats['splits'] += len(trajectories) - 1
    return episode

  def take(self) -> list[RecordedEpisode]:
    """The closed episodes not taken yet, oldest first."""
    with self._lock:
      taken = list(self.finished)
      self.finished.clear()
      return taken
