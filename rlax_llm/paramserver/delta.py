"""Lossless sparse weight updates (after SparseRL-Sync): the indices and new values of the
elements whose bits changed between two versions.

An RL update at a small learning rate leaves most weights' *stored* bits unchanged when the
weights an inference worker holds are a low-precision cast (bf16) of the trainer's fp32
master weights, so sending only what changed moves far fewer bytes. Comparison is bitwise
(the arrays are viewed as unsigned integers of their width), so reconstruction is exact:
``apply(base, encode(base, new)) == new`` bit for bit, NaN payloads and signed zeros
included.

Per leaf, ``encode`` picks the cheaper form: a delta costs ``index_bytes + itemsize`` per
changed element, the full array ``itemsize`` per element, so a leaf is sent whole when more
than ``itemsize / (index_bytes + itemsize)`` of it changed (half for fp32 with int32
indices, a third for bf16). Leaves are grouped into buckets of at most ``bucket_bytes`` so a
transport can move (and a receiver apply) one bucket at a time.

Checksums: the server computes ``checksum`` of every leaf once, when a version is pushed, and
sends them with each update; the receiver checks the leaves it rebuilt with ``verify`` (one
definition on both sides), so a corrupted transfer or a delta applied to the wrong base is an
error naming the leaf, never silently wrong weights.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class LeafUpdate:
  """Leaf ``leaf``'s new value: ``full`` (the whole array), or ``indices`` (flat, int32 or
  int64) with ``values`` (the leaf's dtype)."""

  leaf: int
  full: np.ndarray | None = None
  indices: np.ndarray | None = None
  values: np.ndarray | None = None

  @property
  def nbytes(self) -> int:
    if self.full is not None:
      return int(self.full.nbytes)
    return int(self.indices.nbytes + self.values.nbytes)


@dataclasses.dataclass(frozen=True)
class Delta:
  """From ``base_version`` to ``version``: buckets of ``LeafUpdate``s covering every leaf,
  and the ``checksum`` of each of the version's leaves (in leaf order; empty: none sent)."""

  base_version: int
  version: int
  buckets: tuple[tuple[LeafUpdate, ...], ...]
  num_leaves: int
  changed: int  # elements whose bits changed
  total: int  # elements in all leaves
  checksums: tuple[int, ...] = ()

  @property
  def nbytes(self) -> int:
    return sum(u.nbytes for bucket in self.buckets for u in bucket)

  @property
  def density(self) -> float:
    """Fraction of elements whose bits changed."""
    return self.changed / max(self.total, 1)


def _bits(array: np.ndarray) -> np.ndarray:
  """``array`` viewed as unsigned integers of its width (flat)."""
  flat = np.ascontiguousarray(array).reshape(-1)
  return flat.view(np.dtype(f'u{flat.dtype.itemsize}'))


def checksum(leaf: np.ndarray) -> int:
  """CRC-32 of ``leaf``'s bytes (C order): the per-leaf checksum both ends of a pull use."""
  return zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8))


def verify(leaves: Sequence[np.ndarray], checksums: Sequence[int], paths: Sequence[str],
           version: int) -> None:
  """Checks each of ``leaves`` (version ``version``, named by ``paths``) against its
  ``checksums`` entry. Raises ValueError naming the first leaf that differs."""
  if len(checksums) != len(leaves):
    raise ValueError(f'version {version} came with {len(checksums)} checksums for '
                     f'{len(leaves)} leaves; pull it again from the parameter server.')
  for path, leaf, expected in zip(paths, leaves, checksums):
    seen = checksum(leaf)
    if seen != expected:
      raise ValueError(
          f'leaf {path} of version {version} fails its checksum (crc32 {seen:#010x}, the '
          f'server pushed {expected:#010x}): the transfer was corrupted or the delta was '
          'applied to another base. Pull the version again whole (base_version=-1).')


def encode(base: Sequence[np.ndarray], new: Sequence[np.ndarray], *, base_version: int,
           version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Delta:
  """The update from leaves ``base`` to leaves ``new`` (same shapes and dtypes)."""
  if len(base) != len(new):
    raise ValueError(f'{len(base)} base leaves but {len(new)} new leaves.')
  updates, changed, total = [], 0, 0
  for i, (old, cur) in enumerate(zip(base, new)):
    if old.shape != cur.shape or old.dtype != cur.dtype:
      raise ValueError(f'leaf {i}: base {old.shape} {old.dtype} vs new {cur.shape} {cur.dtype}.')
    diff = np.flatnonzero(_bits(old) != _bits(cur))
    changed += diff.size
    total += cur.size
    index_dtype = np.int32 if cur.size < 2**31 else np.int64
    itemsize = cur.dtype.itemsize
    if diff.size * (np.dtype(index_dtype).itemsize + itemsize) < cur.size * itemsize:
      flat = np.ascontiguousarray(cur).reshape(-1)
      updates.append(LeafUpdate(i, indices=diff.astype(index_dtype), values=flat[diff]))
    else:
      updates.append(LeafUpdate(i, full=np.ascontiguousarray(cur)))
  buckets, bucket, size = [], [], 0
  for update in updates:
    if bucket and size + update.nbytes > bucket_bytes:
      buckets.append(tuple(bucket))
      bucket, size = [], 0
    bucket.append(update)
    size += update.nbytes
  if bucket:
    buckets.append(tuple(bucket))
  return Delta(base_version=base_version, version=version, buckets=tuple(buckets),
               num_leaves=len(new), changed=changed, total=total)


def apply(base: Sequence[np.ndarray], delta: Delta) -> list[np.ndarray]:
  """``base`` leaves updated by ``delta``: new arrays, ``base`` untouched."""
  if len(base) != delta.num_leaves:
    raise ValueError(f'the delta covers {delta.num_leaves} leaves, the base has {len(base)}.')
  out: list[np.ndarray | None] = [None] * len(base)
  for bucket in delta.buckets:
    for update in bucket:
      if update.full is not None:
        out[update.leaf] = update.full
      else:
        leaf = np.array(base[update.leaf], copy=True)
        leaf.reshape(-1)[update.indices] = update.values
        out[update.leaf] = leaf
  missing = [i for i, leaf in enumerate(out) if leaf is None]
  if missing:
    raise ValueError(f'the delta has no update for leaves {missing[:5]}.')
  return out
