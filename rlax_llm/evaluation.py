"""Held-out evaluation of a policy: greedy accuracy, mean@k and unbiased pass@k of a task's
completions; greedy episode success of an environment's episodes.

Every evaluation is computed here, over a function that runs requests with the policy: the
controller's rollout kind (``rlax_llm.controller``) routes it to a live inference worker every
``eval.every_steps`` steps and at the end; ``python -m rlax_llm.evaluate`` gives it a worker
of its own, through the same kind. Metrics of ``evaluate_policy`` (a task):

* ``eval/accuracy``: mean verifier reward of one greedy completion per held-out prompt.
* with ``eval.samples = n > 0``, ``n`` completions per prompt drawn with the rollout sampling
  transform: ``eval/mean@n``, the mean reward, and ``eval/pass@k`` for ``k`` in
  ``pass_ks(n)``: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language
  Models Trained on Code", arXiv 2107.03374, eq. 1) averaged over prompts, a sample counting
  as correct when its reward is at least ``CORRECT_REWARD``.

Metrics of ``evaluate_episodes`` (an environment run, ``env.name``): one greedy episode per
held-out environment seed (``agent.num_eval`` from ``agent.eval_seed_start``),
``eval/success``, ``eval/return``, ``eval/turns``, ``eval/env_tokens`` (``episode_metrics``),
and ``eval/accuracy``, equal to ``eval/success`` (what a run's summary reports).

The draws are keyed by the run's seed, so an evaluation is deterministic given the seed and
the params.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import chex
import jax
import numpy as np

from rlax_llm import console
from rlax_llm.data_types import GenerationRequest, Rollouts, Trajectory
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.tasks import Prompt, Task
from rlax_llm.verifiers import score_rollouts

CORRECT_REWARD = 1.0  # a sample is correct for pass@k when its reward reaches this
_SAMPLED_STREAM = 0x5A3E  # folded into the seed key for the sampled draws
_EPISODE_FIGURES = ('return', 'turns', 'success', 'env_tokens')  # episode_metrics' names


# --------------------------------------------------------------------------- estimators


def pass_at_k(num_samples: np.ndarray, num_correct: np.ndarray, k: int) -> np.ndarray:
  """Unbiased pass@k per problem (Chen et al., 2021, arXiv 2107.03374, eq. 1).

  ``1 - C(n - c, k) / C(n, k)``: the probability that at least one of ``k`` samples drawn
  without replacement from the ``n`` generated is correct, computed as
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no huge binomials), and 1 when ``n - c < k``.

  Args:
    num_samples: int ``[P]``, samples per problem ``n >= k``.
    num_correct: int ``[P]``, correct samples per problem, ``0 <= c <= n``.
    k: int >= 1.
  Returns float64 ``[P]`` in [0, 1].
  """
  n = np.asarray(num_samples)
  c = np.asarray(num_correct)
  chex.assert_rank([n, c], 1)
  chex.assert_equal_shape([n, c])
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f'pass@k needs an int k >= 1, got {k!r}.')
  if np.any(c < 0) or np.any(c > n):
    raise ValueError(f'num_correct must lie in [0, num_samples]; got num_correct={c.tolist()} '
                     f'for num_samples={n.tolist()}.')
  if np.any(n < k):
    raise ValueError(f'pass@{k} needs at least {k} samples per problem; got num_samples='
                     f'{n.tolist()}. Draw more samples (eval.samples) or lower k.')
  out = np.ones(n.shape, np.float64)
  for p, (n_p, c_p) in enumerate(zip(n.tolist(), c.tolist())):
    if n_p - c_p >= k:
      out[p] = 1.0 - np.prod(1.0 - k / np.arange(n_p - c_p + 1, n_p + 1, dtype=np.float64))
  return out


def pass_ks(samples: int) -> list[int]:
  """The ``k`` reported for ``samples`` draws per prompt: 1, 2, 4, ... below it, and itself."""
  ks, k = [], 1
  while k < samples:
    ks.append(k)
    k *= 2
  return ks + [samples] if samples >= 1 else []


def sampled_metrics(rewards: np.ndarray, group_ids: np.ndarray, samples: int
                    ) -> dict[str, float]:
  """``eval/mean@n`` and ``eval/pass@k`` (``k in pass_ks(n)``) of ``n = samples`` scored
  draws per prompt.

  rewards: float ``[B]``; group_ids: int ``[B]``, the prompt of each row (every prompt has
  exactly ``samples`` rows). Per-prompt figures are averaged with equal weight per prompt.
  """
  rewards = np.asarray(rewards, np.float64)
  group_ids = np.asarray(group_ids)
  chex.assert_rank([rewards, group_ids], 1)
  chex.assert_equal_shape([rewards, group_ids])
  groups, index, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
  if np.any(counts != samples):
    raise ValueError(f'every prompt needs {samples} samples; got counts {counts.tolist()}.')
  correct = np.bincount(index, weights=rewards >= CORRECT_REWARD, minlength=len(groups))
  means = np.bincount(index, weights=rewards, minlength=len(groups)) / counts
  metrics = {f'eval/mean@{samples}': float(means.mean())}
  for k in pass_ks(samples):
    metrics[f'eval/pass@{k}'] = float(pass_at_k(counts, correct.astype(np.int64), k).mean())
  return metrics


# ------------------------------------------------------------------------------ harness

Generate = Callable[[list[GenerationRequest], jax.Array], Rollouts]
Play = Callable[[list[GenerationRequest], jax.Array], list[Trajectory]]


def evaluate_policy(task: Task, prompts: Sequence[Prompt], generate: Generate, *,
                    sampling: SamplingSpec, samples: int, max_new_tokens: int,
                    key: jax.Array) -> dict[str, float]:
  """Held-out metrics of one policy (see the module docstring).

  generate: ``(requests, key) -> Rollouts`` with the policy's params (an inference worker;
    the controller routes it to a live worker).
  sampling: the transform of the sampled draws (the rollout one); samples: draws per prompt
    for mean@k / pass@k (0: greedy accuracy only).
  key: the greedy pass uses it, the sampled draws ``fold_in(key, _SAMPLED_STREAM)``.
  Returns ``eval/accuracy`` (plus ``eval/verifier_errors``) and the sampled metrics.
  """
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
    raise ValueError(f'eval.samples={samples!r} must be an int >= 0 (0: greedy only).')
  prompts = list(prompts)
  if not prompts:
    logging.warning('task %r has no held-out prompts (task.num_eval=0): eval metrics are NaN.',
                    getattr(task, 'name', task))
    return {'eval/accuracy': float('nan'), 'eval/verifier_errors': 0.0}
  console.phase(f'evaluating on {len(prompts)} held-out prompts'
                + (f' (greedy, then {samples} samples each)' if samples else ' (greedy)'))
  greedy = score_rollouts(task, prompts, generate(
      [GenerationRequest(p, 1, GREEDY, max_new_tokens) for p in prompts], key))
  metrics = {'eval/accuracy': float(np.mean(greedy.rewards)),
             'eval/verifier_errors': float(greedy.verifier_errors)}
  if samples:
    sampled = score_rollouts(task, prompts, generate(
        [GenerationRequest(p, samples, sampling, max_new_tokens) for p in prompts],
        jax.random.fold_in(key, _SAMPLED_STREAM)))
    metrics.update(sampled_metrics(sampled.rewards, sampled.group_ids, samples))
    metrics['eval/verifier_errors'] += sampled.verifier_errors
  return metrics


def evaluate_episodes(prompts: Sequence[Prompt], play: Play, *, max_new_tokens: int,
                      key: jax.Array) -> dict[str, float]:
  """Held-out metrics of one policy on an environment (see the module docstring).

  prompts: the held-out environment seeds (``EnvSeeds.eval_prompts``).
  play: ``(requests, key) -> trajectories``, one per request in order, with the policy's
    params (``WorkerHandle.play``).
  max_new_tokens: the sampling budget of each request (the run's ``sampling``).
  key: the greedy episodes' key (greedy decoding draws nothing from it; environments may).
  Returns ``eval/accuracy`` (``eval/success``) and ``episode_metrics`` under ``eval/``.
  """
  prompts = list(prompts)
  if not prompts:
    logging.warning('no held-out environment seeds (agent.num_eval=0): eval metrics are NaN.')
    return {'eval/accuracy': float('nan'),
            **{f'eval/{name}': float('nan') for name in _EPISODE_FIGURES}}
  console.phase(f'evaluating on {len(prompts)} held-out environment seeds (greedy episodes)')
  trajectories = play([GenerationRequest(p, 1, GREEDY, max_new_tokens) for p in prompts], key)
  if len(trajectories) != len(prompts):
    raise ValueError(f'play returned {len(trajectories)} trajectories for {len(prompts)} '
                     'held-out seeds; it must return one greedy episode per request.')
  metrics = episode_metrics(trajectories, 'eval/')
  return {'eval/accuracy': metrics['eval/success'], **metrics}


def episode_metrics(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
  """Episodes in figures, each under ``prefix``: ``return``, ``turns`` and ``success`` (means
  over the episodes) and ``env_tokens`` (the mean count of tokens fed between turns, with
  loss mask 0)."""
  if not trajectories:
    raise ValueError(f'episode_metrics needs at least one trajectory (for {prefix!r}), got none.')
  first_turn = [int(x.turn_starts[0]) if x.num_turns else len(x.tokens) for x in trajectories]
  return {
      f'{prefix}return': float(np.mean([x.episode_return for x in trajectories])),
      f'{prefix}turns': float(np.mean([x.num_turns for x in trajectories])),
      f'{prefix}success': float(np.mean([x.success for x in trajectories])),
      f'{prefix}env_tokens': float(np.mean([
          int((~x.loss_mask[start:]).sum()) for x, start in zip(trajectories, first_turn)])),
  }
