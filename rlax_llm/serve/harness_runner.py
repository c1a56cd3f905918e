"""A training run's episodes played by an agent harness through the OpenAI-compatible endpoint.

An environment run (``env.name``) whose environment is an agent harness
(``env.name='harness'``, ``rlax_llm.serve.harness``) plays its episodes here instead of in
the multi-turn runner (``rlax_llm.rollout.episodes``). ``HarnessRunner.run`` starts an
``Endpoint`` on loopback around the inference worker (its engine, at the version the
schedule named: every recorded token carries it), with a random bearer token, the run's
sampling policy (``Endpoint(sampling=...)``: a request's ``temperature``, ``top_p`` and
``top_k`` are ignored, so the trainer scores the tokens under the transform they were drawn
with) and ``agent.max_turn_tokens`` as the length cap of a call that names none. Then it
calls the harness once per episode, each in a thread of its own with its own ``openai``
client, whose default header ``X-Episode-Id`` names the episode; at most
``max_concurrent_episodes`` run at once.

Each episode is opened on the endpoint with its key (``Endpoint.open_episode``): call ``n``
of episode ``e`` samples with ``fold_in(e.key, n)``, the keys ``request_episodes`` gives an
environment run, whatever ``seed`` the harness asks for. The endpoint's recorder stitches the
episode's calls into ``Trajectory``s (``recorder.stitch``: model tokens with loss mask 1,
behaviour log-prob and version; the ids between calls, tool results and template text, with
mask 0; a new trajectory where the harness edited its history), which go to the controller's
batch path (``make_trajectory_batch``) and staleness rules like an environment's. An episode
trains as one row, like an environment's: one whose harness edited its history (a split)
trains on its last trajectory, the calls since its last edit, which its reward judged; the
earlier ones are left out and counted (``splits``). So a batch keeps ``prompts_per_step *
group_size`` rows, the shape the trainer's data axis splits.

A harness is contained and never blocks the others (``data_types.TERMINATIONS``):

* it returns a finite number: that is the reward (``'done'``), unless it posted one first
  (the posted reward stands); it returns None having posted none: ``'no_reward'``;
* it raises, or returns something that is not a finite number: ``'env_error'``;
* it runs past ``timeout_s`` from its start: ``'timeout'``; the endpoint cancels its calls in
  flight and refuses its later ones (409), and its thread, which cannot be killed, is left to
  end on its own (a daemon).

Each of those keeps what the episode recorded with reward 0, so its tokens count against it
as an environment's failure does (an episode with no call gives an empty trajectory).
``Trajectory.success`` is a positive reward of a ``'done'`` episode. Each call prefills its
whole prompt (the endpoint does not keep an episode's KV cache between calls, unlike the
multi-turn runner).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm import extras
from rlax_llm.data_types import GenerationRequest, Trajectory
from rlax_llm.paramserver.receiver import Fetch
from rlax_llm.rollout.episodes import Episode, request_episodes
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.schedule import EpisodeSettings
from rlax_llm.serve.harness import Harness, load_harness
from rlax_llm.serve.openai_api import EPISODE_HEADER, Endpoint
from rlax_llm.serve.recorder import RecordedEpisode, stitch

openai = extras.require('openai', "env.name='harness'")  # the serve extra

# The model id the harness is given (and the endpoint serves).
MODEL_NAME = 'policy'
# The harnesses' clients would log one INFO line per call (httpx's request log).
logging.getLogger('httpx').setLevel(logging.WARNING)


class HarnessRunner:
  """Plays ``Episode``s with ``harness`` through an endpoint on ``worker``.

  Args:
    worker: the inference worker (weights loaded); its engine's slots bound the calls
      sampled at once.
    harness: the agent (``rlax_llm.serve.harness.Harness``).
    max_concurrent_episodes: harness calls running at once.
    max_turn_tokens: the length cap of a call that names no ``max_tokens``.
    timeout_s: wall-clock seconds an episode may take from its start (also each HTTP call's
      timeout).
  """

  def __init__(self, worker: InferenceWorker, harness: Harness, *,
               max_concurrent_episodes: int, max_turn_tokens: int, timeout_s: float):
    if max_concurrent_episodes < 1:
      raise ValueError(f'max_concurrent_episodes={max_concurrent_episodes} must be >= 1.')
    if not timeout_s > 0:
      raise ValueError(f'timeout_s={timeout_s} must be > 0 (seconds an episode may take).')
    self.worker = worker
    self.harness = harness
    self.concurrency = max_concurrent_episodes
    self.max_turn_tokens = max_turn_tokens
    self.timeout_s = float(timeout_s)
    self.stats: dict[str, float] = {}

  def run(self, episodes: Sequence[Episode], spec: SamplingSpec
          ) -> list[Trajectory]:
    """Plays every episode (its ``seed``, ``key``, ``group_id`` and ``prompt_id``; its
    ``env`` is not used) with the sampling policy ``spec``. Returns the trajectories in
    episode order, one per episode (its last: see the module docstring;
    ``Trajectory.episode_id`` is the episode's index).

    ``stats`` then holds ``episodes``, ``turns`` (calls), ``model_tokens``, ``splits``,
    ``termination/<reason>``, the endpoint's counts under ``endpoint/`` and ``wall_s``."""
    start = time.perf_counter()
    names = [f'rlax-{secrets.token_hex(6)}-{i}' for i in range(len(episodes))]
    endpoint = Endpoint(self.worker, model_name=MODEL_NAME, api_key=secrets.token_hex(16),
                        sampling=spec, max_tokens=self.max_turn_tokens,
                        max_waiting=max(64, 4 * self.concurrency)).start()
    try:
      for i, (name, episode) in enumerate(zip(names, episodes)):
        endpoint.open_episode(name, episode.key, episode_id=i, group_id=episode.group_id,
                              prompt_id=episode.prompt_id)
      outcomes = self._play(endpoint, names, episodes)
    finally:
      endpoint.stop()
    posted = {e.name: e for e in endpoint.recorder.take()}
    counts = collections.Counter()
    trajectories = []
    for i, (name, episode, outcome) in enumerate(zip(names, episodes, outcomes)):
      reason, reward, calls = _ending(outcome, posted.get(name),
                                      _open_calls(endpoint, name))
      counts[f'termination/{reason}'] += 1
      made = stitch(calls, episode_id=i, group_id=episode.group_id,
                    prompt_id=episode.prompt_id, reward=reward, termination=reason)
      counts['splits'] += max(0, len(made) - 1)
      for call in calls:
        counts['turns'] += 1
        counts['model_tokens'] += len(call.completion_ids)
      last = made[-1] if made else _empty(i, episode, reward, reason)
      trajectories.append(dataclasses.replace(last, success=reason == 'done' and reward > 0))
    self.stats = {'episodes': float(len(episodes)), **counts,
                  **{f'endpoint/{k}': float(v) for k, v in endpoint.stats.items()},
                  'wall_s': time.perf_counter() - start}
    return trajectories

  def _play(self, endpoint: Endpoint, names: Sequence[str], episodes: Sequence[Episode]
            ) -> list[tuple[str, Any]]:
    """Runs the harness once per episode, at most ``concurrency`` at once, each until it
    returns, raises or passes its deadline. Returns one outcome per episode:
    ``('returned', value)``, ``('raised', error)`` or ``('timeout', None)``."""
    results: queue.Queue = queue.Queue()
    outcomes: list[tuple[str, Any] | None] = [None] * len(episodes)
    waiting = collections.deque(range(len(episodes)))
    deadlines: dict[int, float] = {}
    while waiting or deadlines:
      while waiting and len(deadlines) < self.concurrency:
        i = waiting.popleft()
        deadlines[i] = time.monotonic() + self.timeout_s
        threading.Thread(target=self._episode, args=(endpoint, names[i], episodes[i].seed, i,
                                                     results),
                         name=f'rlax-harness-{i}', daemon=True).start()
      try:
        i, outcome = results.get(timeout=max(0.0, min(deadlines.values()) - time.monotonic()))
        if i in deadlines:  # else: it had timed out already
          del deadlines[i]
          outcomes[i] = outcome
      except queue.Empty:
        now = time.monotonic()
        for i in [i for i, deadline in deadlines.items() if deadline <= now]:
          del deadlines[i]
          outcomes[i] = ('timeout', None)
          endpoint.abandon(names[i])
    return outcomes

  def _episode(self, endpoint: Endpoint, name: str, seed: int, index: int,
               results: queue.Queue) -> None:
    """One harness call in its own thread, with its own client; puts its outcome."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                           default_headers={EPISODE_HEADER: name}, timeout=self.timeout_s,
                           max_retries=0)
    try:
      outcome = ('returned', self.harness(client, MODEL_NAME, seed))
    except Exception as error:  # noqa: BLE001  (a harness's bug ends its own episode only)
      outcome = ('raised', error)
    finally:
      client.close()
    results.put((index, outcome))


def _open_calls(endpoint: Endpoint, name: str) -> tuple:
  try:
    return endpoint.recorder.calls(name)
  except KeyError:  # closed by a posted reward
    return ()


def _ending(outcome: tuple[str, Any], posted: RecordedEpisode | None, open_calls: tuple
            ) -> tuple[str, float, tuple]:
  """``(termination, reward, calls)`` of an episode from its harness's outcome, the episode
  its harness closed by posting a reward (or None) and the calls still open."""
  kind, value = outcome
  calls = posted.calls if posted is not None else open_calls
  if kind == 'timeout':
    return 'timeout', 0.0, calls
  if kind == 'raised':
    return 'env_error', 0.0, calls
  if posted is not None:
    return 'done', posted.reward, calls
  if value is None:
    return 'no_reward', 0.0, calls
  try:
    reward = float(value)
  except (TypeError, ValueError):
    return 'env_error', 0.0, calls
  return ('done', reward, calls) if math.isfinite(reward) else ('env_error', 0.0, calls)


def _empty(index: int, episode: Episode, reward: float, termination: str) -> Trajectory:
  """The trajectory of an episode that made no call: no tokens, no turns."""
  none = lambda dtype: np.zeros(0, dtype)
  return Trajectory(
      episode_id=index, group_id=episode.group_id, prompt_id=episode.prompt_id,
      tokens=none(np.int32), loss_mask=none(bool), behaviour_logprobs=none(np.float32),
      support_sizes=none(np.int32), versions=none(np.int32), token_turn=none(np.int32),
      turn_starts=none(np.int32), turn_ends=none(np.int32), turn_rewards=none(np.float32),
      turn_mask=none(bool), state_ids=none(np.int64), episode_return=reward,
      termination=termination)


def play_harness(worker: InferenceWorker, fetch: Fetch, requests: Sequence[GenerationRequest],
                 rng_data: np.ndarray, version: int, first: int, spec: SamplingSpec,
                 episodes: EpisodeSettings) -> tuple[list[Trajectory], dict[str, float]]:
  """``backends.play.play_requests`` for a harness run, in a worker's process: the episodes of
  ``requests`` (``request_episodes``: keys and group ids as an environment run's) played by
  the harness ``episodes.env`` names, with the weights of ``version`` (pulled through
  ``fetch`` unless held: ``Receiver.ensure``). Returns the trajectories in order and the
  runner's figures (plus the pull's, ``sync/``)."""
  pulled = worker.receiver.ensure(version, fetch)
  played = request_episodes(requests, lambda: None, jax.random.wrap_key_data(rng_data), first)
  runner = HarnessRunner(worker, load_harness(episodes.env),
                         max_concurrent_episodes=episodes.max_concurrent_episodes,
                         max_turn_tokens=episodes.max_turn_tokens,
                         timeout_s=episodes.timeout_s)
  trajectories = runner.run(played, spec)
  return trajectories, {**runner.stats, **pulled}
