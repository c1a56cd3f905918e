"""The trainer's process's checkpoints: building the ``Checkpointer``, saving a step, resuming.

Every backend's trainer (the local backend's thread, each Ray trainer actor) saves and
restores through these three functions, so a run's checkpoint holds the same items whatever
placed its roles: the trainer's params, optimizer state and counters, and the controller's
state and rollouts' arrays it is handed (``rlax_llm.checkpoint``, which loads orbax, is
imported only by runs that checkpoint).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from rlax_llm import config as config_lib
from rlax_llm.trainer.trainer import Trainer


def build_checkpointer(config: ml_collections.ConfigDict, workdir):
  """The run's ``Checkpointer`` (for the trainer's process, which writes and restores), or
  None when ``checkpoint.every_steps`` and ``checkpoint.every_seconds`` are both 0 (no
  checkpoints)."""
  if not config_lib.checkpointing(config):
    return None
  c = config.checkpoint
  # orbax is heavy: imported only by runs that checkpoint.
  from rlax_llm.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  return Checkpointer(workdir, keep=c.keep, async_save=c.async_save)


def save_checkpoint(checkpointer, trainer: Trainer, step: int, controller: dict[str, Any],
                    rollouts: dict[str, dict[str, Any]]) -> None:
  """In the trainer's process: saves step ``step`` with ``checkpointer`` (a
  ``rlax_llm.checkpoint.Checkpointer``): the trainer's params, optimizer state and counters,
  and the controller's state (``ControllerState.to_dict()``) and rollouts' arrays it was
  handed, as one Orbax step. Returns once the arrays are copied off the devices (the files
  are written in the background)."""
  checkpointer.save(step, params=trainer.params, opt_state=trainer.opt_state,
                    trainer=trainer.counters(), controller=controller, rollouts=rollouts)


def resume_trainer(checkpointer, trainer: Trainer):
  """In the trainer's process: restores the latest readable checkpoint of ``checkpointer``
  into ``trainer`` (params and optimizer state onto its shardings, its counters) and returns
  the rest, the controller's ``rlax_llm.checkpoint.Resume``; None when there is none."""
  restored = checkpointer.restore(trainer.params, trainer.opt_state)
  if restored is None:
    return None
  trainer.load(restored.params, restored.opt_state, restored.trainer)
  return restored.resume()
