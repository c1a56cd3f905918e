"""What runs inside the Ray backend's actors: the roles and the transport between them.

``ServerRole`` (the parameter server), ``TrainerRole`` (one per trainer process),
``WorkerRole`` (one per inference worker) and ``TeacherRole`` (on-policy distillation's
teacher) are the classes ``rlax_llm.backends.ray`` makes actors of; each builds its role
from the run's config (``rlax_llm.roles``). Weights move between them without the driver:
``push_shards`` (a trainer's blocks to the server actor, through a shared-memory slot on the
server's machine or the object store) and ``fetch_update`` (a version from the server actor
to a worker, whole leaves read zero-copy from the trainer's object or mapped from a slot).
``pin_tpu_chips`` is what an actor given ``'TPU'`` resources runs first, so that libtpu opens
only the chips Ray assigned to it. The module docstring of ``rlax_llm.backends.ray``
describes the whole protocol.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import socket
import threading
from typing import Any

import jax
import ml_collections
import numpy as np

from rlax_llm import config as config_lib
from rlax_llm import extras, roles
from rlax_llm.backends import checkpoints, tpu_env
from rlax_llm.backends.play import play_requests
from rlax_llm.errors import ConfigError
from rlax_llm.paramserver import ParameterServer, ShardPush, local_shards, shm
from rlax_llm.paramserver.delta import Delta, LeafUpdate
from rlax_llm.paramserver.publisher import Publisher
from rlax_llm.trainer.trainer import host_arrays


def import_ray():
  """The ``ray`` module, or a one-line ``MissingExtra`` naming the ``ray`` extra."""
  return extras.require('ray', "backend='ray'")


def _node() -> dict[str, Any]:
  """This process's Ray node (``ray.nodes()``'s entry)."""
  ray = import_ray()
  node_id = ray.get_runtime_context().get_node_id()
  return next(n for n in ray.nodes() if n['NodeID'] == node_id)


def _tpu_chips() -> tuple[list[str], int]:
  """In an actor: the TPU chip ids Ray assigned to it and its host's chip count (``[]`` and 0
  for an actor without ``'TPU'`` resources)."""
  chips = import_ray().get_runtime_context().get_accelerator_ids().get('TPU', [])
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
  return import_ray().get_runtime_context().get_node_id()


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
  ray = import_ray()
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
  ray = import_ray()
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
    pushed = import_ray().get(ref)
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


class TeacherRole:
  """On-policy distillation's teacher as an actor (``roles.build_teacher`` from the run's
  config, loaded once in this process, on its first device: with ``'TPU'`` in
  ``ray.teacher_resources``, a chip of its own, ``pin_tpu_chips``): the driver's controller
  sends it each trained batch's token ids and loss mask and receives the teacher's scores
  (``trainer.teacher.TeacherScores``); its weights never leave it."""

  def __init__(self, payload: str):
    pin_tpu_chips()
    config = _config_from(payload)
    task = roles.build_task(config)
    self.teacher = roles.build_teacher(config, config_lib.run_spec(config), task,
                                       roles.load_tokenizer(config, task))

  def score(self, tokens: np.ndarray, loss_mask: np.ndarray):
    return self.teacher.score(tokens, loss_mask)


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
    self._restarted = import_ray().get_runtime_context().was_current_actor_reconstructed

  def _fetch(self, version: int, base_version: int):
    """The update from the server's process to this one (``fetch_update``: shared memory on
    the server's machine, else the object store)."""
    return fetch_update(self.server, version, base_version)

  def _latest(self) -> int:
    """The server's newest version (free-running mode asks before every decode step)."""
    return import_ray().get(self.server.latest_version.remote())

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
