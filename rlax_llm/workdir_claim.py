"""An exclusive claim on a run directory for the life of a run, alone or as a job.

Two launches on the same ``--workdir`` must not interleave (merged ``metrics.jsonl``,
overwritten ``config.json`` and TensorBoard files), so a run claims its workdir
(``rlax_llm.workdir``: what it holds) before writing anything::

    workdir = storage.path(flag) if flag else default_workdir(config.name)
    with claim(workdir):
      storage.write_text_atomic(workdir / 'config.json', config.to_json_best_effort(indent=2))
      ...  # the run

* ``claim(workdir)`` takes an exclusive, non-blocking ``flock`` on ``workdir/.lock`` that
  lasts until the claim is closed or the process exits. A second claim while the first holds
  it raises ``WorkdirInUse`` naming the holder (pid, host, start time). Because the OS drops
  an ``flock`` when its holder dies, a run that crashed or was SIGKILLed never leaves its
  workdir unusable; the stale ``.lock`` file left behind is harmless. A workdir that holds a
  run but no checkpoint to resume it from is refused with ``WorkdirHasRun``.
* On ``gs://`` there is no ``flock``: ``claim`` creates the object ``workdir/.lock`` only if
  it is absent (``ifGenerationMatch=0``), holding a lease (the holder's id, pid, host, start
  time and expiry, ``LEASE_S`` from now) that a background thread renews every
  ``LEASE_S / 4`` while the claim is held, and deletes it on ``close``. A second claim while
  the lease is live raises ``WorkdirInUse``; a lease that expired (its holder died, or lost
  the network for ``LEASE_S``) is taken over, atomically (the expired object is deleted only
  if it is still the one that was read), so of two claimers racing for it one wins. Hosts'
  clocks must agree to well within ``LEASE_S`` (NTP does).
* ``claim_for_job(workdir, process_index, agree)``: the rule of a multi-process job
  (``jax.distributed``), whose every process runs the same command on the same workdir.
  Process 0 claims the workdir for the whole job (and writes ``config.json``, metrics, ledger,
  TensorBoard and summary); the other processes claim nothing (they only write their part of
  the Orbax checkpoints) and learn process 0's outcome through ``agree``, so a second *job*
  on a busy workdir fails in every one of its processes, never in process 0 alone.

Limitation (local paths): ``flock`` excludes processes on one host. On a network filesystem
shared between hosts (NFS, some FUSE mounts) it may not exclude a process on another host, so
two hosts can still both claim one workdir there; give runs on different hosts different
workdirs, or a ``gs://`` workdir (whose lease works across hosts).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from rlax_llm import storage
from rlax_llm.errors import WorkdirError, WorkdirHasRun, WorkdirInUse
from rlax_llm.workdir import METRICS_FILENAME, existing_steps, has_checkpoint

LOCK_FILENAME = '.lock'
LEASE_S = 60.0  # a gs:// claim's lease: renewed every LEASE_S / 4, taken over once expired

# Workdirs claimed by this process, keyed by the directory's (st_dev, st_ino) (a gs:// one by
# its URL), so a second claim in this process is refused even where flock is emulated per
# process (NFS on Linux).
_CLAIMED: dict[tuple[Any, Any], WorkdirClaim] = {}
_CLAIMED_LOCK = threading.Lock()


def _holder_text(info: dict[str, Any]) -> str:
  """'pid 123 on host h, started 2025-01-01T12:00:00+00:00' from the lock file's details."""
  if not info:
    return 'a process that has not written its pid yet'
  return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, "
          f"started {info.get('started', '?')}")


def _read_holder(fd: int) -> dict[str, Any]:
  """The holder details another claimer wrote into the lock file ({} if none yet)."""
  try:
    raw = os.pread(fd, 4096, 0)
    info = json.loads(raw.decode('utf-8', 'replace')) if raw.strip() else {}
  except (OSError, ValueError):
    return {}
  return info if isinstance(info, dict) else {}


def _in_use_error(workdir: Any, info: dict[str, Any], this_process: bool) -> WorkdirInUse:
  """The error for a workdir whose lock is held, naming the holder (and, for a gs:// lease,
  when it expires unless renewed)."""
  holder = _holder_text(info)
  if 'expires' in info:
    holder += f'; its lease expires in {_lease_expiry(info) - time.time():.0f}s unless renewed'
  if this_process:
    return WorkdirInUse(
        f'workdir {workdir} is already claimed by this process ({holder}); close '
        'that claim first, or pass another --workdir.')
  return WorkdirInUse(
      f'workdir {workdir} is in use by another run ({holder}); two runs in one '
      'workdir would mix their metrics, config and TensorBoard files. Pass another --workdir, '
      'or wait for that run to finish (or, if it died, for its lease to expire).')


class WorkdirClaim:
  """An exclusive claim on a run directory; create it with ``claim(workdir)``.

  Locally the claim is an ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``workdir/.lock``, held from
  ``claim`` until ``close()`` (or the end of a ``with`` block), and dropped by the OS if the
  process dies, however it dies. The lock file holds the holder's pid, host and start time as
  JSON, for the error a second claimer sees. On ``gs://`` it is a lease (``GcsLease``).

  Caveats (local): ``flock`` is per host, so on a network filesystem shared between hosts it
  may not exclude a run on another host. A child created by ``os.fork`` (without exec)
  inherits the lock and keeps it while it lives. Never delete or atomically replace ``.lock``
  while a run holds it.

  Attributes:
    workdir: the claimed directory.
    lock_path: ``workdir/.lock``.
    holder: ``{'pid', 'host', 'started'}`` as written into the lock file (a lease adds
      ``owner`` and ``expires``).
  """

  def __init__(self, workdir: Any, key: tuple[Any, Any] | None, holder: dict[str, Any],
               release: Callable[[], None] | None):
    """Internal: use ``claim(workdir)``, which takes the lock first. ``release`` drops it
    (None: a claim that holds nothing, ``JobMember``)."""
    self.workdir = workdir
    self.lock_path = workdir / LOCK_FILENAME
    self.holder = holder
    self._release = release
    self._key = key

  @property
  def held(self) -> bool:
    """Whether this claim still holds the lock (False after ``close``)."""
    return self._release is not None

  def close(self) -> None:
    """Releases the claim. Idempotent."""
    with _CLAIMED_LOCK:
      release, self._release = self._release, None
      if release is None:
        return
      if _CLAIMED.get(self._key) is self:
        del _CLAIMED[self._key]
      release()

  def __enter__(self) -> WorkdirClaim:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return f'WorkdirClaim({str(self.workdir)!r}, held={self.held})'


def _lock(workdir: pathlib.Path) -> int:
  """Opens ``workdir/.lock`` and flocks it; returns the fd or raises ``WorkdirInUse``."""
  lock_path = workdir / LOCK_FILENAME
  for _ in range(10):
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      info = _read_holder(fd)
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise _in_use_error(workdir, info, this_process=False) from None
      raise WorkdirError(
          f'could not lock {lock_path} ({e.strerror}, errno {e.errno}): the filesystem may not '
          'support flock. Put the workdir on a local filesystem.') from e
    # Someone may have deleted (or replaced) .lock between our open and flock: then our lock
    # is on an orphaned inode that excludes nobody. Retry on the file that is there now.
    try:
      same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
    except FileNotFoundError:
      same = False
    if same:
      return fd
    os.close(fd)
  raise WorkdirError(f'{lock_path} keeps being deleted or replaced while this run tries to '
                     'lock it; make sure nothing else manages files in the workdir.')


def _unlock(fd: int) -> Callable[[], None]:
  """What releases a local claim: clears the holder details, unlocks and closes ``fd``."""

  def release() -> None:
    try:
      os.ftruncate(fd, 0)  # still locked: no other claimer has written yet
    except OSError:
      pass
    try:
      fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
      os.close(fd)

  return release


def _lease_expiry(info: dict[str, Any]) -> float:
  """A lease's expiry (seconds since the epoch) from its metadata; 0 when unreadable."""
  try:
    return float(info.get('expires', 0))
  except (TypeError, ValueError):
    return 0.0


class GcsLease:
  """The claim on a ``gs://`` workdir: the object ``workdir/.lock``, created only if absent,
  whose metadata holds the holder and an expiry that a background thread renews.

  ``acquire`` creates it (``ifGenerationMatch=0``) or, when the one there has expired, deletes
  that one (only if it is still the generation read) and creates it again. The renewer moves
  the expiry ``lease_s`` ahead every ``lease_s / 4`` seconds, conditional on the generation
  this holder created; if that fails (another run took the lease over after this process
  stalled for ``lease_s``), it logs an error and ``lost`` becomes True. ``release`` stops the
  renewer and deletes the object if it is still this holder's.

  Args:
    lock_path: ``workdir/.lock`` (a ``gs://`` URL).
    holder: pid, host and start time (written with an ``owner`` id and the expiry).
    lease_s: how long the lease lasts without renewal.
  """

  def __init__(self, lock_path: Any, holder: dict[str, Any], lease_s: float):
    if not lease_s > 0:
      raise ValueError(f'lease_s={lease_s!r} must be > 0 seconds.')
    self.lock_path = lock_path
    self.lease_s = float(lease_s)
    self.holder = {**holder, 'owner': secrets.token_hex(8)}
    self.generation: int | None = None
    self.lost = False
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _metadata(self) -> dict[str, str]:
    expires = time.time() + self.lease_s
    self.holder['expires'] = f'{expires:.3f}'
    return {k: str(v) for k, v in self.holder.items()}

  def acquire(self, workdir: Any) -> None:
    """Takes the lease, or raises ``WorkdirInUse`` naming the live holder."""
    for _ in range(10):
      metadata = self._metadata()
      try:
        self.generation = storage.create_exclusive(
            self.lock_path, (json.dumps(self.holder) + '\n').encode('utf-8'), metadata)
        break
      except FileExistsError:
        pass
      seen = storage.read_lease(self.lock_path)
      if seen is None:
        continue  # released since: create it again
      generation, info = seen
      if info.get('owner') == self.holder['owner']:  # our create succeeded; its reply was lost
        self.generation = generation
        break
      if _lease_expiry(info) > time.time():
        raise _in_use_error(workdir, info, this_process=False)
      logging.warning('workdir %s: taking over the expired lease of %s.', workdir,
                      _holder_text(info))
      storage.delete_if_generation(self.lock_path, generation)
    else:
      raise WorkdirError(f'could not take the lease {self.lock_path}: other claimers keep '
                         'replacing it; make sure one run at a time starts on this workdir.')
    self._thread = threading.Thread(target=self._renew, name='rlax-workdir-lease', daemon=True)
    self._thread.start()

  def _renew(self) -> None:
    while not self._stop.wait(self.lease_s / 4):
      try:
        renewed = storage.renew_lease(self.lock_path, self.generation, self._metadata())
      except Exception as e:  # pylint: disable=broad-except  # the network: retry next time
        logging.warning('could not renew the lease %s (%s: %s); retrying.', self.lock_path,
                        type(e).__name__, e)
        continue
      if not renewed:
        self.lost = True
        logging.error('the lease %s was taken over by another run (this process did not renew '
                      'it for %.0fs): two runs may now write this workdir. Stop this one.',
                      self.lock_path, self.lease_s)
        return

  def release(self) -> None:
    """Stops renewing and deletes the lease if it is still this holder's."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self.generation is not None and not self.lost:
      try:
        storage.delete_if_generation(self.lock_path, self.generation)
      except Exception as e:  # pylint: disable=broad-except  # it expires anyway
        logging.warning('could not delete the lease %s (%s); it expires in %.0fs.',
                        self.lock_path, e, self.lease_s)


def _check_resumable(workdir: Any) -> None:
  """Raises ``WorkdirHasRun`` when ``workdir`` holds a run but no checkpoint to resume."""
  steps = existing_steps(workdir)
  if steps and not has_checkpoint(workdir):
    raise WorkdirHasRun(
        f'workdir {workdir} already holds a run ({steps} step{"s" if steps != 1 else ""} '
        f'in {METRICS_FILENAME}) but no checkpoint to resume it from (it ran with '
        'checkpoint.every_steps=0 and checkpoint.every_seconds=0); pass a new --workdir '
        f'(or delete {workdir} to start over).')


def _holder() -> dict[str, Any]:
  return {
      'pid': os.getpid(),
      'host': socket.gethostname(),
      'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
  }


def _claim_gcs(workdir: Any, lease_s: float) -> WorkdirClaim:
  """``claim`` of a ``gs://`` workdir: a ``GcsLease``."""
  if workdir.is_file():
    raise WorkdirError(f'workdir {workdir} exists but is an object, not a directory; pass '
                       'another --workdir.')
  key = ('gs', str(workdir).rstrip('/'))
  with _CLAIMED_LOCK:
    held = _CLAIMED.get(key)
    if held is not None:
      raise _in_use_error(workdir, held.holder, this_process=True)
    lease = GcsLease(workdir / LOCK_FILENAME, _holder(), lease_s)
    lease.acquire(workdir)
    try:
      _check_resumable(workdir)
    except BaseException:
      lease.release()
      raise
    result = WorkdirClaim(workdir, key, lease.holder, lease.release)
    _CLAIMED[key] = result
    return result


def claim(workdir: str | os.PathLike, lease_s: float = LEASE_S) -> WorkdirClaim:
  """Claims ``workdir`` for one run, creating it if needed; release with ``close`` or ``with``.

  Locally: takes an exclusive, non-blocking ``fcntl.flock`` on ``workdir/.lock`` and writes
  the holder's pid, host and start time into it. The OS releases the lock when the process
  exits or is killed, so a crashed run's workdir can be claimed again. ``flock`` is per host:
  on a network filesystem shared between hosts it may not exclude a run on another host.
  On ``gs://``: a ``GcsLease`` on the object ``workdir/.lock`` (see the module docstring).

  Then decides whether the directory may be used: one whose ``metrics.jsonl`` holds step rows
  (``existing_steps(workdir) > 0``) is refused unless it holds a checkpoint to resume from
  (``has_checkpoint``). A directory left by a run that died before its
  first step (``config.json``, an empty or absent ``metrics.jsonl``, a stale ``.lock``) is
  claimable.

  Args:
    workdir: the run directory (a local path or a ``gs://`` URL).
    lease_s: a ``gs://`` claim's lease in seconds: how long after its holder dies the
      workdir can be claimed again (ignored locally).

  Returns:
    A held ``WorkdirClaim`` (a context manager that releases it on exit).

  Raises:
    WorkdirInUse: another process, or this one, holds the claim; the message names the
      holder's pid, host and start time.
    WorkdirHasRun: ``metrics.jsonl`` already holds a run.
    WorkdirError: the path exists but is not a directory, or cannot be locked.
  """
  if storage.is_gcs(workdir):
    return _claim_gcs(storage.path(workdir), lease_s)
  workdir = pathlib.Path(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise WorkdirError(f'workdir {workdir} exists but is not a directory; pass another '
                       '--workdir.')
  workdir.mkdir(parents=True, exist_ok=True)
  stat = workdir.stat()
  key = (stat.st_dev, stat.st_ino)
  with _CLAIMED_LOCK:
    held = _CLAIMED.get(key)
    if held is not None:
      raise _in_use_error(workdir, held.holder, this_process=True)
    fd = _lock(workdir)
    try:
      _check_resumable(workdir)
      holder = _holder()
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(holder) + '\n').encode('utf-8'), 0)
    except BaseException:
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
      raise
    result = WorkdirClaim(workdir, key, holder, _unlock(fd))
    _CLAIMED[key] = result
    return result


# What process 0's claim gave, as the one int ``claim_for_job``'s ``agree`` sends to the job.
_CLAIM_OUTCOMES = {0: None, 1: WorkdirInUse, 2: WorkdirHasRun, 3: WorkdirError}


class JobMember(WorkdirClaim):
  """What a non-zero process of a job holds: a claim without a lock (``held`` is False;
  process 0's ``WorkdirClaim`` holds the workdir for the job), closed like any claim."""

  def __init__(self, workdir: Any):
    super().__init__(workdir, None, {}, None)


def claim_for_job(workdir: str | os.PathLike, process_index: int,
                  agree: Callable[[int], int] | None = None) -> WorkdirClaim:
  """The workdir claim of one process of a (possibly multi-process) job.

  The rule: process 0 claims ``workdir`` (``claim``: the lock, the resume-or-refuse check);
  every other process claims nothing, because the job's process 0 holds the lock for it, and
  gets a ``JobMember``. ``agree`` sends process 0's outcome (an int) to every process and
  returns it (every process calls it once, together: ``rlax_llm.distributed.agree``); with it
  a refused claim fails the whole job, each process raising the same class of error, instead
  of leaving the other processes waiting for a process 0 that has exited. ``agree=None``
  (one process) skips the exchange.

  Args:
    workdir: the run directory (the same path or ``gs://`` URL in every process).
    process_index: this process's index in the job (``jax.process_index()``).
    agree: process 0's value -> every process; required when ``process_index > 0``.

  Returns:
    Process 0: a held ``WorkdirClaim``; other processes: a ``JobMember`` (a claim that
    holds nothing).

  Raises:
    WorkdirInUse, WorkdirHasRun, WorkdirError: as ``claim``, in process 0 with ``claim``'s
      message, in the others with a message pointing at process 0's.
  """
  if process_index == 0:
    try:
      result = claim(workdir)
    except WorkdirError as e:
      if agree is not None:
        agree(1 if isinstance(e, WorkdirInUse) else 2 if isinstance(e, WorkdirHasRun) else 3)
      raise
    except BaseException:
      if agree is not None:
        agree(3)
      raise
    if agree is not None:
      agree(0)
    return result
  if agree is None:
    raise ValueError(f'process {process_index} of a job needs agree (process 0\'s claim '
                     'outcome, rlax_llm.distributed.agree) to know whether the job may run.')
  error = _CLAIM_OUTCOMES.get(int(agree(0)), WorkdirError)
  if error is not None:
    raise error(f'process 0 of this job could not claim workdir {workdir} ({error.__name__}; '
                'its log says why, e.g. another run holds it); this process stops with it. '
                'Pass another --workdir to every process, or wait for that run to finish.')
  return JobMember(storage.path(workdir))
