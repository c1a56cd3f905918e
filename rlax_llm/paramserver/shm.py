"""Same-node shared-memory transport of weight versions: a ring of reused segments.

Between processes of one machine (the Ray backend's trainer, server and worker actors on one
node), a version moves through a shared-memory segment that the parameter server's process
owns, instead of being serialised into Ray's object store:

1. the writer (the trainer) asks the server for a slot (``SlotRing.reserve``: a tiny
   message; a free segment of the version's size from the server's ring, or a new one);
2. it copies its shards straight into the slot (``SlotWriter.write``: each whole leaf with
   ``delta.copy_with_checksum``, one copy at memory speed into pages already touched, the
   checksum taken in the same pass) and returns the checksums;
3. the server commits the version by reference to the slot (``SlotRing.commit``: read-only
   views of it adopted as the version's leaves, no copy);
4. a reader (a worker) on the same machine gets, for each whole leaf, a marker
   (``SlotLeaf``: the slot's name and the leaf's offset; no bytes) and maps the slot
   read-only (``SlotReader.resolve``: zero copy), then verifies the checksums as for any
   update.

Reuse. A slot is reused for a later version only when nobody maps it any more: the server's
own views of it are gone (its version was dropped and no pull of it is being answered;
tracked with a weak reference) and no reader holds it. A reader reports the slots it still
holds (those of its views that are alive: ``SlotReader.held``) with every pull, and a pull
answered with a slot leases it to that reader until its next report
(``SlotRing.lease``). A slot that cannot be reused yet is skipped and, when none is free, a
new one is made: the ring holds about ``keep + 1`` segments, more while readers hold old
versions. Pages are touched once, when a segment is made (``os.posix_fallocate``): after the
first versions every copy writes into memory already touched, about twice as fast as into
fresh pages (what ``ray.put`` writes into).

Cleanup. A segment is an anonymous memory file (``memfd_create``, named ``rlax_ps_<ring>_<n>``
for ``/proc``'s listings) that has no path to unlink: the server's process holds its file
descriptor, and the other processes of the machine open it as ``/proc/<server pid>/fd/<fd>``
(same user). The kernel frees its memory once no process holds the descriptor or a mapping:
``SlotRing.close`` (the server's shutdown) closes the server's, and so does the end of its
process, however it ends (a killed actor runs no cleanup; Ray also kills the children of an
actor's process, such as Python's resource tracker, so files in ``/dev/shm`` would be left
behind). Readers and writers drop theirs when their processes end.

Which processes use it is the caller's decision (``use_slots``): processes on one machine
(same node id), a writer that is the whole trainer (one process), and the transport the
config allows (``paramserver.transport``: ``'auto'`` or ``'object_store'``); every other
pair keeps the object-store path.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.paramserver.server import ParameterServer
from rlax_llm.paramserver.shards import LeafSpec, Shard, ShardPush
from rlax_llm.transport_spec import check_transport

PREFIX = 'rlax_ps_'
# Each leaf starts at a multiple of this many bytes in its slot (cache lines, SIMD loads).
ALIGN = 64


def use_slots(transport: str, server_node: str, client_node: str,
              process_count: int = 1) -> bool:
  """Whether a writer or reader on node ``client_node`` moves versions through the server's
  slots (on node ``server_node``): ``transport`` is ``'auto'``, both are on one machine, the
  writer is a whole trainer (``process_count`` 1; the processes of a trainer spanning hosts
  push through the object store) and this machine has memory files (Linux)."""
  return (check_transport(transport) == 'auto' and server_node == client_node and process_count == 1
          and hasattr(os, 'memfd_create') and os.path.isdir('/proc/self/fd'))


def layout(specs: Sequence[LeafSpec]) -> tuple[tuple[int, ...], int]:
  """``(offsets, nbytes)``: where each leaf of ``specs`` (``(shape, dtype name)``) starts in a
  slot (multiples of ``ALIGN``, in leaf order) and the slot's size in bytes."""
  offsets, end = [], 0
  for shape, dtype in specs:
    offsets.append(end)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    end += -(-nbytes // ALIGN) * ALIGN
  return tuple(offsets), end


@dataclasses.dataclass(frozen=True)
class Slot:
  """A segment of the ring (what travels to a writer or reader): ``name``, unique, ``size``
  bytes, open in process ``pid`` as file descriptor ``fd``."""

  name: str
  size: int
  pid: int
  fd: int

  @property
  def path(self) -> str:
    """Where another process of the machine opens it."""
    return f'/proc/{self.pid}/fd/{self.fd}'


@dataclasses.dataclass(frozen=True)
class SlotLeaf:
  """In an update on its way to a reader on the server's machine: leaf ``leaf`` is sent whole
  and lies in slot ``slot`` at byte ``offset`` (``SlotReader.resolve`` maps it)."""

  leaf: int
  slot: Slot
  offset: int
  spec: LeafSpec

  @property
  def nbytes(self) -> int:
    """The leaf's bytes in this update: none (they stay in the slot)."""
    return 0


def _view(buffer: np.ndarray, offset: int, spec: LeafSpec) -> np.ndarray:
  """Leaf ``spec`` at byte ``offset`` of the flat uint8 ``buffer``, as a view."""
  shape, dtype = spec
  nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
  return buffer[offset:offset + nbytes].view(np.dtype(dtype)).reshape(shape)


def _map(slot: Slot, writable: bool) -> mmap.mmap:
  """Maps ``slot`` (from the server's process), read-only unless ``writable``. Raises
  OSError when this process may not open it (``/proc/<pid>/fd`` of another user's process,
  or the server's process is gone)."""
  fd = os.open(slot.path, os.O_RDWR if writable else os.O_RDONLY)
  try:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, slot.size, flags=mmap.MAP_SHARED, prot=prot)
  finally:
    os.close(fd)


def _owner(mapped: mmap.mmap) -> np.ndarray:
  """A new flat uint8 array over all of ``mapped``: every view cut from it (and every view of
  those) has it as its ``base`` (numpy collapses chains of views up to an array whose base
  is not an array), so it lives exactly as long as any of them: what the weak references
  that tell whether a slot is held watch."""
  return np.frombuffer(mapped, np.uint8)


class _Mappings:
  """A process's mappings of slots, by name, made once and kept while the process lives (so
  its pages are faulted in once per process, not once per version)."""

  def __init__(self, writable: bool):
    self._writable = writable
    self._maps: dict[str, mmap.mmap] = {}
    self._lock = threading.Lock()

  def buffer(self, slot: Slot) -> np.ndarray:
    """The whole slot as a new flat uint8 array (``_owner``; read-only unless writable)."""
    with self._lock:
      if slot.name not in self._maps:
        self._maps[slot.name] = _map(slot, self._writable)
      return _owner(self._maps[slot.name])


class SlotWriter:
  """The writer's end (the trainer's process): copies a version's shards into a slot."""

  def __init__(self):
    self._mappings = _Mappings(writable=True)

  def write(self, slot: Slot, shards: ShardPush) -> tuple[int, ...]:
    """Writes every leaf of ``shards`` (this process holds them all: blocks covering each
    leaf exactly once) into ``slot`` at ``layout(shards.specs)`` and returns each leaf's
    ``delta.checksum`` (a whole-leaf shard summed while copied; a leaf of several blocks
    summed once complete). Raises ValueError when the slot is too small or a leaf is not
    covered."""
    offsets, nbytes = layout(shards.specs)
    if nbytes > slot.size:
      raise ValueError(f'slot {slot.name} holds {slot.size} bytes; the version needs {nbytes}.')
    buffer = self._mappings.buffer(slot)
    targets = [_view(buffer, offset, spec) for offset, spec in zip(offsets, shards.specs)]
    written = [0] * len(targets)
    checksums: list[int | None] = [None] * len(targets)
    for shard in shards.shards:
      target, data = targets[shard.leaf], np.asarray(shard.data)
      if data.shape == target.shape:
        checksums[shard.leaf] = delta_lib.copy_with_checksum(target, data)
      else:
        target[tuple(slice(start, stop) for start, stop in shard.box)] = data
      written[shard.leaf] += data.size
    for i, (target, count) in enumerate(zip(targets, written)):
      if count != target.size:
        raise ValueError(f'leaf {shards.paths[i]}: the shards hold {count} of its {target.size} '
                         'elements; a slot is written by a process holding every block.')
      if checksums[i] is None:
        checksums[i] = delta_lib.checksum(target)
    return tuple(checksums)


class SlotReader:
  """A reader's end (a worker's process): maps the slots an update names, read-only."""

  def __init__(self):
    self._mappings = _Mappings(writable=False)
    # slot name -> weak references to the owners of the arrays handed out of it (alive: the
    # slot is held).
    self._handed: dict[str, list[weakref.ref]] = {}
    self._lock = threading.Lock()

  def held(self) -> list[str]:
    """The slots this process still holds (some array handed out of it is alive)."""
    with self._lock:
      for name in list(self._handed):
        self._handed[name] = [ref for ref in self._handed[name] if ref() is not None]
        if not self._handed[name]:
          del self._handed[name]
      return sorted(self._handed)

  def resolve(self, update: delta_lib.Delta) -> delta_lib.Delta:
    """``update`` with every ``SlotLeaf`` replaced by the leaf, a read-only view of its slot
    (held, ``held``, while it or any view of it is alive). The slots stay mapped in this
    process while it lives (a slot is mapped once, not once per version; the server's ring
    keeps its segments for the run)."""
    if not any(isinstance(u, SlotLeaf) for bucket in update.buckets for u in bucket):
      return update

    owners = {}

    def leaf(u):
      if not isinstance(u, SlotLeaf):
        return u
      if u.slot.name not in owners:
        owners[u.slot.name] = self._mappings.buffer(u.slot)
        with self._lock:
          self._handed.setdefault(u.slot.name, []).append(weakref.ref(owners[u.slot.name]))
      return delta_lib.LeafUpdate(u.leaf, full=_view(owners[u.slot.name], u.offset, u.spec))
    return dataclasses.replace(update, buckets=tuple(tuple(leaf(u) for u in bucket)
                                                     for bucket in update.buckets))


@dataclasses.dataclass
class _Segment:
  slot: Slot
  mapped: mmap.mmap
  buffer: np.ndarray
  version: int = -1  # reserved for or committed as (-1: none yet)
  views: Any = None  # weak reference to the owner of the server's views of its version


class SlotRing:
  """The server's end: the ring of segments, their reservations, commits and leases.

  Thread-safe (a server actor answers pulls while a push commits)."""

  def __init__(self, tag: str | None = None):
    self._tag = tag or uuid.uuid4().hex[:12]
    self._segments: dict[str, _Segment] = {}
    self._reserved: dict[str, int] = {}  # slot name -> the version it is reserved for
    self._leases: dict[str, set[str]] = {}  # reader -> slot names it holds
    self._lock = threading.Lock()
    self._closed = False

  def names(self) -> list[str]:
    """The ring's slot names."""
    with self._lock:
      return list(self._segments)

  def _busy(self, name: str) -> bool:
    """Whether slot ``name`` may not be written (call with the lock held): reserved, its
    server-side views alive (its version stored, or a pull of it being answered), or leased
    to a reader."""
    segment = self._segments[name]
    return (name in self._reserved or (segment.views is not None and segment.views() is not None)
            or any(name in held for held in self._leases.values()))

  def reserve(self, version: int, nbytes: int) -> Slot:
    """A slot of at least ``nbytes`` for ``version``'s push, nobody mapping it: a free one of
    the ring (the smallest that fits), else a new one. A reservation for an older version
    that never committed (its writer died) is given up."""
    with self._lock:
      if self._closed:
        raise RuntimeError('the slot ring is closed (the parameter server shut down).')
      for name, reserved in list(self._reserved.items()):
        if reserved < version:
          del self._reserved[name]
      free = [s for name, s in self._segments.items()
              if s.slot.size >= nbytes and not self._busy(name)]
      if free:
        segment = min(free, key=lambda s: s.slot.size)
      else:
        segment = self._create(nbytes)
      segment.version = version
      segment.views = None
      self._reserved[segment.slot.name] = version
      return segment.slot

  def _create(self, nbytes: int) -> _Segment:
    """A new segment of ``nbytes`` (pages allocated now)."""
    name = f'{PREFIX}{self._tag}_{len(self._segments)}'
    fd = os.memfd_create(name)  # close-on-exec: no child process inherits it
    try:
      size = max(nbytes, 1)
      os.posix_fallocate(fd, 0, size)  # every page allocated once, here
      mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
      os.close(fd)
      raise
    segment = _Segment(Slot(name, size, os.getpid(), fd), mapped, np.frombuffer(mapped, np.uint8))
    self._segments[name] = segment
    return segment

  def commit(self, server: ParameterServer, version: int, slot: Slot, push: ShardPush,
             checksums: Sequence[int]) -> bool:
    """Commits ``version`` into ``server`` by reference to ``slot`` (which a writer filled
    with the leaves ``push`` describes, ``push.shards`` empty, and ``checksums``): each leaf a
    read-only view of the slot, adopted with its checksum (``push_shards(adopt=True)``: the
    version order and the template are checked as for any push). Returns True; the
    reservation is given up whatever happens."""
    try:
      with self._lock:
        segment = self._segments.get(slot.name)
        if segment is None or self._reserved.get(slot.name) != version:
          raise ValueError(f'version {version} was written into slot {slot.name}, which is not '
                           'reserved for it; reserve a slot for each push.')
      offsets, nbytes = layout(push.specs)
      if nbytes > segment.slot.size:
        raise ValueError(f'slot {slot.name} holds {segment.slot.size} bytes; version {version} '
                         f'needs {nbytes}.')
      owner = _owner(segment.mapped)
      shards = []
      for i, (offset, spec) in enumerate(zip(offsets, push.specs)):
        leaf = _view(owner, offset, spec)
        leaf.setflags(write=False)
        shards.append(Shard(i, tuple((0, d) for d in spec[0]), leaf, checksum=checksums[i]))
      server.push_shards(version, dataclasses.replace(push, shards=tuple(shards)), adopt=True)
      with self._lock:
        segment.views = weakref.ref(owner)
      return True
    finally:
      with self._lock:
        self._reserved.pop(slot.name, None)

  def in_slots(self, update: delta_lib.Delta) -> tuple[delta_lib.Delta, list[str]]:
    """``(update with each whole leaf that lies in a slot replaced by a SlotLeaf, the names of
    those slots)``: what a reader on this machine is sent (``lease`` them to it)."""
    with self._lock:
      spans = [(s.buffer.__array_interface__['data'][0], s.slot) for s in self._segments.values()]
    used = set()

    def leaf(u):
      if not isinstance(u, delta_lib.LeafUpdate) or u.full is None:
        return u
      address = u.full.__array_interface__['data'][0]
      for start, slot in spans:
        if start <= address < start + slot.size and u.full.flags.c_contiguous:
          used.add(slot.name)
          spec = (tuple(u.full.shape), str(u.full.dtype))
          return SlotLeaf(u.leaf, slot, address - start, spec)
      return u
    buckets = tuple(tuple(leaf(u) for u in bucket) for bucket in update.buckets)
    return dataclasses.replace(update, buckets=buckets), sorted(used)

  def lease(self, reader: str, held: Sequence[str], handed: Sequence[str] = ()) -> None:
    """Reader ``reader`` holds the slots ``held`` (its report) and is being handed
    ``handed``: its lease becomes their union (slots it dropped become free)."""
    with self._lock:
      names = (set(held) | set(handed)) & set(self._segments)
      if names:
        self._leases[reader] = names
      else:
        self._leases.pop(reader, None)

  def close(self) -> None:
    """Closes every segment's file descriptor: no other process can open them any more, and
    their memory is freed once every mapping (the server's views of stored versions
    included, readers' and writers') is gone. The ring takes no more reservations."""
    with self._lock:
      self._closed = True
      for segment in self._segments.values():
        os.close(segment.slot.fd)
      self._segments.clear()
