"""One assembly for every backend: the controller over roles a backend has placed.

A backend (``rlax_llm.backends.local``, ``rlax_llm.backends.ray``) builds the parameter
server, the trainer and the inference workers where they run, connects the trainer (which
pushes each version) and the workers (which pull the versions they are asked for) to the
server, and hands the trainer's and workers' handles (``TrainerHandle``, ``WorkerHandle`` of
``rlax_llm.controller``) to ``assemble``, which adds what is the same on every backend: the
settings, the metrics writer, the controller and its restored state. The controller gets no
server: it moves version numbers, never weights. A backend only places roles and moves
bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections

from rlax_llm.controller import Controller, ControllerState, TrainerHandle, WorkerHandle
from rlax_llm.metrics import MetricsWriter
from rlax_llm.schedule import ControllerSettings
from rlax_llm.tasks import Task


@dataclasses.dataclass
class Run:
  """An assembled run: ``execute()`` runs the controller and writes the summary."""

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
def assemble(config: ml_collections.ConfigDict, settings: ControllerSettings, workdir,
             task: Task, trainer: TrainerHandle, workers: Sequence[WorkerHandle],
             warmup_metrics: dict[str, float], *, checkpointer=None, restored=None,
             stop=None) -> Iterator[Run]:
  """Yields the ``Run`` of the placed roles ``trainer`` and ``workers``.

  Args:
    config: the validated config (``log.*``).
    settings: the controller's settings (``RunSpec.controller`` of ``validate_config``).
    workdir: the run directory (metrics, ledger, summary).
    task: the run's task (prompts and verifier, in the controller's process).
    trainer, workers: the role handles, placed by the backend.
    warmup_metrics: the warm-up's figures (part of the summary).
    checkpointer: a ``rlax_llm.checkpoint.Checkpointer``, or None (no checkpoints).
    restored: the checkpoint the trainer was restored from (``Checkpointer.restore``), or
      None: the controller continues from its state, the writer from its step.
    stop: the preemption event (or None).
  """
  resume_step = (restored.step if restored is not None else
                 0 if checkpointer is not None else None)
  with MetricsWriter.from_config(workdir, config, resume_step=resume_step) as writer:
    controller = Controller(settings, task, trainer, workers, writer,
                            checkpointer=checkpointer, stop=stop)
    if restored is not None:
      controller.restore(ControllerState.from_dict(restored.controller), restored.rollouts)
    yield Run(controller, writer, warmup_metrics)
