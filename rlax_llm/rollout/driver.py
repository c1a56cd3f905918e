"""Continuous batching over the engine, with the weights read from a versioned holder.

``Driver.run(jobs)`` generates every sample of every job: samples fill free KV-cache slots
as earlier ones finish (each job's prompt is prefilled once and shared by its samples), and
every token is recorded with its behaviour log-prob and the version of the params that
produced it. Before every decode step the driver reads ``(version, params)`` from a
``VersionedParams`` holder, so a new version enters between two steps (no recompilation: the
params are an argument of the step). What happens to sequences in flight when the version
changes is a policy (``on_swap``):

* ``'continue'`` (PipelineRL): they go on with the new params on top of the keys/values the
  old ones wrote; their tokens carry the version that sampled each of them.
* ``'discard'`` (RLAX): they are dropped and regenerated from scratch with the new params;
  each sample counts its ``restarts``. So are samples a ``Job.resume`` continues whose last
  token another version drew: no sample mixes versions.

Either way a sample started after a swap is prefilled with the new params, and one decode
step never mixes versions.

Cancellation (a client of the OpenAI-compatible endpoint that disconnects,
``rlax_llm.serve``): ``run(jobs, cancelled=f)`` asks ``f(j)`` before every decode step for
every job ``j`` still running; a cancelled job's unfinished samples end at once with
``finish_reason`` ``'cancelled'`` (the tokens drawn so far kept), their slots take other
samples from the next step on and their pending samples never start. Who swaps: whoever sets the holder; ``run(jobs, refresh=f)`` calls
``f()`` before every decode step reads it, which is where a worker in free-running mode pulls
a newer version from the parameter server (``InferenceWorker.generate_at``). The driver is
single-threaded and deterministic: given the jobs, their keys and the versions it reads at
each step, the output is fixed; each sample's randomness depends only on its own key (see
``rlax_llm.rollout.engine``).

Jobs that use different sampling specs run one spec after the other (a phase per spec, in
order of first appearance), because the spec is part of the compiled step.

Partial rollouts (APRIL, Zhou et al., arXiv 2509.18521): ``run(jobs, stop_after=n)`` stops
as soon as ``n`` jobs have all their samples finished; the other samples come back
unfinished (``finish_reason`` None) with the tokens drawn so far. A later ``run`` continues
them: a ``Job`` with ``resume`` (its samples so far) keeps the finished ones, prefills each
unfinished one's prompt plus drawn tokens and goes on drawing with the same per-sample keys
(the ``t``-th token still uses ``fold_in(key, t)``), so with unchanged weights a continued
sample is the sample it would have been uninterrupted (up to the float rounding of a
prefill vs a decode step).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.rollout.engine import MAX_STOP_IDS, Engine, Insert
from rlax_llm.schedule import ON_SWAP  # rollout.on_swap's choices, named once


class VersionedParams:
  """The weights generation reads at every step: ``(version, params)``, swapped atomically."""

  def __init__(self):
    self._lock = threading.Lock()
    self._entry: tuple[int, Any] | None = None

  def set(self, version: int, params: Any) -> None:
    with self._lock:
      self._entry = (int(version), params)

  def get(self) -> tuple[int, Any]:
    with self._lock:
      if self._entry is None:
        raise RuntimeError('no weights loaded yet; set a version first.')
      return self._entry

  @property
  def version(self) -> int:
    """The held version, -1 when empty."""
    with self._lock:
      return -1 if self._entry is None else self._entry[0]


@dataclasses.dataclass(frozen=True)
class Job:
  """``num_samples`` completions of ``prompt_ids`` (token ids, non-empty).

  ``keys``: uint32 ``[num_samples, key_size]`` key data, one PRNG key per sample (the
  ``t``-th token of sample ``i`` is drawn with ``fold_in(keys[i], t)``).
  ``stop_ids``: token ids that end a sample (the stop token is kept in the output).
  ``resume``: the samples so far of a job an earlier ``run`` stopped (one ``Sample`` each:
  finished ones are kept, unfinished ones continued from their tokens); None: a new job.

  Token ids may be any integer sequence (stored as tuples of ints) and ``keys`` key data or
  typed PRNG keys; anything else (floats, strings, a wrong key shape) raises ValueError
  here. ``Driver.check`` checks what depends on the engine (ids in its vocabulary, lengths).
  """

  prompt_ids: tuple[int, ...]
  num_samples: int
  sampling: SamplingSpec
  max_new_tokens: int
  stop_ids: tuple[int, ...]
  keys: np.ndarray
  resume: tuple['Sample', ...] | None = None

  def __post_init__(self):
    for name in ('num_samples', 'max_new_tokens'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f'Job.{name}={value!r} must be an int >= 1.')
      object.__setattr__(self, name, int(value))
    object.__setattr__(self, 'prompt_ids', _token_ids('Job.prompt_ids', self.prompt_ids))
    object.__setattr__(self, 'stop_ids', _token_ids('Job.stop_ids', self.stop_ids))
    keys = self.keys
    if jax.dtypes.issubdtype(getattr(keys, 'dtype', np.float32), jax.dtypes.prng_key):
      keys = jax.random.key_data(keys)
    keys = np.asarray(keys)
    if keys.ndim != 2 or keys.shape[0] != self.num_samples or keys.dtype.kind not in 'iu':
      raise ValueError(f'Job.keys must be integer key data [num_samples={self.num_samples}, '
                       f'key size] (jax.random.key_data of one key per sample); got '
                       f'{keys.dtype.name}{list(keys.shape)}.')
    object.__setattr__(self, 'keys', keys.astype(np.uint32))


def _token_ids(name: str, ids) -> tuple[int, ...]:
  """``ids`` (a sequence or 1-D array of integers) as a tuple of ints; ValueError naming
  ``name`` for anything else (floats, strings, nested sequences)."""
  array = np.asarray(ids)
  if array.size == 0:
    return ()
  if array.ndim != 1 or array.dtype.kind not in 'iu':
    raise ValueError(f'{name} must be a 1-D sequence of integer token ids; got '
                     f'{array.dtype.name}{list(array.shape)}: {ids!r:.80}.')
  return tuple(int(t) for t in array)


@dataclasses.dataclass
class Sample:
  """One generated completion. With an engine that records routes (``record_routes``),
  ``prompt_routes`` (int ``[P, layers, k]``) and ``routes`` (one int ``[layers, k]`` per
  token fed so far: all tokens but the last) are the experts each prompt and sampled token
  was routed to when it went through the model (a continued sample's drawn tokens: as its
  continuation's prefill routed them)."""

  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  supports: list[int] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # 'stop' | 'length' | 'cancelled'; None: unfinished
  restarts: int = 0
  prompt_routes: np.ndarray | None = None
  routes: list[np.ndarray] = dataclasses.field(default_factory=list)

  def append(self, token: int, logprob: float, support: int, version: int) -> None:
    self.tokens.append(int(token))
    self.logprobs.append(float(logprob))
    self.supports.append(int(support))
    self.versions.append(int(version))

  def copy(self) -> 'Sample':
    """A copy whose token lists can grow without touching this one."""
    return dataclasses.replace(self, tokens=list(self.tokens), logprobs=list(self.logprobs),
                               supports=list(self.supports), versions=list(self.versions),
                               routes=list(self.routes))

  def restart(self) -> None:
    self.tokens, self.logprobs, self.supports, self.versions = [], [], [], []
    self.prompt_routes, self.routes = None, []
    self.finish_reason = None
    self.restarts += 1


class Driver:
  """Continuous batching of ``Job``s on ``engine`` with weights from ``holder``.

  Args:
    engine: the ``Engine``.
    holder: where the current ``(version, params)`` is read before every step.
    on_swap: ``'continue'`` or ``'discard'`` (see the module docstring).
    before_step: optional ``callback(step)`` called before each decode step's params are
      read (``step`` counts this driver's decode steps); tests use it to swap weights at an
      exact step.
    continuous: True (continuous batching): a free slot takes the next sample at once.
      False (static batching, the baseline it is measured against): new samples enter only
      when every slot is free, so each batch runs as long as its longest sample.
    prefill_batch: how many prompts a prefill call is filled up to (default: the engine's
      slots). When free slots need prompts prefilled (a call always takes those), the
      prompts of the next pending jobs join that call up to this many, and later free
      slots take those prefixes without another call: one prefill of many prompts costs
      far less per prompt than many of a few (benchmarks/RESULTS.md). 1 prefills only
      what the free slots need. Prefixes from before a weight swap are dropped at the
      swap, so samples started after it are prefilled with the new params either way.
  """

  def __init__(self, engine: Engine, holder: VersionedParams, *, on_swap: str = 'continue',
               before_step: Callable[[int], None] | None = None, continuous: bool = True,
               prefill_batch: int | None = None):
    if on_swap not in ON_SWAP:
      raise ValueError(f'on_swap={on_swap!r} is not valid; choose one of {list(ON_SWAP)}.')
    prefill_batch = engine.slots if prefill_batch is None else prefill_batch
    if not 1 <= prefill_batch <= engine.slots:
      raise ValueError(f'prefill_batch={prefill_batch} must be in [1, slots={engine.slots}] '
                       '(one prefill call takes at most as many prompts as there are slots).')
    self.prefill_batch = prefill_batch
    self.engine = engine
    self.holder = holder
    self.on_swap = on_swap
    self.before_step = before_step
    self.continuous = continuous
    self.state = engine.init_decode_state()
    self.steps = 0
    self.stats: dict[str, float] = {}

  def check(self, jobs: Sequence[Job]) -> None:
    """Raises ValueError for a job the engine cannot run (before any compute): an empty or
    too long prompt, a token or stop id outside the vocabulary, more than ``MAX_STOP_IDS``
    stop ids, keys of another size, a ``resume`` that does not fit."""
    e = self.engine
    vocab = e.model.config.vocab_size

    def in_vocab(what, ids):
      bad = [t for t in ids if not 0 <= t < vocab]
      if bad:
        raise ValueError(f'{what} holds ids outside the vocabulary [0, {vocab}): '
                         f'{bad[:5]}.')

    for i, job in enumerate(jobs):
      if not job.prompt_ids:
        raise ValueError(f'job {i}: the prompt is empty.')
      if len(job.prompt_ids) > e.max_prefill_length:
        raise ValueError(f'job {i}: the prompt has {len(job.prompt_ids)} tokens, more than '
                         f'max_prefill_length={e.max_prefill_length}.')
      in_vocab(f'job {i}: the prompt', job.prompt_ids)
      in_vocab(f'job {i}: stop_ids', job.stop_ids)
      if len(job.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f'job {i}: {len(job.stop_ids)} stop ids {job.stop_ids}; at most '
                         f'MAX_STOP_IDS={MAX_STOP_IDS} are supported (eos included).')
      if not 1 <= job.max_new_tokens <= e.max_decode_length:
        raise ValueError(f'job {i}: max_new_tokens={job.max_new_tokens} is not in [1, '
                         f'max_decode_length={e.max_decode_length}].')
      if job.keys.shape[1] != e.key_size:
        raise ValueError(f'job {i}: keys of {job.keys.shape[1]} words; this JAX PRNG '
                         f'implementation\'s keys have {e.key_size}.')
      if job.resume is not None:
        if len(job.resume) != job.num_samples:
          raise ValueError(f'job {i}: resume holds {len(job.resume)} samples for '
                           f'num_samples={job.num_samples}.')
        for n, sample in enumerate(job.resume):
          in_vocab(f'job {i} sample {n}: resume tokens', sample.tokens)
          if sample.finish_reason is None and len(sample.tokens) >= job.max_new_tokens:
            raise ValueError(f'job {i} sample {n}: unfinished with {len(sample.tokens)} '
                             f'tokens, but max_new_tokens={job.max_new_tokens}.')

  def run(self, jobs: Sequence[Job], stop_after: int | None = None,
          refresh: Callable[[], None] | None = None,
          cancelled: Callable[[int], bool] | None = None,
          on_token: Callable[[int, int, Sample], None] | None = None) -> list[list[Sample]]:
    """Generates the samples of every job; ``result[j][i]`` is sample ``i`` of job ``j``.

    ``stop_after``: stop once that many jobs are complete (every sample finished); the
    samples of the others may come back unfinished (``finish_reason`` None; pass them as
    ``Job.resume`` to continue). None: run every job to the end.
    ``refresh``: called before every decode step reads the holder (after ``before_step``);
    it may set a new version there, which that step uses.
    ``cancelled``: ``cancelled(j)`` is asked before every decode step for each job ``j`` with
    unfinished samples; True ends them (``'cancelled'``) and frees their slots.
    ``on_token``: ``on_token(j, i, sample)`` is called each time sample ``i`` of job ``j``
    gains a token (``sample``: the growing ``Sample``, its finish reason set at its last
    token), e.g. to stream it.
    """
    self.check(jobs)
    if stop_after is not None and not 1 <= stop_after <= len(jobs):
      raise ValueError(f'stop_after={stop_after} must be in [1, {len(jobs)}] (the jobs) or '
                       'None.')
    start = time.perf_counter()
    self.stats = collections.defaultdict(float)
    results = [[job.resume[i].copy() if job.resume is not None else Sample()
                for i in range(job.num_samples)] for job in jobs]
    self.stats['continued_samples'] = sum(
        1 for samples in results for sample in samples
        if sample.tokens and sample.finish_reason is None)
    done = (lambda: sum(all(x.finish_reason for x in samples) for samples in results)
            >= stop_after) if stop_after is not None else None
    specs = list(dict.fromkeys(job.sampling for job in jobs))
    for spec in specs:
      if done is not None and done():
        break
      self._phase(spec, [j for j, job in enumerate(jobs) if job.sampling == spec], jobs,
                  results, done, refresh, cancelled, on_token)
    self.stats['unfinished_samples'] = sum(
        1 for samples in results for sample in samples if sample.finish_reason is None)
    self.stats['wall_s'] = time.perf_counter() - start
    self.stats = dict(self.stats)
    return results

  def _phase(self, spec: SamplingSpec, job_ids: list[int], jobs: Sequence[Job],
             results: list[list[Sample]], done: Callable[[], bool] | None = None,
             refresh: Callable[[], None] | None = None,
             cancelled: Callable[[int], bool] | None = None,
             on_token: Callable[[int, int, Sample], None] | None = None) -> None:
    """Runs the jobs of one sampling spec to completion (or until ``done()``).

    Steps are pipelined one deep: step ``t + 1`` is dispatched before the host reads step
    ``t``'s tokens, so the host's bookkeeping overlaps the device's compute. A sample that
    finished at step ``t`` is inactive on the device at ``t + 1`` (the engine tracks its
    remaining budget), and its slot is refilled before step ``t + 2``.
    """
    e = self.engine
    pending = collections.deque((j, i) for j in job_ids for i in range(jobs[j].num_samples)
                                if results[j][i].finish_reason is None)
    # New samples of a job share its prompt's prefill; continued ones have their own.
    to_insert = collections.Counter(j for j, i in pending if not results[j][i].tokens)
    # job or (job, i) -> (version, Prefix, row, its routes on the host or None)
    prefixes: dict[Any, tuple[int, Any, int, Any]] = {}
    slots: list[tuple[int, int] | None] = [None] * e.slots
    self.state = e.release_all(self.state)
    version = None
    in_flight = None  # (StepResult, version, the slots' occupants at its dispatch)
    while pending or in_flight or any(s is not None for s in slots):
      if done is not None and done():
        if in_flight is not None:  # its tokens are final: keep them
          self._collect(in_flight, slots, jobs, results, on_token)
        self.state = e.release_all(self.state)
        self.stats['stopped_early'] += 1
        return
      if self.before_step is not None:
        self.before_step(self.steps)
      if refresh is not None:
        refresh()
      current, params = self.holder.get()
      if current != version:
        e.check_params(params)
        if self.on_swap == 'discard':  # continued samples another version drew start over
          stale = [(j, i) for j, i in pending
                   if results[j][i].tokens and results[j][i].versions[-1] != current]
          for j, i in stale:
            results[j][i].restart()
            to_insert[j] += 1
          self.stats['discarded_samples'] += len(stale)
        if version is not None:
          self.stats['swaps'] += 1
          prefixes.clear()  # samples started from now on are prefilled with the new params
          if self.on_swap == 'discard':
            if in_flight is not None:  # its tokens are final before anything is dropped
              self._collect(in_flight, slots, jobs, results, on_token)
              in_flight = None
            dropped = [occupant for occupant in slots if occupant is not None]
            for j, i in dropped:
              results[j][i].restart()
              to_insert[j] += 1
            pending.extendleft(reversed(dropped))
            slots = [None] * e.slots
            self.state = e.release_all(self.state)
            self.stats['discarded_samples'] += len(dropped)
        version = current
      if cancelled is not None:
        pending = self._cancel(cancelled, slots, pending, prefixes, to_insert, results)
      self._fill(slots, pending, prefixes, to_insert, jobs, results, params, version, spec)
      dispatched = None
      if any(s is not None for s in slots):
        longest = max(len(jobs[j].prompt_ids) + len(results[j][i].tokens)
                      for j, i in filter(None, slots)) + (in_flight is not None)
        self.state, step = e.generate(params, self.state, spec, longest)
        dispatched = (step, version, tuple(slots))
        self.stats['steps'] += 1
        self.steps += 1
      if in_flight is not None:
        self._collect(in_flight, slots, jobs, results, on_token)
      in_flight = dispatched

  def _cancel(self, cancelled, slots, pending, prefixes, to_insert, results
              ) -> collections.deque:
    """Ends the unfinished samples of the jobs ``cancelled`` names (``'cancelled'``): frees
    their slots (a step in flight skips them: its occupant is gone) and drops their pending
    samples and prefixes. Returns the pending samples left."""
    running = {j for j, _ in pending} | {occupant[0] for occupant in slots if occupant}
    stopped = {j for j in running if cancelled(j)}
    if not stopped:
      return pending
    for slot, occupant in enumerate(slots):
      if occupant is not None and occupant[0] in stopped:
        slots[slot] = None
    for j in stopped:
      for sample in results[j]:
        if sample.finish_reason is None:
          sample.finish_reason = 'cancelled'
          self.stats['cancelled_samples'] += 1
      to_insert[j] = 0
      prefixes.pop(j, None)
      for key in [key for key in prefixes if isinstance(key, tuple) and key[0] == j]:
        del prefixes[key]
    return collections.deque((j, i) for j, i in pending if j not in stopped)

  def _collect(self, in_flight, slots, jobs, results, on_token=None) -> None:
    """Appends a dispatched step's tokens to the samples it advanced; frees finished slots."""
    step, version, occupants = in_flight
    t0 = time.perf_counter()
    host = step.to_host()
    self.stats['decode_s'] += time.perf_counter() - t0
    for slot, occupant in enumerate(occupants):
      if occupant is None or slots[slot] != occupant:
        continue  # free at dispatch, or its sample finished at the step before
      j, i = occupant
      if not host.valid[slot]:
        raise RuntimeError(f'slot {slot} holds job {j} sample {i} but the engine reports it '
                           'inactive; host and device bookkeeping disagree.')
      self.stats['slot_steps'] += 1
      sample = results[j][i]
      if host.routes is not None:  # the token this step fed: the sample's last
        sample.routes.append(host.routes[slot])
      token = int(host.tokens[slot])
      sample.append(token, host.logprobs[slot], host.supports[slot], version)
      if host.done[slot]:
        sample.finish_reason = 'stop' if token in jobs[j].stop_ids else 'length'
        slots[slot] = None
      if on_token is not None:
        on_token(j, i, sample)

  def _fill(self, slots, pending, prefixes, to_insert, jobs, results, params, version,
            spec) -> None:
    """Inserts pending samples into the free slots, prefilling the prompts of jobs without a
    current prefix in one batch, and inserting from each prefix batch in one call."""
    e = self.engine
    free = [slot for slot, occupant in enumerate(slots) if occupant is None]
    if not self.continuous and len(free) < e.slots:
      return
    take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
    if not take:
      return
    # A prefill unit: a job (its new samples share the prompt's prefill) or, for a sample
    # continued from drawn tokens, (job, sample) (prompt + its tokens).
    unit = lambda j, i: (j, i) if results[j][i].tokens else j
    need = [u for u in dict.fromkeys(unit(j, i) for j, i in take) if u not in prefixes]
    if need:  # and, up to prefill_batch, the prompts of the next pending new samples
      ahead = set(need)
      for j, i in pending:
        if len(need) >= self.prefill_batch:
          break
        if not results[j][i].tokens and j not in prefixes and j not in ahead:
          need.append(j)
          ahead.add(j)
      t0 = time.perf_counter()
      sequences = [jobs[u].prompt_ids if isinstance(u, int) else
                   jobs[u[0]].prompt_ids + tuple(results[u[0]][u[1]].tokens) for u in need]
      prefix = e.prefill(params, sequences,
                         continuation=any(not isinstance(u, int) for u in need))
      self.stats['prefill_s'] += time.perf_counter() - t0
      self.stats['prefills'] += len(need)
      self.stats['prefill_calls'] += 1
      routes = None if prefix.routes is None else np.asarray(jax.device_get(prefix.routes))
      for row, u in enumerate(need):
        prefixes[u] = (version, prefix, row, routes)
    groups: dict[int, tuple[Any, int, list]] = {}
    for slot, (j, i) in zip(free, take):
      u = unit(j, i)
      prefix_version, prefix, row, routes = prefixes[u]
      groups.setdefault(id(prefix), (prefix, prefix_version, []))[2].append(
          (slot, j, i, row, len(results[j][i].tokens)))
      if routes is not None:  # the prompt's and a continuation's drawn tokens' routing
        sample, length = results[j][i], len(jobs[j].prompt_ids)
        sample.prompt_routes = routes[row, :length]
        sample.routes = list(routes[row, length:length + len(sample.tokens)])
      if isinstance(u, int):
        to_insert[j] -= 1
        if to_insert[j] == 0:
          del prefixes[u]
      else:
        del prefixes[u]
    for prefix, prefix_version, entries in groups.values():
      inserts = [Insert(row=row, slot=slot, key=jobs[j].keys[i],
                        max_new_tokens=jobs[j].max_new_tokens, stop_ids=jobs[j].stop_ids,
                        offset=offset)
                 for slot, j, i, row, offset in entries]
      self.state, first = e.insert(prefix, self.state, inserts, spec)
      first = first.to_host()
      self.stats['inserts'] += len(inserts)
      for k, (slot, j, i, _, _) in enumerate(entries):
        token = int(first.tokens[k])
        results[j][i].append(token, first.logprobs[k], first.supports[k], prefix_version)
        if first.done[k]:
          results[j][i].finish_reason = 'stop' if token in jobs[j].stop_ids else 'length'
        else:
          slots[slot] = (j, i)


def generate(model, params, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *,
             max_new_tokens: int, stop_ids: Sequence[int] = (), seed: int = 0,
             slots: int | None = None, mesh=None, engine: Engine | None = None
             ) -> list[Sample]:
  """One sample per prompt (token ids), through an engine and driver built for the call.

  A convenience for scripts and tests; the RL path uses ``InferenceWorker``. Sample ``i``
  draws with ``fold_in(key(seed), i)``. ``engine`` reuses a built engine (and its
  compilations); otherwise one with ``slots`` (default: one per prompt) is built on ``mesh``
  (default: the first device).
  """
  if not prompts:
    raise ValueError('generate needs at least one prompt.')
  if engine is None:
    # pylint: disable=import-outside-toplevel
    from rlax_llm.sharding import make_mesh
    mesh = mesh or make_mesh({'data': 1}, jax.devices()[:1])
    longest = max(len(p) for p in prompts)
    engine = Engine(model, mesh, slots=slots or len(prompts), max_prefill_length=longest,
                    max_decode_length=max_new_tokens, pad_id=0)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  root = jax.random.key(seed)
  jobs = [Job(p, 1, spec, max_new_tokens, stop_ids,
              np.asarray(jax.random.key_data(jax.random.fold_in(root, i)))[None])
          for i, p in enumerate(prompts)]
  return [samples[0] for samples in Driver(engine, holder).run(jobs)]
