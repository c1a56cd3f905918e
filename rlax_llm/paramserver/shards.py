"""What a push is made of: each leaf's ``(shape, dtype)`` and the blocks of a sharded tree.

``local_shards(params)`` describes the params a process holds as a ``ShardPush``: the whole
tree's structure, leaf paths and ``LeafSpec`` (global shape, dtype name) of each leaf, and
the distinct blocks (``Shard``: a leaf number, its ``Box`` in the leaf and its data) this
process holds of it. ``ParameterServer.push_shards`` (``rlax_llm.paramserver.server``)
assembles versions from them; the shared-memory transport (``paramserver.shm``) writes whole
leaves as shards. ``leaf_specs`` is the ``LeafSpec`` of every leaf of a tree, the template a
server, a receiver and the engine compare params against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

# A leaf's static description: (shape, dtype name), e.g. ((2, 3), 'float32').
LeafSpec = tuple[tuple[int, ...], str]


def leaf_specs(tree: Any) -> dict[str, LeafSpec]:
  """Leaf path (``jax.tree_util.keystr``) -> ``(shape, dtype name)`` of every leaf of
  ``tree`` (arrays, ``jax.ShapeDtypeStruct``s or Python scalars), in tree order."""
  leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): leaf_spec(leaf) for path, leaf in leaves_with_path}


@functools.cache
def dtype_name(dtype: Any) -> str:
  """``str(np.dtype(dtype))``, remembered (numpy computes it afresh each time, slowly)."""
  return str(np.dtype(dtype))


def leaf_spec(leaf: Any) -> LeafSpec:
  """(shape, dtype name) of an array, a ``jax.ShapeDtypeStruct`` or a Python scalar."""
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    return tuple(int(d) for d in leaf.shape), dtype_name(leaf.dtype)
  arr = np.asarray(leaf)
  return arr.shape, str(arr.dtype)


# A shard's place in its leaf: (start, stop) per dimension.
Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Shard:
  """One block of leaf number ``leaf`` (tree order): the elements ``box`` (``(start, stop)``
  per dimension) with the values ``data`` (an array of the box's shape and the leaf's dtype:
  numpy, or a single-device ``jax.Array`` the server copies from). ``checksum``: the
  ``delta.checksum`` of ``data`` when its writer already took it (a whole leaf written into a
  shared-memory slot, ``rlax_llm.paramserver.shm``), used when the server adopts it."""

  leaf: int
  box: Box
  data: Any
  checksum: int | None = None


@dataclasses.dataclass(frozen=True)
class ShardPush:
  """What one process pushes of one version: the whole tree's description (structure, leaf
  paths, global ``(shape, dtype)`` of each leaf) and the shards of it this process holds.
  Built by ``local_shards``; picklable (shards of numpy arrays), so it can cross processes."""

  treedef: Any
  paths: tuple[str, ...]
  specs: tuple[LeafSpec, ...]
  shards: tuple[Shard, ...]

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(box_shape(s.box))) * np.dtype(self.specs[s.leaf][1]).itemsize
               for s in self.shards)


def box_shape(box: Box) -> tuple[int, ...]:
  """The shape of the block ``box``."""
  return tuple(stop - start for start, stop in box)


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
  """A ``jax.Shard.index`` (slices, ``None`` bounds allowed) as a box of ``shape``."""
  box = []
  for sl, dim in zip(index, shape):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise ValueError(f'shard index {index} has a step; shards must be contiguous blocks.')
    box.append((start, stop))
  return tuple(box)


def overlap(a: Box, b: Box) -> bool:
  """Whether the blocks ``a`` and ``b`` of one leaf share an element."""
  return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def local_shards(params: Any, to_host: bool = False) -> ShardPush:
  """The shards of ``params`` this process holds, ready for ``ParameterServer.push_shards``.

  A leaf that is a ``jax.Array`` contributes one shard per distinct block among its
  addressable shards (those with ``replica_id == 0``; the block's device data, copied by the
  server straight into its host leaf, never gathered whole first); other leaves (numpy
  arrays, Python scalars) one shard covering the whole leaf. On a multi-host trainer each
  process pushes its own ``local_shards``; the blocks of all processes together cover every
  leaf exactly once. Device-to-host copies of all shards start here, asynchronously.

  ``to_host``: the shards' data as host numpy arrays (each block brought to host on its own;
  zero-copy views on CPU devices), for a push that crosses processes (pickled; on Ray into
  the object store). Otherwise single-device ``jax.Array`` s, for a server in this process.
  """
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths, specs, blocks = [], [], []  # blocks: (leaf, box, data)
  for i, (path, leaf) in enumerate(leaves_with_path):
    paths.append(jax.tree_util.keystr(path))
    if isinstance(leaf, jax.Array):
      shape = tuple(int(d) for d in leaf.shape)
      specs.append((shape, dtype_name(leaf.dtype)))
      for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
          shard.data.copy_to_host_async()  # every block's transfer starts before any is read
          blocks.append((i, box_of(shard.index, shape), shard.data))
    else:
      arr = np.asarray(leaf)
      specs.append((arr.shape, dtype_name(arr.dtype)))
      blocks.append((i, tuple((0, d) for d in arr.shape), arr))
  shards = [Shard(i, box, np.asarray(data) if to_host else data) for i, box, data in blocks]
  return ShardPush(treedef, tuple(paths), tuple(specs), tuple(shards))
