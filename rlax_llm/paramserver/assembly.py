"""Assembling one version of the parameter server from the shard pushes of its processes.

A trainer spanning ``P`` processes pushes each version as ``P`` ``ShardPush`` es
(``rlax_llm.paramserver.shards``); ``PendingVersion`` is that version while it is incomplete:
its host leaves, filled block by block straight from each shard (or, for a read-only
whole-leaf shard pushed with ``adopt``, the shard itself), the blocks reserved per leaf (an
overlap is refused), and each leaf's checksum, taken once by the push that completes it.
``ParameterServer.push_shards`` (``rlax_llm.paramserver.server``) drives it and commits the
version once every block arrived. A dropped version's buffers come back as ``spare`` leaves
(``take_spare``) for the next one.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.paramserver.shards import Box, LeafSpec, ShardPush, box_shape, dtype_name, overlap


class PendingVersion:
  """A version being assembled from the shards of ``process_count`` processes: its host
  leaves (allocated, filled block by block), the blocks reserved per leaf, the elements
  still missing per leaf, the processes that pushed and finished, each complete leaf's
  checksum. The server calls ``check_joins``, ``reserve`` and ``describe`` with its lock
  held, and ``write`` without it (``write`` takes the lock to count what it filled)."""

  def __init__(self, process_count: int, treedef: Any, paths: list[str],
               specs: list[LeafSpec], spare: dict[LeafSpec, list[np.ndarray]]):
    self.process_count = process_count
    self.treedef, self.paths, self.specs = treedef, paths, specs
    self.leaves = [take_spare(spare, spec) for spec in specs]
    self.boxes: list[list[Box]] = [[] for _ in specs]
    self.missing = [leaf.size for leaf in self.leaves]
    self.pushed: set[int] = set()
    self.finished = 0
    self.checksums: list[int | None] = [None] * len(specs)
    for i, leaf in enumerate(self.leaves):
      if leaf.size == 0:  # complete from the start: it has no element to wait for
        leaf.setflags(write=False)
        self.checksums[i] = delta_lib.checksum(leaf)

  def check_joins(self, shards: ShardPush, process_index: int, process_count: int,
                  version: int) -> None:
    """A later process's push of a pending version agrees with the first one's."""
    if process_count != self.process_count:
      raise ValueError(f'process {process_index} pushes version {version} as one of '
                       f'{process_count} processes; the first push said '
                       f'{self.process_count}. Every process passes jax.process_count().')
    if process_index in self.pushed:
      raise ValueError(f'process {process_index} already pushed version {version}; each '
                       'process pushes its shards of a version once.')
    if (shards.treedef, list(shards.paths), list(shards.specs)) != (
        self.treedef, self.paths, self.specs):
      raise ValueError(f'process {process_index} pushes version {version} with another tree, '
                       'leaf shapes or dtypes than the first push; every process pushes the '
                       "same params' shards.")

  def reserve(self, shards: ShardPush, process_index: int, version: int) -> None:
    """Reserves the blocks of process ``process_index``'s push, or raises (reserving nothing)
    when one overlaps a block already reserved."""
    reserved = [list(boxes) for boxes in self.boxes]
    for shard in shards.shards:
      clash = next((b for b in reserved[shard.leaf] if overlap(b, shard.box)), None)
      if clash is not None:
        raise ValueError(
            f'push of version {version} by process {process_index} rejected: its shard '
            f'{shard.box} of leaf {self.paths[shard.leaf]} overlaps the block {clash} already '
            'pushed. Push each block once: the shards with replica_id == 0 '
            '(local_shards).')
      reserved[shard.leaf].append(shard.box)
    self.boxes = reserved
    self.pushed.add(process_index)

  def write(self, shards: ShardPush, adopt: bool, lock: threading.Lock) -> None:
    """Copies the (reserved) shards into the pending leaves (or, with ``adopt``, keeps a
    whole-leaf read-only shard as its leaf), then checksums the leaves this push completed
    (outside ``lock``, the server's: a complete leaf is never written again)."""
    written = [0] * len(self.leaves)
    whole = {}  # leaf -> checksum, for the leaves this push sends as one block
    for shard in shards.shards:
      target = self.leaves[shard.leaf]
      if target.size == 0:
        continue
      if adopt and box_shape(shard.box) == target.shape and adoptable(shard.data):
        # A view: never owndata, so a dropped version never hands it to take_spare. The
        # leaf is covered by this one shard only (overlaps were refused), so no other push
        # writes to self.leaves[shard.leaf].
        self.leaves[shard.leaf] = shard.data.view()
        whole[shard.leaf] = (delta_lib.checksum(shard.data) if shard.checksum is None
                             else shard.checksum)
      elif box_shape(shard.box) == target.shape:  # copied and summed in one pass
        whole[shard.leaf] = delta_lib.copy_with_checksum(target, np.asarray(shard.data))
      else:
        target[tuple(slice(start, stop) for start, stop in shard.box)] = np.asarray(shard.data)
      written[shard.leaf] += int(np.prod(box_shape(shard.box)))
    with lock:
      completed = []
      for i, n in enumerate(written):
        if n:
          self.missing[i] -= n
          if self.missing[i] == 0:
            completed.append(i)
    for i in completed:
      self.leaves[i].setflags(write=False)
      self.checksums[i] = whole[i] if i in whole else delta_lib.checksum(self.leaves[i])

  def describe(self) -> str:
    """What this version still lacks."""
    waiting = [p for p, n in zip(self.paths, self.missing) if n]
    return (f'processes {sorted(self.pushed)} of {self.process_count} pushed; '
            f'{len(waiting)} of {len(self.paths)} leaves lack blocks, e.g. {waiting[:3]}')


def take_spare(spare: dict[LeafSpec, list[np.ndarray]], spec: LeafSpec) -> np.ndarray:
  """A writable array of ``spec``: a leaf of a dropped version that nothing references any
  more (no snapshot, view, delta or device buffer of it is alive), taken out of ``spare``,
  else a new one. Writing into memory already touched copies about twice as fast as into
  fresh pages (14 vs 6 GB/s on the 2-core dev machine). Unshared means the pool's reference
  and the argument's are the only ones: every view of a numpy array references its owner,
  and a zero-copy device buffer references the array it aliases."""
  arrays = spare.get(spec, [])
  for i in range(len(arrays)):
    if sys.getrefcount(arrays[i]) == 2:
      leaf = arrays.pop(i)
      leaf.setflags(write=True)
      return leaf
  return np.empty(*spec)


def adoptable(data: Any) -> bool:
  """Whether ``push_shards(adopt=True)`` may keep ``data`` (a shard's values, shape and
  dtype already checked) instead of copying it: a read-only, C-contiguous numpy array."""
  return (isinstance(data, np.ndarray) and not data.flags.writeable
          and data.flags.c_contiguous)


def check_shards(shards: ShardPush) -> None:
  """Each shard lies inside its leaf and has its block's shape and the leaf's dtype."""
  for shard in shards.shards:
    if not 0 <= shard.leaf < len(shards.specs):
      raise ValueError(f'a shard names leaf {shard.leaf}; the tree has '
                       f'{len(shards.specs)} leaves.')
    path, (shape, dtype) = shards.paths[shard.leaf], shards.specs[shard.leaf]
    if len(shard.box) != len(shape) or any(
        not 0 <= start <= stop <= dim for (start, stop), dim in zip(shard.box, shape)):
      raise ValueError(f'the shard {shard.box} of leaf {path} lies outside its shape '
                       f'{shape}; a block is (start, stop) per dimension within it.')
    seen = (tuple(int(d) for d in shard.data.shape), dtype_name(shard.data.dtype))
    if seen != (box_shape(shard.box), dtype):
      raise ValueError(f'the shard {shard.box} of leaf {path} holds {seen[0]} {seen[1]}; '
                       f'its block needs {box_shape(shard.box)} {dtype}.')
