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
step. Decisions that depend on a process's own clock or signals go through them, because
processes that decide differently would wait on each other's collectives forever.
"""

from __future__ import annotations

import logging
import re
import threading

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

  In a multi-process job ``is_set()`` is a collective (an all-gather of one int): every
  process must call it at the same points, as the controller and the warm-up do (after each
  step, from the main thread). One process: ``event.is_set()``.
  """

  def __init__(self, event: threading.Event):
    self.event = event

  def set(self) -> None:
    """Sets this process's flag."""
    self.event.set()

  def is_set(self) -> bool:
    """Whether any process of the job has been asked to stop."""
    import jax  # pylint: disable=import-outside-toplevel  # this module stays jax-free to import
    if jax.process_count() == 1:
      return self.event.is_set()
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return bool(np.any(multihost_utils.process_allgather(np.int32(self.event.is_set()))))
