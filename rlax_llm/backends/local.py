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
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from rlax_llm import config as config_lib
from rlax_llm import roles
from rlax_llm.controller import Controller, ControllerState
from rlax_llm.metrics import MetricsWriter
from rlax_llm.paramserver import ParameterServer
from rlax_llm.trainer.warmup import supervised_warmup


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


class InjectedFault(RuntimeError):
  """A failure injected by ``rollout.fault`` (tests of failure handling)."""


@dataclasses.dataclass
class Fault:
  """Makes a worker fail at its ``call``-th generate call: ``die`` (raise from then on) or
  ``hang`` (block until retired)."""

  call: int
  kind: str


class LocalWorker:
  """``WorkerHandle`` over an in-process ``InferenceWorker``."""

  def __init__(self, worker, threaded: bool, fault: Fault | None = None):
    self.worker = worker
    self._serial = Serial('inference', threaded)
    self._fault = fault
    self._calls = 0
    self._retired = threading.Event()

  def generate(self, requests, rng_data: np.ndarray, update=None, stop_after=None, first=0):
    return self._serial.submit(self._generate, requests, rng_data, update, stop_after, first)

  def _generate(self, requests, rng_data, update, stop_after, first):
    self._calls += 1
    if self._fault is not None and self._calls >= self._fault.call:
      if self._fault.kind == 'hang':
        self._retired.wait()
      raise InjectedFault(f'injected fault: worker {self._fault.kind} at call {self._calls}')
    if update is not None:
      self.worker.apply_update(update)
    return self.worker.generate(requests, jax.random.wrap_key_data(rng_data), stop_after,
                                first)

  def retire(self) -> None:
    self._retired.set()
    self._serial.shutdown()


def parse_fault(config: ml_collections.ConfigDict, worker: int) -> Fault | None:
  f = config.rollout.fault
  if f.worker != worker or f.kind == 'none':
    return None
  return Fault(call=f.call, kind=f.kind)


@dataclasses.dataclass
class Run:
  controller: Controller
  writer: MetricsWriter
  warmup_metrics: dict[str, float]

  def execute(self) -> dict[str, Any]:
    """Runs the controller; writes and returns the summary (warm-up and final figures)."""
    start = time.perf_counter()
    summary = {**self.warmup_metrics, **self.controller.run()}
    summary['time/total_s'] = time.perf_counter() - start + self.warmup_metrics.get(
        'warmup/time_s', 0.0)
    self.writer.write_summary(summary)
    return summary


@contextlib.contextmanager
def build_run(config: ml_collections.ConfigDict, workdir, stop=None) -> Iterator[Run]:
  """Builds task, model, warm-up, trainer, parameter server, workers and controller;
  resumes from ``workdir``'s checkpoint when it has one. ``stop``: the preemption event."""
  settings = config_lib.controller_settings(config)
  task, model, params, tokenizer = roles.prepare(config)
  meshes = roles.meshes(config)
  threaded = config.local.concurrent
  checkpointer = roles.build_checkpointer(config, workdir)

  w = config.warmup
  restored_warmup = (checkpointer.restore_warmup(params)
                     if checkpointer is not None and w.steps > 0 else None)
  if restored_warmup is not None:
    params, warmup_metrics = restored_warmup
    logging.info('warm-up restored from its checkpoint')
  else:
    params, warmup_metrics = supervised_warmup(
        model, params, task, tokenizer, meshes['trainer'], steps=w.steps,
        batch_size=w.batch_size, learning_rate=w.learning_rate, warmup_steps=w.warmup_steps,
        max_nonfinite_updates=config.rl.max_nonfinite_updates, stop=stop)
    if checkpointer is not None and w.steps > 0:
      checkpointer.save_warmup(params, warmup_metrics)

  trainer = LocalTrainer(roles.build_trainer(config, model, params, meshes['trainer']),
                         threaded)
  restored = None
  if checkpointer is not None:
    restored = checkpointer.restore(trainer.trainer.params, trainer.trainer.opt_state)
    if restored is not None:
      trainer.trainer.load(restored.params, restored.opt_state, restored.trainer)
  workers = [LocalWorker(roles.build_worker(config, model, tokenizer, mesh), threaded,
                         parse_fault(config, n))
             for n, mesh in enumerate(meshes['inference'])]
  server = ParameterServer(keep=config.staleness.k + 2)
  try:
    with MetricsWriter.from_config(
        workdir, config, resume_step=(restored.step if restored is not None else
                                      0 if checkpointer is not None else None)) as writer:
      controller = Controller(settings, task, trainer, workers, server, writer,
                              checkpointer=checkpointer, stop=stop)
      if restored is not None:
        controller.restore(ControllerState.from_dict(restored.controller), restored.rollouts)
      yield Run(controller, writer, warmup_metrics)
  finally:
    if checkpointer is not None:
      checkpointer.close()
    trainer.close()
    for worker in workers:
      worker.retire()
