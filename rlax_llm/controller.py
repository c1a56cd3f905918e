"""The controller: the one active part, running the RL loop deterministically.

It owns the data order (a grain dataset of prompt batches and its iterator position), the RNG
(one root key; step ``s`` uses ``fold_in(root, s)``) and the step counter; the trainer,
parameter server, inference worker and verifier act only when it calls them (DESIGN.md).

This controller runs the loop synchronously (staleness ``(j, k) = (1, 1)``): every step the
worker reloads the version the trainer just pushed, so each rollout is on-policy
(``staleness = 0``). The asynchronous scheduler with larger ``(j, k)`` and snapshot/resume
build on the same roles and the same staleness bookkeeping below.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import grain
import jax
import numpy as np

from rlax_llm import losses
from rlax_llm.metrics import MetricsWriter
from rlax_llm.paramserver import ParameterServer
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.tasks import Prompt, Task
from rlax_llm.trainer.trainer import Trainer
from rlax_llm.types import Rollouts, make_train_batch
from rlax_llm.verifiers import score_completions


@dataclasses.dataclass
class ControllerSettings:
  total_steps: int
  prompts_per_step: int
  group_size: int
  staleness_j: int
  staleness_k: int
  eval_every: int
  seed: int
  advantage_estimator: str = 'grpo'

  def __post_init__(self):
    if (self.staleness_j, self.staleness_k) != (1, 1):
      raise ValueError(
          'The synchronous controller runs on-policy lockstep, staleness (j, k) = (1, 1); got '
          f'(j, k) = ({self.staleness_j}, {self.staleness_k}). Set '
          '--config.staleness.j=1 --config.staleness.k=1.')


def prompt_dataset(task: Task, prompts_per_step: int) -> grain.MapDataset:
  """Batches of training prompts: element ``s`` holds the prompts of RL step ``s``."""
  return (grain.MapDataset.range(0, 2**40)
          .map(task.train_prompt)
          .batch(prompts_per_step, batch_fn=list))


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

  def data_state(self) -> dict[str, Any]:
    """The data iterator position (what a snapshot stores)."""
    return self._prompts.get_state()

  def collect(self, prompts: list[Prompt], key: jax.Array) -> Rollouts:
    """Samples ``group_size`` completions per prompt and scores them."""
    g = self.settings.group_size
    samples, prompt_tokens, prompt_lengths = self.worker.sample(prompts, g, key)
    completions = self.worker.decode(samples)
    expanded = [p for p in prompts for _ in range(g)]
    rewards, errors = score_completions(self.task, expanded, completions)
    return Rollouts(
        prompt_ids=np.array([p.prompt_id for p in expanded], np.int64),
        group_ids=np.repeat(np.arange(len(prompts), dtype=np.int32), g),
        prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths,
        completion_tokens=np.asarray(samples.tokens),
        completion_mask=np.asarray(samples.mask),
        behaviour_logprobs=np.asarray(samples.logprobs),
        versions=np.asarray(samples.versions), finished=np.asarray(samples.finished),
        completions=completions, rewards=rewards, verifier_errors=errors)

  def evaluate(self) -> float:
    """Held-out greedy accuracy of the worker's current weights."""
    samples, _, _ = self.worker.sample(self._eval_prompts, 1, self._root_key, greedy=True)
    rewards, _ = score_completions(self.task, self._eval_prompts, self.worker.decode(samples))
    return float(np.mean(rewards))

  def run(self) -> dict[str, float]:
    """Runs the loop to ``total_steps``. Returns the summary (also written to the workdir)."""
    s = self.settings
    if self.server.latest_version() < self.trainer.version:
      self.server.push(self.trainer.version, self.trainer.host_params())
    self.worker.maybe_reload(self.server, s.staleness_j)
    start_accuracy = self.evaluate()
    logging.info('RL starting point: held-out greedy accuracy %.3f', start_accuracy)
    accuracy = start_accuracy
    run_start = time.perf_counter()
    while self.step < s.total_steps:
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
      train_metrics = self.trainer.step(batch)
      self.server.push(self.trainer.version, self.trainer.host_params())
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
          'time/rollout_s': t_rollout,
          'time/train_s': t_train,
          **train_metrics,
      }
      last = self.step == s.total_steps
      if last or (s.eval_every > 0 and self.step % s.eval_every == 0):
        self.worker.maybe_reload(self.server, 1)  # evaluate exactly the pushed version
        accuracy = self.evaluate()
        metrics['eval/accuracy'] = accuracy
      if last:
        metrics['eval/start_accuracy'] = start_accuracy
        metrics['eval/final_accuracy'] = accuracy
        metrics['eval/improvement'] = accuracy - start_accuracy
      metrics['time/step_s'] = time.perf_counter() - t0
      self.writer.write(self.step, metrics)

    summary = {
        'steps': self.step,
        'eval/start_accuracy': start_accuracy,
        'eval/final_accuracy': accuracy,
        'eval/improvement': accuracy - start_accuracy,
        'time/rl_s': time.perf_counter() - run_start,
    }
    return summary
