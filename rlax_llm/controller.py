"""The controller: the one active part, scheduling the RL loop deterministically.

It owns the data order (a grain dataset of prompt batches and its iterator position), the RNG
(one root key; batch ``i`` samples with ``fold_in(root, i)``), the step counter and the
staleness schedule; the trainer and the inference workers act only when it calls them,
through typed interfaces (``GenerationRequest``s in, ``Rollouts`` out, ``TrainBatch`` to the
trainer) and through *handles* whose calls return futures, so the same code drives roles in
this process (``rlax_llm.backends.local``) or in Ray actors (``rlax_llm.backends.ray``).
Everything it must remember to resume is one ``ControllerState``.

The controller moves version numbers, never weights: the trainer pushes each new version to
the parameter server itself, and each ``generate`` call names the version the schedule
chose, which the worker pulls from the server itself (``InferenceWorker.generate_at``). The
controller holds no server and never asks a role for its params; it only adds up the pull
figures (``sync/...``) the workers report with their rollouts, in the fixed order it gathers
them.

The schedule (which version samples which batch, when a batch launches, what is trained,
recycled, padded, carried or dropped: RLAX's ``(j, k)`` staleness, dynamic sampling, prompt
replay, APRIL's partial rollouts) is decided by the pure functions of ``rlax_llm.schedule``;
this module runs it: launches batches, gathers and scores their rollouts, trains, evaluates,
checkpoints.

Deterministic asynchrony: every decision is a function of the schedule and of results the
controller waits for in a fixed order, never of which thread finishes first. An asynchronous
run therefore gives the same metrics and params whatever the timing, on every backend; only
``time/...`` metrics differ. The exception is the optional free-running mode
(``staleness.schedule='free'``, ``rlax_llm.schedule``): ``generate`` names no version
(``FollowLatest(j)``), the workers follow the server between decode steps, and which version
draws which token depends on timing; the acceptance window ``k`` is then enforced when a
batch is trained, and ``sampling_version`` reports the batch's oldest token's version.

Environment runs (``settings.episodes``; docs/environments.md, "Training on an
environment"): each prompt is an environment seed; the workers ``play`` its ``group_size``
episodes where they would ``generate`` completions (same keys, versions, chunks and
failure handling), the environment's returns are the rewards (no verifier), advantages come
from ``advantage_estimator`` (a group estimator over returns, or a multi-turn one broadcast
to the turns' tokens, ``[B, T]``), and held-out evaluation is greedy episode success.
Episodes in flight at a checkpoint are not stored: they are played again on resume with the
same keys and version.

Worker failures: a worker whose call raises, or returns nothing within ``worker_timeout_s``,
is retired and its requests re-issued to a live one (same keys, same version: the same
rollouts); the run goes on and reports the loss. A backend that restarts a lost worker
process (Ray) retries its call there; the worker reports the restart with its rollouts
(``workers/restarts``, and an event). Checkpoints: the controller decides when to save and
hands its state to the trainer, whose process writes it with the weights
(``TrainerHandle.save``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from rlax_llm import console, losses, rewards, schedule
from rlax_llm.data import prompt_dataset
from rlax_llm.data_types import (
  TERMINATIONS,
  FollowLatest,
  GenerationRequest,
  Rollouts,
  TrainBatch,
  Trajectory,
  make_train_batch,
  make_trajectory_batch,
)
from rlax_llm.errors import NonFiniteError
from rlax_llm.evaluation import evaluate_policy
from rlax_llm.metrics import MetricsWriter
from rlax_llm.sampling_spec import GREEDY
from rlax_llm.schedule import ControllerSettings
from rlax_llm.tasks import Prompt, Task
from rlax_llm.verifiers import score_rollouts


class Future(Protocol):
  def result(self, timeout: float | None = None) -> Any:
    ...


class TrainerHandle(Protocol):
  """The trainer role as the controller sees it (calls return futures, run in order).
  ``version``: the updates it applied; each ``step`` that makes a new version pushes it to
  the parameter server before its future resolves (the trainer does, not the controller)."""

  version: int

  def step(self, batch) -> Future:  # -> metrics dict
    ...

  def save(self, step: int, controller: dict[str, Any],
           rollouts: dict[str, dict[str, np.ndarray]]) -> Future:  # -> None
    """Checkpoints the run after ``step`` in the trainer's process: its params, optimizer
    state and counters with the controller's state (``ControllerState.to_dict()``) and the
    rollouts' arrays (``Controller.snapshot``), as one step (``rlax_llm.checkpoint``). The
    future resolves once the save has started (the files are written in the background)."""


class WorkerHandle(Protocol):
  """An inference worker as the controller sees it (calls return futures, run in order)."""

  def generate(self, requests: Sequence[GenerationRequest], rng_data: np.ndarray,
               version: int | FollowLatest, stop_after: int | None = None, first: int = 0
               ) -> Future:  # -> Rollouts
    """``InferenceWorker.generate_at``: sample with weights ``version``, which the worker
    pulls from the parameter server itself when it does not hold them (the figures of that
    pull in the rollouts' ``timings``, under ``sync/``); ``FollowLatest(j)``: free-running,
    with the newest weights, pulled between decode steps too."""

  def play(self, requests: Sequence[GenerationRequest], rng_data: np.ndarray, version: int,
           first: int = 0) -> Future:  # -> (list[Trajectory], dict[str, float])
    """An environment run's ``generate`` (``roles.play_requests``): plays each request's
    ``num_samples`` episodes of the environment seed its prompt stands for with weights
    ``version`` (pulled by the worker itself), keys as ``generate`` draws them; returns the
    trajectories and the runner's figures (``sync/`` keys: the pull's)."""

  def retire(self) -> None:
    ...


@dataclasses.dataclass
class ControllerState:
  """Everything the controller needs to continue a run exactly (what a snapshot stores).

  Attributes:
    step: RL steps completed (updates attempted).
    data: the prompt iterator's position (grain iterator state).
    rng: the root PRNG key's data (uint32 array); batch ``i`` uses ``fold_in(root, i)``.
    trainer_version: the version the trainer's params are at.
    worker_version: the version the first inference worker holds (-1: none yet).
    start_accuracy: held-out accuracy of the RL starting point (None until measured).
    accuracy: the latest held-out accuracy (None until measured).
    step_versions: the version after each step so far (``[s]``: after ``s`` steps).
    counters: the run's running counts (``workers/lost``, the workers' pulls ``sync/...``).
    events: what went wrong and was survived (lost workers), in order.
    inflight: batches generated ahead of the trainer: ``{'index', 'version', 'prompts',
      'rollouts'}`` (prompts as dicts, the rollouts' JSON part; their arrays are stored
      apart, under ``inflight_<n>``).
    recycled: recycled groups: ``{'version', 'rollouts'}`` (arrays under ``recycled_<n>``).
    unfinished: partial groups to continue: ``{'prompt', 'rollouts'}`` (arrays under
      ``unfinished_<n>``).
    replay: the replay pool's prompts (as dicts), oldest first.
  """

  step: int
  data: dict[str, Any]
  rng: np.ndarray
  trainer_version: int = 0
  worker_version: int = -1
  start_accuracy: float | None = None
  accuracy: float | None = None
  step_versions: list[int] = dataclasses.field(default_factory=lambda: [0])
  counters: dict[str, float] = dataclasses.field(default_factory=dict)
  events: list[str] = dataclasses.field(default_factory=list)
  inflight: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  recycled: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  unfinished: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  replay: list[dict[str, Any]] = dataclasses.field(default_factory=list)

  def to_dict(self) -> dict[str, Any]:
    """JSON-friendly form (``rng`` as a list of ints)."""
    return dict(dataclasses.asdict(self), rng=np.asarray(self.rng).tolist())

  @classmethod
  def from_dict(cls, state: dict[str, Any]) -> 'ControllerState':
    return cls(**dict(state, rng=np.asarray(state['rng'], np.uint32)))


@dataclasses.dataclass
class _Batch:
  """A batch in flight: its prompts, the version sampling it and the futures of its chunks."""

  index: int
  version: int | None  # None: free-running (the workers follow the server)
  prompts: list[Prompt]
  chunks: list[tuple[int, list[GenerationRequest], Any]]  # (worker, requests, future)
  stop_after: int = 0  # APRIL: the batch stops when this many groups finished (0: never)
  carried: int = 0  # groups carried in from earlier batches (the first ones)
  restarted: int = 0  # of those, regenerated from scratch (too stale to continue)
  replayed: int = 0  # prompts re-asked from the replay pool (after the carried ones)


def _done(value) -> concurrent.futures.Future:
  future = concurrent.futures.Future()
  future.set_result(value)
  return future


class Controller:
  """Runs ``total_steps`` RL updates under the ``(j, k)`` schedule; see the module docstring.

  Args:
    settings: the schedule.
    task: prompts and verifier.
    trainer: a ``TrainerHandle`` whose ``version`` counts its applied updates.
    workers: ``WorkerHandle``s (at least one).
    writer: metrics (and the ledger).
    checkpoints: a ``rlax_llm.checkpoint.SaveSchedule``, or None for no checkpoints: the
      controller asks the trainer to save (``TrainerHandle.save``) after steps it says are
      due, after the last step, and when ``stop`` is set.
    stop: an event (set by ``checkpoint.PreemptionGuard`` on SIGTERM/SIGINT): after the
      current step the controller saves a checkpoint and returns, ``summary['preempted']``
      True.
  """

  def __init__(self, settings: ControllerSettings, task: Task, trainer, workers: Sequence,
               writer: MetricsWriter, checkpoints=None, stop: threading.Event | None = None):
    if not workers:
      raise ValueError('the controller needs at least one inference worker.')
    self.settings = settings
    self.task = task
    self.trainer = trainer
    self.workers = list(workers)
    self.alive = [True] * len(self.workers)
    self.writer = writer
    self.step = 0
    self._prompts = iter(prompt_dataset(task, 1).to_iter_dataset())
    self._root_key = jax.random.key(settings.seed)
    self._eval_prompts = task.eval_prompts()
    # Reward shaping (rlax_llm.rewards): None trains on the verifier's reward as it is.
    self._reward_components = (rewards.make_components(settings.reward, task,
                                                       settings.max_new_tokens)
                               if settings.reward else None)
    self.start_accuracy: float | None = None
    self._start_eval: dict[str, float] = {}
    self.accuracy: float | None = None
    # The version each worker will hold once its queued calls have run (the controller knows
    # it: each call names the version the worker pulls).
    self._worker_versions = [-1] * len(self.workers)
    self._recycled: list[tuple[int, Rollouts]] = []  # (oldest token version, one group)
    self._unfinished: list[tuple[Prompt, Rollouts]] = []  # partial groups to continue
    # Prompts whose last group had unequal rewards, re-asked by later batches (oldest first).
    self._replay: collections.deque[Prompt] = collections.deque(
        maxlen=settings.replay_capacity)
    self.events: list[str] = []
    self.counters = collections.Counter()
    self._busy_s = 0.0
    self._run_start = None
    self.step_versions = [trainer.version]  # [s]: the version after s steps
    self.checkpoints = checkpoints
    self.stop = stop
    self._restored_inflight: list[_Batch] = []
    # The oldest version whose weights exist after a restore (the checkpoint holds only the
    # trainer's); -1: no restore, every version the schedule names was pushed.
    self._oldest_held = -1

  # ----------------------------------------------------------------------------- state

  def state(self) -> ControllerState:
    """The controller's state now (copy)."""
    return ControllerState(
        step=self.step, data=dict(self._prompts.get_state()),
        rng=np.asarray(jax.random.key_data(self._root_key)),
        trainer_version=self.trainer.version, worker_version=self._worker_versions[0],
        start_accuracy=self.start_accuracy, accuracy=self.accuracy,
        step_versions=list(self.step_versions), counters=dict(self.counters),
        events=list(self.events), replay=[p.to_dict() for p in self._replay])

  def snapshot(self, in_flight: Sequence[_Batch]
               ) -> tuple[ControllerState, dict[str, dict[str, np.ndarray]]]:
    """The state to checkpoint, waiting for the batches in flight (their rollouts are stored,
    and ``in_flight`` is switched to the stored results, so nothing is generated twice).
    Returns ``(state, arrays)``: the rollouts' arrays by name (``inflight_<n>``,
    ``recycled_<n>``)."""
    state = self.state()
    arrays = {}
    for n, batch in enumerate(in_flight):
      if self.settings.episodes is not None:  # regenerated on resume (same keys, version)
        state.inflight.append({'index': batch.index, 'version': batch.version,
                               'prompts': [p.to_dict() for p in batch.prompts]})
        continue
      rollouts = Rollouts.concatenate(self._gather(batch, self._sampling_root(batch.index)))
      batch.chunks = [(batch.chunks[0][0], [], _done(rollouts))]
      arrays[f'inflight_{n}'], meta = rollouts.to_state()
      state.inflight.append({'index': batch.index, 'version': batch.version,
                             'prompts': [p.to_dict() for p in batch.prompts],
                             'rollouts': meta, 'stop_after': batch.stop_after,
                             'carried': batch.carried, 'restarted': batch.restarted,
                             'replayed': batch.replayed})
    for n, (version, group) in enumerate(self._recycled):
      arrays[f'recycled_{n}'], meta = group.to_state()
      state.recycled.append({'version': version, 'rollouts': meta})
    for n, (prompt, group) in enumerate(self._unfinished):
      arrays[f'unfinished_{n}'], meta = group.to_state()
      state.unfinished.append({'prompt': prompt.to_dict(), 'rollouts': meta})
    return state, arrays

  def restore(self, state: ControllerState,
              arrays: dict[str, dict[str, np.ndarray]] | None = None) -> None:
    """Continues from ``state`` (with the in-flight and recycled rollouts' ``arrays``, as
    ``snapshot`` returned them). The trainer must already hold the params of
    ``state.trainer_version``; workers are reloaded as the schedule needs."""
    if self.trainer.version != state.trainer_version:
      raise ValueError(f'the trainer holds version {self.trainer.version} but the controller '
                       f'state expects {state.trainer_version}; restore the matching params '
                       'first.')
    self.step = state.step
    self._oldest_held = state.trainer_version
    self._prompts.set_state(state.data)
    self._root_key = jax.random.wrap_key_data(np.asarray(state.rng, np.uint32))
    self.start_accuracy = state.start_accuracy
    self.accuracy = state.accuracy
    self.step_versions = list(state.step_versions)
    self.counters = collections.Counter(state.counters)
    self.events = list(state.events)
    arrays = arrays or {}
    self._restored_inflight = []
    for n, batch in enumerate(state.inflight):
      if 'rollouts' not in batch:  # an environment run's: regenerated when the run starts
        self._restored_inflight.append(_Batch(
            index=batch['index'], version=batch['version'],
            prompts=[Prompt.from_dict(p) for p in batch['prompts']], chunks=[]))
        continue
      rollouts = Rollouts.from_state(arrays[f'inflight_{n}'], batch['rollouts'])
      self._restored_inflight.append(_Batch(
          index=batch['index'], version=batch['version'],
          prompts=[Prompt.from_dict(p) for p in batch['prompts']],
          chunks=[(0, [], _done(rollouts))], stop_after=batch.get('stop_after', 0),
          carried=batch.get('carried', 0), restarted=batch.get('restarted', 0),
          replayed=batch.get('replayed', 0)))
    self._recycled = [(group['version'],
                       Rollouts.from_state(arrays[f'recycled_{n}'], group['rollouts']))
                      for n, group in enumerate(state.recycled)]
    self._unfinished = [(Prompt.from_dict(group['prompt']),
                         Rollouts.from_state(arrays[f'unfinished_{n}'], group['rollouts']))
                        for n, group in enumerate(state.unfinished)]
    self._replay = collections.deque((Prompt.from_dict(p) for p in state.replay),
                                     maxlen=self.settings.replay_capacity)

  # ------------------------------------------------------------------------ scheduling

  def _live_workers(self) -> list[int]:
    live = [w for w, ok in enumerate(self.alive) if ok]
    if not live:
      raise RuntimeError('every inference worker has been lost: ' + '; '.join(self.events))
    return live

  def _submit(self, worker: int, requests: list[GenerationRequest], root: jax.Array,
              version: int | None, stop_after: int | None = None, first: int = 0):
    """Queues ``requests`` on ``worker`` with weights ``version`` (a number: the worker pulls
    the weights from the parameter server itself; None: free-running, ``FollowLatest``);
    ``root``, ``first``, ``stop_after``: the batch's sampling key, the index of
    ``requests[0]`` in the batch and APRIL's stop (see ``InferenceWorker.generate``)."""
    if version is None:
      named = FollowLatest(self.settings.staleness_j)
    else:
      named = self._worker_versions[worker] = version
    if self.settings.episodes is not None:  # an environment run: episodes, not completions
      return self.workers[worker].play(requests, np.asarray(jax.random.key_data(root)), named,
                                       first)
    return self.workers[worker].generate(requests, np.asarray(jax.random.key_data(root)),
                                         named, stop_after, first)

  def _count_pulls(self, result):
    """Adds the figures of the pull a worker made for ``result`` (``Rollouts``: their
    ``sync/`` timings; an environment run's ``(trajectories, figures)``: its figures) and a
    restart it reports (``workers/restarts``: its process was lost and restarted by the
    backend; recorded as an event) to the counters and returns the result without them (so
    they count once)."""
    if not isinstance(result, Rollouts):
      trajectories, figures = result
      return trajectories, self._count_figures(figures)
    timings = self._count_figures(result.timings)
    if len(timings) == len(result.timings):
      return result
    return dataclasses.replace(result, timings=timings)

  def _count_figures(self, figures: dict[str, float]) -> dict[str, float]:
    """``figures`` without the pull's and restart's, which are added to the counters."""
    pulled = {k: v for k, v in figures.items() if k.startswith(('sync/', 'workers/'))}
    if not pulled:
      return figures
    if pulled.get('workers/restarts'):
      message = (f'an inference worker\'s process was lost and restarted before step '
                 f'{self.step + 1}; it pulled its version again and its call was retried')
      logging.warning(message)
      self.events.append(message)
    self.counters.update(pulled)
    return {k: v for k, v in figures.items() if k not in pulled}

  def _sampling_root(self, index: int) -> jax.Array:
    """The key batch ``index`` samples with: request ``i`` of the batch draws from
    ``fold_in(root, i)`` whichever worker runs it, so a run's rollouts do not depend on how
    many workers it has or which of them is lost. (``fold_in(..., 0)``: the key a batch's
    first chunk had when each chunk folded its own; single-worker runs kept their keys.)"""
    return jax.random.fold_in(jax.random.fold_in(self._root_key, index), 0)

  def _launch(self, batch: _Batch, root: jax.Array,
              resumes: Sequence[Rollouts | None] = ()) -> _Batch:
    """Submits ``batch``'s requests in contiguous chunks, one per live worker
    (``schedule.chunk_bounds``); ``root``: the batch's sampling key (``_sampling_root``);
    ``resumes[g]``: the rows so far of group ``g`` when it continues a partial group."""
    s = self.settings
    resumes = list(resumes) + [None] * (len(batch.prompts) - len(resumes))
    requests = [GenerationRequest(p, s.group_size, s.sampling, s.max_new_tokens, resume=r)
                for p, r in zip(batch.prompts, resumes)]
    live = self._live_workers()
    for worker, (start, end) in zip(live, schedule.chunk_bounds(len(requests), len(live))):
      part = requests[start:end]
      batch.chunks.append((worker, part, self._submit(
          worker, part, root, batch.version, self._chunk_stop(batch, part), first=start)))
    return batch

  @staticmethod
  def _chunk_stop(batch: _Batch, part: Sequence[GenerationRequest]) -> int | None:
    return schedule.chunk_stop(batch.stop_after, len(part), len(batch.prompts))

  def _gather(self, batch: _Batch, root: jax.Array) -> list[Rollouts]:
    """The chunks' rollouts in order; a failed or silent worker is retired and its chunk
    re-issued to a live one (same keys, same version: the same rollouts). ``root``: the
    key the batch was launched with."""
    out = []
    for n, (worker, requests, future) in enumerate(batch.chunks):
      while True:
        try:
          out.append(self._count_pulls(future.result(timeout=self.settings.worker_timeout_s)))
          break
        except Exception as e:  # pylint: disable=broad-except
          if self.alive[worker]:  # the first failure seen from this worker: retire it
            reason = ('no answer within worker_timeout_s='
                      f'{self.settings.worker_timeout_s} s'
                      if isinstance(e, concurrent.futures.TimeoutError | TimeoutError)
                      else f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}')
            message = (f'inference worker {worker} was lost during batch {batch.index} '
                       f'({reason}); its requests were re-issued to the other workers')
            logging.error(message)
            self.events.append(message)
            self.counters['workers/lost'] += 1
            self.alive[worker] = False
            self.workers[worker].retire()
          self.counters['workers/reissued_chunks'] += 1
          live = self._live_workers()
          worker = live[n % len(live)]
          first = sum(len(part) for _, part, _ in batch.chunks[:n])
          future = self._submit(worker, requests, root, batch.version,
                                self._chunk_stop(batch, requests), first)
    return out

  # --------------------------------------------------------------------------- evaluate

  def evaluate(self) -> dict[str, float]:
    """Held-out metrics of the trainer's current version (``rlax_llm.evaluate``: greedy
    ``eval/accuracy``; with ``eval_samples`` mean@k and pass@k), generated on a live worker;
    an environment run's: greedy episode success (``_evaluate_episodes``)."""
    if self.settings.episodes is not None:
      return self._evaluate_episodes()
    version = self.trainer.version

    def generate(requests, key):
      worker = self._live_workers()[0]
      batch = _Batch(index=-1, version=version, prompts=[r.prompt for r in requests],
                     chunks=[(worker, requests, self._submit(worker, requests, key, version))])
      return self._gather(batch, key)[0]

    return evaluate_policy(self.task, self._eval_prompts, generate,
                           sampling=self.settings.sampling, samples=self.settings.eval_samples,
                           max_new_tokens=self.settings.max_new_tokens, key=self._root_key)

  # -------------------------------------------------------------------------------- run

  def run(self) -> dict[str, float]:
    """Runs the loop to ``total_steps``. Returns the summary (also written to the workdir).

    Raises ``NonFiniteError`` naming the step when the trainer's updates diverge.
    """
    s = self.settings
    if self.start_accuracy is None:
      start = self.evaluate()
      self.start_accuracy = self.accuracy = start['eval/accuracy']
      logging.info('RL starting point: %s', start)
      # Logged with the first step's metrics as eval/start_accuracy, eval/start_pass@k, ...
      self._start_eval = {k.replace('eval/', 'eval/start_', 1): v for k, v in start.items()}
    self._run_start = time.perf_counter()
    in_flight: collections.deque[_Batch] = collections.deque(
        batch if batch.chunks else self._launch(batch, self._sampling_root(batch.index))
        for batch in self._restored_inflight)
    self._restored_inflight = []
    next_batch = self.step + len(in_flight)
    preempted = False
    if self.step < s.total_steps:
      console.phase('compiling the first RL step (this takes a minute on CPU for a real model)')
    while self.step < s.total_steps:
      started = time.perf_counter()
      # Launch every batch whose sampling params exist (at most k ahead: the schedule).
      while schedule.launch_due(next_batch, self.step, s):
        in_flight.append(self._launch_step(next_batch))
        next_batch += 1
      metrics = self._train_step(in_flight.popleft(), queued=len(in_flight), started=started)
      self.writer.write(self.step, metrics)
      preempted = self.stop is not None and self.stop.is_set()
      if self.checkpoints is not None and (
          preempted or self.step == s.total_steps or self.checkpoints.due(self.step)):
        self.save(in_flight)
      if preempted:
        logging.warning('preempted: stopped after step %d of %d%s.', self.step,
                        s.total_steps, '; the checkpoint is saved, relaunch with the same '
                        '--workdir to resume' if self.checkpoints is not None else '')
        break
    if self.events:
      logging.warning('the run finished despite: %s', '; '.join(self.events))
    return {
        'preempted': preempted,
        'steps': self.step,
        'eval/start_accuracy': self.start_accuracy,
        'eval/final_accuracy': self.accuracy,
        'eval/improvement': self.accuracy - self.start_accuracy,
        'time/rl_s': time.perf_counter() - self._run_start,
        'workers/lost': self.counters['workers/lost'],
        'workers/restarts': self.counters['workers/restarts'],
        'events': list(self.events),
    }

  def save(self, in_flight: Sequence[_Batch]) -> None:
    """Checkpoints the run after ``self.step``: the trainer's process writes its params and
    optimizer state with the controller's state and the rollouts in flight, as one step
    (``TrainerHandle.save``); the controller hands over only its own state."""
    state, arrays = self.snapshot(in_flight)
    self.trainer.save(self.step, state.to_dict(), arrays).result()
    self.checkpoints.saved()

  def _launch_step(self, index: int) -> _Batch:
    """Launches batch ``index``: partial groups carried from earlier batches first (continued,
    or restarted when they could be too stale at step ``index``), then prompts re-asked from
    the replay pool (``replay``), then new prompts from the stream."""
    s = self.settings
    count = s.requested_groups
    carried, self._unfinished = self._unfinished[:count], self._unfinished[count:]
    # At step ``index`` the trainer's version is at most one per step above today's.
    goes_on = schedule.continue_carried([group.oldest_version for _, group in carried],
                                        self.trainer.version + (index - self.step),
                                        s.staleness_k)
    # A group too stale to continue is regenerated with this batch's keys.
    resumes = [group if go else None for (_, group), go in zip(carried, goes_on)]
    prompts = [prompt for prompt, _ in carried]
    replayed = schedule.replay_count(len(self._replay), s.replay, count - len(carried))
    prompts += [self._replay.popleft() for _ in range(replayed)]
    prompts += [next(self._prompts)[0] for _ in range(count - len(prompts))]
    version = None if s.schedule == 'free' else self._held_version(self.step_versions[
        schedule.sampling_version(index, s.staleness_j, s.staleness_k)], index)
    batch = _Batch(index=index, version=version, prompts=prompts, chunks=[],
                   stop_after=s.stop_after_groups, carried=len(carried),
                   restarted=goes_on.count(False), replayed=replayed)
    return self._launch(batch, self._sampling_root(index), resumes)

  def _held_version(self, version: int, index: int) -> int:
    """``version``, or the restored one when the schedule names an older version after a
    restore. That happens only when a finished run is resumed with a larger ``total_steps``
    at ``k >= 2``: the uninterrupted longer run would have launched batch ``index`` before the
    save, with weights the checkpoint does not hold (it holds the trainer's only), so the
    extension samples it with the restored version instead, and says so. A preempted run
    never gets here: every batch it had launched is in the checkpoint."""
    if version >= self._oldest_held:
      return version
    logging.warning('batch %d would sample with version %d, which this resumed run does not '
                    'hold (total_steps was raised past the step the checkpoint was saved '
                    'at); it samples with the restored version %d.', index, version,
                    self._oldest_held)
    self.events.append(f'batch {index} sampled with version {self._oldest_held} instead of '
                       f'{version} (extended past the checkpoint)')
    return self._oldest_held

  def _select(self, batch: _Batch, rollouts: Rollouts) -> tuple[Rollouts, dict[str, float]]:
    """The groups to train on (``schedule.select_groups``: the acceptance window, dynamic
    sampling, recycling; recycled groups from earlier batches first) and their counts; None:
    skip the update."""
    informative = set(rollouts.informative_groups.tolist())
    groups = []
    for g in np.unique(rollouts.group_ids):
      group = rollouts.select(rollouts.group_ids == g)
      oldest = group.oldest_version  # a continued group holds tokens older than the batch
      groups.append((batch.version if oldest is None else oldest, group, g in informative))
    selection = schedule.select_groups(groups, self._recycled, self.trainer.version,
                                       self.settings)
    self._recycled = selection.recycled
    if selection.train is None:
      return None, selection.stats
    if (self.settings.oversample == 0
        and not selection.stats['rollout/dropped_stale_groups']):  # every group, as generated
      return rollouts, selection.stats
    return Rollouts.concatenate(selection.train), selection.stats

  def _train_step(self, batch: _Batch, queued: int, started: float) -> dict[str, float]:
    """Trains on ``batch``; ``started``: when this step's launches began. Its ``time/``
    metrics are wall seconds of this loop iteration: ``rollout_s`` from ``started`` until
    the batch's rollouts are scored (launching, which in the inline local backend is the
    generation itself, then waiting), ``train_s`` the update (and the trainer's push of the
    new version), ``step_s`` the
    whole iteration (evaluation included)."""
    s = self.settings
    if s.episodes is not None:
      return self._train_episodes(batch, queued, started)
    rollouts = Rollouts.concatenate(self._gather(batch, self._sampling_root(batch.index)))
    unfinished = rollouts.unfinished_groups
    for g in unfinished:  # APRIL: continued in the next batch launched
      self._unfinished.append((batch.prompts[g], rollouts.select(rollouts.group_ids == g)))
    if unfinished.size:
      rollouts = rollouts.select(~np.isin(rollouts.group_ids, unfinished))
    rollouts = score_rollouts(self.task, batch.prompts, rollouts)
    reward_parts = {}
    if self._reward_components is not None:  # train on the shaped reward, log each part
      total, reward_parts = rewards.shape_rewards(rollouts, self._reward_components,
                                                  batch.prompts)
      rollouts = dataclasses.replace(rollouts, rewards=total)
    t_rollout = time.perf_counter() - started
    if s.replay:  # prompts with a learning signal now are asked again by a later batch
      self._replay.extend(batch.prompts[g] for g in rollouts.informative_groups)
    trained, selection = self._select(batch, rollouts)
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
            'rollout/unfinished_groups': len(self._unfinished)}
           if s.stop_after_groups else {}),
        **({'rollout/replayed_groups': batch.replayed, 'rollout/replay_pool': len(self._replay)}
           if s.replay else {}),
        **self._start_eval,
    }
    self._start_eval = {}
    t1 = time.perf_counter()
    advantages = staleness = None  # for writer.write_rollouts (stay None without an update)
    if trained is not None:
      advantages = np.asarray(losses.group_advantages(
          trained.rewards, trained.group_ids, s.advantage_estimator))
      staleness = self._update(make_train_batch(trained, advantages), metrics)
    else:
      metrics.update({'staleness/mean': 0.0, 'staleness/max': 0.0, 'update/skipped': 1.0})
    t_train = time.perf_counter() - t1
    self.step += 1
    self.writer.write_rollouts(self.step, batch.prompts, rollouts, advantages, staleness)
    return self._end_step(batch, metrics, {
        # New prompts from the stream; APRIL's carried groups (continued or restarted) and
        # prompts re-asked from the replay pool apart.
        'prompt_ids': [p.prompt_id for p in batch.prompts[batch.carried + batch.replayed:]],
        **({'carried_prompt_ids': [p.prompt_id for p in batch.prompts[:batch.carried]]}
           if batch.carried else {}),
        **({'replayed_prompt_ids': [p.prompt_id for p in
                                    batch.prompts[batch.carried:batch.carried + batch.replayed]]}
           if batch.replayed else {}),
        'trained_prompt_ids': ([] if trained is None else
                               [int(i) for i in dict.fromkeys(trained.prompt_ids.tolist())]),
        'trained_versions': ([] if trained is None else
                             sorted({int(v) for v in np.unique(trained.versions) if v >= 0}))},
        started=started, t_rollout=t_rollout, t_train=t_train, queued=queued,
        tokens_per_s=rollouts.timings.get('tokens_per_s', 0.0))

  def _update(self, train_batch, metrics: dict[str, float]) -> np.ndarray:
    """Trains on ``train_batch`` (a ``TrainBatch``), after checking the staleness bound;
    adds the staleness and the trainer's metrics to ``metrics``. Returns the staleness of
    every trained token."""
    s = self.settings
    versions = np.asarray(train_batch.versions)
    staleness = self.trainer.version - versions[versions >= 0]
    too_stale = int(np.sum(staleness >= s.staleness_k))
    if too_stale:  # the schedule makes this impossible; the check guards the invariant.
      raise RuntimeError(f'{too_stale} tokens exceed the staleness bound k={s.staleness_k}.')
    try:
      train_metrics = self.trainer.step(train_batch).result()
    except NonFiniteError as e:
      raise NonFiniteError(f'RL step {self.step + 1}: {e}') from None
    metrics.update({
        'staleness/mean': float(staleness.mean()) if staleness.size else 0.0,
        'staleness/max': float(staleness.max()) if staleness.size else 0.0,
        **{f'staleness/frac_{d}': float(np.mean(staleness == d))
           for d in range(s.staleness_k)},
        **train_metrics,
    })
    return staleness

  def _end_step(self, batch: _Batch, metrics: dict[str, float], ledger: dict[str, Any], *,
                started: float, t_rollout: float, t_train: float, queued: int,
                tokens_per_s: float) -> dict[str, float]:
    """What every step ends with, once ``self.step`` counts it: the ledger row (``ledger``
    adds to the batch, its sampling version and the trainer's version), the evaluation when
    due, the counters and the ``time/`` metrics."""
    s = self.settings
    self._busy_s += t_train
    self.step_versions.append(self.trainer.version)
    metrics['version'] = self.trainer.version
    self.writer.ledger(self.step, {
        'batch': batch.index, 'sampling_version': metrics['sampling_version'], **ledger,
        'version': self.trainer.version})
    last = self.step == s.total_steps
    if schedule.eval_due(self.step, s):
      evaluation = self.evaluate()
      self.accuracy = evaluation['eval/accuracy']
      metrics.update(evaluation)
    if last:
      metrics['eval/start_accuracy'] = self.start_accuracy
      metrics['eval/final_accuracy'] = self.accuracy
      metrics['eval/improvement'] = self.accuracy - self.start_accuracy
    metrics.update({
        'sync/updates': self.counters['sync/updates'],
        'sync/bytes': float(self.counters['sync/bytes']),
        'sync/full_bytes': float(self.counters['sync/full_bytes']),
        'sync/density': self.counters['sync/changed'] / max(1, self.counters['sync/elements']),
        'workers/lost': self.counters['workers/lost'],
        'workers/restarts': self.counters['workers/restarts'],
        'time/rollout_s': t_rollout, 'time/train_s': t_train,
        'time/queued_batches': queued,
        'time/trainer_busy_fraction': self._busy_s / (time.perf_counter() - self._run_start),
        'time/step_s': time.perf_counter() - started,
        'time/rollout_tokens_per_s': tokens_per_s,
    })
    return metrics

  # ------------------------------------------------------------------ environment runs

  def _train_episodes(self, batch: _Batch, queued: int, started: float) -> dict[str, float]:
    """``_train_step`` of an environment run: the batch's episodes (``group_size`` per
    environment seed) with the environment's rewards, advantages from
    ``rl.advantage_estimator`` (``_episode_batch``), one update."""
    trajectories, figures = self._played(batch, self._sampling_root(batch.index))
    t_rollout = time.perf_counter() - started
    returns = np.asarray([x.episode_return for x in trajectories])
    metrics = {'reward/mean': float(returns.mean()), 'reward/std': float(returns.std()),
               **_episode_metrics(trajectories, 'episode/'),
               **{f'termination/{reason}': float(np.mean([x.termination == reason
                                                          for x in trajectories]))
                  for reason in TERMINATIONS},
               'sampling_version': batch.version, **self._start_eval}
    self._start_eval = {}
    t1 = time.perf_counter()
    self._update(self._episode_batch(trajectories), metrics)
    t_train = time.perf_counter() - t1
    self.step += 1
    played = [x.prompt_id for x in trajectories]
    return self._end_step(batch, metrics, {
        'prompt_ids': [p.prompt_id for p in batch.prompts],
        'trained_prompt_ids': [int(i) for i in dict.fromkeys(played)],
        'trained_versions': sorted({int(v) for x in trajectories
                                    for v in np.unique(x.versions) if v >= 0})},
        started=started, t_rollout=t_rollout, t_train=t_train, queued=queued,
        tokens_per_s=figures.get('model_tokens', 0.0) / max(figures.get('wall_s', 0.0), 1e-9))

  def _played(self, batch: _Batch, root: jax.Array) -> tuple[list, dict[str, float]]:
    """The trajectories of ``batch``'s chunks in order and their runners' figures, summed
    (``wall_s``: the longest chunk's)."""
    trajectories, figures = [], collections.Counter()
    for part, stats in self._gather(batch, root):
      trajectories += part
      figures.update({k: v for k, v in stats.items() if k != 'wall_s'})
      figures['wall_s'] = max(figures['wall_s'], stats.get('wall_s', 0.0))
    return trajectories, dict(figures)

  def _episode_batch(self, trajectories: list[Trajectory]) -> TrainBatch:
    """The trainer's rows of ``trajectories``, ``episodes.length`` wide (one shape every
    step), with their advantages: ``rl.advantage_estimator`` a group estimator
    (``losses.ESTIMATORS``, e.g. GRPO over episode returns: ``[B]``) or a multi-turn one
    (``losses.TURN_ESTIMATORS``: per-turn advantages broadcast to the turns' tokens,
    ``[B, T]``). Environment state keys become dense ids per batch (``losses.multi_turn``)."""
    s = self.settings
    e = s.episodes
    returns = np.asarray([x.episode_return for x in trajectories], np.float32)
    group_ids = np.asarray([x.group_id for x in trajectories], np.int32)
    if s.advantage_estimator not in losses.TURN_ESTIMATORS:
      advantages = np.asarray(losses.group_advantages(returns, group_ids,
                                                      s.advantage_estimator))
      return make_trajectory_batch(trajectories, advantages, length=e.length).train
    packed = make_trajectory_batch(trajectories, np.zeros(len(trajectories), np.float32),
                                   length=e.length)
    _, dense = np.unique(packed.state_ids, return_inverse=True)
    per_turn = losses.turn_advantages(
        s.advantage_estimator, episode_returns=packed.episode_returns, group_ids=group_ids,
        turn_rewards=packed.turn_rewards, turn_mask=packed.turn_mask,
        state_ids=dense.reshape(packed.state_ids.shape).astype(np.int32), gamma=e.gamma,
        omega=e.omega, norm=e.norm)
    tokens = losses.broadcast_turn_advantages(per_turn, packed.token_turn)
    return packed.train.replace(advantages=np.asarray(tokens, np.float32))

  def _evaluate_episodes(self) -> dict[str, float]:
    """Held-out episode success of the trainer's current version: one greedy episode per
    held-out seed (``agent.num_eval`` from ``agent.eval_seed_start``) on a live worker.
    ``eval/accuracy`` is ``eval/success`` (what the summary reports)."""
    version = self.trainer.version
    requests = [GenerationRequest(p, 1, GREEDY, self.settings.max_new_tokens)
                for p in self._eval_prompts]
    worker = self._live_workers()[0]
    batch = _Batch(index=-1, version=version, prompts=list(self._eval_prompts), chunks=[
        (worker, requests, self._submit(worker, requests, self._root_key, version))])
    trajectories, _ = self._played(batch, self._root_key)
    metrics = _episode_metrics(trajectories, 'eval/')
    return {'eval/accuracy': metrics['eval/success'], **metrics}


def _episode_metrics(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
  """Episodes in figures, each under ``prefix``: ``return``, ``turns`` and ``success`` (means
  over the episodes) and ``env_tokens`` (the mean count of tokens fed between turns, with
  loss mask 0)."""
  first_turn = [int(x.turn_starts[0]) if x.num_turns else len(x.tokens) for x in trajectories]
  return {
      f'{prefix}return': float(np.mean([x.episode_return for x in trajectories])),
      f'{prefix}turns': float(np.mean([x.num_turns for x in trajectories])),
      f'{prefix}success': float(np.mean([x.success for x in trajectories])),
      f'{prefix}env_tokens': float(np.mean([
          int((~x.loss_mask[start:]).sum()) for x, start in zip(trajectories, first_turn)])),
  }
