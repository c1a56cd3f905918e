"""The local backend: every role in this process, each on its own devices.

``build_run(config, workdir, stop)`` builds the roles (``rlax_llm.roles``), checks that the run
fits (prompt lengths, memory) before any compute, runs the supervised warm-up when configured
(or restores its checkpointed result), restores the latest checkpoint when the workdir holds
one (``rlax_llm.checkpoint``), and yields a ``Run`` whose ``execute()`` runs the controller.

Each role's calls run in order on the role's own thread (``local.concurrent=True``, the
default), so inference for later batches overlaps training (JAX releases the GIL while XLA
runs); with ``False`` every call runs inline, one after the other, which is the synchronous
reference the asynchronous runs are checked against. With ``mesh.disjoint`` the trainer takes
the first devices and each inference worker the next ones (e.g. 8 devices: trainer 4,
inference 4); otherwise every role's mesh starts at device 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np

from rlax_llm import roles
from rlax_llm.backends.assembly import Run, assemble


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


class LocalTrainer:
  """``TrainerHandle`` over an in-process ``Trainer``."""

  def __init__(self, trainer, threaded: bool):
    self.trainer = trainer
    self._serial = Serial('trainer', threaded)

  @property
  def version(self) -> int:
    return self.trainer.version

  def step(self, batch):
    return self._serial.submit(self.trainer.step, batch)

  def host_params(self):
    return self._serial.submit(self.trainer.host_params)

  def state(self):
    return self._serial.submit(
        lambda: (self.trainer.params, self.trainer.opt_state, self.trainer.counters()))

  def close(self) -> None:
    self._serial.shutdown()


class LocalWorker:
  """``WorkerHandle`` over an in-process ``InferenceWorker``."""

  def __init__(self, worker, threaded: bool):
    self.worker = worker
    self._serial = Serial('inference', threaded)

  def generate(self, requests, rng_data: np.ndarray, update=None, stop_after=None, first=0):
    return self._serial.submit(self._generate, requests, rng_data, update, stop_after, first)

  def _generate(self, requests, rng_data, update, stop_after, first):
    if update is not None:
      self.worker.apply_update(update)
    return self.worker.generate(requests, jax.random.wrap_key_data(rng_data), stop_after,
                                first)

  def retire(self) -> None:
    self._serial.shutdown()


@contextlib.contextmanager
def build_run(config: ml_collections.ConfigDict, workdir, stop=None) -> Iterator[Run]:
  """Builds task, model, warm-up, trainer and workers in this process and assembles the run
  (``assembly.assemble``); resumes from ``workdir``'s checkpoint when it has one. ``stop``:
  the preemption event."""
  task, model, params, tokenizer = roles.prepare(config)
  meshes = roles.meshes(config)
  threaded = config.local.concurrent
  checkpointer = roles.build_checkpointer(config, workdir)
  trainer, warmup_metrics = roles.warm_trainer(config, task, model, params, tokenizer,
                                               meshes['trainer'], checkpointer, stop)
  trainer = LocalTrainer(trainer, threaded)
  restored = None
  if checkpointer is not None:
    restored = checkpointer.restore(trainer.trainer.params, trainer.trainer.opt_state)
    if restored is not None:
      trainer.trainer.load(restored.params, restored.opt_state, restored.trainer)
  workers = [LocalWorker(roles.build_worker(config, model, tokenizer, mesh), threaded)
             for mesh in meshes['inference']]
  try:
    with assemble(config, workdir, task, trainer, workers, warmup_metrics,
                  checkpointer=checkpointer, restored=restored, stop=stop) as run:
      yield run
  finally:
    if checkpointer is not None:
      checkpointer.close()
    trainer.close()
    for worker in workers:
      worker.retire()
