"""The controller's loop: launch, gather, train, evaluate, checkpoint; written once over a
``RolloutKind`` (see the package docstring, ``rlax_llm.controller``)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm import console, distributed, schedule
from rlax_llm.checkpoint import PreemptionGuard, StepAbandoned
from rlax_llm.controller.completions import Completions
from rlax_llm.controller.episodes import Episodes
from rlax_llm.controller.protocols import Batch, Made, RolloutKind, TrainerHandle, WorkerHandle
from rlax_llm.controller.state import Snapshots
from rlax_llm.data import prompt_dataset
from rlax_llm.data_types import FollowLatest, GenerationRequest
from rlax_llm.errors import NonFiniteError
from rlax_llm.metrics import MetricsWriter
from rlax_llm.schedule import ControllerSettings
from rlax_llm.tasks import Task


def _agreement_every_s(notice_s: float) -> float:
  """How often a multi-process job's processes agree whether to abandon the step while they
  wait (``distributed.JobStop.wait``): a tenth of the preemption notice, at most 1 s (each
  agreement is one exchange of a few ints through the coordination service, milliseconds;
  docs/checkpoints.md)."""
  return min(1.0, notice_s / 10)


def rollout_kind(settings: ControllerSettings, task: Task, teacher=None) -> RolloutKind:
  """The run's kind: ``Episodes`` for an environment run (``settings.episodes``), else
  ``Completions`` of ``task``'s prompts; ``teacher``: on-policy distillation
  (``completions.Distillation``)."""
  if settings.episodes is None:
    return Completions(settings, task, teacher)
  return Episodes(settings, teacher)


class Controller(Snapshots):
  """Runs ``total_steps`` RL updates under the ``(j, k)`` schedule; see the package docstring.

  Args:
    settings: the schedule.
    task: prompts and verifier (an environment run's: its seeds).
    trainer: a ``TrainerHandle`` whose ``version`` counts its applied updates.
    workers: ``WorkerHandle``s (at least one).
    writer: metrics (and the ledger).
    checkpoints: a ``rlax_llm.checkpoint.SaveSchedule``, or None for no checkpoints: the
      controller asks the trainer to save (``TrainerHandle.save``) after steps it says are
      due, after the last step, and when ``stop`` is set.
    stop: an event (set by ``checkpoint.PreemptionGuard`` on SIGTERM/SIGINT): after the
      current step the controller saves a checkpoint and returns, ``summary['preempted']``
      True. A step that would overrun the notice (``SaveSchedule.preemption_notice_s``) is
      abandoned instead (``_abandon_window``): the controller saves the state it had before
      the step and returns. A multi-process job passes its ``distributed.JobStop``, whose
      agreement points make every process abandon the same step.
    teacher: the on-policy distillation teacher (``completions.Distillation``) or None.
  """

  def __init__(self, settings: ControllerSettings, task: Task, trainer: TrainerHandle,
               workers: Sequence[WorkerHandle], writer: MetricsWriter, checkpoints=None,
               stop: threading.Event | None = None, teacher=None):
    if not workers:
      raise ValueError('the controller needs at least one inference worker.')
    self.settings = settings
    self.kind = rollout_kind(settings, task, teacher)
    self.trainer = trainer
    self.workers = list(workers)
    self.alive = [True] * len(self.workers)
    self.writer = writer
    self.step = 0
    self._prompts = iter(prompt_dataset(task, 1).to_iter_dataset())
    # The RL batches' sampling root (``rl.seed``, by default ``config.seed``; a snapshot
    # stores it) and held-out evaluation's key (``config.seed`` always, so that runs of one
    # warm-up with different RL seeds are evaluated alike).
    self._root_key = jax.random.key(settings.sampling_seed)
    self._eval_key = jax.random.key(settings.seed)
    self._eval_prompts = task.eval_prompts()
    self.start_accuracy: float | None = None
    self._start_eval: dict[str, float] = {}
    self.accuracy: float | None = None
    # The version each worker will hold once its queued calls have run (the controller knows
    # it: each call names the version the worker pulls).
    self._worker_versions = [-1] * len(self.workers)
    self.events: list[str] = []
    self.counters = collections.Counter()
    self._busy_s = 0.0
    self._run_start = None
    self.step_versions = [trainer.version]  # [s]: the version after s steps
    self.checkpoints = checkpoints
    self.stop = stop
    self._restored_inflight: list[Batch] = []
    # The oldest version whose weights exist after a restore (the checkpoint holds only the
    # trainer's); -1: no restore, every version the schedule names was pushed.
    self._oldest_held = -1
    # Preemption (``_abandon_window``): the last step's wall seconds and the last save's
    # (None: not measured in this process yet), and the step the last save was made after.
    self._step_s: float | None = None
    self._save_s = 0.0
    self._saved_step: int | None = None
    self._helper: concurrent.futures.ThreadPoolExecutor | None = None  # ``_make``'s thread

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
    return self.kind.submit(self.workers[worker], requests,
                            np.asarray(jax.random.key_data(root)), named, stop_after, first)

  def _count_figures(self, figures: dict[str, float]) -> dict[str, float]:
    """``figures`` without the pull's (``sync/``) and a restart's (``workers/restarts``: the
    worker's process was lost and restarted by the backend; recorded as an event), which are
    added to the counters (so they count once)."""
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

  def _launch(self, batch: Batch, root: jax.Array, resumes: Sequence[Any] = ()) -> Batch:
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
  def _chunk_stop(batch: Batch, part: Sequence[GenerationRequest]) -> int | None:
    return schedule.chunk_stop(batch.stop_after, len(part), len(batch.prompts))

  def _gather(self, batch: Batch, root: jax.Array) -> list[Any]:
    """The chunks' results in order; a failed or silent worker is retired and its chunk
    re-issued to a live one (same keys, same version: the same results). ``root``: the
    key the batch was launched with."""
    out = []
    for n, (worker, requests, future) in enumerate(batch.chunks):
      while True:
        try:
          result = future.result(timeout=self.settings.worker_timeout_s)
          out.append(self.kind.counted(result, self._count_figures))
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

  def _launch_step(self, index: int) -> Batch:
    """Launches batch ``index`` with the prompts the kind composes (``RolloutKind.compose``)
    and the version the schedule names (``_held_version``)."""
    s = self.settings
    # At step ``index`` the trainer's version is at most one per step above today's.
    prompts, resumes, counts = self.kind.compose(
        s.requested_groups, self.trainer.version + (index - self.step),
        lambda: next(self._prompts)[0])
    version = None if s.schedule == 'free' else self._held_version(self.step_versions[
        schedule.sampling_version(index, s.staleness_j, s.staleness_k)], index)
    batch = Batch(index=index, version=version, prompts=prompts, chunks=[],
                  stop_after=s.stop_after_groups, **counts)
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

  # --------------------------------------------------------------------------- evaluate

  def evaluate(self) -> dict[str, float]:
    """Held-out metrics of the trainer's current version (``RolloutKind.evaluate``, computed
    by ``rlax_llm.evaluation``), generated on a live worker."""
    version = self.trainer.version

    def run(requests, key):
      worker = self._live_workers()[0]
      batch = Batch(index=-1, version=version, prompts=[r.prompt for r in requests],
                    chunks=[(worker, requests, self._submit(worker, requests, key, version))])
      return self.kind.merge(self._gather(batch, key))

    return self.kind.evaluate(run, self._eval_prompts, self._eval_key)

  # -------------------------------------------------------------------------------- run

  def run(self) -> dict[str, float]:
    """Runs the loop to ``total_steps``. Returns the summary (also written to the workdir).

    Raises ``NonFiniteError`` naming the step when the trainer's updates diverge.
    """
    s = self.settings
    if self.start_accuracy is None:
      start = self.evaluate()
      self.start_accuracy = self.accuracy = start['eval/accuracy']
      logging.info('RL starting point: %s', console.format_metrics(start))
      # Logged with the first step's metrics as eval/start_accuracy, eval/start_pass@k, ...
      self._start_eval = {k.replace('eval/', 'eval/start_', 1): v for k, v in start.items()}
    self._run_start = time.perf_counter()
    in_flight: collections.deque[Batch] = collections.deque(
        batch if batch.chunks else self._launch(batch, self._sampling_root(batch.index))
        for batch in self._restored_inflight)
    self._restored_inflight = []
    next_batch = self.step + len(in_flight)
    preempted = False
    if self.step < s.total_steps:
      console.phase('compiling the first RL step (this takes a minute on CPU for a real model)')
    while self.step < s.total_steps:
      started = time.perf_counter()
      guard, pending = self._abandon_window(in_flight)
      # Several processes: the job's agreement points decide (``_agreed``), not the handler.
      agreed = guard is not None and jax.process_count() > 1
      overruns = (lambda: self._overruns(started, _agreement_every_s(
          self.checkpoints.preemption_notice_s) if agreed else 0.0))
      try:
        with (guard.abandon_window(overruns, raises=not agreed) if guard is not None
              else contextlib.nullcontext()):
          if agreed:  # a signal since the last step's check (distributed.JobStop.is_set)
            self._agreed([], overruns)
          # Launch every batch whose sampling params exist (at most k ahead: the schedule).
          while schedule.launch_due(next_batch, self.step, s):
            in_flight.append(self._launch_step(next_batch))
            next_batch += 1
          batch = in_flight.popleft()
          if agreed:  # the rollouts' generation
            self._agreed([future for _, _, future in batch.chunks], overruns)
          merged = self.kind.merge(self._gather(batch, self._sampling_root(batch.index)))
          made = self._make(batch, merged, overruns if agreed else None)
      except StepAbandoned:
        self._abandon(pending, started)
        preempted = True
        break
      metrics = self._train_step(batch, made, queued=len(in_flight), started=started)
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

  def save(self, in_flight: Sequence[Batch]) -> None:
    """Checkpoints the run after ``self.step``: the trainer's process writes its params and
    optimizer state with the controller's state and the rollouts in flight, as one step
    (``TrainerHandle.save``); the controller hands over only its own state."""
    self._save_snapshot(*self.snapshot(in_flight))

  def _save_snapshot(self, state, arrays: dict[str, dict[str, np.ndarray]]) -> None:
    """Has the trainer save ``state`` (a ``ControllerState`` of step ``state.step``, which
    must be the trainer's step: its params are saved beside it) with ``arrays``; records how
    long the hand-over took (``_overruns``)."""
    began = time.perf_counter()
    self.trainer.save(state.step, state.to_dict(), arrays).result()
    self.checkpoints.saved()
    self._save_s = time.perf_counter() - began
    self._saved_step = state.step

  # ------------------------------------------------------------------------- preemption

  def _abandon_window(self, in_flight: Sequence[Batch]):
    """``(guard, pending)`` for the step about to start: ``guard`` the installed
    ``PreemptionGuard`` when this step may be abandoned on a preemption signal, else None;
    ``pending`` the snapshot to save then (``snapshot(in_flight)`` now, before the step
    launches or draws anything; None when the checkpoint of this step already exists).

    A step may be abandoned when the run checkpoints with a notice
    (``SaveSchedule.preemption_notice_s`` > 0) and a guard's handlers are installed (the
    launch's); in a multi-process job, when ``stop`` is the job's ``distributed.JobStop``:
    every process must abandon at the same point, so there the handler only sets the flag and
    the processes agree at the window's agreement points (``_agreed``). Until its update is
    submitted a step has changed nothing the trainer holds, so the snapshot taken before it
    (every process takes the same one), saved with the trainer's params, is the checkpoint
    the step before wrote or would have written: the relaunch regenerates the abandoned
    step's rollouts with the same keys and version."""
    guard = PreemptionGuard.active()
    if (guard is None or self.checkpoints is None or self.stop is None
        or not self.checkpoints.preemption_notice_s
        or (jax.process_count() > 1 and not isinstance(self.stop, distributed.JobStop))):
      return None, None
    return guard, (None if self._saved_step == self.step else self.snapshot(in_flight))

  def _overruns(self, started: float, margin: float = 0.0) -> bool:
    """Whether the step that began at ``started`` (``time.perf_counter()``), finished and
    then saved, would end later than the preemption notice from now: its expected rest (the
    last step's wall time minus what it has run; unknown for a process's first step, which
    compiles: True) plus the last save's hand-over time plus ``margin`` (a multi-process
    job: the seconds a signal may wait for the next agreement point)."""
    if self._step_s is None:
      return True
    rest = max(0.0, started + self._step_s - time.perf_counter())
    return rest + self._save_s + margin > self.checkpoints.preemption_notice_s

  def _agreed(self, futures: Sequence[concurrent.futures.Future], overruns) -> None:
    """A multi-process job's agreement points while ``futures`` are pending
    (``distributed.JobStop.wait``, every ``_agreement_every_s``): raises ``StepAbandoned``
    in every process at the same point when the job agrees to abandon the step."""
    if self.stop.wait(futures, overruns,
                      _agreement_every_s(self.checkpoints.preemption_notice_s),
                      self.settings.worker_timeout_s):
      raise StepAbandoned

  def _make(self, batch: Batch, merged: Any, overruns) -> Made:
    """``kind.make`` of ``batch``'s rollouts ``merged`` (scoring: a reward function may take
    long). With ``overruns`` (a multi-process abandon window) it runs on the controller's
    helper thread while the main thread passes agreement points (``_agreed``); an abandoned
    step's call then runs to its end there, changing only state the saved snapshot copied."""
    if overruns is None or self.stop.finishing:
      return self.kind.make(batch, merged, self.trainer.version)
    if self._helper is None:
      self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='make')
    future = self._helper.submit(self.kind.make, batch, merged, self.trainer.version)
    self._agreed([future], overruns)
    return future.result()

  def _abandon(self, pending, started: float) -> None:
    """Saves ``pending`` (``_abandon_window``'s snapshot; None: saved already) after the
    step in progress since ``started`` was abandoned. Its message says how long the step
    had run and how long the save took."""
    ran = time.perf_counter() - started
    if pending is not None:
      self._save_snapshot(*pending)
    message = (f'preempted: abandoned step {self.step + 1} of {self.settings.total_steps} '
               f'after {ran:.1f} s (it would have overrun the '
               f'{self.checkpoints.preemption_notice_s:g} s preemption notice); the '
               f'checkpoint after step {self.step} is saved'
               + (f' (in {self._save_s:.2f} s)' if pending is not None else '')
               + ', relaunch with the same --workdir to resume (the step is generated again).')
    logging.warning(message)

  def _train_step(self, batch: Batch, made: Made, queued: int, started: float
                  ) -> dict[str, float]:
    """Trains on ``made``, the kind's training rows of ``batch`` (``RolloutKind.make``);
    ``started``: when this step's launches began. Its ``time/`` metrics are wall seconds of
    this loop iteration: ``rollout_s`` from ``started`` until the kind made the batch's
    training rows (launching, which in the inline local backend is the generation itself,
    waiting, scoring), ``train_s`` the update (and the trainer's push of the new version),
    ``step_s`` the whole iteration (evaluation included)."""
    t_rollout = time.perf_counter() - started
    metrics = {**made.metrics, **self._start_eval}
    self._start_eval = {}
    t1 = time.perf_counter()
    staleness = None  # for the kind's log (stays None without an update)
    if made.train is not None:
      staleness = self._update(made, metrics)
    else:
      metrics.update({'staleness/mean': 0.0, 'staleness/max': 0.0, 'update/skipped': 1.0})
    t_train = time.perf_counter() - t1
    self.step += 1
    self.kind.log(self.writer, self.step, made, staleness)
    self._busy_s += t_train
    self.step_versions.append(self.trainer.version)
    metrics['version'] = self.trainer.version
    self.writer.ledger(self.step, {
        'batch': batch.index, 'sampling_version': metrics['sampling_version'],
        **batch.prompt_ids(), 'trained_prompt_ids': made.trained_prompt_ids,
        'trained_versions': made.trained_versions, 'version': self.trainer.version})
    if schedule.eval_due(self.step, self.settings):
      evaluation = self.evaluate()
      self.accuracy = evaluation['eval/accuracy']
      metrics.update(evaluation)
    if self.step == self.settings.total_steps:
      metrics['eval/start_accuracy'] = self.start_accuracy
      metrics['eval/final_accuracy'] = self.accuracy
      metrics['eval/improvement'] = self.accuracy - self.start_accuracy
    c = self.counters
    metrics.update({
        'sync/updates': c['sync/updates'], 'sync/bytes': float(c['sync/bytes']),
        'sync/full_bytes': float(c['sync/full_bytes']),
        'sync/density': c['sync/changed'] / max(1, c['sync/elements']),
        'workers/lost': c['workers/lost'], 'workers/restarts': c['workers/restarts'],
        'time/rollout_s': t_rollout, 'time/train_s': t_train, 'time/queued_batches': queued,
        'time/trainer_busy_fraction': self._busy_s / (time.perf_counter() - self._run_start),
        'time/step_s': time.perf_counter() - started,
        'time/rollout_tokens_per_s': made.tokens_per_s,
    })
    self._step_s = metrics['time/step_s']
    return metrics

  def _update(self, made: Made, metrics: dict[str, float]) -> np.ndarray:
    """Trains on ``made.train`` after checking the staleness bound; adds the staleness and
    the trainer's metrics to ``metrics``. Returns the staleness of every trained token."""
    s = self.settings
    versions = np.asarray(made.train.versions)
    staleness = self.trainer.version - versions[versions >= 0]
    too_stale = int(np.sum(staleness >= s.staleness_k))
    if too_stale:  # the schedule makes this impossible; the check guards the invariant.
      raise RuntimeError(f'{too_stale} tokens exceed the staleness bound k={s.staleness_k}.')
    try:
      train_metrics = self.trainer.step(made.train).result()
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
