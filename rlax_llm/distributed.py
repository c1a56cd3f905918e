"""Multi-host start-up: ``jax.distributed.initialize`` from ``config.distributed``.

On a multi-host TPU slice every host runs the same ``python -m rlax_llm.launch`` command; each
process must join the others before JAX touches a device, so that ``jax.devices()`` (and the
config validation and role meshes built over it) spans every host. ``config.distributed``:

* ``initialize``: call ``jax.distributed.initialize`` (False: a single process).
* ``coordinator_address`` (``host:port`` of process 0), ``num_processes`` (one per host),
  ``process_id`` (this process's index): None lets JAX discover them, which it does on Cloud
  TPU; elsewhere give all three.

The Cloud TPU recipes (``launch/multihost``, ``launch/gke``) pass them explicitly per host.
On CPU (tests, loopback) the processes' collectives go through Gloo, JAX's default
``jax_cpu_collectives_implementation``.

What each process of a job does (``rlax_llm.launch``): process 0 claims the workdir for the
job and writes ``config.json``, metrics, ledger, TensorBoard and summary; every process runs
the same deterministic controller (same data order, RNG and schedule), so they issue the
same jitted trainer steps over the trainer mesh that spans every process's devices, and
each runs its inference workers on its own devices (``jax.local_devices()``); every process
writes its part of the Orbax checkpoints. ``agree`` sends process 0's value to all;
``JobStop`` makes a preemption signal seen by any process stop every process after the same
step, or abandon the same step at the same agreement point (``JobStop.wait``). Decisions
that depend on a process's own clock or signals go through them, because processes that
decide differently would wait on each other's collectives forever.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from rlax_llm.cli import lookup
from rlax_llm.errors import ConfigError

_ADDRESS = re.compile(r'[^\s:]+:\d{1,5}')


def settings(config: ml_collections.ConfigDict) -> dict | None:
  """The ``jax.distributed.initialize`` arguments ``config`` asks for, or ``None`` (no call).

  Raises:
    ConfigError: inconsistent settings or a missing ``distributed`` key; the message names
      the key, the value and the fix.
  """
  if not lookup(config, 'distributed.initialize'):
    return None
  kwargs = {k: lookup(config, f'distributed.{k}')
            for k in ('coordinator_address', 'num_processes', 'process_id')
            if lookup(config, f'distributed.{k}') is not None}
  n, pid = kwargs.get('num_processes'), kwargs.get('process_id')
  if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
    raise ConfigError(f'config.distributed.num_processes={n!r} must be an int >= 1 (one process '
                     'per host), or None to let JAX discover it (Cloud TPU).')
  if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 0
                          or (n is not None and pid >= n)):
    raise ConfigError(f'config.distributed.process_id={pid!r} must be in [0, num_processes='
                     f'{n}); give each host its own index, or None to let JAX discover it.')
  address = kwargs.get('coordinator_address')
  if address is not None and not _ADDRESS.fullmatch(str(address)):
    raise ConfigError(f'config.distributed.coordinator_address={address!r} must be HOST:PORT '
                     'of process 0, reachable from every host (e.g. 10.0.0.2:8476).')
  return kwargs


def initialize(config: ml_collections.ConfigDict) -> bool:
  """Joins the job ``config.distributed`` describes; returns whether it did.

  Must run before anything initialises a JAX backend (``rlax_llm.launch`` calls it first,
  before validating the config, which builds meshes over ``jax.devices()``).
  """
  kwargs = settings(config)
  if kwargs is None:
    return False
  import jax  # pylint: disable=import-outside-toplevel
  jax.distributed.initialize(**kwargs)
  logging.info('jax.distributed: process %d of %d, %d local / %d global devices',
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def agree(value: int) -> int:
  """Process 0's ``value`` in every process of the job (a collective: every process calls it
  at the same point); ``value`` itself in a single-process run. ``value``: an int32."""
  import jax  # pylint: disable=import-outside-toplevel  # this module stays jax-free to import
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


class JobStop:
  """A preemption flag the whole job agrees on: ``is_set()`` is True in every process once
  any process's ``event`` is set (``checkpoint.PreemptionGuard.requested``), so every process
  saves and stops after the same step.

  In a multi-process job ``is_set()`` is a collective (``_Votes``: every process's few ints
  through the job's coordination service): every process must call it at the same points,
  as the controller and the warm-up do (after each step, from the main thread). One process:
  ``event.is_set()``.

  Within a step, ``wait`` makes the job abandon it together (``Controller._abandon_window``):
  its agreement points are the same exchange, so a signal that reaches one process (or each
  at its own instant) is acted on by every process at the same point, and never by raising
  at an arbitrary point of one process.
  """

  def __init__(self, event: threading.Event):
    self.event = event
    # True once the job has agreed to finish the current step and save after it (a signal
    # came while the step was expected to fit the notice): no more agreement points.
    self.finishing = False
    self.agreements = 0  # agreement points passed (``wait``), the same count in every process

  def set(self) -> None:
    """Sets this process's flag."""
    self.event.set()

  def is_set(self) -> bool:
    """Whether any process of the job has been asked to stop."""
    return bool(np.any(_VOTES.exchange(int(self.event.is_set()), 0, 1)[:, 0]))

  def agree(self, ready: bool, overruns: Callable[[], bool]) -> tuple[bool, bool, bool]:
    """One agreement point (a collective in a multi-process job): ``(stop, abandon, ready)``,
    the same in every process. ``stop``: some process's ``event`` is set; ``abandon``:
    ``stop`` and process 0's ``overruns()`` (evaluated by process 0 alone, so the processes
    cannot decide differently); ``ready``: every process passed ``ready`` True."""
    import jax  # pylint: disable=import-outside-toplevel  # this module stays jax-free to import
    overrun = jax.process_index() == 0 and overruns()
    votes = _VOTES.exchange(int(self.event.is_set()), int(overrun), int(ready))
    stop = bool(np.any(votes[:, 0]))
    return stop, stop and bool(votes[0, 1]), bool(np.all(votes[:, 2]))

  def wait(self, futures: Sequence[concurrent.futures.Future], overruns: Callable[[], bool],
           poll_s: float, timeout_s: float) -> bool:
    """Waits until every process's ``futures`` are done (or ``timeout_s`` has passed in that
    process: its own handling of a silent worker follows), passing an agreement point
    (``agree``) every ``poll_s`` seconds of waiting and when its futures are done (a process
    that is ready waits in the collective for the others). Returns True when the
    job agreed to abandon the step (in every process at the same point), False when the
    waiting is over, or at once when the job is ``finishing`` the step.

    Every process must call it at the same points with the same ``poll_s``: the number of
    agreement points is agreed (each says whether every process is ready), not counted on a
    process's own clock."""
    deadline = time.monotonic() + timeout_s
    while not self.finishing:
      concurrent.futures.wait(futures, timeout=max(0.0, min(poll_s,
                                                            deadline - time.monotonic())))
      ready = all(f.done() for f in futures) or time.monotonic() >= deadline
      stop, abandon, all_ready = self.agree(ready, overruns)
      self.agreements += 1
      if abandon:
        return True
      if stop:
        logging.warning('the job was asked to stop; the current step is expected to fit the '
                        'preemption notice: finishing it and saving after it.')
        self.finishing = True
      if all_ready:
        break
    return False


class _Votes:
  """Every process's few ints at the same point of the job (a collective: every process calls
  ``exchange`` the same number of times, in the same order; one sequence per process,
  ``_VOTES``, whichever ``JobStop`` asks).

  Through the coordination service ``jax.distributed.initialize`` started (its key-value
  store, which Orbax's barriers and JAX's preemption sync manager use too), not a device
  collective: a ``multihost_utils.process_allgather`` runs on the devices, queued behind the
  program a process's inference worker is running there, and took seconds to answer while
  the workers generated (measured on the 2-process CPU job; docs/checkpoints.md). Round
  ``r`` is ``KEY/<r>/<process>``; a process deletes its key of round ``r - 2`` at round
  ``r`` (every process has read it: each finished round ``r - 1``'s reads before this one).
  """

  KEY = 'rlax_llm/job_stop'
  TIMEOUT_MS = 3_600_000  # a process that dies is reported by the service before that

  def __init__(self):
    self.round = 0

  def exchange(self, *votes: int) -> np.ndarray:
    """``[process, len(votes)]`` int: every process's ``votes`` (this process's alone in a
    single-process run)."""
    import jax  # pylint: disable=import-outside-toplevel  # this module stays jax-free to import
    if jax.process_count() == 1:
      return np.asarray(votes, np.int64)[None]
    # The client of jax.distributed.initialize (what orbax.checkpoint.multihost uses).
    from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
    client = jax_distributed.global_state.client
    self.round += 1
    client.key_value_set(f'{self.KEY}/{self.round}/{jax.process_index()}',
                         ','.join(str(int(v)) for v in votes))
    rows = [client.blocking_key_value_get(f'{self.KEY}/{self.round}/{p}', self.TIMEOUT_MS)
            for p in range(jax.process_count())]
    if self.round > 2:
      client.key_value_delete(f'{self.KEY}/{self.round - 2}/{jax.process_index()}')
    return np.asarray([[int(v) for v in row.split(',')] for row in rows], np.int64)


_VOTES = _Votes()
