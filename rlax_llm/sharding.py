"""Device meshes and the logical-axis rules that place params and batches on them.

Parameters carry logical axis names (``rlax_llm.models.decoder``); ``LOGICAL_RULES`` maps
each name to mesh axes, as in MaxText / Tunix. A dimension whose size does not divide by
the product of its mesh axes is replicated instead (tiny models on big meshes stay
runnable); ``param_shardings`` reports no error for that, by design.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# logical axis -> mesh axes (None = replicated).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ('batch', ('data', 'fsdp')),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    # A mixture of experts' stacked experts (``models.moe``): expert parallelism over the
    # data axis (GShard's layout: each data-parallel group holds its share of the experts,
    # fsdp and tensor split each expert's matrices as the dense MLP's).
    ('expert', 'data'),
    ('head_dim', None),
    ('length', None),
    ('layers', None),  # the stacked blocks' layer axis (decoder.stack_layers): the scan
    # reads one layer at a time, so it is never sharded.
)


def mesh_shape(axis_sizes: Mapping[str, int], devices: int) -> dict[str, int]:
  """The size of each axis of a mesh ``axis_sizes`` laid over ``devices`` devices.

  ``make_mesh``'s sizing without devices (the Cloud TPU recipes in ``launch/`` size meshes
  for slices they do not run on). The mesh takes the first devices and may leave some out.

  Args:
    axis_sizes: size per axis name; at most one may be -1 (the remaining devices). Missing
      axes have size 1.
    devices: how many devices there are.

  Returns:
    ``{'data': n, 'fsdp': n, 'tensor': n}`` (``MESH_AXES`` order), every size positive.

  Raises:
    ValueError: an unknown axis, more than one -1, a size neither positive nor -1,
      ``devices`` not divisible by the fixed axes, or a mesh of more than ``devices``.
  """
  unknown = set(axis_sizes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f'Unknown mesh axes {sorted(unknown)}; valid axes are {MESH_AXES}.')
  sizes = {name: int(axis_sizes.get(name, 1)) for name in MESH_AXES}
  if list(sizes.values()).count(-1) > 1:
    raise ValueError(f'At most one mesh axis may be -1, got {sizes}.')
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f'Mesh axis sizes must be positive or -1, got {sizes}.')
  if -1 in sizes.values():
    known = math.prod(s for s in sizes.values() if s != -1)
    if devices % known:
      raise ValueError(f'{devices} devices do not divide by the fixed mesh axes {sizes}.')
    sizes = {name: devices // known if s == -1 else s for name, s in sizes.items()}
  if math.prod(sizes.values()) > devices:
    raise ValueError(f'Mesh {sizes} needs {math.prod(sizes.values())} devices; {devices} are '
                     'available.')
  return sizes


def make_mesh(axis_sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None
              ) -> Mesh:
  """Builds a ``Mesh`` with axes ``('data', 'fsdp', 'tensor')`` (Auto axis types).

  Args:
    axis_sizes: size per axis name; at most one may be -1 (use the remaining devices).
      Missing axes have size 1. Sized by ``mesh_shape`` (its errors, as ValueError).
    devices: defaults to ``jax.devices()``; the mesh takes the first ones it needs.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = list(mesh_shape(axis_sizes, len(devices)).values())
  grid = np.array(devices[:math.prod(sizes)]).reshape(sizes)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def role_meshes(trainer_axes: Mapping[str, int], inference_axes: Mapping[str, int], *,
                workers: int = 1, disjoint: bool = False,
                devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
  """``{'trainer': Mesh, 'inference': [Mesh per worker]}`` for the run's roles.

  With ``disjoint`` the trainer takes the first devices and each worker the next ones (8
  devices, trainer ``data=4``, one worker ``data=4``: devices 0-3 and 4-7); otherwise every
  mesh starts at device 0 and the roles share devices. Raises ValueError when the devices
  do not suffice.

  Multi-process (``jax.distributed``, ``devices`` None): the trainer's mesh spans every
  process's devices (``jax.devices()``: one jitted step in which every process takes part),
  while each process's inference meshes take only its own devices (``jax.local_devices()``):
  every process runs its own workers, which no other process takes part in. ``disjoint`` is
  refused there, and so is a trainer mesh that leaves a process out.
  """
  local = None if devices is not None or jax.process_count() == 1 else jax.local_devices()
  if local is not None and disjoint:
    raise ValueError(f'disjoint=True in a {jax.process_count()}-process job: every process '
                     'takes part in every trainer step and runs its inference workers on its '
                     'own devices, so the roles cannot have disjoint devices; set '
                     'mesh.disjoint=False (the roles take turns on every device), or use '
                     "backend='ray' for trainer and inference on separate hosts.")
  devices = list(jax.devices() if devices is None else devices)
  try:
    trainer = make_mesh(trainer_axes, devices)
  except ValueError as e:
    raise ValueError(f'trainer: {e}') from None
  offset = trainer.devices.size if disjoint else 0
  if local is not None:
    left_out = set(range(jax.process_count())) - {d.process_index for d in trainer.devices.flat}
    if left_out:
      raise ValueError(f'trainer: the mesh {dict(trainer.shape)} takes {trainer.devices.size} '
                       f'of the job\'s {len(devices)} devices and leaves out process(es) '
                       f'{sorted(left_out)}, but every process takes part in every trainer '
                       'step; size it to every device (e.g. data=-1).')
    devices = local
  inference = []
  for worker in range(workers):
    if disjoint and offset >= len(devices):
      raise ValueError(f'inference: worker {worker} gets no device: the trainer and the '
                       f'{worker} worker(s) before it use all {len(devices)} devices.')
    try:
      mesh = make_mesh(inference_axes, devices[offset:])
    except ValueError as e:
      raise ValueError(f'inference: worker {worker}: {e}') from None
    inference.append(mesh)
    if disjoint:
      offset += mesh.devices.size
  return {'trainer': trainer, 'inference': inference}


def _mesh_axes_for(name: str | None, rules: Mapping[str, Any]):
  if name is None:
    return None
  if name not in rules:
    raise ValueError(f'No sharding rule for logical axis {name!r}; rules cover {sorted(rules)}.')
  return rules[name]


def logical_to_spec(logical: PartitionSpec, shape: Sequence[int], mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> PartitionSpec:
  """Maps a logical ``PartitionSpec`` to a mesh ``PartitionSpec`` for an array of ``shape``.

  A mesh axis is used at most once; a dimension not divisible by its mesh axes is replicated.
  """
  rules = dict(rules)
  used: set[str] = set()
  out = []
  for dim, name in zip(shape, logical):
    axes = _mesh_axes_for(name, rules)
    if axes is None:
      out.append(None)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not axes or dim % size:
      out.append(None)
      continue
    used.update(axes)
    out.append(axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*out)


def param_shardings(abstract_params: Any, logical_axes: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
  """A params-shaped tree of ``NamedSharding`` from logical axes and shapes."""
  return jax.tree.map(
      lambda x, spec: NamedSharding(mesh, logical_to_spec(spec, x.shape, mesh, rules)),
      abstract_params, logical_axes)


def batch_sharding(mesh: Mesh, batch: Any,
                   rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
  """Shards dim 0 (``batch``) of every leaf; other dims replicated."""
  def one(x):
    logical = PartitionSpec('batch', *([None] * (np.ndim(x) - 1)))
    return NamedSharding(mesh, logical_to_spec(logical, np.shape(x), mesh, rules))
  return jax.tree.map(one, batch)


def place(tree: Any, shardings: Any) -> Any:
  """``jax.device_put(tree, shardings)`` where every process holds the whole of each leaf
  (the controller is replicated across hosts and deterministic, so every process has the
  same batch, the same initial params).

  One process: ``jax.device_put``. Several (multi-host, after ``jax.distributed.initialize``):
  a leaf that is already a global array (spanning processes) is ``device_put`` (a reshard
  among the same devices); any other leaf (numpy, or a JAX array this process holds whole,
  e.g. restored onto one of its devices) becomes a global array built from this process's
  copy, each process making only its own devices' shards (``jax.make_array_from_callback``):
  no bytes cross hosts, and no cross-host transfer (which the CPU backend lacks) is needed.
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, sharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(one, tree, shardings)


def global_batch(batch: Any, mesh: Mesh,
                 rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
  """Places a host batch (the whole batch, which every process holds) as global arrays
  sharded by ``batch_sharding`` (``place``: on several hosts each process builds only its
  own devices' rows, so no host ever sends rows to another)."""
  return place(batch, batch_sharding(mesh, batch, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


# Activation sharding: models call ``constrain(x, logical_axes)`` on their activations; it is
# a no-op unless a caller (the trainer) traces them inside ``activation_sharding(mesh)``.
_ACTIVATION: contextvars.ContextVar = contextvars.ContextVar('activation_sharding',
                                                            default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES):
  """Within this context (at trace time), ``constrain`` pins activations to ``mesh``."""
  token = _ACTIVATION.set((mesh, tuple(rules)))
  try:
    yield
  finally:
    _ACTIVATION.reset(token)


def activation_context() -> tuple[Mesh, tuple[tuple[str, Any], ...]] | None:
  """``(mesh, rules)`` of the enclosing ``activation_sharding`` (at trace time), or None: the
  mesh a model's activations are laid out on (``models.moe`` dispatches tokens over it)."""
  return _ACTIVATION.get()


def mesh_axes_of(name: str, mesh: Mesh | Mapping[str, int],
                 rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> tuple[str, ...]:
  """The mesh axes of size > 1 that ``rules`` map the logical axis ``name`` to (major
  first), as ``logical_to_spec`` uses them for a leading dimension that divides; ``mesh`` a
  ``Mesh`` or its axis sizes."""
  axes = _mesh_axes_for(name, dict(rules))
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
  return tuple(a for a in axes if sizes[a] > 1)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """``with_sharding_constraint`` by logical axis names; identity outside the context."""
  context = _ACTIVATION.get()
  if context is None:
    return x
  mesh, rules = context
  spec = logical_to_spec(PartitionSpec(*logical), x.shape, mesh, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
