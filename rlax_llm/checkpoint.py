"""Preemption-safe checkpoints: Orbax saves of the whole run state, and resume.

A run's state at the end of step ``s`` is saved together, as one Orbax step, so a restore
never pairs weights with the wrong data position::

    workdir/checkpoints/
      warmup/            the supervised warm-up's result (the RL starting point; kept forever)
      steps/<s>/
        params/          the trainer's params (sharded arrays; Orbax/TensorStore)
        opt_state/       the optimizer state
        trainer/         JSON: policy version, non-finite streak
        controller/      JSON: ``ControllerState`` (step, grain iterator state, RNG, versions,
                         counters, the prompts and metadata of in-flight and recycled groups)
        rollouts/        the in-flight and recycled rollouts' arrays (absent when none)

* Saves are asynchronous (``CheckpointManager`` with async checkpointing): ``save`` returns
  once the arrays are copied off the devices, so the trainer may donate its buffers in the
  next step while the files are written in the background; a step counts only when it is
  complete (locally Orbax writes into a temporary directory and renames it; on ``gs://`` it
  writes in place and ``commit_success.txt`` last: ``workdir.finished_steps``), so a crash
  mid-save leaves the previous checkpoint the latest.
* The workdir may be a ``gs://`` URL: Orbax writes there directly (TensorStore for the
  arrays, ``etils.epath`` for the rest; ``rlax_llm.storage`` for the listings and moves).
* ``restore`` reads the latest step; if it is unreadable (truncated, corrupt, a file
  missing) it moves that step aside to ``steps/<s>.corrupt-<time>`` (nothing is deleted),
  logs a warning naming the error, and falls back to the previous one.
* Restores take the target's shardings (``jax.ShapeDtypeStruct`` with ``sharding``), so a
  checkpoint written on one mesh restores onto another (resharding on restore). Shapes and
  dtypes are compared with the checkpoint's metadata first: a checkpoint of another model or
  optimizer raises ``CheckpointError`` before anything is read or overwritten.
* ``PreemptionGuard`` turns SIGTERM/SIGINT into a flag the run checks after each step: the
  run saves a checkpoint and exits 0 (Cloud TPU gives about 30 s notice); relaunching with
  the same ``--workdir`` resumes. A step that would overrun the notice
  (``checkpoint.preemption_notice_s``) is abandoned instead: while the controller holds an
  abandon window (``PreemptionGuard.abandon_window``: from a step's start until its update is
  submitted) the signal handler raises ``StepAbandoned`` in the main thread (in a
  multi-process job the processes agree at agreement points instead, ``distributed.JobStop``,
  and raise it together), and the controller saves the state it had before the step
  (docs/checkpoints.md, "Preemption").

Who does what: the controller decides *when* to save (``SaveSchedule``: every_steps,
every_seconds, the last step, a preemption) and hands its own small state and the in-flight
rollouts' arrays to the trainer (``TrainerHandle.save``); the trainer's process owns the
``Checkpointer`` and writes that state beside its params and optimizer state as one step.
On restore the trainer's process reads the step, loads its params and optimizer state, and
hands the controller only a ``Resume`` (its state and the rollouts' arrays). So no weight
byte passes through the controller's process (on Ray, the driver never opens the
checkpoint manager); the workdir must be on a filesystem the trainer's process writes and
later launches read (local disk on one machine; ``gs://`` or other shared storage across
hosts).

In-flight rollouts: under staleness ``(j, k)`` up to ``k - 1`` batches are generated ahead of
the trainer, some with params older than the saved ones. The save waits for them and stores
them (they are needed anyway); a resume trains exactly them, so an interrupted run equals an
uninterrupted one bit for bit (``tests/test_resume.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rlax_llm import distributed, storage
from rlax_llm.errors import CheckpointError
from rlax_llm import workdir as workdir_lib

WARMUP_DIRNAME = 'warmup'
STEPS_DIRNAME = 'steps'


@dataclasses.dataclass
class Resume:
  """What the controller continues from: a checkpoint's step, the controller's state
  (``ControllerState.to_dict()``) and the in-flight and recycled rollouts' arrays; no
  weights (the trainer's process restored those itself)."""

  step: int
  controller: dict[str, Any]
  rollouts: dict[str, dict[str, np.ndarray]]


@dataclasses.dataclass
class Restored:
  """One step's state, as read back."""

  step: int
  params: Any
  opt_state: Any
  trainer: dict[str, Any]
  controller: dict[str, Any]
  rollouts: dict[str, dict[str, np.ndarray]]

  def resume(self) -> Resume:
    """The part the controller continues from (no params, no optimizer state)."""
    return Resume(step=self.step, controller=self.controller, rollouts=self.rollouts)


class SaveSchedule:
  """When the controller asks for a save: after steps that are multiples of ``every_steps``
  (0: never by count) and when ``every_seconds`` have passed since the last save (0: never by
  time). The run also saves after its last step and when preempted (``Controller.run``).
  Holds no checkpoint manager: the trainer's process writes (``Checkpointer``)."""

  def __init__(self, every_steps: int = 0, every_seconds: float = 0.0,
               preemption_notice_s: float = 0.0):
    self.every_steps = every_steps
    self.every_seconds = every_seconds
    # The seconds between a preemption signal and the kill (0: never abandon a step).
    self.preemption_notice_s = preemption_notice_s
    self._last_save = time.monotonic()

  def due(self, step: int) -> bool:
    """Whether the schedule asks for a save after ``step``."""
    if self.every_steps and step % self.every_steps == 0:
      return True
    late = bool(self.every_seconds) and time.monotonic() - self._last_save >= self.every_seconds
    return bool(distributed.agree(int(late)))  # multi-host: process 0's clock decides for all

  def saved(self) -> None:
    """Records that a save was made now (``every_seconds`` counts from here)."""
    self._last_save = time.monotonic()


def latest_step(workdir: str | storage.Path) -> int | None:
  """The newest finished step checkpoint of the run in ``workdir`` (None: none), from the
  directory listing (``workdir.finished_steps``): opens no checkpoint manager and reads no
  array (what a process that holds no weights may ask, e.g. Ray's driver naming the step to
  resume from)."""
  steps = workdir_lib.finished_steps(
      storage.path(workdir) / workdir_lib.CHECKPOINT_DIRNAME / STEPS_DIRNAME)
  return steps[-1] if steps else None


def abstract_like(tree: Any) -> Any:
  """Restore targets: ``ShapeDtypeStruct`` with each array's sharding (restores reshard)."""
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, 'sharding', None)),
      tree)


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  # Simple keys ('blocks/0/attn/wq'): Orbax's metadata keeps lists as dicts with string keys.
  return {jax.tree_util.keystr(path, simple=True, separator='/'):
          (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in flat}


def _per_layer(specs: dict[str, Any]) -> bool:
  """Whether leaf paths (``_leaf_specs``) hold the decoder's blocks layer by layer
  (``.../blocks/0/...``, before the blocks were stacked over a leading layer axis)."""
  return any(re.search(r'(^|/)blocks/\d+/', key) for key in specs)


def _check_matches(item: str, metadata: Any, target: Any, directory: storage.Path) -> None:
  """Raises CheckpointError when the saved leaves' paths, shapes or dtypes differ."""
  tree = getattr(metadata, 'tree', metadata)
  saved, want = _leaf_specs(tree), _leaf_specs(target)
  if saved == want:
    return
  if _per_layer(saved) and not _per_layer(want):
    raise CheckpointError(
        f'the checkpoint in {directory} stores the decoder\'s layers one by one (blocks/0/...), '
        'as rlax_llm wrote them before the layers were stacked for the scanned layer stack; '
        'this version cannot read it: resume it with the rlax_llm version that wrote it, or '
        'export its params there (rlax_llm.models.save_pretrained) and start a new --workdir '
        'from that Hugging Face directory. Nothing was overwritten.')
  missing = sorted(set(want) - set(saved))[:3]
  extra = sorted(set(saved) - set(want))[:3]
  changed = [f'{k}: saved {saved[k][0]} {saved[k][1]}, this run {want[k][0]} {want[k][1]}'
             for k in sorted(set(saved) & set(want)) if saved[k] != want[k]][:3]
  details = '; '.join(
      ([f'missing in the checkpoint: {", ".join(missing)}'] if missing else [])
      + ([f'not in this run: {", ".join(extra)}'] if extra else []) + changed)
  raise CheckpointError(
      f'the checkpoint in {directory} does not fit this run\'s {item} ({details}). It was '
      'written by a run with another model or optimizer; resume with that run\'s config, or '
      'pass a new --workdir. Nothing was overwritten.')


def _handlers(*arrays: str, json: tuple[str, ...] = ()) -> dict[str, Any]:
  """Orbax handlers by item name (so metadata can be read before a restore)."""
  return ({name: ocp.StandardCheckpointHandler() for name in arrays}
          | {name: ocp.JsonCheckpointHandler() for name in json})


def _save_whole_replicas_on_one_cpu_host() -> None:
  """On the CPU backend in one process, makes Orbax save a replicated array from one replica
  (its ``ArrayHandler`` with ``use_replica_parallel=False``, registered for ``jax.Array``).

  Replica-parallel saving (Orbax's default) splits a replicated array among its replicas, each
  copying and writing a slice: that spreads device-to-host copies over accelerators and writes
  over hosts, at the cost of one eager ``slice`` program per array shape and replica (56 for
  the smoke config's params and optimizer state on 8 CPU devices). CPU devices in one process
  share the host's memory, so there the slices gain nothing and only compile. Elsewhere
  (accelerators, several processes) Orbax's default is kept."""
  if jax.default_backend() == 'cpu' and jax.process_count() == 1:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)


class Checkpointer:
  """Saves and restores a run's steps under ``workdir/checkpoints`` (module docstring).

  Owned by the trainer's process (``LocalTrainer``, Ray's ``TrainerRole``); when to save is
  the controller's ``SaveSchedule``.

  Args:
    workdir: the run directory (a local path or a ``gs://`` URL).
    keep: how many step checkpoints to keep (the newest; the warm-up's is kept apart).
    async_save: write in the background (``False``: ``save`` returns when the files exist).
  """

  def __init__(self, workdir: str | storage.Path, *, keep: int = 3, async_save: bool = True):
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
      raise ValueError(f'checkpoint.keep={keep!r} must be an int >= 1.')
    self.directory = storage.absolute(workdir) / workdir_lib.CHECKPOINT_DIRNAME
    _save_whole_replicas_on_one_cpu_host()
    self._manager = ocp.CheckpointManager(
        self.directory / STEPS_DIRNAME,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True),
        item_handlers=_handlers('params', 'opt_state', 'rollouts', json=('trainer',
                                                                          'controller')))
    self.blocked_s = 0.0  # time save() kept the caller waiting, summed
    self.saves = 0

  # ---------------------------------------------------------------------------- steps

  def save(self, step: int, *, params: Any, opt_state: Any, trainer: dict[str, Any],
           controller: dict[str, Any], rollouts: dict[str, dict[str, np.ndarray]]) -> None:
    """Saves step ``step`` (asynchronously unless ``async_save=False``); a step already saved
    is left as it is."""
    if step in self._manager.all_steps():
      return
    start = time.perf_counter()
    items = dict(params=ocp.args.StandardSave(params),
                 opt_state=ocp.args.StandardSave(opt_state),
                 trainer=ocp.args.JsonSave(trainer), controller=ocp.args.JsonSave(controller))
    if rollouts:
      items['rollouts'] = ocp.args.StandardSave(rollouts)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self.blocked_s += time.perf_counter() - start
    self.saves += 1

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, params: Any, opt_state: Any) -> Restored | None:
    """The latest readable step, restored onto the shardings of the targets ``params`` and
    ``opt_state`` (arrays or ``ShapeDtypeStruct``s); None when there is none.

    An unreadable latest step is moved aside with a warning and the previous one is tried.
    Raises CheckpointError when a step does not fit the targets (another model/optimizer).
    """
    targets = {'params': abstract_like(params), 'opt_state': abstract_like(opt_state)}
    for step in sorted(self._manager.all_steps(), reverse=True):
      path = self.directory / STEPS_DIRNAME / str(step)
      try:
        metadata = self._manager.item_metadata(step)
        for item, target in targets.items():
          _check_matches(item, metadata[item], target, path)
      except CheckpointError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        self._set_aside(step, path, e)
        continue
      items = dict(params=ocp.args.StandardRestore(targets['params']),
                   opt_state=ocp.args.StandardRestore(targets['opt_state']),
                   trainer=ocp.args.JsonRestore(), controller=ocp.args.JsonRestore())
      if (path / 'rollouts').exists():
        items['rollouts'] = ocp.args.StandardRestore()
      try:
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        rollouts = out['rollouts'] if 'rollouts' in items else {}
        rollouts = jax.tree.map(np.asarray, dict(rollouts or {}))
        restored = Restored(step=step, params=out['params'], opt_state=out['opt_state'],
                            trainer=dict(out['trainer']), controller=dict(out['controller']),
                            rollouts=rollouts)
      except Exception as e:  # pylint: disable=broad-except
        self._set_aside(step, path, e)
        continue
      logging.info('restored checkpoint step %d from %s', step, path)
      return restored
    return None

  def _set_aside(self, step: int, path: storage.Path, error: Exception) -> None:
    aside = path.with_name(f'{step}.corrupt-{time.strftime("%Y%m%d-%H%M%S")}')
    logging.warning('checkpoint step %d in %s is unreadable (%s: %s); moved it to %s and '
                    'falling back to the previous checkpoint.', step, path,
                    type(error).__name__, str(error).splitlines()[0][:300] if str(error)
                    else '', aside)
    storage.rename_dir(path, aside)
    self._manager.reload()

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  # --------------------------------------------------------------------------- warm-up

  def save_warmup(self, params: Any, metrics: dict[str, float]) -> None:
    """Saves the warm-up's result (synchronously: it is needed before RL starts)."""
    save_warmup(self.directory / WARMUP_DIRNAME, params, metrics)

  def restore_warmup(self, params: Any) -> tuple[Any, dict[str, float]] | None:
    """The warm-up's params (onto ``params``' shardings) and metrics; None if not saved."""
    return restore_warmup(self.directory / WARMUP_DIRNAME, params)


def save_warmup(path: storage.Path, params: Any, metrics: dict[str, float]) -> None:
  """Writes a warm-up's result (params and metrics) at ``path``, as one Orbax step 0
  (synchronously), unless ``path`` exists. The one format of a finished warm-up: a run's
  ``checkpoints/warmup`` and ``warmup.cache``'s entries (``rlax_llm.warmup_cache``)."""
  if distributed.agree(path.exists()):  # multi-host: process 0's look, for every process
    return
  with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False, create=True),
                             item_handlers=_handlers('params', json=('metrics',))) as manager:
    manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                            metrics=ocp.args.JsonSave(metrics)))


def restore_warmup(path: storage.Path, params: Any) -> tuple[Any, dict[str, float]] | None:
  """The warm-up ``save_warmup`` wrote at ``path``: its params (onto ``params``' shardings)
  and metrics; None when there is none (or its save did not finish). Raises CheckpointError
  when the saved params' shapes or dtypes differ from ``params``'."""
  if not distributed.agree(path.exists()):  # multi-host: process 0's look, for every process
    return None
  with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False, create=False),
                             item_handlers=_handlers('params', json=('metrics',))) as manager:
    if manager.latest_step() is None:
      return None
    target = abstract_like(params)
    _check_matches('params', manager.item_metadata(0)['params'], target, path)
    out = manager.restore(0, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target), metrics=ocp.args.JsonRestore()))
  return out['params'], dict(out['metrics'])


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """Which checkpoint a path names (``checkpoint_step``).

  Attributes:
    path: the step's directory (``checkpoints/steps/<s>`` or ``checkpoints/warmup``).
    step: the RL step it was saved after (None: the warm-up's).
    version: the policy version its params are (the trainer's count of applied updates, which
      the run's workers sampled with; the step unless updates were skipped; 0: the warm-up).
  """

  path: storage.Path
  step: int | None
  version: int


def checkpoint_step(path: str | storage.Path) -> StepInfo:
  """The checkpoint ``path`` names: a run's workdir (its latest step), ``<workdir>/checkpoints``,
  a step directory (``checkpoints/steps/<s>``) or the warm-up's (``checkpoints/warmup``); local
  or ``gs://``. Raises CheckpointError when there is no checkpoint at ``path``."""
  path = storage.absolute(path)
  if (path / workdir_lib.CHECKPOINT_DIRNAME).is_dir():
    path = path / workdir_lib.CHECKPOINT_DIRNAME
  if (path / STEPS_DIRNAME).is_dir():
    path = path / STEPS_DIRNAME
  if path.name in (STEPS_DIRNAME, WARMUP_DIRNAME):
    steps = workdir_lib.finished_steps(path)
    if not steps:
      raise CheckpointError(f'{path} holds no finished checkpoint.')
    path = path / str(steps[-1])
  if not (path / 'params').is_dir():
    raise CheckpointError(f'no checkpoint at {path}: pass a run\'s workdir or a '
                          'checkpoints/steps/<step> directory.')
  if path.parent.name == WARMUP_DIRNAME:
    return StepInfo(path, None, 0)
  step = int(path.name) if path.name.isdigit() else None
  try:  # the trainer item: Orbax's JSON of TrainerHandle counters ({"version": ...})
    version = int(json.loads(storage.read_text(path / 'trainer' / 'metadata'))['version'])
  except (OSError, ValueError, KeyError, TypeError):
    version = step or 0
  return StepInfo(path, step, version)


def read_params(path: str | storage.Path, template: Any) -> Any:
  """The params of a checkpoint, restored onto ``template``'s shapes, dtypes and shardings.

  ``path``: what ``checkpoint_step`` takes (a run's workdir: its latest step). What
  ``python -m rlax_llm.evaluate --checkpoint`` reads. Raises CheckpointError when there is
  no checkpoint at ``path`` or its params do not fit ``template``.
  """
  path = checkpoint_step(path).path
  item = path / 'params'
  target = abstract_like(template)
  # The item's own metadata: a Checkpointer's would look for a step's _CHECKPOINT_METADATA
  # inside the item and warn that it is missing.
  _check_matches('params', ocp.StandardCheckpointHandler().metadata(item), target, path)
  return ocp.StandardCheckpointer().restore(item, target)


class StepAbandoned(BaseException):
  """Raised in the main thread by ``PreemptionGuard``'s signal handler inside an abandon
  window (``PreemptionGuard.abandon_window``) whose test says the step would overrun the
  preemption notice: the controller drops the step and saves the state it had before it.

  A ``BaseException`` (like ``KeyboardInterrupt``), so that no ``except Exception`` on the way
  (a lost worker's handling, a reward function) takes it for a failure."""


class PreemptionGuard:
  """While active, SIGTERM and SIGINT set ``requested`` instead of killing the process.

  The run checks ``requested`` after each step, saves a checkpoint and exits 0. Inside an
  ``abandon_window`` whose ``overruns()`` is True at the signal, the handler raises
  ``StepAbandoned`` in the main thread instead of waiting for the step. A second SIGINT
  (Ctrl-C twice) raises ``KeyboardInterrupt`` at once. Only the main thread can install
  handlers; elsewhere the guard is inert (``installed`` is False). ``PreemptionGuard.active()``
  is the installed guard.
  """

  _installed: list[PreemptionGuard] = []  # the guards whose handlers are installed, newest last

  def __init__(self):
    self.requested = threading.Event()
    self.signal_name: str | None = None
    self._previous: dict[int, Any] = {}
    self.installed = False
    self._overruns: Callable[[], bool] | None = None
    self._raises = True

  @classmethod
  def active(cls) -> PreemptionGuard | None:
    """The guard whose handlers this process runs now, or None."""
    return cls._installed[-1] if cls._installed else None

  @contextlib.contextmanager
  def abandon_window(self, overruns: Callable[[], bool], raises: bool = True
                     ) -> Iterator[None]:
    """Within it, a preemption signal calls ``overruns()`` (from the handler, in the main
    thread: it must be quick and must not block) and, when True, raises ``StepAbandoned``
    wherever the main thread is; when False, the step goes on and the run saves after it. A
    signal that came before the window opened raises at once when ``overruns()`` is True.
    ``StepAbandoned`` may also surface as the window closes; the caller handles it around the
    window, not inside.

    ``raises=False`` (a multi-process job): the handler only sets ``requested``; the job's
    agreement points (``distributed.JobStop.wait``) decide, in every process at once,
    whether to abandon the step (raising at an arbitrary point of one process would leave
    the others waiting in a collective it never joins)."""
    self._overruns = overruns
    self._raises = raises
    try:
      if raises and self.requested.is_set() and overruns():
        raise StepAbandoned
      yield
    finally:
      self._overruns = None

  def _handle(self, signum, frame):
    del frame
    if self.requested.is_set() and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name
    self.requested.set()
    overruns = self._overruns
    if overruns is not None and not self._raises:
      logging.warning('%s received: the job decides at its next agreement point whether the '
                      'current step fits the preemption notice (else it is abandoned and the '
                      'state before it saved), then saves and exits.', self.signal_name)
      return
    if overruns is not None and overruns():
      logging.warning('%s received: the current step would overrun the preemption notice; '
                      'abandoning it and saving the state before it, then exiting.',
                      self.signal_name)
      raise StepAbandoned
    logging.warning('%s received: saving a checkpoint after the current step, then exiting.',
                    self.signal_name)

  def __enter__(self) -> PreemptionGuard:
    if threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._handle)
      self.installed = True
      PreemptionGuard._installed.append(self)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()
    if self.installed:
      PreemptionGuard._installed.remove(self)
    self.installed = False
