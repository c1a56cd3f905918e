"""One assembly for every backend: the controller over roles a backend has placed.

A backend (``rlax_llm.backends.local``, ``rlax_llm.backends.ray``) builds the parameter
server, the trainer and the inference workers where they run, connects the trainer (which
pushes each version) and the workers (which pull the versions they are asked for) to the
server, and hands the trainer's and workers' handles (``TrainerHandle``, ``WorkerHandle`` of
``rlax_llm.controller``) to ``assemble``, which adds what is the same on every backend: the
settings, the metrics writer, the controller and its restored state. The controller gets no
server: it moves version numbers, never weights. A backend only places roles and moves
bytes.

Checkpoints follow the same line: the trainer's process owns the ``Checkpointer``, writes
each step (``TrainerHandle.save``) and restores its own params and optimizer state when it
is built; the backend hands ``assemble`` only the ``Resume`` the trainer returned (the
controller's state and the rollouts' arrays), and the controller keeps only the decision of
when to save (``rlax_llm.checkpoint.SaveSchedule``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections

from rlax_llm import config as config_lib
from rlax_llm.checkpoint import Resume, SaveSchedule
from rlax_llm.controller import Controller, ControllerState, TrainerHandle, WorkerHandle
from rlax_llm.metrics import MetricsWriter
from rlax_llm.schedule import ControllerSettings
from rlax_llm.tasks import Task, prompt_length


@dataclasses.dataclass
class Run:
  """An assembled run: ``execute()`` runs the controller and writes the summary."""

  controller: Controller
  writer: MetricsWriter
  warmup_metrics: dict[str, float]
  data_metrics: dict[str, float]

  def execute(self) -> dict[str, Any]:
    """Runs the controller; writes and returns the summary (warm-up, data and final
    figures)."""
    start = time.perf_counter()
    summary = {**self.warmup_metrics, **self.data_metrics, **self.controller.run()}
    summary['time/total_s'] = time.perf_counter() - start + self.warmup_metrics.get(
        'warmup/time_s', 0.0)
    self.writer.write_summary(summary)
    return summary


@contextlib.contextmanager
def assemble(config: ml_collections.ConfigDict, settings: ControllerSettings, workdir,
             task: Task, trainer: TrainerHandle, workers: Sequence[WorkerHandle],
             warmup_metrics: dict[str, float], *, resume: Resume | None = None,
             stop=None, teacher=None) -> Iterator[Run]:
  """Yields the ``Run`` of the placed roles ``trainer`` and ``workers``.

  Args:
    config: the validated config (``log.*``).
    settings: the controller's settings (``RunSpec.controller`` of ``validate_config``).
    workdir: the run directory (metrics, ledger, summary).
    task: the run's task (prompts and verifier, in the controller's process).
    trainer, workers: the role handles, placed by the backend.
    warmup_metrics: the warm-up's figures (part of the summary).
      The run checkpoints when ``config.checkpoint.every_steps`` or ``every_seconds`` is set
      (the controller's ``SaveSchedule``; the trainer's process writes).
    resume: what the trainer's process handed back from the checkpoint it restored
      (``checkpoints.resume_trainer``), or None: the controller continues from its state, the
      writer from its step.
    stop: the preemption event (or None).
    teacher: on-policy distillation's teacher (``controller.completions.Distillation``), in
      the controller's process, or None.
  """
  c = config.checkpoint
  checkpoints = (SaveSchedule(c.every_steps, c.every_seconds, c.preemption_notice_s)
                 if config_lib.checkpointing(config) else None)
  resume_step = (resume.step if resume is not None else
                 0 if checkpoints is not None else None)
  with MetricsWriter.from_config(workdir, config, resume_step=resume_step) as writer:
    controller = Controller(settings, task, trainer, workers, writer,
                            checkpoints=checkpoints, stop=stop, teacher=teacher)
    if resume is not None:
      controller.restore(ControllerState.from_dict(resume.controller), resume.rollouts)
    yield Run(controller, writer, warmup_metrics, prompt_length.dropped_metrics(task))
