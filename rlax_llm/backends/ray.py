"""The Ray backend: the trainer, the parameter server and each inference worker in a Ray
actor of its own.

The controller (``rlax_llm.controller``) stays in the launching process (the driver); roles
are actors whose method calls return object refs, wrapped as the futures the controller
waits on, so the controller code is the one the local backend runs. Weights never pass
through the driver: the trainer actor pushes each new version to the server actor itself
(``push_shards``: the trainer writes its shards into Ray's object store once and passes the
server their ref; the server reads them zero-copy and keeps whole leaves as they are), and
each worker actor pulls the version a ``generate`` call names from the server actor itself
(``fetch_update``: a sparse delta from the version it holds, or whole leaves, with per-leaf
checksums the worker verifies; a whole leaf the server kept comes as the trainer's object's
ref, read zero-copy, not serialised again). The driver sends version numbers and receives
rollouts.

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

Lost actors: a worker actor that dies (its process killed, its node lost) is restarted by
Ray, at most ``ray.worker_restarts`` times (``max_restarts``), and the call it was running
is retried on the new process (``max_task_retries``): the restarted worker holds no weights
and pulls the version the call names from the server itself, so the run's rollouts are the
same; it reports the restart with its next rollouts (``workers/restarts`` in the metrics,
and an event). Past its restarts the controller retires it and re-issues its requests to
the others. A lost trainer actor stops the run with a ``RlaxError`` naming the checkpoint
step to resume from (relaunching with the same ``--workdir`` resumes there).

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

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from rlax_llm import config as config_lib
from rlax_llm import roles, storage
from rlax_llm.backends import tpu_env
from rlax_llm.backends.assembly import Run, assemble
from rlax_llm.checkpoint import latest_step
from rlax_llm.errors import ConfigError, RlaxError
from rlax_llm.paramserver import ParameterServer, ShardPush, local_shards
from rlax_llm.paramserver.delta import Delta, LeafUpdate

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ray():
  try:
    import ray  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError('backend=ray needs the ray package (pip install ray).') from e
  return ray


def pin_tpu_chips() -> dict[str, str]:
  """In an actor given ``'TPU'`` resources: puts the environment that makes libtpu open only
  the chips Ray assigned to it into ``os.environ`` (``tpu_env.chip_environment``, agreeing
  with the ``TPU_VISIBLE_CHIPS`` Ray set) and returns it; ``{}`` for an actor without TPU
  resources or holding its whole host. Called first in the roles' ``__init__``: an actor runs
  in a fresh process where ``import jax`` has not created a backend yet, and libtpu reads
  these variables when the first device is used."""
  ray = _ray()
  context = ray.get_runtime_context()
  chips = context.get_accelerator_ids().get('TPU', [])
  if not chips:
    return {}
  if os.environ.get('RAY_TPU_RESOURCE_PER_CHIP', '1') != '1':
    raise ConfigError('RAY_TPU_RESOURCE_PER_CHIP='
                      f'{os.environ["RAY_TPU_RESOURCE_PER_CHIP"]!r}: the Ray backend places '
                      'actors by whole chips (one "TPU" unit per chip); unset it.')
  node = next(n for n in ray.nodes() if n['NodeID'] == context.get_node_id())
  env = tpu_env.chip_environment(chips, int(node['Resources']['TPU']), os.environ)
  os.environ.update(env)
  return env


def _config_from(payload: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(json.loads(payload))


def push_shards(server, version: int, shards: ShardPush) -> None:
  """Pushes ``shards`` (``local_shards(params, to_host=True)``: this process's blocks as host
  arrays) to the server actor ``server`` as ``version``: written into the object store once
  (``ray.put``), the server passed the object's ref (nested in a list, so that Ray hands it
  over unresolved) and reading the arrays from the store zero-copy."""
  ray = _ray()
  ref = ray.put(shards)
  ray.get(server.push.remote(version, [ref]))


def fetch_update(server, version: int, base_version: int) -> Delta:
  """The server actor's ``update(version, base_version)`` fetched to this process, its
  whole leaves that the server kept in the object store read from there zero-copy (the
  trainer's object, not a copy serialised for this pull). The caller verifies the
  checksums, as for any update."""
  ray = _ray()
  update, ref = ray.get(server.update.remote(version, base_version))
  if ref is None:
    return update
  whole = _whole_leaves(ray.get(ref))
  return dataclasses.replace(update, buckets=tuple(
      tuple(LeafUpdate(u.leaf, full=whole[u.leaf]) if isinstance(u, _InStore) else u
            for u in bucket) for bucket in update.buckets))


@dataclasses.dataclass(frozen=True)
class _InStore:
  """In an update on its way to a worker: leaf ``leaf`` is sent whole and is the one in the
  object the update's ref names (``fetch_update`` puts it back)."""

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
  (``max_concurrency``), so pulls run while a push is stored: readers never block the writer
  beyond the server's short lock."""

  def __init__(self, keep: int):
    self.server = ParameterServer(keep=keep)
    # version -> (the ref of the object pushed as it, the leaves kept in that object).
    self._refs: dict[int, tuple[Any, frozenset[int]]] = {}

  def push(self, version: int, boxed: list) -> None:
    """Stores the object ``boxed[0]`` refers to (a ``ShardPush`` of host arrays:
    ``push_shards``) as ``version``. The arrays ``ray.get`` returns are read-only
    zero-copy views of the object store, immutable and valid while referenced; the server
    keeps (adopts) the whole leaves among them instead of copying them (a trainer not split
    over devices along a leaf, e.g. data-parallel, pushes whole leaves), takes their
    checksums, and keeps the ref beside them, so a worker's pull gets them from the store
    as they are (``update``). The ref is dropped with the version: the object store holds
    the ``keep`` versions kept (objects in use are not spilled) and the ones workers hold."""
    ref = boxed[0]
    pushed = _ray().get(ref)
    self.server.push(version, pushed, adopt=True)
    stored = jax.tree.leaves(self.server.get(version).params)
    kept = frozenset(i for i, data in _whole_leaves(pushed).items()
                     if np.may_share_memory(stored[i], data))
    if kept:
      self._refs[version] = (ref, kept)
    for old in set(self._refs) - set(self.server.versions()):
      self._refs.pop(old, None)

  def update(self, version: int, base_version: int):
    """``(update, ref)``: ``ParameterServer.update``'s, each whole leaf this server kept in
    the object store replaced by a marker (``_InStore``), and the ref of the object holding
    them (``None`` when none is; ``fetch_update`` resolves them)."""
    update = self.server.update(version, base_version=base_version)
    ref, kept = self._refs.get(version, (None, frozenset()))
    if ref is None:
      return update, None
    return dataclasses.replace(update, buckets=tuple(
        tuple(_InStore(u.leaf) if u.full is not None and u.leaf in kept else u
              for u in bucket) for bucket in update.buckets)), ref

  def held_refs(self) -> list[int]:
    """The versions whose object-store refs this server holds (at most ``keep``)."""
    return sorted(self._refs)

  def latest_version(self) -> int:
    return self.server.latest_version()


class TrainerRole:
  """The trainer actor: runs the warm-up (or restores its checkpointed result), restores the
  workdir's latest checkpoint, then runs RL updates on this host's devices, pushes each
  version to the server actor ``server`` itself (the starting one when built, each new one
  before ``step`` returns) and writes the checkpoints the controller asks for."""

  def __init__(self, payload: str, server, workdir: str):
    pin_tpu_chips()
    config = _config_from(payload)
    # This process gets the config as JSON, so its boundary is here: the same one builder
    # that validate_config ran in the driver builds the run's typed values again.
    spec = config_lib.run_spec(config)
    task, model, params, tokenizer = roles.prepare(config)
    self.checkpointer = roles.build_checkpointer(config, workdir)
    self.trainer, self.warmup_metrics = roles.warm_trainer(
        config, spec, task, model, params, tokenizer, roles.meshes(config)['trainer'],
        self.checkpointer)
    self.resume = (roles.resume_trainer(self.checkpointer, self.trainer)
                   if self.checkpointer is not None else None)
    self.server = server
    self._pushed = -1
    self._publish()

  def _publish(self) -> None:
    """Pushes the trainer's params as its version unless already pushed (bytes: this
    process -> the object store -> the server's process)."""
    if self._pushed < self.trainer.version:
      push_shards(self.server, self.trainer.version,  # each block to host on its own
                  local_shards(self.trainer.params, to_host=True))
      self._pushed = self.trainer.version

  def start(self):
    """``(warm-up metrics, Resume or None, version)``: what the driver needs to start (the
    restored checkpoint's controller state and rollouts' arrays, no weights)."""
    return self.warmup_metrics, self.resume, self.trainer.version

  def step(self, batch) -> tuple[dict[str, float], int]:
    metrics = self.trainer.step(batch)
    self._publish()
    return metrics, self.trainer.version

  def save(self, step: int, controller, rollouts) -> None:
    """Writes step ``step`` from this process (``roles.save_checkpoint``)."""
    roles.save_checkpoint(self.checkpointer, self.trainer, step, controller, rollouts)

  def close(self) -> None:
    """Waits until every started checkpoint write is on disk."""
    if self.checkpointer is not None:
      self.checkpointer.close()

  def state(self):
    """``(params, opt_state, counters)`` as host arrays, fetched to the caller (for inspecting
    a run, e.g. comparing backends; the controller never calls it)."""
    return (*jax.device_get((self.trainer.params, self.trainer.opt_state)),
            self.trainer.counters())


class WorkerRole:
  """An inference worker actor; pulls the versions it is asked for from the server actor
  ``server`` itself."""

  def __init__(self, payload: str, index: int, server):
    pin_tpu_chips()
    config = _config_from(payload)
    task = roles.build_task(config)
    model, _, tokenizer = roles.build_model(config, task)
    mesh = roles.meshes(config)['inference'][index]
    self.worker = roles.build_worker(config, model, tokenizer, mesh)
    self.server = server
    # Ray restarted this actor after its process was lost: say so with the next rollouts.
    self._restarted = _ray().get_runtime_context().was_current_actor_reconstructed

  def _fetch(self, version: int, base_version: int):
    """The update from the server's process to this one, through the object store."""
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


class RayFuture:
  """An object ref as a ``concurrent.futures``-style future; ``lost(error)``, when given,
  is the error to raise instead of Ray's when the actor has died."""

  def __init__(self, ref, then=None, lost=None):
    self.ref = ref
    self._then = then
    self._lost = lost

  def result(self, timeout: float | None = None) -> Any:
    ray = _ray()
    try:
      value = ray.get(self.ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
      raise TimeoutError(str(e)) from None
    except ray.exceptions.RayActorError as e:
      if self._lost is None:
        raise
      raise self._lost(e) from e
    return self._then(value) if self._then else value


class TrainerLost(RlaxError):
  """The trainer actor's process was lost: the run stops; the last checkpoint resumes it."""


class RayTrainer:
  """``TrainerHandle`` over a trainer actor; ``version`` follows the updates it applied
  (``version``: the one it started at). ``workdir``: where the actor checkpoints (named in
  the error that stops a run whose trainer actor was lost)."""

  def __init__(self, actor, version: int, workdir):
    self.actor = actor
    self.version = version
    self.workdir = storage.path(workdir)

  def _call(self, ref, then=None) -> RayFuture:
    return RayFuture(ref, then, lost=self._lost)

  def _lost(self, error: Exception) -> Exception:
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
    return self._call(self.actor.step.remote(batch), done)

  def save(self, step: int, controller, rollouts) -> RayFuture:
    return self._call(self.actor.save.remote(step, controller, rollouts))

  def close(self) -> None:
    """Waits until the actor's checkpoint writes are on disk (nothing when it is lost)."""
    with contextlib.suppress(_ray().exceptions.RayActorError):
      _ray().get(self.actor.close.remote())

  def state(self) -> RayFuture:
    """``(params, opt_state, counters)`` fetched from the actor (host arrays) to this
    process: for inspecting a run in tests; the controller never calls it."""
    return self._call(self.actor.state.remote())


class RayWorker:
  """``WorkerHandle`` over a worker actor."""

  def __init__(self, actor):
    self.actor = actor

  def generate(self, requests, rng_data, version: int, stop_after=None, first=0) -> RayFuture:
    return RayFuture(self.actor.generate.remote(requests, rng_data, version, stop_after, first))

  def retire(self) -> None:
    with contextlib.suppress(Exception):
      _ray().kill(self.actor)


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
  rebuilds them from the config it receives). The trainer actor restores ``workdir``'s
  latest checkpoint itself and returns the controller's part of it."""
  ray = _ray()
  task = roles.build_task(config)
  started = init_ray(config)
  payload = json.dumps(config.to_dict())
  workdir = storage.absolute(workdir)
  # A lost trainer is not restarted (its state is the checkpoint's): the run stops.
  trainer_cls = ray.remote(num_cpus=0, resources=config.ray.trainer_resources.to_dict(),
                           max_restarts=0)(TrainerRole)
  restarts = config.ray.worker_restarts
  worker_cls = ray.remote(num_cpus=0, resources=config.ray.worker_resources.to_dict(),
                          max_restarts=restarts, max_task_retries=restarts)(WorkerRole)
  server_cls = ray.remote(num_cpus=0, max_concurrency=4)(ServerRole)
  server_actor = server_cls.remote(spec.keep_versions)
  trainer_actor = trainer_cls.remote(payload, server_actor, str(workdir))
  worker_actors = [worker_cls.remote(payload, n, server_actor)
                   for n in range(config.rollout.workers)]
  trainer = None
  try:
    warmup_metrics, resume, version = ray.get(trainer_actor.start.remote())
    trainer = RayTrainer(trainer_actor, version, workdir)
    with assemble(config, spec.controller, workdir, task, trainer,
                  [RayWorker(actor) for actor in worker_actors], warmup_metrics,
                  resume=resume, stop=stop) as run:
      yield run
  finally:
    if trainer is not None:
      trainer.close()
    for actor in [trainer_actor, *worker_actors, server_actor]:
      with contextlib.suppress(Exception):
        ray.kill(actor)
    if started:
      ray.shutdown()
