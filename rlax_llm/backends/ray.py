"""The Ray backend: the trainer and each inference worker in a Ray actor of its own.

The controller (``rlax_llm.controller``) and the parameter server stay in the launching
process; roles are actors whose method calls return object refs, wrapped as the futures the
controller waits on, so the controller code is the one the local backend runs. Weights travel
through Ray's object store: the trainer actor returns its params, the controller sends each
worker the update (a sparse delta or whole leaves) it needs as a call argument.

Placement: each actor asks for ``ray.trainer_resources`` / ``ray.worker_resources`` (e.g.
``{'TPU': 4}`` on a TPU VM host, so Ray puts the trainer and the workers on different hosts;
empty on a laptop). ``ray.address='local'`` starts a private single-node cluster on loopback
(tests do this); any other value is passed to ``ray.init(address=...)`` to join a running
cluster (``launch/ray``). Each actor builds its role from the run's config
(``rlax_llm.roles``); JAX inside an actor sees the devices of its host (the 8 fake CPU devices
of the tests, or the TPU chips Ray assigned).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from rlax_llm import roles
from rlax_llm.backends.assembly import Run, assemble

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ray():
  try:
    import ray  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError('backend=ray needs the ray package (pip install ray).') from e
  return ray


def _config_from(payload: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(json.loads(payload))


class TrainerRole:
  """The trainer actor: runs the warm-up, then RL updates, on this host's devices."""

  def __init__(self, payload: str):
    config = _config_from(payload)
    task, model, params, tokenizer = roles.prepare(config)
    self.trainer, self.warmup_metrics = roles.warm_trainer(
        config, task, model, params, tokenizer, roles.meshes(config)['trainer'])

  def warmup(self) -> dict[str, float]:
    return self.warmup_metrics

  def step(self, batch) -> tuple[dict[str, float], int]:
    metrics = self.trainer.step(batch)
    return metrics, self.trainer.version

  def host_params(self):
    return self.trainer.host_params()

  def state(self):
    """``(params, opt_state, counters)`` as host arrays (what a checkpoint stores)."""
    return (*jax.device_get((self.trainer.params, self.trainer.opt_state)),
            self.trainer.counters())


class WorkerRole:
  """An inference worker actor."""

  def __init__(self, payload: str, index: int):
    config = _config_from(payload)
    task = roles.build_task(config)
    model, _, tokenizer = roles.build_model(config, task)
    mesh = roles.meshes(config)['inference'][index]
    self.worker = roles.build_worker(config, model, tokenizer, mesh)

  def generate(self, requests, rng_data: np.ndarray, update=None, stop_after=None, first=0):
    if update is not None:
      self.worker.apply_update(update)
    return self.worker.generate(requests, jax.random.wrap_key_data(rng_data), stop_after,
                                first)


class RayFuture:
  """An object ref as a ``concurrent.futures``-style future."""

  def __init__(self, ref, then=None):
    self.ref = ref
    self._then = then

  def result(self, timeout: float | None = None) -> Any:
    ray = _ray()
    try:
      value = ray.get(self.ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
      raise TimeoutError(str(e)) from None
    return self._then(value) if self._then else value


class RayTrainer:
  """``TrainerHandle`` over a trainer actor; ``version`` follows the updates it applied."""

  def __init__(self, actor):
    self.actor = actor
    self.version = 0

  def step(self, batch) -> RayFuture:
    def done(value):
      metrics, self.version = value
      return metrics
    return RayFuture(self.actor.step.remote(batch), done)

  def host_params(self) -> RayFuture:
    return RayFuture(self.actor.host_params.remote())

  def state(self) -> RayFuture:
    """``(params, opt_state, counters)`` fetched from the actor (host arrays)."""
    return RayFuture(self.actor.state.remote())


class RayWorker:
  """``WorkerHandle`` over a worker actor."""

  def __init__(self, actor):
    self.actor = actor

  def generate(self, requests, rng_data, update=None, stop_after=None, first=0) -> RayFuture:
    return RayFuture(self.actor.generate.remote(requests, rng_data, update, stop_after, first))

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
  if config.ray.address == 'local':
    if config.ray.num_cpus:
      kwargs['num_cpus'] = config.ray.num_cpus
    ray.init(_node_ip_address='127.0.0.1', **kwargs)
  else:
    ray.init(address=config.ray.address, **kwargs)
  return True


@contextlib.contextmanager
def build_run(config: ml_collections.ConfigDict, workdir, stop=None) -> Iterator[Run]:
  """Builds the roles as Ray actors and assembles the run in this process
  (``assembly.assemble``). (No checkpoints yet on this backend: ``rlax_llm.config`` refuses
  ``checkpoint.*`` with ``backend='ray'``.)"""
  ray = _ray()
  task = roles.build_task(config)
  started = init_ray(config)
  payload = json.dumps(config.to_dict())
  trainer_cls = ray.remote(num_cpus=0, resources=config.ray.trainer_resources.to_dict())(TrainerRole)
  worker_cls = ray.remote(num_cpus=0, resources=config.ray.worker_resources.to_dict(),
                          max_restarts=0)(WorkerRole)
  trainer_actor = trainer_cls.remote(payload)
  worker_actors = [worker_cls.remote(payload, n) for n in range(config.rollout.workers)]
  try:
    warmup_metrics = ray.get(trainer_actor.warmup.remote())
    with assemble(config, workdir, task, RayTrainer(trainer_actor),
                  [RayWorker(actor) for actor in worker_actors], warmup_metrics,
                  stop=stop) as run:
      yield run
  finally:
    for actor in [trainer_actor, *worker_actors]:
      with contextlib.suppress(Exception):
        ray.kill(actor)
    if started:
      ray.shutdown()
