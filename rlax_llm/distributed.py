"""Multi-host start-up: ``jax.distributed.initialize`` from ``config.distributed``.

On a multi-host TPU slice every host runs the same ``python -m rlax_llm.launch`` command; each
process must join the others before JAX touches a device, so that ``jax.devices()`` (and the
config validation and role meshes built over it) spans every host. ``config.distributed``:

* ``initialize``: call ``jax.distributed.initialize`` (False: a single process).
* ``coordinator_address`` (``host:port`` of process 0), ``num_processes`` (one per host),
  ``process_id`` (this process's index): None lets JAX discover them, which it does on Cloud
  TPU; elsewhere give all three.

The Cloud TPU recipes (``launch/multihost``, ``launch/gke``) pass them explicitly per host.
"""

from __future__ import annotations

import logging
import re

import ml_collections

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
