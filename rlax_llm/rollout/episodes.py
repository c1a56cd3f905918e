"""Multi-turn episodes in the engine's slots: token-faithful trajectories.

``EpisodeRunner.run(episodes, spec)`` plays each ``Episode`` (an environment, its seed and a
PRNG key) to its end, several at once in the engine's KV-cache slots (at most
``max_concurrent_episodes``), and returns one ``rlax_llm.data_types.Trajectory`` each:

1. ``env.reset(seed)`` gives the first user message; the prompt is that message rendered by
   the tokenizer's chat template (``ChatRenderer`` of ``rlax_llm.envs.conversation``, which
   the supervised warm-up shares; a tokenizer without one: the text itself,
   ``PlainRenderer``), prefilled and inserted into a free slot.
2. The model samples a turn (up to ``max_turn_tokens``, ending at the tokenizer's eos). Its
   decoded text is the action: ``env.step(text)`` returns the observation, the turn's reward
   and whether the episode is done.
3. Unless it is done, the observation is rendered as the next chat turn: the ids between
   the sampled tokens and the next assistant turn are the difference between the template
   rendered with and without the new message (``ChatRenderer.between_turns``), so the
   conversation's ids equal a render of the whole conversation, while the model's own ids
   are kept as sampled (never re-tokenised). They are appended to the same slot's KV cache
   (``Engine.extend``: only the new tokens are prefilled) with loss mask 0, and the next
   turn is sampled there.

Every model token keeps its behaviour log-prob, support size and the version of the params
that drew it (read from the ``VersionedParams`` holder before every engine call; a new
version is used from then on, as the driver's ``'continue'``). Turn ``n`` of episode ``e``
draws with ``fold_in(fold_in(e.key, n), t)`` for its ``t``-th token, so an episode's tokens
depend only on its key, its environment and the weights: with seeded environments and the
deterministic schedule, two runs are equal bit for bit (on one machine).

Environment calls of one step run concurrently on a thread pool; the runner waits for them
up to each episode's deadline (``timeout_s`` from its start), so a slow or hung environment
delays the others at most until its own deadline. Bad input ends one episode, is counted in
``stats`` and never stops the others (``TERMINATIONS``):

* an environment that raises (in ``reset``, ``step`` or ``state_key``) or returns a reward
  that is not a finite number: ``'env_error'``, its rewards set to 0;
* an episode that never ends: ``'turn_limit'`` after ``env.max_turns`` turns (or the
  runner's ``max_turns``, whichever is smaller), ``'timeout'`` past its deadline;
* a prompt longer than ``max_prefill_length``, or a conversation that no longer fits the
  cache: ``'context_full'``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm.data_types import GenerationRequest, Trajectory
from rlax_llm.envs.base import Environment
from rlax_llm.envs.conversation import (
  ChatRenderer,
  PlainRenderer,
  first_messages,
  make_renderer,
  observe,
)
from rlax_llm.envs.seeds import env_seed
from rlax_llm.models.moe import NO_ROUTE, route_dtype
from rlax_llm.rollout.driver import VersionedParams
from rlax_llm.rollout.engine import DecodeState, Engine, Extend, HostStep, Insert
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.tokenization import Tokenizer


def state_id(key: str) -> int:
  """A stable int64 id of an environment state key (``env.state_key()``): the first 8 bytes
  of its BLAKE2b digest. Equal in every process and run (Python's ``hash`` of a str is
  salted per process), so GiGPO's step groups can be formed across workers."""
  digest = hashlib.blake2b(str(key).encode('utf-8'), digest_size=8).digest()
  return int(np.frombuffer(digest, np.int64)[0])


@dataclasses.dataclass(frozen=True)
class Episode:
  """One episode to play: ``env`` reset with ``seed``; ``key`` uint32 key data (turn ``n``
  draws with ``fold_in(key, n)``); ``group_id`` groups the episodes whose returns are
  compared (GRPO), ``prompt_id`` names the task instance (e.g. the seed)."""

  env: Environment
  seed: int
  key: np.ndarray
  group_id: int = 0
  prompt_id: int = 0


def request_episodes(requests: Sequence[GenerationRequest], make_env: Callable[[], Environment],
                     rng: jax.Array, first: int = 0) -> list[Episode]:
  """The episodes of an environment run's ``requests`` (each prompt stands for an environment
  seed, ``envs.seeds.env_seed``): ``num_samples`` episodes per request, each with a fresh
  environment from ``make_env``. Sample ``s`` of request ``i`` plays with the key
  ``fold_in(fold_in(rng, first + i), s)`` (as ``InferenceWorker.generate`` samples) and group
  id ``first + i``, so a batch's episodes do not depend on how it is split between
  workers."""
  out = []
  for i, request in enumerate(requests):
    request_key = jax.random.fold_in(rng, first + i)
    for s in range(request.num_samples):
      key = np.asarray(jax.random.key_data(jax.random.fold_in(request_key, s)))
      out.append(Episode(env=make_env(), seed=env_seed(request.prompt), key=key,
                         group_id=first + i, prompt_id=request.prompt.prompt_id))
  return out


@dataclasses.dataclass
class _Turn:
  """A turn in flight: its model tokens ``[start, end)``, the state it acts in, its reward and
  whether its environment step completed."""

  start: int
  state: int
  end: int = -1
  reward: float = 0.0
  ok: bool = False


@dataclasses.dataclass(eq=False)  # compared by identity: an episode is itself
class _Live:
  """An episode in flight: what its trajectory holds so far and where it stands. ``rows``:
  one ``(token, loss mask, log-prob, support, version, turn)`` per token fed or sampled."""

  index: int
  episode: Episode
  deadline: float
  max_turns: int
  slot: int = -1
  cached: int = 0  # positions the slot's cache holds
  success: bool = False  # the last step's info['success']
  messages: list = dataclasses.field(default_factory=list)
  texts: list = dataclasses.field(default_factory=list)
  rows: list = dataclasses.field(default_factory=list)
  turns: list = dataclasses.field(default_factory=list)
  # An engine that records routes: the experts of rows[:len(routes)], the rows fed so far.
  routes: list = dataclasses.field(default_factory=list)

  @property
  def tokens(self) -> list[int]:
    return [row[0] for row in self.rows]

  def feed(self, ids: Sequence[int]) -> None:
    """Appends prompt or environment ids (loss mask 0)."""
    self.rows += [(int(t), False, 0.0, 0, -1, -1) for t in ids]

  def begin_turn(self, state: int) -> None:
    self.turns.append(_Turn(start=len(self.rows), end=len(self.rows), state=state))

  def sampled(self, token: int, logprob: float, support: int, version: int) -> None:
    """Appends a model token of the current turn."""
    self.rows.append((int(token), True, float(logprob), int(support), int(version),
                      len(self.turns) - 1))
    self.turns[-1].end = len(self.rows)

  def turn_tokens(self) -> list[int]:
    turn = self.turns[-1]
    return [row[0] for row in self.rows[turn.start:turn.end]]


class EpisodeRunner:
  """Plays ``Episode``s concurrently in ``engine``'s slots with weights from ``holder``.

  Args:
    engine: the ``Engine`` (its ``max_prefill_length`` bounds the first prompt, its cache
      length the whole conversation).
    holder: where ``(version, params)`` is read before every engine call.
    tokenizer: the model's tokenizer (renders observations, decodes actions; its eos ends a
      turn).
    max_concurrent_episodes: episodes in flight at once (at most the engine's slots).
    max_turn_tokens: the most tokens one turn may sample.
    timeout_s: wall-clock seconds an episode may take from its start.
    max_turns: a cap on turns over every environment's own ``max_turns`` (None: theirs).
    stop_ids: extra token ids that end a turn (the eos always does).
    state: the engine's decode state to run in (e.g. a worker's driver's, so that one KV
      cache serves both; the engine donates it: read ``runner.state`` back after a run);
      default: a new one.
  """

  def __init__(self, engine: Engine, holder: VersionedParams, tokenizer: Tokenizer, *,
               max_concurrent_episodes: int, max_turn_tokens: int, timeout_s: float,
               max_turns: int | None = None, stop_ids: Sequence[int] = (),
               state: DecodeState | None = None):
    if not 1 <= max_concurrent_episodes <= engine.slots:
      raise ValueError(f'max_concurrent_episodes={max_concurrent_episodes} must be in [1, '
                       f'slots={engine.slots}] (an episode holds a slot for its whole life).')
    if not 1 <= max_turn_tokens <= engine.max_decode_length:
      raise ValueError(f'max_turn_tokens={max_turn_tokens} must be in [1, '
                       f'max_decode_length={engine.max_decode_length}].')
    if not timeout_s > 0:
      raise ValueError(f'timeout_s={timeout_s} must be > 0 (seconds an episode may take).')
    if max_turns is not None and max_turns < 1:
      raise ValueError(f'max_turns={max_turns} must be >= 1 or None.')
    self.engine = engine
    self.holder = holder
    self.tokenizer = tokenizer
    self.concurrency = max_concurrent_episodes
    self.max_turn_tokens = max_turn_tokens
    self.timeout_s = float(timeout_s)
    self.max_turns = max_turns
    self.stop_ids = tuple(dict.fromkeys((tokenizer.eos_id, *stop_ids)))
    self.state = engine.init_decode_state() if state is None else state
    self.stats: dict[str, float] = {}

  def renderer(self, env: Environment) -> ChatRenderer | PlainRenderer:
    """How ``env``'s conversation becomes ids (``make_renderer`` with its tools)."""
    return make_renderer(self.tokenizer, getattr(env, 'tools', None))

  def run(self, episodes: Sequence[Episode], spec: SamplingSpec) -> list[Trajectory]:
    """Plays every episode to its end; ``result[i]`` is ``episodes[i]``'s trajectory.

    ``stats`` then holds the run's counts: ``episodes``, ``turns``, ``model_tokens``,
    ``env_tokens``, ``prefilled_tokens`` (prompt and observation tokens run through the
    model: each once), ``steps`` (decode steps), ``termination/<reason>`` per reason of
    ``TERMINATIONS``, and ``wall_s``.
    """
    start = time.perf_counter()
    self.stats = collections.defaultdict(float)
    prefilled = self.engine.prefilled_tokens
    results: list[Trajectory | None] = [None] * len(episodes)
    waiting = collections.deque(range(len(episodes)))
    slots: list[_Live | None] = [None] * self.engine.slots
    renderers: dict[int, Any] = {}
    self.state = self.engine.release_all(self.state)
    # Not a `with` block: leaving one joins the threads, and a hung environment call (a
    # thread cannot be killed) would hang the run; its thread is left to finish on its own.
    # Threads start as calls need them: one per episode at most, so calls never queue behind
    # a hung one.
    pool = concurrent.futures.ThreadPoolExecutor(max(1, len(episodes)))
    try:
      ended: list[_Live] = []  # episodes whose turn ended, waiting for their env step
      while waiting or any(slots):
        live = sum(s is not None for s in slots)
        admitted = [waiting.popleft()
                    for _ in range(min(len(waiting), self.concurrency - live))]
        if admitted:
          ended += self._admit(pool, admitted, episodes, slots, renderers, results, spec)
        if ended:
          ended = self._step_envs(pool, ended, slots, renderers, results, spec)
        decoding = [s for s in slots if s is not None and s not in ended]
        if decoding:
          ended += self._decode(decoding, slots, results, spec)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
    self.stats['prefilled_tokens'] = self.engine.prefilled_tokens - prefilled
    self.stats['episodes'] = len(episodes)
    self.stats['wall_s'] = time.perf_counter() - start
    self.stats = dict(self.stats)
    return results

  # ----------------------------------------------------------------------- steps

  def _env_calls(self, pool, calls: list[tuple[_Live, Any]], slots
                 ) -> list[tuple[Any, str | None]]:
    """Runs ``calls`` (an episode and a no-argument function each) concurrently; returns
    ``(value, None)`` or ``(None, 'env_error' | 'timeout')`` per call, in order, waiting for
    each at most until its episode's deadline. Time an episode spends waiting on another's
    call is not counted against it: its deadline moves by that wait."""
    begin = time.perf_counter()
    futures = [pool.submit(_timed, call) for _, call in calls]
    out, finished = [], []
    for (live, _), future in zip(calls, futures):
      try:
        value, done_at = future.result(timeout=max(0.0, live.deadline - time.perf_counter()))
        out.append((value, None))
        finished.append(done_at)
      except concurrent.futures.TimeoutError:
        out.append((None, 'timeout'))
        finished.append(None)
      except Exception:  # pylint: disable=broad-except  # an env's bug ends its episode only
        out.append((None, 'env_error'))
        finished.append(None)
    end = time.perf_counter()
    callers = {id(live) for live, _ in calls}
    for live in slots:
      if live is not None and id(live) not in callers:
        live.deadline += end - begin
    for (live, _), done_at in zip(calls, finished):
      if done_at is not None:
        live.deadline += end - done_at
    return out

  def _admit(self, pool, admitted, episodes, slots, renderers, results, spec) -> list[_Live]:
    """Resets the admitted episodes' envs, prefills their prompts into free slots and
    samples each one's first token; returns those whose first turn already ended."""
    e = self.engine
    now = time.perf_counter()
    lives = []
    for index in admitted:
      episode = episodes[index]
      turns = int(getattr(episode.env, 'max_turns', 1) or 1)
      lives.append(_Live(index, episode, now + self.timeout_s,
                         min(turns, self.max_turns or turns)))
    resets = self._env_calls(pool, [(lv, lambda ep=lv.episode: (ep.env.reset(ep.seed),
                                                                 ep.env.state_key()))
                                    for lv in lives], slots)
    ready = []
    for live, (value, error) in zip(lives, resets):
      if error:
        self._finish(live, error, slots, results)
        continue
      observation, key = value
      renderer = renderers.setdefault(live.index, self.renderer(live.episode.env))
      live.messages = first_messages(observation)
      try:
        ids = renderer.prompt(live.messages)
      except Exception:  # pylint: disable=broad-except  # text the tokenizer cannot encode
        self._finish(live, 'env_error', slots, results)
        continue
      if not 1 <= len(ids) <= e.max_prefill_length:
        self._finish(live, 'context_full', slots, results)
        continue
      live.feed(ids)
      live.cached = len(ids)
      live.begin_turn(state_id(key))
      ready.append(live)
    free = [slot for slot, s in enumerate(slots) if s is None]
    ended = []
    for lo in range(0, len(ready), e.slots):
      chunk = ready[lo:lo + e.slots]
      version, params = self.holder.get()
      prefix = e.prefill(params, [lv.tokens for lv in chunk])
      routes = None if prefix.routes is None else np.asarray(jax.device_get(prefix.routes))
      inserts = []
      for row, live in enumerate(chunk):
        if routes is not None:
          live.routes = list(routes[row, :len(live.rows)])
        live.slot = free.pop(0)
        slots[live.slot] = live
        inserts.append(Insert(row=row, slot=live.slot, key=self._turn_key(live),
                              max_new_tokens=self._budget(live.cached),
                              stop_ids=self.stop_ids))
      self.state, first = e.insert(prefix, self.state, inserts, spec)
      ended += self._record(first.to_host(), chunk, range(len(chunk)), version)
    return ended

  def _decode(self, decoding, slots, results, spec) -> list[_Live]:
    """One decode step; returns the episodes whose turn ended at it. Episodes past their
    deadline end (``'timeout'``) and their slots are released first."""
    now = time.perf_counter()
    late = [live for live in decoding if live.deadline < now]
    if late:
      self.state = self.engine.release(self.state, [live.slot for live in late])
      for live in late:
        self._finish(live, 'timeout', slots, results)
      decoding = [live for live in decoding if live not in late]
      if not decoding:
        return []
    version, params = self.holder.get()
    longest = max(live.cached + len(live.turn_tokens()) for live in decoding)
    self.state, step = self.engine.generate(params, self.state, spec,
                                            min(longest, self.engine.cache_length))
    self.stats['steps'] += 1
    return self._record(step.to_host(), decoding, [live.slot for live in decoding], version)

  def _record(self, host: HostStep, lives, rows, version) -> list[_Live]:
    """Appends each episode's token from ``host`` row ``rows[i]``; returns those done."""
    ended = []
    for live, row in zip(lives, rows):
      if host.routes is not None and host.routes[row][0, 0] != NO_ROUTE:  # it fed a token
        live.routes.append(host.routes[row])
      live.sampled(host.tokens[row], host.logprobs[row], host.supports[row], version)
      self.stats['model_tokens'] += 1
      if host.done[row]:
        ended.append(live)
    return ended

  def _step_envs(self, pool, ended, slots, renderers, results, spec) -> list[_Live]:
    """Passes each ended turn's text to its env, then ends the episode or appends the
    observation to its slot (``Engine.extend``) and samples the next turn. Returns the
    episodes whose next turn ended at its first token."""
    e = self.engine
    ended = sorted(ended, key=lambda live: live.index)
    for live in ended:
      turn = live.turn_tokens()
      stopped = turn[-1] in self.stop_ids
      live.texts.append(self.tokenizer.decode(turn[:-1] if stopped else turn))
      self.stats['turns'] += 1
    steps = self._env_calls(pool, [
        (live, lambda env=live.episode.env, text=live.texts[-1]: _env_step(env, text))
        for live in ended], slots)
    extends, continuing = [], []
    for live, (value, error) in zip(ended, steps):
      if error:
        self._finish(live, error, slots, results)
        continue
      step, reward, key = value
      live.turns[-1].reward, live.turns[-1].ok = reward, True
      if step.done:
        live.success = bool((step.info or {}).get('success', False))
        truncated = (step.info or {}).get('truncated')  # a TextEnv's own turn limit
        self._finish(live, 'turn_limit' if truncated else 'done', slots, results)
        continue
      if len(live.turns) >= live.max_turns:
        self._finish(live, 'turn_limit', slots, results)
        continue
      if time.perf_counter() > live.deadline:
        self._finish(live, 'timeout', slots, results)
        continue
      turn = live.turn_tokens()
      try:
        delta = observe(renderers[live.index], live.messages, live.texts[-1], step,
                        turn[-1] if turn[-1] in self.stop_ids else None)
      except Exception:  # pylint: disable=broad-except  # an observation it cannot encode
        self._finish(live, 'env_error', slots, results)
        continue
      fed = [turn[-1], *delta]  # the last sampled token is not in the cache yet
      if live.cached + len(turn) - 1 + len(fed) >= e.cache_length:
        self._finish(live, 'context_full', slots, results)
        continue
      start = live.cached + len(turn) - 1
      live.feed(delta)
      self.stats['env_tokens'] += len(delta)
      live.cached = start + len(fed)
      live.begin_turn(state_id(key))
      extends.append(Extend(slot=live.slot, start=start, tokens=tuple(fed),
                            key=self._turn_key(live), max_new_tokens=self._budget(live.cached),
                            stop_ids=self.stop_ids))
      continuing.append(live)
    if not extends:
      return []
    version, params = self.holder.get()
    self.state, first = e.extend(params, self.state, extends, spec)
    host = first.to_host()
    if host.prefilled is not None:  # the last sampled token and the observation
      for i, (live, x) in enumerate(zip(continuing, extends)):
        live.routes += list(host.prefilled[i, :len(x.tokens)])
    return self._record(host, continuing, range(len(extends)), version)

  # ----------------------------------------------------------------------- helpers

  def _budget(self, cached: int) -> int:
    """Tokens a turn may draw after ``cached`` positions: its cap, and what the cache holds
    (every drawn token but the last is written)."""
    return max(1, min(self.max_turn_tokens, self.engine.cache_length - cached + 1))

  @staticmethod
  def _turn_key(live: _Live) -> np.ndarray:
    turn = len(live.turns) - 1
    key = jax.random.fold_in(jax.random.wrap_key_data(np.asarray(live.episode.key,
                                                                 np.uint32)), turn)
    return np.asarray(jax.random.key_data(key))

  def _finish(self, live: _Live, reason: str, slots, results) -> None:
    """Ends ``live`` with ``reason``: frees its slot and stores its trajectory."""
    if live.slot >= 0:
      slots[live.slot] = None
    self.stats[f'termination/{reason}'] += 1
    turns = live.turns
    rewards = [t.reward if reason != 'env_error' else 0.0 for t in turns]
    columns = list(zip(*live.rows)) or [()] * 6
    routes = {}
    if self.engine.record_routes:
      c = self.engine.model.config
      routes['routes'] = np.full((len(live.rows), c.num_moe_layers, c.num_experts_per_tok),
                                 NO_ROUTE, route_dtype(c.num_experts))
      if live.routes:
        routes['routes'][:len(live.routes)] = live.routes
    results[live.index] = Trajectory(
        episode_id=live.index, group_id=live.episode.group_id,
        prompt_id=live.episode.prompt_id,
        **{name: np.asarray(values, dtype) for name, values, dtype in zip(
            ('tokens', 'loss_mask', 'behaviour_logprobs', 'support_sizes', 'versions',
             'token_turn'), columns,
            (np.int32, bool, np.float32, np.int32, np.int32, np.int32))},
        turn_starts=np.asarray([t.start for t in turns], np.int32),
        turn_ends=np.asarray([t.end for t in turns], np.int32),
        turn_rewards=np.asarray(rewards, np.float32),
        turn_mask=np.asarray([t.ok for t in turns], bool),
        state_ids=np.asarray([t.state for t in turns], np.int64),
        episode_return=float(sum(rewards)), termination=reason, texts=tuple(live.texts),
        success=live.success and reason == 'done', **routes)


def _timed(call):
  """``(call(), the time it returned)``."""
  value = call()
  return value, time.perf_counter()


def _env_step(env: Environment, text: str):
  """``(env.step(text), its reward as a float, env.state_key() after it)``; raises (an
  ``env_error``) for a reward that is not a finite number."""
  step = env.step(text)
  reward = float(step.reward)
  if not math.isfinite(reward):
    raise ValueError(f'{env.name}: step returned the reward {reward}; rewards must be finite.')
  return step, reward, (None if step.done else env.state_key())
