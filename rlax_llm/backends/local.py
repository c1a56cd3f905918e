"""The local backend: every role in this process, each on its own devices.

``build_run(config, workdir, spec, stop)`` builds the roles (``rlax_llm.roles``) from the
config and its typed values (``spec``: ``validate_config``'s ``RunSpec``), checks that the run
fits (prompt lengths, memory) before any compute, runs the supervised warm-up when configured
(or restores its checkpointed result), restores the latest checkpoint when the workdir holds
one (``rlax_llm.checkpoint``), and yields a ``Run`` whose ``execute()`` runs the controller.

Each role's calls run in order on the role's own thread (``local.concurrent=True``, the
default), so inference for later batches overlaps training (JAX releases the GIL while XLA
runs); with ``False`` every call runs inline, one after the other, which is the synchronous
reference the asynchronous runs are checked against. With ``mesh.disjoint`` the trainer takes
the first devices and each inference worker the next ones (e.g. 8 devices: trainer 4,
inference 4); otherwise every role's mesh starts at device 0.

Weights: the parameter server (``rlax_llm.paramserver.ParameterServer``, keeping
``RunSpec.keep_versions`` versions: ``paramserver.keep_versions``) is an object of this
process, but only the roles call it: the trainer's publisher
(``paramserver.publisher.Publisher``, with this backend's transport: ``ParameterServer.push``)
pushes each new version from the trainer's thread when its update is done (and its starting
version when it is built or restored), cast to the workers' dtype
(``model.inference_param_dtype``) on its devices first, and each worker's receiver
(``paramserver.receiver.Receiver``, fetching with ``ParameterServer.update``) pulls the
version a ``generate`` call names from the worker's thread (``InferenceWorker.generate_at``).
The controller passes version numbers only. A LoRA run with adapter-only sync
(``publisher.adapter_sync``) has a second server, keeping one version: the base, pushed once
by the trainer when it is built (after restoring), pulled once by each worker before its
first adapter version; the versions are then the adapter trees (``lora.pushed_params``).

Host memory: every role allocates from this process's heap. ``build_run`` has glibc map
each buffer of 1 MiB or more on its own (``return_freed_buffers``), so that what a role frees
goes back to the system instead of staying in heaps the next allocations may not fit, and
the server frees a dropped version at once (``ParameterServer(reuse_buffers=False)``), since
a spare version would be held through every update's peak.

Checkpoints: the trainer's handle (``LocalTrainer``) owns the ``Checkpointer``; it restores
the trainer's params and optimizer state when built and writes each save the controller
asks for (``save``) on the trainer's thread, after the updates queued before it. The
controller sees only its own state and the rollouts' arrays.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np

from rlax_llm import config as config_lib
from rlax_llm import memory_fit, roles
from rlax_llm.backends import checkpoints
from rlax_llm.backends.assembly import Run, assemble
from rlax_llm.backends.play import play_requests
from rlax_llm.controller.completions import Distillation
from rlax_llm.models.model import Model, abstract_model
from rlax_llm.paramserver import ParameterServer
from rlax_llm.paramserver.publisher import Publisher, adapter_sync
from rlax_llm.trainer.trainer import host_arrays


# glibc's mallopt parameter for the size from which an allocation gets its own mapping.
_M_MMAP_THRESHOLD = -3
# Host buffers from 1 MiB up (per-layer weights and caches, step outputs, rollout arrays) get
# their own mappings, returned to the system when freed.
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_buffers(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
  """Makes glibc's malloc map every allocation of ``threshold`` bytes or more on its own
  (one its heaps cannot serve from a free chunk that large), so that its memory goes back
  to the system when it is freed, and returns True (False where
  the C library has no ``mallopt``, e.g. not glibc: nothing changes).

  glibc raises its mapping threshold to the size of each mapped buffer freed, up to 32 MiB,
  and serves anything smaller from its heaps, which keep freed memory: a run whose roles
  free and allocate buffers of a few MiB every step (an engine's per-layer weights of each
  version, its step outputs, the trainer's batch) grows heaps that hold freed memory
  (SmolLM2-135M recipe: 1.9 GiB of 3.3 GiB of heap free after 4 steps; 0.5 of 1.0 GiB with
  a fixed 1 MiB threshold, resident memory 7.4 -> 6.0 GiB). Process-wide: the local backend
  sets it because every role allocates from this process's heap."""
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


class Serial:
  """Runs a role's calls in submission order, on a dedicated thread or inline."""

  def __init__(self, name: str, threaded: bool):
    self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
                  if threaded else None)

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    if self._pool is not None:
      return self._pool.submit(fn, *args)
    future = concurrent.futures.Future()
    try:
      future.set_result(fn(*args))
    except BaseException as e:  # pylint: disable=broad-except
      future.set_exception(e)
    return future

  def shutdown(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)


def _push(server: ParameterServer, version: int, params) -> None:
  """The local transport (``publisher.Push``): one process pushes its arrays, shard by shard
  (one copy); with several, each process's server holds the whole params, gathered by
  ``host_arrays`` (``process_allgather``)."""
  server.push(version, params if jax.process_count() == 1 else host_arrays(params))


class LocalTrainer:
  """``TrainerHandle`` over an in-process ``Trainer`` that publishes each of its versions to
  ``server`` itself (``paramserver.publisher.Publisher``): its current one when built (or
  ``load``ed), each new one at the end of the ``step`` that made it, cast to the dtypes of
  ``inference`` (the workers' model, ``roles.inference_model``; default the trainer's own:
  pushed as they are). With a ``checkpointer`` it first restores the trainer from its latest
  checkpoint (``resume``: what the controller continues from, or None) and writes the saves
  the controller asks for. A LoRA trainer with adapter-only sync (``publisher.adapter_sync``)
  publishes its base to ``base_server`` once, before its first version."""

  def __init__(self, trainer, threaded: bool, server: ParameterServer, checkpointer=None,
               inference: Model | None = None, base_server: ParameterServer | None = None):
    self.trainer = trainer
    self.server = server
    self.base_server = base_server
    inference = (abstract_model(trainer.model.config) if inference is None  # a LoRA
                 else inference)  # trainer's workers hold the base model
    self.checkpointer = checkpointer
    self.resume = (checkpoints.resume_trainer(checkpointer, trainer)
                   if checkpointer is not None else None)
    self._serial = Serial('trainer', threaded)
    self.publisher = Publisher(trainer.model, inference, _push, server, base_server)
    self._publish()

  @property
  def version(self) -> int:
    return self.trainer.version

  def _publish(self) -> None:
    self.publisher.publish(self.trainer.version, self.trainer.params)

  def _step(self, batch):
    metrics = self.trainer.step(batch)
    self._publish()
    return metrics

  def step(self, batch):
    return self._serial.submit(self._step, batch)

  def save(self, step: int, controller, rollouts):
    """Saves step ``step`` on the trainer's thread (``checkpoints.save_checkpoint``)."""
    return self._serial.submit(checkpoints.save_checkpoint, self.checkpointer, self.trainer,
                               step, controller, rollouts)

  def load(self, params, opt_state, counters: dict[str, int]) -> None:
    """Continues from a checkpoint (``Trainer.load``) and pushes the restored version."""
    self.trainer.load(params, opt_state, counters)
    self._publish()

  def host_params(self):
    """The trainer's params as host arrays (for inspecting a run; the controller never
    calls it)."""
    return self._serial.submit(self.trainer.host_params)

  def state(self):
    """``(params, opt_state, counters)`` (for inspecting a run, e.g. comparing backends; the
    controller never calls it)."""
    return self._serial.submit(
        lambda: (self.trainer.params, self.trainer.opt_state, self.trainer.counters()))

  def close(self) -> None:
    """Waits for the checkpoint writes, then stops the trainer's thread."""
    if self.checkpointer is not None:
      self.checkpointer.close()
    self._serial.shutdown()


class LocalWorker:
  """``WorkerHandle`` over an in-process ``InferenceWorker`` that pulls the versions it is
  asked for from ``server`` itself. An environment run's worker has ``episodes`` (the run's
  ``EpisodeSettings``) and ``make_env`` (``roles.env_factory``) to ``play`` with."""

  def __init__(self, worker, threaded: bool, server: ParameterServer, episodes=None,
               make_env=None):
    self.worker = worker
    self.server = server
    self.episodes = episodes
    self.make_env = make_env
    self._serial = Serial('inference', threaded)

  def play(self, requests, rng_data: np.ndarray, version: int, first: int = 0):
    """``play_requests`` on this worker's thread."""
    return self._serial.submit(play_requests, self.worker, self.server.update, requests,
                               rng_data, version, first, self.episodes, self.make_env)

  def generate(self, requests, rng_data: np.ndarray, version: int, stop_after=None, first=0):
    return self._serial.submit(self._generate, requests, rng_data, version, stop_after, first)

  def _generate(self, requests, rng_data, version, stop_after, first):
    return self.worker.generate_at(version, self.server.update, requests,
                                   jax.random.wrap_key_data(rng_data), stop_after, first,
                                   latest=self.server.latest_version)

  def retire(self) -> None:
    self._serial.shutdown()


@contextlib.contextmanager
def build_run(config: ml_collections.ConfigDict, workdir, spec: config_lib.RunSpec,
              stop=None) -> Iterator[Run]:
  """Builds task, model, warm-up, trainer and workers in this process and assembles the run
  (``assembly.assemble``); resumes from ``workdir``'s checkpoint when it has one. ``spec``:
  the run's typed values (``validate_config(config)``'s result); ``stop``: the preemption
  event."""
  return_freed_buffers()
  task, model, params, tokenizer = roles.prepare(config)
  # On-policy distillation's teacher (None without): loaded before the memory check, so on
  # CPU the host memory it holds is already out of what the plan is checked against.
  teacher = roles.build_teacher(config, spec, task, tokenizer)
  meshes = roles.meshes(config)
  held = [params] if teacher is None else [params, teacher.params]
  memory_fit.check_plan_fits(config, model.config, meshes,
                             held_bytes=sum(x.nbytes for x in jax.tree.leaves(held)),
                             teacher=None if teacher is None else teacher.model.config)
  threaded = config.local.concurrent
  checkpointer = checkpoints.build_checkpointer(config, workdir)
  trainer, warmup_metrics = roles.warm_trainer(config, spec, task, model, params, tokenizer,
                                               meshes['trainer'], checkpointer, stop)
  # The trainer placed its own copy: the loaded params would otherwise stay alive in this
  # frame for the whole run (one more copy of the model in host memory).
  del params, held
  # In this process the server's host versions sit beside the trainer's step: it frees a
  # dropped version at once instead of keeping it for the next push to write into (one
  # version less held through every update: 0.5 GB for SmolLM2-135M in float32).
  server = ParameterServer(keep=spec.keep_versions, reuse_buffers=False)
  # LoRA with adapter-only sync: the base goes through a server of its own, once.
  base_server = ParameterServer(keep=1) if adapter_sync(config) is not None else None
  # Restores the latest checkpoint into the trainer, then pushes its version (in the
  # workers' dtype).
  trainer = LocalTrainer(trainer, threaded, server, checkpointer,
                         inference=roles.inference_model(config, model), base_server=base_server)
  fetch_base = None if base_server is None else functools.partial(base_server.update, 0)
  workers = [LocalWorker(roles.build_worker(config, model, tokenizer, mesh, fetch_base),
                         threaded, server, spec.controller.episodes,
                         roles.env_factory(config, tokenizer))
             for mesh in meshes['inference']]
  try:
    with assemble(config, spec.controller, workdir, task, trainer, workers, warmup_metrics,
                  resume=trainer.resume, stop=stop,
                  teacher=None if teacher is None else Distillation(teacher, spec.distill)
                  ) as run:
      yield run
  finally:
    trainer.close()
    for worker in workers:
      worker.retire()
