"""The Ray backend: the trainer, the parameter server, each inference worker and on-policy
distillation's teacher in a Ray actor of its own.

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

Placement: each actor asks for its role's resources (``actor_options``:
``ray.trainer_resources``, ``ray.worker_resources``, and on-policy distillation's teacher
``ray.teacher_resources``; e.g. ``{'TPU': 4}`` on a TPU VM host, so Ray puts the trainer and
the workers on different hosts, and ``{'TPU': 1}`` for a teacher on a chip of its own; empty
on a laptop). ``ray.address='local'`` starts a private single-node cluster on loopback
(tests do this); any other value is passed to ``ray.init(address=...)`` to join a running
cluster (``launch/ray``). Each actor builds its role from the run's config
(``rlax_llm.roles``); the actors' classes and the transport between them are
``rlax_llm.backends.ray_actors``, this module is the driver's side (the handles the
controller calls, ``init_ray``, ``build_run``). JAX inside an actor sees the 8 fake CPU
devices of the tests, or on a TPU host exactly the chips Ray assigned to it: an actor given
``'TPU'`` resources first sets the variables libtpu reads (``pin_tpu_chips``, ``tpu_env``:
its chips, their block's shape, a one-process TPU system and a port of its own), so two
workers sharing a v5e-8 host each open their 4 chips; an actor holding a whole host needs
none.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import ml_collections

from rlax_llm import config as config_lib
from rlax_llm import roles, storage
from rlax_llm.backends import tpu_env
from rlax_llm.backends.assembly import Run, assemble
from rlax_llm.backends.ray_actors import (ServerRole, TeacherRole, TrainerRole, WorkerRole,
                                          import_ray)
from rlax_llm.checkpoint import latest_step
from rlax_llm.controller.completions import Distillation
from rlax_llm.errors import RlaxError
from rlax_llm.paramserver.publisher import adapter_sync

_ROOT = pathlib.Path(__file__).resolve().parents[2]


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
    ray = import_ray()
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
  ray = import_ray()
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
      args = [import_ray().put(arg) for arg in args]
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
    with contextlib.suppress(import_ray().exceptions.RayActorError):
      import_ray().get([actor.close.remote() for actor in self.actors])

  def state(self) -> RayFuture:
    """``(params, opt_state, counters)`` fetched from the actors (host arrays; gathered in
    them when there are several) to this process: for inspecting a run in tests; the
    controller never calls it."""
    return self._call('state')


class RayTeacher:
  """On-policy distillation's teacher over its actor (``TeacherRole``): ``score`` as the
  local ``trainer.teacher.Teacher``'s, the token ids sent and the scores received."""

  def __init__(self, actor):
    self.actor = actor

  def score(self, tokens, loss_mask):
    return RayFuture(self.actor.score.remote(tokens, loss_mask)).result()


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
      import_ray().kill(self.actor)


def order_trainers(actors: list) -> tuple[list, list[tpu_env.HostReport]]:
  """The trainer actors in process order and their hosts' reports (``TrainerRole.host``) in
  that order: process ``p`` is the actor on the host whose TPU worker id is ``p``
  (``tpu_env.process_order``; off TPU, ``actors``' order). Raises ConfigError for a
  duplicate or missing worker id."""
  reports = import_ray().get([actor.host.remote() for actor in actors])
  order = tpu_env.process_order(reports)
  return [actors[i] for i in order], [reports[i] for i in order]


def _same_start(values: list[tuple[Any, Any, int]]) -> None:
  """The trainer actors started at the same version (each restored the same checkpoint)."""
  versions = [version for _, _, version in values]
  if len(set(versions)) > 1:
    raise RlaxError(f'the trainer\'s processes started at different versions {versions}: '
                    'they restored different checkpoints; check that every trainer host sees '
                    'the same workdir (shared storage).')


# The roles whose actors ask for resources of their own (``ray.<role>_resources``).
ROLES = ('trainer', 'worker', 'teacher')


def actor_options(config: ml_collections.ConfigDict, role: str) -> dict[str, Any]:
  """The ``ray.remote`` options of ``role``'s actors (one of ``ROLES``): the resources
  ``config.ray.<role>_resources`` names (e.g. ``{'TPU': 4}``; Ray places the actor where they
  are free and holds them for it, and an actor given ``'TPU'`` opens only its chips:
  ``ray_actors.pin_tpu_chips``; ``'CPU'`` and ``'GPU'`` become Ray's ``num_cpus`` and
  ``num_gpus``), no CPU held unless named (the roles' work is on their devices), and what
  Ray does when the actor's process is lost. A worker is restarted ``ray.worker_restarts``
  times and its call retried there (it pulls its weights again); the teacher
  ``ray.teacher_restarts`` times, its call retried there (it loads its frozen weights again:
  its scores depend only on the tokens, so the run is unchanged); a trainer is not (its
  state is the checkpoint's: the run stops). The trainer's processes also get
  ``ray.trainer_env``."""
  if role not in ROLES:
    raise ValueError(f'role={role!r} is not one of the Ray roles {ROLES}.')
  r = config.ray
  resources = r[f'{role}_resources'].to_dict()
  options: dict[str, Any] = dict(num_cpus=resources.pop('CPU', 0), resources=resources,
                                 max_restarts=0)
  if 'GPU' in resources:
    options['num_gpus'] = resources.pop('GPU')
  if role in ('worker', 'teacher'):
    restarts = r[f'{role}_restarts']
    options.update(max_restarts=restarts, max_task_retries=restarts)
  if role == 'trainer' and r.trainer_env:
    options['runtime_env'] = {'env_vars': r.trainer_env.to_dict()}
  return options


def init_ray(config: ml_collections.ConfigDict) -> bool:
  """Starts (``address='local'``) or joins a Ray cluster; returns whether this call started
  it. Actors inherit this process's JAX/XLA environment and can import rlax_llm."""
  ray = import_ray()
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
  ray = import_ray()
  task = roles.prepare_task(config)  # the prompts the trainer's prepare() keeps, the same
  started = init_ray(config)
  payload = json.dumps(config.to_dict())
  workdir = storage.absolute(workdir)
  processes = config.ray.trainer_processes
  trainer_cls = ray.remote(**actor_options(config, 'trainer'))(TrainerRole)
  worker_cls = ray.remote(**actor_options(config, 'worker'))(WorkerRole)
  # Threads for the trainer's processes pushing a version at once beside workers' pulls.
  server_cls = ray.remote(num_cpus=0, max_concurrency=max(4, processes + 2))(ServerRole)
  server_actor = server_cls.remote(spec.keep_versions, spec.transport)
  # LoRA with adapter-only sync: the base in a server actor of its own, pushed once.
  base_actor = (server_cls.remote(1, spec.transport) if adapter_sync(config) is not None
                else None)
  trainer_actors = [trainer_cls.remote() for _ in range(processes)]
  worker_actors = [worker_cls.remote(payload, n, server_actor, base_actor)
                   for n in range(config.rollout.workers)]
  # On-policy distillation's teacher: an actor of its own on the resources it asks for (its
  # process's first device), asked for each batch's scores.
  teacher_actor = (ray.remote(**actor_options(config, 'teacher'))(TeacherRole).remote(payload)
                   if spec.distill.enabled else None)
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
    teacher = (None if teacher_actor is None
               else Distillation(RayTeacher(teacher_actor), spec.distill))
    with assemble(config, spec.controller, workdir, task, trainer,
                  [RayWorker(actor) for actor in worker_actors], warmup_metrics,
                  resume=resume, stop=stop, teacher=teacher) as run:
      yield run
  finally:
    if trainer is not None:
      trainer.close()
    servers = [server_actor] + ([base_actor] if base_actor is not None else [])
    with contextlib.suppress(Exception):
      ray.get([server.close.remote() for server in servers], timeout=30)
    teachers = [] if teacher_actor is None else [teacher_actor]
    for actor in [*trainer_actors, *worker_actors, *teachers, *servers]:
      with contextlib.suppress(Exception):
        ray.kill(actor)
    if started:
      ray.shutdown()
