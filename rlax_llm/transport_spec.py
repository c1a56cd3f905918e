"""How the Ray backend moves weight versions (``paramserver.transport``): the choices and their
check, defined once.

JAX-free, like the other spec modules (``loss_spec``, ``model_spec``, ``sampling_spec``):
``rlax_llm.config`` validates ``paramserver.transport`` with it without importing the
parameter server, and ``rlax_llm.paramserver.shm.use_slots`` checks the value it decides on.
"""

from __future__ import annotations

# 'auto': shared-memory slots between the Ray actors of one machine, the object store between
# machines (and from a trainer of several processes); 'object_store': always the object store.
TRANSPORTS = ('auto', 'object_store')


def check_transport(transport: str) -> str:
  """Returns ``transport`` if it is one of ``TRANSPORTS``.

  Raises:
    ValueError: naming the value seen and the choices, each with what it means.
  """
  if transport not in TRANSPORTS:
    raise ValueError(f'paramserver.transport={transport!r}: expected one of {TRANSPORTS} '
                     "('auto': shared memory between the Ray actors of one machine, else the "
                     "object store; 'object_store': always the object store).")
  return transport
