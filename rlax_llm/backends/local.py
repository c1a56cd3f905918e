"""The local backend: every role in this process, each on its own mesh.

``build_run(config, workdir)`` builds the roles (``rlax_llm.roles``), checks that the run fits
(prompt lengths, memory) before any compute, runs the supervised warm-up when configured, and
yields a ``Run`` whose ``execute()`` runs the controller. The Ray backend (a later issue)
places the same roles on actors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import ml_collections

from rlax_llm import config as config_lib
from rlax_llm import roles
from rlax_llm.controller import Controller
from rlax_llm.metrics import MetricsWriter
from rlax_llm.paramserver import ParameterServer
from rlax_llm.trainer.warmup import supervised_warmup


@dataclasses.dataclass
class Run:
  controller: Controller
  writer: MetricsWriter
  warmup_metrics: dict[str, float]

  def execute(self) -> dict[str, float]:
    """Runs the controller; writes and returns the summary (warm-up and final figures)."""
    start = time.perf_counter()
    summary = {**self.warmup_metrics, **self.controller.run()}
    summary['time/total_s'] = time.perf_counter() - start + self.warmup_metrics.get(
        'warmup/time_s', 0.0)
    self.writer.write_summary(summary)
    return summary


@contextlib.contextmanager
def build_run(config: ml_collections.ConfigDict, workdir) -> Iterator[Run]:
  """Builds task, model, warm-up, trainer, parameter server, worker and controller."""
  settings = config_lib.controller_settings(config)
  task, model, params, tokenizer = roles.prepare(config)
  mesh = roles.meshes(config)

  w = config.warmup
  params, warmup_metrics = supervised_warmup(
      model, params, task, tokenizer, mesh['trainer'], steps=w.steps,
      batch_size=w.batch_size, learning_rate=w.learning_rate, warmup_steps=w.warmup_steps,
      max_nonfinite_updates=config.rl.max_nonfinite_updates)

  trainer = roles.build_trainer(config, model, params, mesh['trainer'])
  worker = roles.build_worker(config, model, tokenizer, mesh['inference'])
  server = ParameterServer(keep=2)
  with MetricsWriter(workdir, tensorboard=config.log.tensorboard,
                     console_every=config.log.console_every) as writer:
    yield Run(Controller(settings, task, trainer, server, worker, writer), writer,
              warmup_metrics)
