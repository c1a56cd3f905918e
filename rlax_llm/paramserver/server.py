"""Versioned parameter server: the store behind the parameter-server role.

The trainer pushes its params after every update as version ``n`` (the number of updates
applied) itself; each inference worker pulls the version it is asked to sample with
(``update``: a lossless delta from the version it holds, or whole leaves) itself, and checks
every leaf against the checksum the server computed at push time. The controller never calls
it: it passes version numbers only. The server keeps the latest ``keep`` versions as
read-only host numpy copies, so a snapshot handed out never changes, whatever the trainer or
a reader does afterwards. Where it runs is the backend's choice (``rlax_llm.backends``: in
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
* Readers never block the writer: the lock is held only to look versions up and to commit
  one; copying to host, checksumming and encoding deltas run outside it.
* A pull of a version no longer held is a ``KeyError`` naming the version, the versions held
  and the fix.

Transfers. ``update(version, base_version)`` returns a version as a lossless sparse delta from
the version a puller holds (``rlax_llm.paramserver.delta``: per leaf, the changed elements'
indices and values, or the whole leaf when that is smaller), so a worker pulls only what
changed.

Seam for transports. ``push`` does two things: (1) ``_to_host_leaves`` brings the leaves to
host memory as private read-only copies; (2) ``_commit`` checks them against the version order
and the template and stores them atomically. Transports (sparse deltas as in SparseRL-Sync:
indices and values of the changed elements with bit-exact reconstruction; a cross-host wire
format) belong between (1) and (2): a transport's receiving side rebuilds full host leaves from
the previous stored version plus a delta, then calls ``_commit(version, treedef, paths,
leaves)``, so the version and template checks hold for every transport alike.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import numpy as np

from rlax_llm.paramserver import delta as delta_lib

# A leaf's static description: (shape, dtype name), e.g. ((2, 3), 'float32').
LeafSpec = tuple[tuple[int, ...], str]


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
  """One stored version of the params.

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


def leaf_specs(tree: Any) -> dict[str, LeafSpec]:
  """Leaf path (``jax.tree_util.keystr``) -> ``(shape, dtype name)`` of every leaf of
  ``tree`` (arrays, ``jax.ShapeDtypeStruct``s or Python scalars), in tree order."""
  leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): _leaf_spec(leaf) for path, leaf in leaves_with_path}


def _leaf_spec(leaf: Any) -> LeafSpec:
  """(shape, dtype name) of an array, a ``jax.ShapeDtypeStruct`` or a Python scalar."""
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    return tuple(int(d) for d in leaf.shape), str(np.dtype(leaf.dtype))
  arr = np.asarray(leaf)
  return arr.shape, str(arr.dtype)


def _to_host_leaves(params: Any) -> tuple[Any, list[str], list[np.ndarray]]:
  """Flattens ``params`` into private, read-only host copies of its leaves.

  Returns:
      ``(treedef, paths, leaves)``: the tree structure, the ``keystr`` path of each leaf, and
      the leaves as C-contiguous ``np.ndarray`` copies with ``writeable=False``, in tree order.
  """
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [jax.tree_util.keystr(path) for path, _ in leaves_with_path]
  host = jax.device_get([leaf for _, leaf in leaves_with_path])
  leaves = []
  for leaf in host:
    # Always copy: device_get returns the caller's own numpy arrays unchanged (and may
    # return a view of a JAX buffer), and a stored version must never change.
    arr = np.array(leaf, copy=True, order='C')
    arr.setflags(write=False)
    leaves.append(arr)
  return treedef, paths, leaves


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
      snap = server.pull(min_version=0)   # inference worker
      snap.version, snap.params
  """

  def __init__(self, keep: int = 2, template: Any = None):
    """Creates an empty server.

    Args:
        keep: how many of the newest versions to hold (>= 1); a push evicts older ones.
        template: optional pytree of arrays or ``jax.ShapeDtypeStruct`` fixing the tree
            structure, leaf shapes and dtypes that every push must match. ``None``: the
            first push fixes them.
    """
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1:
      raise ValueError(
        f'keep must be an int >= 1 (how many versions to hold), got {keep!r}; '
        'use keep=1 to hold only the latest version.'
      )
    self._keep = int(keep)
    self._cond = threading.Condition()
    # version -> (treedef, leaves, checksums); dict order is ascending version order.
    self._store: dict[int, tuple[Any, list[np.ndarray], tuple[int, ...]]] = {}
    self._latest = -1
    self._template: tuple[Any, list[str], list[LeafSpec]] | None = None
    if template is not None:
      leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
      self._template = (
        treedef,
        [jax.tree_util.keystr(path) for path, _ in leaves_with_path],
        [_leaf_spec(leaf) for _, leaf in leaves_with_path],
      )

  @property
  def keep(self) -> int:
    """How many of the newest versions the server holds."""
    return self._keep

  @property
  def template(self) -> dict[str, LeafSpec] | None:
    """Leaf path -> ``(shape, dtype name)`` every push must match; ``None`` until fixed."""
    with self._cond:
      if self._template is None:
        return None
      _, paths, specs = self._template
      return dict(zip(paths, specs))

  def push(self, version: int, params: Any) -> None:
    """Stores ``params`` as ``version`` and wakes every waiting ``pull``.

    Args:
        version: int strictly greater than ``latest_version()`` (so the first push may use
            any version >= 0).
        params: pytree of arrays (numpy, JAX, Python scalars) matching the template. The
            server stores its own read-only host copies; later changes to ``params`` never
            reach them.

    Raises:
        ValueError: ``version`` is not an int or not newer than the latest version, or
            ``params`` does not match the template (tree structure, a leaf shape or a leaf
            dtype). The server is unchanged after a failed push.
    """
    version = _check_int('version', version)
    with self._cond:
      # Cheap early rejection before copying params off device; _commit checks again.
      self._check_version_order(version)
    treedef, paths, leaves = _to_host_leaves(params)
    self._commit(version, treedef, paths, leaves)

  def _commit(self, version: int, treedef: Any, paths: list[str], leaves: list[np.ndarray]) -> None:
    """Checks order and template, then stores host leaves atomically (the transport seam)."""
    specs = [_leaf_spec(leaf) for leaf in leaves]
    checksums = tuple(delta_lib.checksum(leaf) for leaf in leaves)  # outside the lock
    with self._cond:
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
        del self._store[next(iter(self._store))]
      self._cond.notify_all()

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

  def pull(self, min_version: int = 0, timeout: float | None = 0.0) -> WeightSnapshot:
    """Returns the latest snapshot, waiting for one with ``version >= min_version``.

    Args:
        min_version: the oldest version the caller accepts.
        timeout: seconds to wait for a push while the latest version is older than
            ``min_version`` (0 = do not wait, ``None`` = wait forever).

    Returns:
        The newest held ``WeightSnapshot``. Its leaves are shared read-only host arrays;
        its containers are fresh, so the caller may rearrange them freely.

    Raises:
        LookupError: nothing was ever pushed and ``timeout`` is 0.
        TimeoutError: no version ``>= min_version`` arrived within ``timeout`` seconds.
    """
    min_version = _check_int('min_version', min_version)
    if timeout is not None and not timeout >= 0:
      raise ValueError(f'timeout must be >= 0 seconds or None (wait forever), got {timeout!r}.')
    with self._cond:
      if not self._cond.wait_for(lambda: self._latest >= min_version, timeout=timeout):
        if self._latest < 0 and timeout == 0:
          raise LookupError(
            'the parameter server is empty: nothing has been pushed yet. Push '
            'version 0 first, or pull with timeout > 0 (or None) to wait for it.'
          )
        raise TimeoutError(
          f'no version >= {min_version} arrived within {timeout} s; the latest '
          f'version is {self._latest}. Wait longer (timeout=None waits forever) or '
          'lower min_version.'
        )
      return self._snapshot(self._latest)

  def get(self, version: int) -> WeightSnapshot:
    """Returns the held snapshot of exactly ``version``.

    Raises:
        KeyError: ``version`` was dropped or never pushed; the message lists held versions.
    """
    version = _check_int('version', version)
    with self._cond:
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
             'pushed, or keep more (ControllerSettings.versions_kept)')
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
    with self._cond:
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
    with self._cond:
      return None if self._template is None else self._template[0]

  def latest_version(self) -> int:
    """The newest pushed version, or -1 when nothing has been pushed."""
    with self._cond:
      return self._latest

  def versions(self) -> list[int]:
    """The held versions, ascending."""
    with self._cond:
      return list(self._store)

  def _snapshot(self, version: int) -> WeightSnapshot:
    treedef, leaves, _ = self._store[version]
    return WeightSnapshot(version=version, params=jax.tree_util.tree_unflatten(treedef, leaves))
