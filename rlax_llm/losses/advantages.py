"""Advantage estimators over groups of samples that share a prompt.

Groups are given by an explicit ``group_ids`` array, so groups of unequal size and dropped
samples work without reshaping.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def _group_stats(values: jax.Array, group_ids: jax.Array):
  """Per-sample group count, mean and unbiased variance (segment reductions)."""
  num_segments = values.shape[0]  # group ids are < batch after remapping
  _, dense_ids = jnp.unique(group_ids, return_inverse=True, size=num_segments)
  dense_ids = dense_ids.reshape(-1)
  count = jax.ops.segment_sum(jnp.ones_like(values), dense_ids, num_segments)
  total = jax.ops.segment_sum(values, dense_ids, num_segments)
  mean = total / jnp.maximum(count, 1.0)
  sq = jax.ops.segment_sum((values - mean[dense_ids]) ** 2, dense_ids, num_segments)
  var = sq / jnp.maximum(count - 1.0, 1.0)
  # Exact "all rewards equal" test: rounding in mean/var can leave r - mean ~ std ~ 1e-8.
  constant = (jax.ops.segment_max(values, dense_ids, num_segments)
              == jax.ops.segment_min(values, dense_ids, num_segments))
  return count[dense_ids], mean[dense_ids], var[dense_ids], constant[dense_ids]


def grpo_advantages(rewards: jax.Array, group_ids: jax.Array, eps: float = 1e-6) -> jax.Array:
  """GRPO group-normalised advantages, ``A_i = (r_i - mean_g) / (std_g + eps)``.

  Shao et al., "DeepSeekMath" (GRPO), arXiv 2402.03300, section 4.1.2 (outcome supervision).
  ``std_g`` is the unbiased (Bessel-corrected) sample standard deviation of the group, as in
  TRL and verl. A group with a single member, or whose rewards are all equal, has zero
  advantage (it carries no learning signal) rather than NaN.

  Args:
    rewards: float ``[B]``.
    group_ids: int ``[B]``; samples with the same id form one group (any int values).
    eps: added to the std.
  Returns:
    float32 ``[B]``.
  """
  chex.assert_rank([rewards, group_ids], 1)
  chex.assert_equal_shape([rewards, group_ids])
  rewards = rewards.astype(jnp.float32)
  count, mean, var, constant = _group_stats(rewards, group_ids)
  adv = (rewards - mean) / (jnp.sqrt(var) + eps)
  return jnp.where((count > 1) & ~constant, adv, 0.0)
