"""Multi-host start-up: ``jax.distributed.initialize`` from ``config.distributed``.

On a multi-host TPU slice every host runs the same ``python -m rlax_llm.launch`` command; each
process must join the others before JAX touches a device, so that ``jax.devices()`` (and the
role meshes built over it) spans every host. ``config.distributed``:

* ``num_processes``: processes in the job (one per host); 1 (the default) = single process,
  nothing is initialised.
* ``process_id``: this process's index in ``[0, num_processes)``.
* ``coordinator_address``: ``host:port`` of process 0, which every process can reach.

The Cloud TPU recipes (``launch/multihost``, ``launch/gke``) fill these in per host.
"""

from __future__ import annotations

import re

import ml_collections

_ADDRESS = re.compile(r'[^\s:]+:\d{1,5}')


def settings(config: ml_collections.ConfigDict) -> dict | None:
  """The ``jax.distributed.initialize`` arguments ``config`` asks for, or ``None``.

  Raises:
    ValueError: inconsistent settings; the message names the key, the value and the fix.
  """
  group = config.get('distributed')
  if group is None or group.num_processes == 1:
    return None
  n, pid, address = group.num_processes, group.process_id, group.coordinator_address
  if not isinstance(n, int) or n < 1:
    raise ValueError(f'config.distributed.num_processes={n!r} must be an int >= 1 (one process '
                     'per host; 1 = single process).')
  if not isinstance(pid, int) or not 0 <= pid < n:
    raise ValueError(f'config.distributed.process_id={pid!r} must be in [0, {n}) '
                     f'(num_processes={n}); give each host its own index.')
  if not address or not _ADDRESS.fullmatch(str(address)):
    raise ValueError(f'config.distributed.coordinator_address={address!r} must be HOST:PORT '
                     'of process 0, reachable from every host (e.g. 10.0.0.2:8476).')
  return dict(coordinator_address=str(address), num_processes=n, process_id=pid)


def initialize(config: ml_collections.ConfigDict) -> bool:
  """Joins the job ``config.distributed`` describes; returns whether it did.

  Must run before anything initialises a JAX backend (``rlax_llm.launch`` calls it first).
  """
  kwargs = settings(config)
  if kwargs is None:
    return False
  import jax  # pylint: disable=import-outside-toplevel
  jax.distributed.initialize(**kwargs)
  return True
