"""The Ray backend: the trainer, the parameter server and each inference worker in a Ray
actor of its own.

The controller (``rlax_llm.controller``) stays in the launching process (the driver); roles
are actors whose method calls return object refs, wrapped as the futures the controller
waits on, so the controller code is the one the local backend runs. Weights never pass
through the driver: the trainer actor publishes each new version to the server actor itself
(``paramserver.publisher.Publisher`` with this backend's transport, ``push_shards``: the
trainer writes its shards into Ray's object store once and passes the server their ref; the
server reads them zero-copy and keeps whole leaves as they are), and each worker actor's
receiver (``paramserver.receiver.Receiver``) pulls the version a ``generate`` call names from
the server actor itself (``fetch_update``: a sparse delta from the version it holds, or whole
leaves, with per-leaf checksums the receiver verifies; a whole leaf the server kept comes as
the trainer's object's ref, read zero-copy, not serialised again). Between actors of one
machine (``paramserver.transport='auto'``, the default) the object store is skipped: the
trainer copies each version straight into a reused shared-memory slot the server names, the
server commits it by reference, and a worker maps the slot read-only
(``rlax_llm.paramserver.shm``; actors on other nodes, and a trainer of several processes,
keep the object store). The driver sends version numbers and receives rollouts. A LoRA run
with adapter-only sync (``publisher.adapter_sync``) has a second server actor keeping the
base alone: the trainer actor pushes the base there once when it starts (after restoring),
each worker actor pulls it before its first adapter version (a restarted one again), and the
versions are the adapter trees.

Checkpoints: the trainer actor owns the ``Checkpointer``. When built it restores its params
and optimizer state from the workdir's latest checkpoint itself and hands the driver only
the controller's state and the rollouts' arrays (``start``); each save the controller asks
for (``TrainerHandle.save``) carries that small state to the actor, which writes it with its
params and optimizer state as one Orbax step. The driver never opens the checkpoint manager.
The workdir must be storage both see: local disk for ``ray.address='local'`` (one
machine), a ``gs://`` URL (``rlax_llm.storage``) or shared storage (NFS) on a multi-host
cluster. SIGTERM/SIGINT to
the driver sets the preemption event, the controller asks the trainer actor for a save after
the current step, waits for it to be on disk, and the launch exits 0, as on the local
backend. (A signal during the warm-up takes effect once the warm-up is done: it runs in the
trainer actor, which does not see the driver's event.)

A trainer spanning several hosts (``ray.trainer_processes = N``, one actor per host of a
multi-host trainer slice): N ``TrainerRole`` actors join one ``jax.distributed`` job and the
trainer mesh spans all their devices. Each actor reports its host (``host``: its TPU worker
id, hostname and address) and the driver orders the processes by worker id
(``order_trainers``, ``tpu_env.process_order``: process ``p`` is the host of worker id ``p``,
as libtpu numbers the slice's hosts; a duplicate or missing id stops the launch; off TPU the
actors' creation order); the coordinator is process 0's actor (``coordinator_address``), and
on TPU each actor sets the variables of the slice's multi-host bring-up first
(``tpu_env.slice_environment``).
``RayTrainer`` sends each the same calls (arguments written into the object store once) and
takes process 0's result, checking that the others agree. Each actor pushes only its own
blocks of each version (``local_shards``, its ``process_index``) and the server actor
commits the version when all N parts arrived: no process holds the whole params for a push.
Each writes and restores its part of the checkpoints (multi-process Orbax). A call fails as
soon as any of them fails (the others would wait in their collectives forever).

Lost actors: a worker actor that dies (its process killed, its node lost) is restarted by
Ray, at most ``ray.worker_restarts`` times (``max_restarts``), and the call it was running
is retried on the new process (``max_task_retries``): the restarted worker holds no weights
and pulls the version the call names from the server itself, so the run's rollouts are the
same; it reports the restart with its next rollouts (``workers/restarts`` in the metrics,
and an event). Past its restarts the controller retires it and re-issues its requests to
the others. A lost trainer actor (any of them, when there are several) stops the run with a
``RlaxError`` naming the checkpoint step to resume from (relaunching with the same
``--workdir`` resumes there).

Placement: each actor asks for ``ray.trainer_resources`` / ``ray.worker_resources`` (e.g.
``{'TPU': 4}`` on a TPU VM host, so Ray puts the trainer and the workers on different hosts;
empty on a laptop). ``ray.address='local'`` starts a private single-node cluster on loopback
(tests do this); any other value is passed to ``ray.init(address=...)`` to join a running
cluster (``launch/ray``). Each actor builds its role from the run's config
(``rlax_llm.roles``). JAX inside an actor sees the 8 fake CPU devices of the tests, or on a TPU
host exactly the chips Ray assigned to it: an actor given ``'TPU'`` resources first sets the
variables libtpu reads (``pin_tpu_chips``, ``tpu_env``: its chips, their block's shape, a
one-process TPU system and a port of its own), so two workers sharing a v5e-8 host each open
their 4 chips; an actor holding a whole host needs none.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from rlax_llm import config as config_lib
from rlax_llm import roles, storage
from rlax_llm.backends import checkpoints, tpu_env
from rlax_llm.backends.assembly import Run, assemble
from rlax_llm.backends.play import play_requests
from rlax_llm.checkpoint import latest_step
from rlax_llm.errors import ConfigError, RlaxError
from rlax_llm.paramserver import ParameterServer, ShardPush, local_shards, shm
from rlax_llm.paramserver.delta import Delta, LeafUpdate
from rlax_llm.paramserver.publisher import Publisher, adapter_sync
from rlax_llm.trainer.trainer import host_arrays

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ray():
  try:
    import ray  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError('backend=ray needs the ray package (pip install ray).') from e
  return ray


def _node() -> dict[str, Any]:
  """This process's Ray node (``ray.nodes()``'s entry)."""
  ray = _ray()
  node_id = ray.get_runtime_context().get_node_id()
  return next(n for n in ray.nodes() if n['NodeID'] == node_id)


def _tpu_chips() -> tuple[list[str], int]:
  """In an actor: the TPU chip ids Ray assigned to it and its host's chip count (``[]`` and 0
  for an actor without ``'TPU'`` resources)."""
  chips = _ray().get_runtime_context().get_accelerator_ids().get('TPU', [])
  if not chips:
    return [], 0
  if os.environ.get('RAY_TPU_RESOURCE_PER_CHIP', '1') != '1':
    raise ConfigError('RAY_TPU_RESOURCE_PER_CHIP='
                      f'{os.environ["RAY_TPU_RESOURCE_PER_CHIP"]!r}: the Ray backend places '
                      'actors by whole chips (one "TPU" unit per chip); unset it.')
  return list(chips), int(_node()['Resources']['TPU'])


def pin_tpu_chips() -> dict[str, str]:
  """In an actor given ``'TPU'`` resources: puts the environment that makes libtpu open only
  the chips Ray assigned to it into ``os.environ`` (``tpu_env.chip_environment``, agreeing
  with the ``TPU_VISIBLE_CHIPS`` Ray set) and returns it; ``{}`` for an actor without TPU
  resources or holding its whole host. Called first in the roles' ``__init__``: an actor runs
  in a fresh process where ``import jax`` has not created a backend yet, and libtpu reads
  these variables when the first device is used."""
  chips, host_chips = _tpu_chips()
  if not chips:
    return {}
  env = tpu_env.chip_environment(chips, host_chips, os.environ)
  os.environ.update(env)
  return env


def _config_from(payload: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(json.loads(payload))


# This process's ends of the shared-memory transport (its mappings of the server's slots).
_SLOT_WRITER = shm.SlotWriter()
_SLOT_READER = shm.SlotReader()


def _node_id() -> str:
  return _ray().get_runtime_context().get_node_id()


def push_shards(server, version: int, shards: ShardPush, process_index: int = 0,
                process_count: int = 1) -> None:
  """Pushes ``shards`` (``local_shards(params, to_host=True)``: this process's blocks as host
  arrays) to the server actor ``server`` as ``version``. On the server's machine (and a
  trainer of one process; ``paramserver.transport='auto'``): copied straight into a slot of
  the server's shared-memory ring, the checksums taken in the same pass, and committed by
  reference (``rlax_llm.paramserver.shm``; the server sends a slot's name, this process its
  checksums). Else written into the object store once (``ray.put``), the server passed the
  object's ref (nested in a list, so that Ray hands it over unresolved) and reading the
  arrays from the store zero-copy. A trainer spanning ``process_count`` processes pushes
  from each (``process_index``) its own blocks only; the server commits the version once
  all have arrived."""
  ray = _ray()
  slot = ray.get(server.reserve.remote(version, shm.layout(shards.specs)[1], _node_id(),
                                       process_count))
  if slot is not None:
    try:
      checksums = _SLOT_WRITER.write(slot, shards)
    except OSError:  # this process may not open the server's memory: the object store
      checksums = None
    if checksums is not None:
      ray.get(server.push_slot.remote(version, slot, dataclasses.replace(shards, shards=()),
                                      checksums))
      return
  ref = ray.put(shards)
  ray.get(server.push.remote(version, [ref], process_index, process_count))


def fetch_update(server, version: int, base_version: int) -> Delta:
  """The server actor's ``update(version, base_version)`` fetched to this process, its
  whole leaves that the server kept in the object store read from there zero-copy (the
  trainer's object, not a copy serialised for this pull), and on the server's machine its
  whole leaves in shared-memory slots mapped read-only (zero copy; this process reports
  the slots it still holds with each pull, so that the server never reuses them). The
  caller verifies the checksums, as for any update."""
  ray = _ray()
  context = ray.get_runtime_context()
  reader = (_node_id(), context.get_actor_id() or f'{_node_id()}/{os.getpid()}',
            _SLOT_READER.held())
  update, refs = ray.get(server.update.remote(version, base_version, reader))
  try:
    update = _SLOT_READER.resolve(update)
  except OSError:  # this process may not open the server's memory: the object store
    update, refs = ray.get(server.update.remote(version, base_version))
  if not refs:
    return update
  whole = {}
  for pushed in ray.get(refs):  # one object per trainer process that pushed a whole leaf
    whole.update(_whole_leaves(pushed))
  return dataclasses.replace(update, buckets=tuple(
      tuple(LeafUpdate(u.leaf, full=whole[u.leaf]) if isinstance(u, _InStore) else u
            for u in bucket) for bucket in update.buckets))


@dataclasses.dataclass(frozen=True)
class _InStore:
  """In an update on its way to a worker: leaf ``leaf`` is sent whole and is the one in one
  of the objects the update's refs name (``fetch_update`` puts it back)."""

  leaf: int

  @property
  def nbytes(self) -> int:
    """The leaf's bytes in this update: none (they stay in the object store)."""
    return 0


def _whole_leaves(pushed: ShardPush) -> dict[int, np.ndarray]:
  """Leaf number -> host array, for the leaves that ``pushed`` holds as one block."""
  return {s.leaf: s.data for s in pushed.shards
          if tuple(s.data.shape) == tuple(pushed.specs[s.leaf][0])}


class ServerRole:
  """The parameter server actor: a ``ParameterServer`` keeping ``keep`` versions. Threaded
  (``max_concurrency``), so pulls run while a push is stored, and the processes of a trainer
  spanning several push a version at the same time: readers never block the writer beyond
  the server's short lock."""

  # How many pushes ``received`` remembers (the newest).
  RECEIVED = 4096

  def __init__(self, keep: int, transport: str = 'auto'):
    """``keep`` versions; ``transport`` (``paramserver.transport``): ``'auto'`` moves
    versions between processes of this machine through the shared-memory slots of this
    server (``rlax_llm.paramserver.shm``) and others through the object store;
    ``'object_store'`` always the object store."""
    self.server = ParameterServer(keep=keep)
    self.transport = transport
    shm.use_slots(transport, '', '')  # checks the value
    self.node = _node_id()
    self.slots = shm.SlotRing()
    # version -> [(the ref of an object pushed as part of it, the leaves kept in it)].
    self._refs: dict[int, list[tuple[Any, frozenset[int]]]] = {}
    # version being assembled -> [(ref, ShardPush)] of the pushes accepted so far.
    self._arriving: dict[int, list[tuple[Any, ShardPush]]] = {}
    self._received: collections.deque = collections.deque(maxlen=self.RECEIVED)
    self._lock = threading.Lock()

  def push(self, version: int, boxed: list, process_index: int = 0,
           process_count: int = 1) -> None:
    """Stores the object ``boxed[0]`` refers to (a ``ShardPush`` of host arrays:
    ``push_shards``) as process ``process_index``'s part of ``version`` (of
    ``process_count``; the version commits once every part arrived). The arrays
    ``ray.get`` returns are read-only zero-copy views of the object store, immutable and
    valid while referenced; the server keeps (adopts) the whole leaves among them instead of
    copying them (a trainer not split over devices along a leaf, e.g. data-parallel, pushes
    whole leaves), takes their checksums, and keeps the refs beside them, so a worker's pull
    gets them from the store as they are (``update``). The refs are dropped with the
    version: the object store holds the ``keep`` versions kept (objects in use are not
    spilled) and the ones workers hold."""
    ref = boxed[0]
    pushed = _ray().get(ref)
    entry = (ref, pushed)
    with self._lock:  # before the push: an adopted leaf must not outlive its object's ref
      self._arriving.setdefault(version, []).append(entry)
    try:
      committed = self.server.push_shards(version, pushed, process_index, process_count,
                                          adopt=True)
    except BaseException:
      with self._lock:
        self._arriving.get(version, []).remove(entry)
      raise
    with self._lock:
      self._received.append((version, process_index, process_count, pushed.nbytes))
      if not committed:
        return
      self._forget_dropped()
      stored = jax.tree.leaves(self.server.get(version).params)
      held = []
      for ref, pushed in self._arriving.pop(version):
        kept = frozenset(i for i, data in _whole_leaves(pushed).items()
                         if np.may_share_memory(stored[i], data))
        if kept:
          held.append((ref, kept))
      if held:
        self._refs[version] = held
      for old in [v for v in self._arriving if v < version]:  # versions that never completed
        self._arriving.pop(old)

  def _forget_dropped(self) -> None:
    """Drops the refs of versions no longer held (call with the lock held)."""
    for old in set(self._refs) - set(self.server.versions()):
      self._refs.pop(old, None)

  def reserve(self, version: int, nbytes: int, node: str, process_count: int = 1):
    """A ``shm.Slot`` of ``nbytes`` for the push of ``version`` by a writer on node ``node``
    (one of ``process_count`` trainer processes), or None when it pushes through the object
    store (another machine, a trainer of several processes, or the transport says so)."""
    if not shm.use_slots(self.transport, self.node, node, process_count):
      return None
    return self.slots.reserve(version, nbytes)

  def push_slot(self, version: int, slot, push: ShardPush, checksums: tuple[int, ...]) -> None:
    """Commits ``version``, written into ``slot`` (``reserve``) as ``push`` describes (its
    tree, paths and specs; no shards) with ``checksums``, by reference (no copy)."""
    self.slots.commit(self.server, version, slot, push, checksums)
    with self._lock:
      self._received.append((version, 0, 1, shm.layout(push.specs)[1]))
      self._forget_dropped()

  def update(self, version: int, base_version: int, reader: tuple | None = None):
    """``(update, refs)``: ``ParameterServer.update``'s, each whole leaf this server kept in
    the object store replaced by a marker (``_InStore``), and the refs of the objects holding
    them (none when none is; ``fetch_update`` resolves them). ``reader``: ``(node, reader
    id, slots it holds)`` of the pulling process; one on this machine gets each whole leaf
    that lies in a slot as a ``shm.SlotLeaf`` and those slots are leased to it."""
    update = self.server.update(version, base_version=base_version)
    if reader is not None and shm.use_slots(self.transport, self.node, reader[0]):
      update, handed = self.slots.in_slots(update)
      self.slots.lease(reader[1], reader[2], handed)
    with self._lock:
      held = self._refs.get(version, [])
    if not held:
      return update, []
    kept = frozenset().union(*(leaves for _, leaves in held))
    return dataclasses.replace(update, buckets=tuple(
        tuple(_InStore(u.leaf) if isinstance(u, LeafUpdate) and u.full is not None
              and u.leaf in kept else u
              for u in bucket) for bucket in update.buckets)), [ref for ref, _ in held]

  def held_refs(self) -> list[int]:
    """The versions whose object-store refs this server holds (at most ``keep``)."""
    with self._lock:
      return sorted(self._refs)

  def received(self) -> list[tuple[int, int, int, int]]:
    """The pushes accepted, oldest first (the newest ``RECEIVED``): ``(version,
    process_index, process_count, bytes)``, bytes: the pushed blocks' (``ShardPush.nbytes``)."""
    with self._lock:
      return list(self._received)

  def latest_version(self) -> int:
    return self.server.latest_version()

  def close(self) -> None:
    """Unlinks the shared-memory slots (also done by Python's resource tracker when this
    process dies without closing)."""
    self.slots.close()


class TrainerRole:
  """A trainer actor: one of the trainer actors (``ray.trainer_processes``; one actor: the
  whole trainer), its process index given by ``start`` (the driver orders several by their
  hosts' TPU worker ids: ``host``). ``start`` joins them into one
  ``jax.distributed`` job when there are several, runs the warm-up (or restores its
  checkpointed result), restores the workdir's latest checkpoint, and pushes the starting
  version; then it runs RL updates on the trainer mesh, which spans every actor's devices,
  pushes each version to the server actor ``server`` itself (its own blocks of it only) and
  writes its part of the checkpoints the controller asks for. Every actor of a trainer is
  sent the same calls in the same order (the collectives of a step need them all)."""

  def __init__(self):
    pin_tpu_chips()
    self.process_index, self.process_count = 0, 1

  def host(self) -> tpu_env.HostReport:
    """This actor's host: its TPU worker id (``TPU_WORKER_ID`` in this process's environment,
    else, on a TPU host, the VM's metadata; None off TPU), hostname and Ray node address."""
    on_tpu = bool(_tpu_chips()[0])
    worker_id = tpu_env.host_worker_id(os.environ, tpu_env.gce_metadata if on_tpu else None)
    return tpu_env.HostReport(worker_id, socket.gethostname(), _node()['NodeManagerAddress'])

  def coordinator_address(self) -> str:
    """``host:port`` for the job's coordinator, in this actor (process 0): this node's
    address and a port free on it now."""
    with socket.socket() as s:
      s.bind(('', 0))
      return f'{_node()["NodeManagerAddress"]}:{s.getsockname()[1]}'

  def start(self, payload: str, server, workdir: str, coordinator: str | None = None,
            process_index: int = 0, addresses: tuple[str, ...] = (), base_server=None):
    """Builds the trainer and returns ``(warm-up metrics, Resume or None, version)``: what the
    driver needs to start (the restored checkpoint's controller state and rollouts' arrays,
    no weights), having published its version (``paramserver.publisher.Publisher``; a LoRA
    trainer syncing adapters publishes its base to ``base_server``, a ``ServerRole`` keeping
    it alone, first). With several processes (``addresses``: every trainer host's, in
    process order) this one is process ``process_index``: on a TPU host it first sets the
    variables of the slice's multi-host bring-up (``tpu_env.slice_environment``), then joins
    the job at ``coordinator``."""
    self.process_index, self.process_count = process_index, max(1, len(addresses))
    if self.process_count > 1:
      chips, host_chips = _tpu_chips()
      if chips:  # before JAX opens a TPU device: libtpu reads these then
        os.environ.update(tpu_env.slice_environment(process_index, addresses, chips,
                                                    host_chips, os.environ))
      jax.distributed.initialize(coordinator, self.process_count, self.process_index)
    config = _config_from(payload)
    # This process gets the config as JSON, so its boundary is here: the same one builder
    # that validate_config ran in the driver builds the run's typed values again.
    spec = config_lib.run_spec(config)
    task, model, params, tokenizer = roles.prepare(config)
    self.checkpointer = checkpoints.build_checkpointer(config, workdir)
    mesh = (roles.meshes(config)['trainer'] if self.process_count == 1
            else roles.trainer_mesh(config))
    self.trainer, warmup_metrics = roles.warm_trainer(
        config, spec, task, model, params, tokenizer, mesh, self.checkpointer)
    resume = (checkpoints.resume_trainer(self.checkpointer, self.trainer)
              if self.checkpointer is not None else None)
    self.publisher = Publisher(self.trainer.model, roles.inference_model(config, model),
                               self._push, server, base_server)
    self._publish()
    return warmup_metrics, resume, self.trainer.version

  def _push(self, server, version: int, params) -> None:
    """The Ray transport (``publisher.Push``): this process's blocks of ``params``, each
    brought to host on its own, to the server actor ``server`` (``push_shards``: a
    shared-memory slot of the server on its machine, else the object store)."""
    push_shards(server, version, local_shards(params, to_host=True), self.process_index,
                self.process_count)

  def _publish(self) -> None:
    self.publisher.publish(self.trainer.version, self.trainer.params)

  def step(self, batch) -> tuple[dict[str, float], int]:
    metrics = self.trainer.step(batch)
    self._publish()
    return metrics, self.trainer.version

  def save(self, step: int, controller, rollouts) -> None:
    """Writes step ``step`` (this process's part of it: ``checkpoints.save_checkpoint``)."""
    checkpoints.save_checkpoint(self.checkpointer, self.trainer, step, controller, rollouts)

  def close(self) -> None:
    """Waits until every started checkpoint write is on disk."""
    if self.checkpointer is not None:
      self.checkpointer.close()

  def state(self):
    """``(params, opt_state, counters)`` as host arrays, fetched to the caller (for inspecting
    a run, e.g. comparing backends; the controller never calls it). Several processes: a
    collective (every actor is asked); process 0 returns them, the others None."""
    params, opt_state = host_arrays((self.trainer.params, self.trainer.opt_state))
    return (params, opt_state, self.trainer.counters()) if self.process_index == 0 else None


class WorkerRole:
  """An inference worker actor; pulls the versions it is asked for from the server actor
  ``server`` itself."""

  def __init__(self, payload: str, index: int, server, base_server=None):
    pin_tpu_chips()
    config = _config_from(payload)
    task = roles.build_task(config)
    model, _, tokenizer = roles.build_model(config, task)
    mesh = roles.meshes(config)['inference'][index]
    # LoRA with adapter-only sync: the base from its server, on the first pull (a restarted
    # actor pulls it again).
    fetch_base = (None if base_server is None
                  else lambda: fetch_update(base_server, 0, -1))
    self.worker = roles.build_worker(config, model, tokenizer, mesh, fetch_base)
    self.episodes = config_lib.run_spec(config).controller.episodes
    self.make_env = roles.env_factory(config, tokenizer)
    self.server = server
    # Ray restarted this actor after its process was lost: say so with the next rollouts.
    self._restarted = _ray().get_runtime_context().was_current_actor_reconstructed

  def _fetch(self, version: int, base_version: int):
    """The update from the server's process to this one (``fetch_update``: shared memory on
    the server's machine, else the object store)."""
    return fetch_update(self.server, version, base_version)

  def _latest(self) -> int:
    """The server's newest version (free-running mode asks before every decode step)."""
    return _ray().get(self.server.latest_version.remote())

  def generate(self, requests, rng_data: np.ndarray, version: int, stop_after=None, first=0):
    rollouts = self.worker.generate_at(version, self._fetch, requests,
                                       jax.random.wrap_key_data(rng_data), stop_after, first,
                                       latest=self._latest)
    if self._restarted:
      self._restarted = False
      rollouts = dataclasses.replace(rollouts,
                                     timings={**rollouts.timings, 'workers/restarts': 1})
    return rollouts


  def play(self, requests, rng_data: np.ndarray, version: int, first: int = 0):
    """``play_requests`` in this actor: the environments are built here, and what
    comes back is the trajectories' host arrays (small; weights never pass the driver)."""
    trajectories, stats = play_requests(self.worker, self._fetch, requests, rng_data, version,
                                        first, self.episodes, self.make_env)
    if self._restarted:
      self._restarted = False
      stats = {**stats, 'workers/restarts': 1}
    return trajectories, stats


class RayFuture:
  """An object ref, or the refs of one call to each actor of a trainer spanning several
  processes, as a ``concurrent.futures``-style future whose value is the first ref's
  (``then(value)`` when given). ``lost(error)``, when given, is the error to raise instead
  of Ray's when an actor has died; ``agree(values)`` checks the values of a call to several
  actors. Waiting on several, the future fails as soon as any of them fails (an actor left
  alone would wait on its collectives forever)."""

  def __init__(self, ref, then=None, lost=None, agree=None):
    self.refs = list(ref) if isinstance(ref, (list, tuple)) else [ref]
    self._then = then
    self._lost = lost
    self._agree = agree

  def result(self, timeout: float | None = None) -> Any:
    ray = _ray()
    try:
      values = _get_each(self.refs, timeout)
    except ray.exceptions.GetTimeoutError as e:
      raise TimeoutError(str(e)) from None
    except ray.exceptions.RayActorError as e:
      if self._lost is None:
        raise
      raise self._lost(e) from e
    if self._agree is not None and len(values) > 1:
      self._agree(values)
    return self._then(values[0]) if self._then else values[0]


def _get_each(refs: list, timeout: float | None) -> list:
  """``ray.get(refs)``, raising the error of the first ref to fail as soon as it does."""
  ray = _ray()
  if len(refs) == 1:
    return [ray.get(refs[0], timeout=timeout)]
  deadline = None if timeout is None else time.monotonic() + timeout
  waiting = list(refs)
  while waiting:
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
    if not ready:
      raise ray.exceptions.GetTimeoutError(f'{len(waiting)} of {len(refs)} trainer actors '
                                           f'did not answer within {timeout} s.')
    ray.get(ready)  # raises now if that call failed
  return ray.get(refs)


def _same_step(values: list[tuple[dict[str, Any], int]]) -> None:
  """The trainer actors' ``step`` results agree: the same version and scalar metrics (each
  is the value of the same replicated array)."""
  (first, version), *others = values
  scalars = lambda metrics: {k: v for k, v in metrics.items() if isinstance(v, float)}
  for index, (metrics, other_version) in enumerate(others, 1):
    if other_version != version or scalars(metrics) != scalars(first):
      raise RlaxError(f'the trainer\'s processes disagree after a step: process {index} has '
                      f'version {other_version}, loss {metrics.get("loss")}; process 0 '
                      f'version {version}, loss {first.get("loss")}. They must run the same '
                      'calls on the same data; report this as a bug.')


class TrainerLost(RlaxError):
  """The trainer actor's process was lost: the run stops; the last checkpoint resumes it."""


class RayTrainer:
  """``TrainerHandle`` over the trainer's actors (``actors``: one per trainer process, in
  process order; each is sent every call, and process 0's result is the call's);
  ``version`` follows the updates it applied (``version``: the one it started at).
  ``workdir``: where the actors checkpoint (named in the error that stops a run whose
  trainer actor was lost). ``server``, ``base_server``: the server actors it pushes to (the
  base's: LoRA with adapter-only sync, else None), for inspecting a run (e.g. their
  ``received``); the controller never calls them."""

  def __init__(self, actors, version: int, workdir, server=None, base_server=None):
    self.actors = list(actors)
    self.version = version
    self.workdir = storage.path(workdir)
    self.server, self.base_server = server, base_server
    self._lost_one = False

  @property
  def actor(self):
    """Process 0's actor (the one whose results the driver takes)."""
    return self.actors[0]

  def _call(self, method: str, *args, then=None, agree=None) -> RayFuture:
    """``method(*args)`` on every actor; with several, each argument is written into the
    object store once for all of them (a batch is sent once, not once per process)."""
    if len(self.actors) > 1:
      args = [_ray().put(arg) for arg in args]
    return RayFuture([getattr(actor, method).remote(*args) for actor in self.actors], then,
                     lost=self._lost, agree=agree)

  def _lost(self, error: Exception) -> Exception:
    self._lost_one = True
    step = latest_step(self.workdir)
    resume = (f'the last checkpoint is step {step} in {self.workdir / "checkpoints"}; '
              f'relaunch with --workdir={self.workdir} to resume from it' if step is not None
              else 'no checkpoint was written yet (checkpoint.every_steps / every_seconds); '
              'relaunching starts the run again')
    return TrainerLost(f'the trainer actor was lost ({type(error).__name__}: '
                       f'{str(error).splitlines()[0] if str(error) else ""}); the run stops: '
                       f'{resume}.')

  def step(self, batch) -> RayFuture:
    def done(value):
      metrics, self.version = value
      return metrics
    return self._call('step', batch, then=done, agree=_same_step)

  def save(self, step: int, controller, rollouts) -> RayFuture:
    return self._call('save', step, controller, rollouts)

  def close(self) -> None:
    """Waits until the actors' checkpoint writes are on disk (nothing when one is lost: the
    others of several would wait on it)."""
    if self._lost_one and len(self.actors) > 1:
      return
    with contextlib.suppress(_ray().exceptions.RayActorError):
      _ray().get([actor.close.remote() for actor in self.actors])

  def state(self) -> RayFuture:
    """``(params, opt_state, counters)`` fetched from the actors (host arrays; gathered in
    them when there are several) to this process: for inspecting a run in tests; the
    controller never calls it."""
    return self._call('state')


class RayWorker:
  """``WorkerHandle`` over a worker actor."""

  def __init__(self, actor):
    self.actor = actor

  def generate(self, requests, rng_data, version: int, stop_after=None, first=0) -> RayFuture:
    return RayFuture(self.actor.generate.remote(requests, rng_data, version, stop_after, first))

  def play(self, requests, rng_data, version: int, first: int = 0) -> RayFuture:
    return RayFuture(self.actor.play.remote(requests, rng_data, version, first))

  def retire(self) -> None:
    with contextlib.suppress(Exception):
      _ray().kill(self.actor)


def order_trainers(actors: list) -> tuple[list, list[tpu_env.HostReport]]:
  """The trainer actors in process order and their hosts' reports (``TrainerRole.host``) in
  that order: process ``p`` is the actor on the host whose TPU worker id is ``p``
  (``tpu_env.process_order``; off TPU, ``actors``' order). Raises ConfigError for a
  duplicate or missing worker id."""
  reports = _ray().get([actor.host.remote() for actor in actors])
  order = tpu_env.process_order(reports)
  return [actors[i] for i in order], [reports[i] for i in order]


def _same_start(values: list[tuple[Any, Any, int]]) -> None:
  """The trainer actors started at the same version (each restored the same checkpoint)."""
  versions = [version for _, _, version in values]
  if len(set(versions)) > 1:
    raise RlaxError(f'the trainer\'s processes started at different versions {versions}: '
                    'they restored different checkpoints; check that every trainer host sees '
                    'the same workdir (shared storage).')


def init_ray(config: ml_collections.ConfigDict) -> bool:
  """Starts (``address='local'``) or joins a Ray cluster; returns whether this call started
  it. Actors inherit this process's JAX/XLA environment and can import rlax_llm."""
  ray = _ray()
  if ray.is_initialized():
    return False
  env = {key: os.environ[key] for key in ('XLA_FLAGS', 'JAX_PLATFORMS') if key in os.environ}
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get('PYTHONPATH')]))
  kwargs = dict(runtime_env={'env_vars': env}, include_dashboard=False,
                log_to_driver=False, configure_logging=False)
  # ray.init puts its own SIGTERM handler in this process (it aborts the driver); Python
  # handlers installed before (``checkpoint.PreemptionGuard``'s) are put back, so SIGTERM and
  # SIGINT save a checkpoint and exit 0 as on the local backend.
  handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
  if config.ray.address == 'local':
    if config.ray.num_cpus:
      kwargs['num_cpus'] = config.ray.num_cpus
    ray.init(_node_ip_address='127.0.0.1', **kwargs)
  else:
    ray.init(address=config.ray.address, **kwargs)
  if threading.current_thread() is threading.main_thread():
    for signum, handler in handlers.items():
      if callable(handler):
        signal.signal(signum, handler)
  return True


@contextlib.contextmanager
def build_run(config: ml_collections.ConfigDict, workdir, spec: config_lib.RunSpec,
              stop=None) -> Iterator[Run]:
  """Builds the roles as Ray actors (the server first: the trainer and the workers are
  given its handle) and assembles the run in this process (``assembly.assemble``) with
  ``spec``, the run's typed values (``validate_config(config)``'s result; the trainer actor
  rebuilds them from the config it receives). The trainer actor (each of the
  ``ray.trainer_processes``, after joining the others) restores ``workdir``'s latest
  checkpoint itself and returns the controller's part of it."""
  ray = _ray()
  task = roles.prepare_task(config)  # the prompts the trainer's prepare() keeps, the same
  started = init_ray(config)
  payload = json.dumps(config.to_dict())
  workdir = storage.absolute(workdir)
  # A lost trainer is not restarted (its state is the checkpoint's): the run stops.
  processes = config.ray.trainer_processes
  trainer_cls = ray.remote(num_cpus=0, resources=config.ray.trainer_resources.to_dict(),
                           max_restarts=0)(TrainerRole)
  if config.ray.trainer_env:
    trainer_cls = trainer_cls.options(
        runtime_env={'env_vars': config.ray.trainer_env.to_dict()})
  restarts = config.ray.worker_restarts
  worker_cls = ray.remote(num_cpus=0, resources=config.ray.worker_resources.to_dict(),
                          max_restarts=restarts, max_task_retries=restarts)(WorkerRole)
  # Threads for the trainer's processes pushing a version at once beside workers' pulls.
  server_cls = ray.remote(num_cpus=0, max_concurrency=max(4, processes + 2))(ServerRole)
  server_actor = server_cls.remote(spec.keep_versions, spec.transport)
  # LoRA with adapter-only sync: the base in a server actor of its own, pushed once.
  base_actor = (server_cls.remote(1, spec.transport) if adapter_sync(config) is not None
                else None)
  trainer_actors = [trainer_cls.remote() for _ in range(processes)]
  worker_actors = [worker_cls.remote(payload, n, server_actor, base_actor)
                   for n in range(config.rollout.workers)]
  trainer = None
  try:
    coordinator, addresses = None, ()
    if processes > 1:
      trainer_actors, reports = order_trainers(trainer_actors)
      coordinator = ray.get(trainer_actors[0].coordinator_address.remote())
      addresses = tuple(report.address for report in reports)
    starts = _get_each([actor.start.remote(payload, server_actor, str(workdir), coordinator,
                                           p, addresses, base_actor)
                        for p, actor in enumerate(trainer_actors)], None)
    _same_start(starts)
    warmup_metrics, resume, version = starts[0]
    trainer = RayTrainer(trainer_actors, version, workdir, server_actor, base_actor)
    with assemble(config, spec.controller, workdir, task, trainer,
                  [RayWorker(actor) for actor in worker_actors], warmup_metrics,
                  resume=resume, stop=stop) as run:
      yield run
  finally:
    if trainer is not None:
      trainer.close()
    servers = [server_actor] + ([base_actor] if base_actor is not None else [])
    with contextlib.suppress(Exception):
      ray.get([server.close.remote() for server in servers], timeout=30)
    for actor in [*trainer_actors, *worker_actors, *servers]:
      with contextlib.suppress(Exception):
        ray.kill(actor)
    if started:
      ray.shutdown()
