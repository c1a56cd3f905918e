"""The controller: the one active part, scheduling the RL loop deterministically.

It owns the data order (a grain dataset of prompt batches and its iterator position), the RNG
(one root key; step ``s`` samples with ``fold_in(root, s)``), the step counter and the
staleness policy; the trainer, parameter server, inference worker and verifier act only when
it calls them, through typed interfaces: ``GenerationRequest``s in, ``Rollouts`` out,
``TrainBatch`` to the trainer (docs/architecture.md). Everything it must remember to resume is one
``ControllerState`` (``state()`` / ``restore()``).

This controller runs the loop synchronously (staleness ``(j, k) = (1, 1)``): every step the
worker reloads the version the trainer just pushed, so each rollout is on-policy
(``staleness = 0``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from rlax_llm import losses
from rlax_llm.data import prompt_dataset
from rlax_llm.data_types import GenerationRequest, Rollouts, make_train_batch
from rlax_llm.metrics import MetricsWriter
from rlax_llm.paramserver import ParameterServer
from rlax_llm.policy import GREEDY, SamplingSpec
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.tasks import Prompt, Task
from rlax_llm.trainer.trainer import NonFiniteError, Trainer
from rlax_llm.verifiers import score_rollouts


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
  """What the controller schedules (validated by ``rlax_llm.config`` before any compute)."""

  total_steps: int
  prompts_per_step: int
  group_size: int
  staleness_j: int
  staleness_k: int
  eval_every: int
  seed: int
  sampling: SamplingSpec
  max_new_tokens: int
  advantage_estimator: str = 'grpo'

  def __post_init__(self):
    if (self.staleness_j, self.staleness_k) != (1, 1):
      raise ValueError(
          f'(j, k) = ({self.staleness_j}, {self.staleness_k}): this controller runs the '
          'synchronous on-policy loop only, staleness (j, k) = (1, 1); set '
          '--config.staleness.j=1 --config.staleness.k=1.')
    self.sampling.check_for_rollouts()


@dataclasses.dataclass
class ControllerState:
  """Everything the controller needs to continue a run exactly (what a snapshot stores).

  Attributes:
    step: RL steps completed.
    data: the prompt iterator's position (grain iterator state).
    rng: the root PRNG key's data (uint32 array); step ``s`` uses ``fold_in(root, s)``.
    trainer_version: the version the trainer's params are at.
    worker_version: the version the inference worker holds (-1: none yet).
    start_accuracy: held-out accuracy of the RL starting point (None until measured).
    accuracy: the latest held-out accuracy (None until measured).
  """

  step: int
  data: dict[str, Any]
  rng: np.ndarray
  trainer_version: int = 0
  worker_version: int = -1
  start_accuracy: float | None = None
  accuracy: float | None = None

  def to_dict(self) -> dict[str, Any]:
    """JSON-friendly form (``rng`` as a list of ints)."""
    return dict(dataclasses.asdict(self), rng=np.asarray(self.rng).tolist())

  @classmethod
  def from_dict(cls, state: dict[str, Any]) -> 'ControllerState':
    return cls(**dict(state, rng=np.asarray(state['rng'], np.uint32)))


class Controller:
  """Runs ``total_steps`` synchronous RL steps; see the module docstring."""

  def __init__(self, settings: ControllerSettings, task: Task, trainer: Trainer,
               server: ParameterServer, worker: InferenceWorker, writer: MetricsWriter):
    self.settings = settings
    self.task = task
    self.trainer = trainer
    self.server = server
    self.worker = worker
    self.writer = writer
    self.step = 0
    self._prompts = iter(prompt_dataset(task, settings.prompts_per_step).to_iter_dataset())
    self._root_key = jax.random.key(settings.seed)
    self._eval_prompts = task.eval_prompts()
    self.start_accuracy: float | None = None
    self.accuracy: float | None = None

  def state(self) -> ControllerState:
    """The controller's state now (copy)."""
    return ControllerState(
        step=self.step, data=dict(self._prompts.get_state()),
        rng=np.asarray(jax.random.key_data(self._root_key)),
        trainer_version=self.trainer.version, worker_version=self.worker.version,
        start_accuracy=self.start_accuracy, accuracy=self.accuracy)

  def restore(self, state: ControllerState) -> None:
    """Continues from ``state``. The trainer (and the server) must already hold the params of
    ``state.trainer_version``; the worker reloads them on the next step."""
    if self.trainer.version != state.trainer_version:
      raise ValueError(f'the trainer holds version {self.trainer.version} but the controller '
                       f'state expects {state.trainer_version}; restore the matching params '
                       'first.')
    self.step = state.step
    self._prompts.set_state(state.data)
    self._root_key = jax.random.wrap_key_data(np.asarray(state.rng, np.uint32))
    self.start_accuracy = state.start_accuracy
    self.accuracy = state.accuracy

  def requests(self, prompts: list[Prompt]) -> list[GenerationRequest]:
    s = self.settings
    return [GenerationRequest(p, s.group_size, s.sampling, s.max_new_tokens) for p in prompts]

  def collect(self, prompts: list[Prompt], key: jax.Array) -> Rollouts:
    """Samples ``group_size`` completions per prompt and scores them."""
    return score_rollouts(self.task, prompts, self.worker.generate(self.requests(prompts), key))

  def evaluate(self) -> float:
    """Held-out greedy accuracy of the worker's current weights."""
    requests = [GenerationRequest(p, 1, GREEDY, self.settings.max_new_tokens)
                for p in self._eval_prompts]
    rollouts = self.worker.generate(requests, self._root_key)
    return float(np.mean(score_rollouts(self.task, self._eval_prompts, rollouts).rewards))

  def _push(self) -> None:
    if self.server.latest_version() < self.trainer.version:
      self.server.push(self.trainer.version, self.trainer.host_params())

  def run(self) -> dict[str, float]:
    """Runs the loop to ``total_steps``. Returns the summary (also written to the workdir).

    Raises ``NonFiniteError`` naming the step when the trainer's updates diverge.
    """
    s = self.settings
    self._push()
    self.worker.maybe_reload(self.server, s.staleness_j)
    if self.start_accuracy is None:
      self.start_accuracy = self.accuracy = self.evaluate()
      logging.info('RL starting point: held-out greedy accuracy %.3f', self.start_accuracy)
    run_start = time.perf_counter()
    while self.step < s.total_steps:
      metrics = self._one_step()
      self.writer.write(self.step, metrics)
    return {
        'steps': self.step,
        'eval/start_accuracy': self.start_accuracy,
        'eval/final_accuracy': self.accuracy,
        'eval/improvement': self.accuracy - self.start_accuracy,
        'time/rl_s': time.perf_counter() - run_start,
    }

  def _one_step(self) -> dict[str, float]:
    s = self.settings
    t0 = time.perf_counter()
    key = jax.random.fold_in(self._root_key, self.step)
    self.worker.maybe_reload(self.server, s.staleness_j)
    prompts = next(self._prompts)
    rollouts = self.collect(prompts, key)
    t_rollout = time.perf_counter() - t0

    advantages = np.asarray(losses.group_advantages(
        rollouts.rewards, rollouts.group_ids, s.advantage_estimator))
    batch = make_train_batch(rollouts, advantages)
    staleness = self.trainer.version - batch.versions[batch.versions >= 0]
    too_stale = int(np.sum(staleness >= s.staleness_k))
    if too_stale:  # cannot happen in lockstep; the check guards the invariant.
      raise RuntimeError(f'{too_stale} tokens exceed the staleness bound k={s.staleness_k}.')

    t1 = time.perf_counter()
    try:
      train_metrics = self.trainer.step(batch)
    except NonFiniteError as e:
      raise NonFiniteError(f'RL step {self.step + 1}: {e}') from None
    self._push()
    t_train = time.perf_counter() - t1
    self.step += 1

    metrics = {
        'reward/mean': float(rollouts.rewards.mean()),
        'reward/std': float(rollouts.rewards.std()),
        'completion/length_mean': float(rollouts.completion_mask.sum(1).mean()),
        'completion/truncated_fraction': float(1.0 - rollouts.finished.mean()),
        'staleness/mean': float(staleness.mean()) if staleness.size else 0.0,
        'staleness/max': float(staleness.max()) if staleness.size else 0.0,
        'verifier/errors': rollouts.verifier_errors,
        'version': self.trainer.version,
        'time/rollout_tokens_per_s': rollouts.timings['tokens_per_s'],
        'time/rollout_s': t_rollout,
        'time/train_s': t_train,
        **train_metrics,
    }
    last = self.step == s.total_steps
    if last or (s.eval_every > 0 and self.step % s.eval_every == 0):
      self.worker.maybe_reload(self.server, 1)  # evaluate exactly the pushed version
      self.accuracy = self.evaluate()
      metrics['eval/accuracy'] = self.accuracy
    if last:
      metrics['eval/start_accuracy'] = self.start_accuracy
      metrics['eval/final_accuracy'] = self.accuracy
      metrics['eval/improvement'] = self.accuracy - self.start_accuracy
    metrics['time/step_s'] = time.perf_counter() - t0
    return metrics
