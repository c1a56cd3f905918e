"""The worker side of weight sync, one for every backend: pull a version unless held, verify
it, merge adapters.

An inference worker owns a ``Receiver`` (``InferenceWorker.receiver``). A backend supplies only
the transport, as callables: ``Fetch`` (``ParameterServer.update`` in process; a call to the
server actor on Ray, ``backends.ray_actors.fetch_update``), ``Latest`` for free-running mode and,
with LoRA's adapter-only sync, ``FetchBase``. The receiver asks for a version as a lossless
delta from the version it holds (or whole leaves when it holds none), rebuilds the leaves
(``delta.apply``), checks every leaf against the checksum the server took when the trainer
pushed it (``delta.verify``: a corrupted transfer or a delta applied to the wrong base is an
error naming the leaf, and nothing is installed), and hands the params to the worker
(``install``: placed on its mesh and swapped in before the driver's next decode step).

Adapter-only sync (``lora.sync='adapters'``, ``publisher.adapter_sync``; ``rlax_llm.models.
lora``): the versions are adapter trees (``lora.synced_adapters`` of ``lora.adapter_tree``).
Before its first one the receiver pulls the base once through ``fetch_base`` (whole leaves,
verified against the base server's checksums; a restarted worker pulls it again) and keeps it
on the worker's mesh (``place_base``); each version's adapters are merged into it
(``lora.merge_program``: ``W + s * A @ B``, one jitted program, on the worker's devices) and
the merged weights are installed. Deltas are then of the adapters, from the adapters held.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import jax
import numpy as np

from rlax_llm import schedule
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.model import Model, Params
from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.paramserver.shards import leaf_specs

# ``fetch(version, base_version) -> Delta``: a backend's way to ask the parameter server for a
# version (``ParameterServer.update`` in process, a call to the server's actor on Ray).
Fetch = Callable[[int, int], delta_lib.Delta]
# ``fetch_base() -> Delta``: a backend's way to ask for the base a LoRA trainer pushed once
# (adapter-only sync: whole leaves with their checksums).
FetchBase = Callable[[], delta_lib.Delta]
# ``latest() -> int``: a backend's way to ask the parameter server for its newest version
# (``ParameterServer.latest_version`` in process, a call to the server's actor on Ray).
Latest = Callable[[], int]
# ``install(version, params)``: the worker's way to place params of its model on its mesh and
# swap them in (``InferenceWorker``: its engine's ``place_params``, then its holder).
Install = Callable[[int, Params], None]


def _figures(update: delta_lib.Delta) -> dict[str, int]:
  """An update's transfer figures: bytes moved, bytes of the leaves sent whole, elements
  whose bits changed, and elements in all."""
  return {'sync/bytes': update.nbytes,
          'sync/full_bytes': sum(u.full.nbytes for b in update.buckets for u in b
                                 if u.full is not None),
          'sync/changed': update.changed, 'sync/elements': update.total}


def _rebuild(base: list[np.ndarray] | None, update: delta_lib.Delta,
             paths: list[str]) -> list[np.ndarray]:
  """``update`` applied to ``base`` (None: whole leaves), each leaf checked against the
  update's checksums when it has them (the server's always do)."""
  leaves = delta_lib.apply(base or [None] * update.num_leaves, update)
  if update.checksums:
    delta_lib.verify(leaves, update.checksums, paths, update.version)
  return leaves


class Receiver:
  """Pulls, verifies and installs the versions a worker of ``model`` samples with.

  Args:
    model: the worker's model (in the workers' dtypes, ``roles.inference_model``): the
      versions are its params, or with ``lora`` the base they adapt.
    install: the worker's ``Install``.
    lora: the trainer's adapters under adapter-only sync (``publisher.adapter_sync``): the
      versions are adapter trees merged into the base pulled once through ``fetch_base``.
      None: the versions are ``model``'s params.
    fetch_base: the backend's way to pull that base (``FetchBase``); with ``lora`` only.
    place_base: the worker's way to put the base (host arrays of ``model``'s params, checked)
      on its mesh; with ``lora`` only.
  """

  def __init__(self, model: Model, install: Install, *,
               lora: lora_lib.LoRAConfig | None = None, fetch_base: FetchBase | None = None,
               place_base: Callable[[Params], Params] | None = None):
    if (lora is None) != (fetch_base is None) or (lora is None) != (place_base is None):
      raise ValueError('adapter-only sync needs lora, fetch_base (the base pulled once) and '
                       f'place_base, and only it; got lora={lora!r}, fetch_base='
                       f'{fetch_base!r}, place_base={place_base!r}.')
    self._install_params = install
    self.version = -1  # of the params installed (-1: none)
    self._host_leaves: list[np.ndarray] | None = None  # the version held, for deltas
    abstract = model.abstract_params()
    self._fetch_base, self._place_base = fetch_base, place_base
    self._base = None  # adapter-only sync: the base, on the worker's mesh (pulled once)
    if lora is not None:
      self._lora_model = lora_lib.lora_model(model, lora)
      self._base_treedef = jax.tree_util.tree_structure(abstract)
      self._base_paths = list(leaf_specs(abstract))
      abstract = lora_lib.synced_adapters(
          lora, lora_lib.adapter_tree(self._lora_model.abstract_params()))
    self._treedef = jax.tree_util.tree_structure(abstract)  # of the versions pulled
    self._leaf_paths = list(leaf_specs(abstract))  # names leaves in checksum errors

  @property
  def adapters(self) -> bool:
    """Whether the versions are adapter trees (adapter-only sync)."""
    return self._fetch_base is not None

  def load(self, version: int, params: Params) -> None:
    """Installs whole params of the worker's model (host or device arrays) as ``version``.
    Params that are not the model's raise ValueError (``install``'s) and leave the version
    held, and the base of the next delta, as they were. Under adapter-only sync the next
    pull is of whole adapters (there are none held to delta from)."""
    self._install_params(version, params)
    self.version = version
    self._host_leaves = (None if self.adapters
                         else [np.asarray(leaf) for leaf in jax.tree.leaves(params)])

  def apply(self, update: delta_lib.Delta) -> None:
    """Installs ``update`` (``ParameterServer.update``'s): a delta from the version held, or
    whole leaves, verified leaf by leaf (``_rebuild``). Raises ValueError if it was computed
    from another base version, or naming the leaf whose checksum differs; the version held
    stays as it was."""
    if update.base_version >= 0 and update.base_version != self.version:
      raise ValueError(f'the update is a delta from version {update.base_version} but this '
                       f'worker holds version {self.version}; ask for one from that version.')
    if update.base_version >= 0 and self._host_leaves is None:
      raise ValueError(f'the update is a delta from version {update.base_version} but this '
                       'worker holds no leaves to apply it to; ask for whole leaves (-1).')
    leaves = _rebuild(self._host_leaves, update, self._leaf_paths)
    tree = jax.tree_util.tree_unflatten(self._treedef, leaves)
    if not self.adapters:
      self.load(update.version, tree)
      return
    merged = lora_lib.merge_program(self._lora_model)(lora_lib.with_adapters(self._base, tree))
    self.load(update.version, merged)
    self._host_leaves = leaves

  def _pull_base(self) -> dict[str, int]:
    """Pulls the base (adapter-only sync) through ``fetch_base``, verifies it and places it
    on the worker's mesh; returns the pull's figures."""
    update = self._fetch_base()
    leaves = _rebuild(None, update, self._base_paths)
    self._base = self._place_base(jax.tree_util.tree_unflatten(self._base_treedef, leaves))
    return _figures(update)

  def pull(self, version: int, fetch: Fetch) -> dict[str, int | float]:
    """Pulls ``version`` through ``fetch`` (a delta from the version held, or whole leaves
    when none is held) and installs it (``apply``). Returns the pull's figures:
    ``sync/updates`` (1), ``sync/bytes`` moved, ``sync/full_bytes`` of leaves sent whole,
    ``sync/changed`` and ``sync/elements`` (elements whose bits changed, of all), and
    ``sync/pull_s`` (seconds). Under adapter-only sync the first pull fetches the base first
    (its figures are added)."""
    start = time.perf_counter()
    figures = collections.Counter()
    if self.adapters and self._base is None:
      figures.update(self._pull_base())
    update = fetch(version, self.version if self._host_leaves is not None else -1)
    self.apply(update)
    figures.update(_figures(update))
    figures['sync/updates'] = 1
    figures['sync/pull_s'] = time.perf_counter() - start
    return dict(figures)

  def ensure(self, version: int, fetch: Fetch) -> dict[str, int | float]:
    """Holds ``version``: pulls it (``pull``) unless held. Returns the pull's figures, none
    when it was held."""
    return {} if version == self.version else self.pull(version, fetch)

  def follow(self, latest: Latest, j: int, fetch: Fetch) -> dict[str, int | float]:
    """Pulls the server's newest version (``latest()``) when it is ``j`` (an int >= 1,
    ``FollowLatest.j``) or more versions ahead of the one held, or none is held (reload
    staleness ``j``, RLAX: ``schedule.reload_due``). Returns the pull's figures, none when no
    pull was due. Raises LookupError when the server holds no version yet."""
    if isinstance(j, bool) or not isinstance(j, int) or j < 1:
      raise ValueError(f'reload threshold j={j!r} must be an int >= 1 (staleness.j).')
    newest = latest()
    if newest < 0:
      raise LookupError('the parameter server holds no weights yet; the trainer pushes '
                        'version 0 when it is built: follow it after that.')
    if schedule.reload_due(newest, self.version, j):
      return self.pull(newest, fetch)
    return {}
