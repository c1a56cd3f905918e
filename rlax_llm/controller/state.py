"""``ControllerState``, everything the controller must remember to continue a run exactly,
and ``Snapshots``, the controller's methods that take and restore it (``loop.Controller``
inherits them: they sit beside the state they read and write, the loop beside them)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm.controller.protocols import Batch


@dataclasses.dataclass
class ControllerState:
  """Everything the controller needs to continue a run exactly (what a snapshot stores).

  Attributes:
    step: RL steps completed (updates attempted).
    data: the prompt iterator's position (grain iterator state).
    rng: the RL sampling root key's data (uint32 array; ``rl.seed``'s, by default
      ``config.seed``'s); batch ``i`` uses ``fold_in(root, i)``. ``restore`` checks it
      equals the resuming run's.
    trainer_version: the version the trainer's params are at.
    worker_version: the version the first inference worker holds (-1: none yet).
    start_accuracy: held-out accuracy of the RL starting point (None until measured).
    accuracy: the latest held-out accuracy (None until measured).
    step_versions: the version after each step so far (``[s]``: after ``s`` steps).
    counters: the run's running counts (``workers/lost``, the workers' pulls ``sync/...``).
    events: what went wrong and was survived (lost workers), in order.
    inflight: batches generated ahead of the trainer: ``{'index', 'version', 'prompts'}``
      (prompts as dicts) and, for completions, ``'rollouts'`` (their JSON part; their arrays
      are stored apart, under ``inflight_<n>``) with the batch's APRIL and replay counts;
      an environment run's episodes are played again on resume (same keys and version).
    recycled: recycled groups: ``{'version', 'rollouts'}`` (arrays under ``recycled_<n>``).
    unfinished: partial groups to continue: ``{'prompt', 'rollouts'}`` (arrays under
      ``unfinished_<n>``).
    replay: the replay pool's prompts (as dicts), oldest first.
  """

  step: int
  data: dict[str, Any]
  rng: np.ndarray
  trainer_version: int = 0
  worker_version: int = -1
  start_accuracy: float | None = None
  accuracy: float | None = None
  step_versions: list[int] = dataclasses.field(default_factory=lambda: [0])
  counters: dict[str, float] = dataclasses.field(default_factory=dict)
  events: list[str] = dataclasses.field(default_factory=list)
  inflight: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  recycled: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  unfinished: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  replay: list[dict[str, Any]] = dataclasses.field(default_factory=list)

  def to_dict(self) -> dict[str, Any]:
    """JSON-friendly form (``rng`` as a list of ints)."""
    return dict(dataclasses.asdict(self), rng=np.asarray(self.rng).tolist())

  @classmethod
  def from_dict(cls, state: dict[str, Any]) -> 'ControllerState':
    return cls(**dict(state, rng=np.asarray(state['rng'], np.uint32)))


class Snapshots:
  """``state``, ``snapshot`` and ``restore`` of ``loop.Controller`` (its fields: the step,
  the prompt stream, the root key, the versions, evaluations, counters and events, and its
  rollout ``kind``, which stores its own part: ``RolloutKind.state``, ``snapshot``,
  ``restore``)."""

  def state(self) -> ControllerState:
    """The controller's state now (copy)."""
    return ControllerState(
        step=self.step, data=dict(self._prompts.get_state()),
        rng=np.asarray(jax.random.key_data(self._root_key)),
        trainer_version=self.trainer.version, worker_version=self._worker_versions[0],
        start_accuracy=self.start_accuracy, accuracy=self.accuracy,
        step_versions=list(self.step_versions), counters=dict(self.counters),
        events=list(self.events), **self.kind.state())

  def snapshot(self, in_flight: Sequence[Batch]
               ) -> tuple[ControllerState, dict[str, dict[str, np.ndarray]]]:
    """The state to checkpoint with the kind's batches ``in_flight`` and pending results
    (``RolloutKind.snapshot``). Returns ``(state, arrays)``: the rollouts' arrays by name."""
    state, arrays = self.state(), {}
    self.kind.snapshot(state, arrays, in_flight, lambda batch: self.kind.merge(
        self._gather(batch, self._sampling_root(batch.index))))
    return state, arrays

  def restore(self, state: ControllerState,
              arrays: dict[str, dict[str, np.ndarray]] | None = None) -> None:
    """Continues from ``state`` (with the in-flight and recycled rollouts' ``arrays``, as
    ``snapshot`` returned them). The trainer must already hold the params of
    ``state.trainer_version``; workers are reloaded as the schedule needs."""
    if self.trainer.version != state.trainer_version:
      raise ValueError(f'the trainer holds version {self.trainer.version} but the controller '
                       f'state expects {state.trainer_version}; restore the matching params '
                       'first.')
    self.step = state.step
    self._oldest_held = state.trainer_version
    self._prompts.set_state(state.data)
    stored = np.asarray(state.rng, np.uint32)
    configured = np.asarray(jax.random.key_data(self._root_key))
    if not np.array_equal(stored, configured):
      raise ValueError(
          f'the controller state was saved by a run whose RL sampling key is {stored.tolist()}'
          f', but this run\'s rl.seed={self.settings.rl_seed!r} (config.seed='
          f'{self.settings.seed}) gives {configured.tolist()}; resume with the rl.seed (and '
          'config.seed) the run was started with, or start it in a new workdir.')
    self.start_accuracy = state.start_accuracy
    self.accuracy = state.accuracy
    self.step_versions = list(state.step_versions)
    self.counters = collections.Counter(state.counters)
    self.events = list(state.events)
    self._saved_step = state.step  # the checkpoint restored: abandoning the next step saves none
    self._restored_inflight = self.kind.restore(state, arrays or {})
