"""Versioned parameter server: the store behind the parameter-server role.

The trainer pushes its params after every update as version ``n`` (the number of updates
applied) itself (``rlax_llm.paramserver.publisher``); each inference worker pulls the version
it is asked to sample with (``update``: a lossless delta from the version it holds, or whole
leaves, a ``delta.Delta``) itself, and checks every leaf against the checksum the server
computed at push time (``rlax_llm.paramserver.receiver``). The controller never calls it: it
passes version numbers only. The server keeps the latest ``keep`` versions as read-only host
numpy copies, so an update or snapshot handed out never changes, whatever the trainer or a
reader does afterwards. Where it runs is the backend's choice (``rlax_llm.backends``: in
the process of the local backend's roles, or in an actor of its own on Ray).

Guarantees:

* Versions are ints that strictly increase: a push whose version is ``<= latest_version()`` is
  rejected ("versions never go backwards").
* Every version has the same tree structure, leaf shapes and leaf dtypes: the *template*, fixed
  by the constructor's ``template`` or else by the first push. A push that differs is rejected
  with the offending leaf path.
* A rejected push leaves the server exactly as it was.
* Non-finite values are stored as they are; the server never scans values (the checksums
  are of the bytes).
* Readers never block the writer: the lock is held only to look versions up, to reserve a
  push's blocks and to commit a version; copying to host, checksumming and encoding deltas
  run outside it.
* A version is visible only once complete; a push that overlaps blocks already pushed, or
  pushes that leave a leaf uncovered, are errors naming the leaf.
* A pull of a version no longer held is a ``KeyError`` naming the version, the versions held
  and the fix.

Transfers. ``update(version, base_version)`` returns a version as a lossless sparse delta from
the version a puller holds (``rlax_llm.paramserver.delta``: per leaf, the changed elements'
indices and values, or the whole leaf when that is smaller), so a worker pulls only what
changed.

Pushes by shard. A trainer pushes ``local_shards(params)``
(``rlax_llm.paramserver.shards``): per leaf, the distinct blocks of its sharded
``jax.Array`` (``replica_id == 0``) it holds; ``push_shards`` copies each block once, from
its device straight into the version's host leaf (no gather of the whole model onto one
host, no intermediate copy), and takes a leaf's checksum once the leaf is complete. A
trainer spanning ``P`` hosts pushes from each process (``process_index``, ``P``); the
version is committed, and visible, once the blocks of all ``P`` pushes cover every leaf
exactly once (the version being assembled: ``rlax_llm.paramserver.assembly``).
``push(version, params)`` is the one-process case. With ``adopt=True`` (the
Ray server actor: arrays Ray deserialised from its immutable object store) a whole-leaf
read-only shard is kept as it is, not copied; its checksum is still taken at push time.

Seam for transports. ``_commit(version, treedef, paths, leaves, checksums)`` checks complete
host leaves against the version order and the template and stores them atomically;
``push_shards`` ends in it, and so does any other transport's receiving side (one that
rebuilds full host leaves from the previous stored version plus a delta), so the version and
template checks hold for every transport alike.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import numpy as np

from rlax_llm.paramserver import assembly
from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.paramserver.shards import LeafSpec, ShardPush, leaf_spec, leaf_specs, local_shards

@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
  """One stored version of the params, whole (``ParameterServer.get``: for inspecting a
  server; workers receive ``delta.Delta`` updates).

  Attributes:
      version: number of trainer updates behind these params (0 = the initial params).
      params: pytree with the template's structure whose leaves are read-only host
          ``np.ndarray`` s, each with the template's shape and dtype.
  """

  version: int
  params: Any

  @property
  def metadata(self) -> dict[str, LeafSpec]:
    """Leaf path (``jax.tree_util.keystr``) -> ``(shape, dtype name)``, in tree order."""
    return leaf_specs(self.params)


def _check_int(name: str, value: Any) -> int:
  """Returns ``value`` as a Python int; rejects bools, floats and other types."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(
      f'{name} must be an int, got {value!r} of type {type(value).__name__}; '
      'pass a Python int (versions count trainer updates).'
    )
  return int(value)


class ParameterServer:
  """Thread-safe, in-process store of the newest ``keep`` weight versions.

  Example::

      server = ParameterServer(keep=2)
      server.push(0, params)              # trainer, after n updates: push(n, params)
      update = server.update(0, -1)       # inference worker holding no version: whole leaves
      server.push(1, params1)
      update = server.update(1, 0)        # holding version 0: a delta from it
  """

  def __init__(self, keep: int = 2, template: Any = None, reuse_buffers: bool = True):
    """Creates an empty server.

    Args:
        keep: how many of the newest versions to hold (>= 1); a push evicts older ones.
        template: optional pytree of arrays or ``jax.ShapeDtypeStruct`` fixing the tree
            structure, leaf shapes and dtypes that every push must match. ``None``: the
            first push fixes them.
        reuse_buffers: keep the leaves of the last dropped version until the next push and
            copy it into them when nobody holds them (about twice as fast as into fresh
            pages), so the server holds ``keep + 1`` versions between pushes. False: a
            dropped version is freed at once (``keep`` versions between pushes, ``keep + 1``
            only while a push is written); for a server whose process also runs the trainer's
            step, whose peak the spare version would add to (``backends.local``).
    """
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1:
      raise ValueError(
        f'keep must be an int >= 1 (how many versions to hold), got {keep!r}; '
        'use keep=1 to hold only the latest version.'
      )
    self._keep = int(keep)
    self._reuse_buffers = bool(reuse_buffers)
    self._lock = threading.Lock()
    # version -> (treedef, leaves, checksums); dict order is ascending version order.
    self._store: dict[int, tuple[Any, list[np.ndarray], tuple[int, ...]]] = {}
    self._latest = -1
    self._template: tuple[Any, list[str], list[LeafSpec]] | None = None
    self._pending: tuple[int, assembly.PendingVersion] | None = None  # the version being assembled
    # The leaves of the last dropped version, by spec: the next version's buffers when no
    # reader holds them any more (the peak stays keep + 1 versions, as without reuse).
    self._spare: dict[LeafSpec, list[np.ndarray]] = {}
    if template is not None:
      leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
      self._template = (
        treedef,
        [jax.tree_util.keystr(path) for path, _ in leaves_with_path],
        [leaf_spec(leaf) for _, leaf in leaves_with_path],
      )

  @property
  def template(self) -> dict[str, LeafSpec] | None:
    """Leaf path -> ``(shape, dtype name)`` every push must match; ``None`` until fixed."""
    with self._lock:
      if self._template is None:
        return None
      _, paths, specs = self._template
      return dict(zip(paths, specs))

  def push(self, version: int, params: Any, adopt: bool = False) -> None:
    """Stores ``params`` as ``version``: the one-process case of ``push_shards``
    (``push_shards(version, local_shards(params))``; ``params`` may also be a ``ShardPush``
    already, e.g. ``local_shards(params, to_host=True)`` sent from another process).

    Args:
        version: int strictly greater than ``latest_version()`` (so the first push may use
            any version >= 0).
        params: pytree of arrays (numpy, JAX, Python scalars) matching the template. The
            server copies each leaf into its own read-only host array, a sharded
            ``jax.Array`` shard by shard from its devices (never gathered whole first); later
            changes to ``params`` never reach them.
        adopt: keep the caller's arrays instead of copying them where a shard may be kept
            as it is (see ``push_shards``).

    Raises:
        ValueError: ``version`` is not an int or not newer than the latest version, or
            ``params`` does not match the template (tree structure, a leaf shape or a leaf
            dtype), or this process does not hold every block of every leaf. The server is
            unchanged after a failed push.
    """
    version = _check_int('version', version)
    with self._lock:
      # Cheap early rejection before touching the params; push_shards checks again.
      self._check_version_order(version)
    self.push_shards(version, params if isinstance(params, ShardPush) else local_shards(params),
                     adopt=adopt)

  def push_shards(self, version: int, shards: ShardPush, process_index: int = 0,
                  process_count: int = 1, adopt: bool = False) -> bool:
    """Adds process ``process_index``'s shards of ``version`` (``local_shards`` of its part
    of a trainer spanning ``process_count`` processes); the version is committed, visible to
    pulls, once the shards of every process have arrived and cover every leaf exactly once.

    Each shard is copied once, straight into the version's host leaf; each leaf's checksum
    is taken once the leaf is complete, by the push that completed it. Processes may push
    concurrently (from threads of a server actor); the lock is held only to reserve blocks
    and to commit. One version is assembled at a time (a trainer's processes push version
    ``n`` before any of them computes ``n + 1``).

    ``adopt``: a shard that is a whole leaf and a read-only, C-contiguous ``np.ndarray``
    (shape and dtype are checked for every shard) is kept as the version's leaf, a view of
    it, instead of being copied; its checksum is taken now, unless the shard carries the one
    its writer took (``Shard.checksum``). Only for memory nothing can write to while the
    server holds it: the arrays Ray deserialised from its object store for a server actor
    (zero-copy views of immutable shared memory, valid while referenced;
    ``rlax_llm.backends.ray_actors.ServerRole``), or a shared-memory slot the server's ring lends
    to no writer while the version is held (``rlax_llm.paramserver.shm``). Adopted memory
    is never reused for a later version by this server (only buffers it allocated are).
    Other shards are copied.

    Returns:
        True if this push committed the version (it was the last one needed).

    Raises:
        ValueError: the version is not newer than the latest; another version is still
            incomplete; ``process_index``/``process_count`` are invalid, differ from the
            version's other pushes, or this process already pushed it; the tree does not
            match the template; a shard lies outside its leaf, has another shape or dtype
            than its block, or overlaps a block already pushed; or every process has pushed
            and a leaf is still not covered (the version is then dropped). A rejected push
            leaves the server as it was before it.
    """
    version = _check_int('version', version)
    process_index = _check_int('process_index', process_index)
    process_count = _check_int('process_count', process_count)
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ValueError(f'process_index={process_index} of process_count={process_count}: need '
                       '0 <= process_index < process_count (jax.process_index() of '
                       'jax.process_count()).')
    paths, specs = list(shards.paths), list(shards.specs)
    assembly.check_shards(shards)
    with self._lock:
      self._check_version_order(version)
      if self._template is not None:
        self._check_matches_template(shards.treedef, paths, specs)
      if self._pending is not None and self._pending[0] != version:
        raise ValueError(
            f'push of version {version} rejected: version {self._pending[0]} is incomplete '
            f'({self._pending[1].describe()}). Push its missing shards first (every trainer '
            'process pushes each version).')
      if self._pending is None:
        pending = assembly.PendingVersion(process_count, shards.treedef, paths, specs,
                                          self._spare)
      else:
        pending = self._pending[1]
        pending.check_joins(shards, process_index, process_count, version)
      pending.reserve(shards, process_index, version)  # the copies run outside the lock
      self._pending = (version, pending)
    try:
      pending.write(shards, adopt, self._lock)
    except BaseException:
      with self._lock:  # a copy failed (e.g. out of memory): the version cannot complete
        if self._pending is not None and self._pending[1] is pending:
          self._pending = None
      raise
    with self._lock:
      pending.finished += 1
      if pending.finished < pending.process_count:
        return False
      self._pending = None
      incomplete = [(paths[i], n) for i, n in enumerate(pending.missing) if n]
      if incomplete:
        path, n = incomplete[0]
        raise ValueError(
            f'version {version} is incomplete after all {process_count} processes pushed: '
            f'{len(incomplete)} leaves lack blocks ({path} misses {n} of '
            f'{pending.leaves[paths.index(path)].size} elements). The version is dropped; '
            'push every block of every leaf (each process its addressable shards).')
      self._commit(version, pending.treedef, paths, pending.leaves, tuple(pending.checksums))
      return True


  def _commit(self, version: int, treedef: Any, paths: list[str], leaves: list[np.ndarray],
              checksums: tuple[int, ...]) -> None:
    """Checks order and template, then stores complete read-only host leaves (with their
    ``delta.checksum`` s) atomically (the transport seam). Call with the lock held."""
    specs = [leaf_spec(leaf) for leaf in leaves]
    self._check_version_order(version)
    if self._template is None:
      template = (treedef, paths, specs)
    else:
      template = self._template
      self._check_matches_template(treedef, paths, specs)
    # Nothing below can fail: the push is accepted.
    self._template = template
    self._store[version] = (treedef, leaves, checksums)
    self._latest = version
    while len(self._store) > self._keep:
      _, dropped, _ = self._store.pop(next(iter(self._store)))
      self._spare = {}
      for leaf in dropped if self._reuse_buffers else ():
        if leaf.flags.owndata:  # an array this server allocated
          self._spare.setdefault(leaf_spec(leaf), []).append(leaf)

  def _check_version_order(self, version: int) -> None:
    if version <= self._latest:
      raise ValueError(
        f'push of version {version} rejected: the latest version is {self._latest} and '
        f'versions never go backwards; push version {self._latest + 1} or later.'
      )

  def _check_matches_template(self, treedef: Any, paths: list[str], specs: list[LeafSpec]) -> None:
    expected_treedef, expected_paths, expected_specs = self._template
    if treedef != expected_treedef:
      seen, expected = set(paths), set(expected_paths)
      missing = [p for p in expected_paths if p not in seen]
      extra = [p for p in paths if p not in expected]
      if missing or extra:
        raise ValueError(
          'params tree structure does not match the template: missing leaves '
          f"{missing}, extra leaves {extra}. Push a tree with exactly the template's "
          'leaves.'
        )
      raise ValueError(
        'params tree structure does not match the template although the leaf paths '
        f'agree (container types differ): expected {expected_treedef}, seen {treedef}. '
        'Push the same container types (dict, list, tuple, ...) as the template.'
      )
    for path, (shape, dtype), (exp_shape, exp_dtype) in zip(paths, specs, expected_specs):
      if shape != exp_shape:
        raise ValueError(
          f'leaf {path} has shape {shape} but the template expects {exp_shape}; '
          "every push must keep each leaf's shape."
        )
      if dtype != exp_dtype:
        raise ValueError(
          f'leaf {path} has dtype {dtype} but the template expects {exp_dtype}; '
          f'cast it with .astype({exp_dtype!r}) before pushing.'
        )

  def get(self, version: int) -> WeightSnapshot:
    """Returns the held snapshot of exactly ``version``.

    Raises:
        KeyError: ``version`` was dropped or never pushed; the message lists held versions.
    """
    version = _check_int('version', version)
    with self._lock:
      if version not in self._store:
        raise self._not_held(version)
      return self._snapshot(version)

  def _not_held(self, version: int) -> KeyError:
    """The error for a version not in the store (call with the lock held): dropped (older
    than every held version), not pushed yet, or skipped."""
    held = list(self._store)
    if held and version < held[0]:
      why = (f'it was dropped: the server keeps the newest {self._keep} versions, now '
             f'{held[0]}..{held[-1]}. Pull a version before {self._keep} newer ones are '
             'pushed, or keep more (config paramserver.keep_versions)')
    elif self._pending is not None and version == self._pending[0]:
      why = f'it is still being pushed ({self._pending[1].describe()}); pull it once complete'
    elif version > self._latest:
      why = (f'it has not been pushed yet (the latest is {self._latest}); pull it after the '
             'trainer pushed it')
    else:
      why = 'it was never pushed (versions may skip numbers); pull a held version'
    return KeyError(f'version {version} is not held: {why}. held versions: {held} '
                    f'(keep={self._keep}).')

  def update(self, version: int, base_version: int = -1, *,
             bucket_bytes: int = delta_lib.DEFAULT_BUCKET_BYTES) -> delta_lib.Delta:
    """Version ``version`` as an update from ``base_version`` (what a puller holds).

    Every leaf comes as the indices and values of its changed elements or whole, whichever
    is smaller (``rlax_llm.paramserver.delta``); with ``base_version`` -1 or no longer held,
    every leaf comes whole. ``delta.apply(base_leaves, update)`` rebuilds the version's
    leaves bit for bit (tree order of the template), and ``delta.verify`` checks them against
    ``update.checksums`` (the leaves' checksums taken at push time). The lock is held only to
    look the versions up; the delta is encoded outside it, so pushes go on meanwhile.

    Raises KeyError when ``version`` is not held (dropped, or not pushed yet).
    """
    version = _check_int('version', version)
    with self._lock:
      target = self._store.get(version)
      if target is None:
        raise self._not_held(version)
      base = self._store.get(base_version) if base_version >= 0 else None
    _, new, checksums = target
    if base is None:
      updates = tuple((delta_lib.LeafUpdate(i, full=leaf),) for i, leaf in enumerate(new))
      total = sum(leaf.size for leaf in new)
      return delta_lib.Delta(base_version=-1, version=version, buckets=updates,
                             num_leaves=len(new), changed=total, total=total,
                             checksums=checksums)
    return dataclasses.replace(
        delta_lib.encode(base[1], new, base_version=base_version, version=version,
                         bucket_bytes=bucket_bytes), checksums=checksums)

  @property
  def treedef(self) -> Any:
    """The tree structure of every version (None until the first push)."""
    with self._lock:
      return None if self._template is None else self._template[0]

  def latest_version(self) -> int:
    """The newest pushed version, or -1 when nothing has been pushed."""
    with self._lock:
      return self._latest

  def versions(self) -> list[int]:
    """The held versions, ascending."""
    with self._lock:
      return list(self._store)

  def _snapshot(self, version: int) -> WeightSnapshot:
    treedef, leaves, _ = self._store[version]
    return WeightSnapshot(version=version, params=jax.tree_util.tree_unflatten(treedef, leaves))
