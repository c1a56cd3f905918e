"""Advantage estimators over groups of samples that share a prompt.

Groups are given by an explicit ``group_ids`` array (any int values, any order), so groups of
unequal size work without reshaping. Samples with ``valid == False`` (dropped, e.g. filtered
by dynamic sampling) are left out of every statistic and get advantage 0.

Estimators (``ESTIMATORS``), for a sample ``i`` in group ``g`` with ``n_g`` valid members:

===========  ==============================================================================
``grpo``     ``(r_i - mean_g) / (std_g + eps)``, ``std_g`` Bessel-corrected.
             Shao et al., DeepSeekMath, arXiv 2402.03300.
``drgrpo``   ``r_i - mean_g`` (no std division). Liu et al., Dr. GRPO, arXiv 2503.20783.
``rloo``     ``r_i - mean_{j != i} r_j = n_g / (n_g - 1) * (r_i - mean_g)``.
             Ahmadian et al., "Back to Basics" (RLOO), arXiv 2402.14740.
``median``   ``(r_i - median_g) / (std_g + eps)``: GRPO centred on the median, robust to one
             outlier in small groups. Kim, MC-GRPO, arXiv 2601.22582. With an odd group the
             median sample gets exactly 0 (MC-GRPO's pivot, which then adds no gradient).
``gdpo``     rewards ``[B, R]``: each reward column is GRPO-normalised in its group, the
             columns are summed with ``reward_weights``, then the sum is normalised over the
             batch. Liu et al., GDPO, arXiv 2601.05242.
``reinforce`` ``r_i`` (no baseline). Williams, 1992.
``reinforce_pp`` ``r_i - mean_g`` then normalised over the batch (REINFORCE++-baseline).
             Hu, REINFORCE++, arXiv 2501.03262.
``w_reinforce`` ``positive_weight * r_i - (1 - r_i)`` for rewards in [0, 1]: a right answer
             is reinforced by ``positive_weight`` (0.1), a wrong one pushed down by 1, with no
             group baseline, so a group that is all wrong still trains (it moves mass off
             the wrong answer) and the policy's entropy is kept. Zhu et al., "The
             Surprising Effectiveness of Negative Reinforcement in LLM Reasoning"
             (W-REINFORCE), arXiv 2506.01347.
===========  ==============================================================================

Edge cases (documented and tested, never NaN): a group with one valid member has no baseline,
so every group-relative estimator gives it 0; a group whose rewards are all equal gets 0. For
``gdpo`` and ``reinforce_pp`` those zeros then go through the batch normalisation with every
other valid sample (so they become ``-mean/std`` of the batch, as in those papers); a batch
whose values are all equal (to float32 rounding, ``_CONSTANT_RTOL``) normalises to 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_llm.loss_spec import BASELINE_FREE, ESTIMATORS

_CONSTANT_RTOL = 1e-5
POSITIVE_WEIGHT = 0.1  # w_reinforce's lambda (Zhu et al. 2025)


def _dense_ids(group_ids: jax.Array) -> jax.Array:
  """Maps arbitrary int ids to ``0 .. num_groups - 1`` (jit-safe, at most B groups)."""
  _, dense = jnp.unique(group_ids, return_inverse=True, size=group_ids.shape[0])
  return dense.reshape(-1)


def _group_stats(values: jax.Array, ids: jax.Array, valid: jax.Array):
  """Per-sample ``(count, mean, unbiased var, all-equal)`` of its group's valid values."""
  b = values.shape[0]
  w = valid.astype(values.dtype)
  count = jax.ops.segment_sum(w, ids, b)
  mean = jax.ops.segment_sum(values * w, ids, b) / jnp.maximum(count, 1.0)
  dev = (values - mean[ids]) * w
  var = jax.ops.segment_sum(dev * dev, ids, b) / jnp.maximum(count - 1.0, 1.0)
  # Exact "all rewards equal" test: rounding in mean/var can leave r - mean ~ std ~ 1e-8.
  big = jnp.finfo(values.dtype).max
  vmax = jax.ops.segment_max(jnp.where(valid, values, -big), ids, b)
  vmin = jax.ops.segment_min(jnp.where(valid, values, big), ids, b)
  return count[ids], mean[ids], var[ids], (vmax == vmin)[ids]


def _group_median(values: jax.Array, ids: jax.Array, valid: jax.Array) -> jax.Array:
  """Per-sample median of its group's valid values (mean of the two middle ones if even).

  O(B^2) pairwise ranks: the k-th smallest value of a group is the largest value ``v`` with
  fewer than ``k + 1`` group members strictly below ``v``.
  """
  same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]
  below = jnp.sum(same & (values[None, :] < values[:, None]), axis=1)  # rank of each j
  count = jnp.sum(same, axis=1)

  def order_stat(k):  # k: per-sample index into its group's sorted values
    ok = same & (below[None, :] <= k[:, None])
    return jnp.max(jnp.where(ok, values[None, :], -jnp.inf), axis=1)

  lo = order_stat((count - 1) // 2)
  hi = order_stat(count // 2)
  return jnp.where(count > 0, 0.5 * (lo + hi), 0.0)


def batch_normalize(advantages: jax.Array, valid: jax.Array | None = None,
                    eps: float = 1e-6) -> jax.Array:
  """``(A - mean) / (std + eps)`` over the valid samples of the batch (0 if all equal)."""
  valid = jnp.ones(advantages.shape, bool) if valid is None else valid
  w = valid.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(w), 1.0)
  mean = jnp.sum(advantages * w) / n
  var = jnp.sum(jnp.square(advantages - mean) * w) / jnp.maximum(n - 1.0, 1.0)
  big = jnp.finfo(jnp.float32).max
  vmax = jnp.max(jnp.where(valid, advantages, -big))
  vmin = jnp.min(jnp.where(valid, advantages, big))
  # Inputs are computed advantages: float32 rounding can leave an exactly-constant batch
  # spread by ~1e-7, which dividing by its std would blow up. Treat a spread below
  # _CONSTANT_RTOL of the scale as constant.
  constant = (vmax - vmin) <= _CONSTANT_RTOL * jnp.maximum(
      jnp.maximum(jnp.abs(vmax), jnp.abs(vmin)), 1.0)
  out = (advantages - mean) / (jnp.sqrt(var) + eps)
  return jnp.where(valid & ~constant, out, 0.0)


def _check_inputs(rewards, group_ids, valid, estimator):
  if estimator not in ESTIMATORS:
    raise ValueError(f'Unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}.')
  want_rank = 2 if estimator == 'gdpo' else 1
  if rewards.ndim != want_rank:
    shape = '[batch, num_rewards]' if want_rank == 2 else '[batch]'
    raise ValueError(f'estimator {estimator!r} needs rewards of shape {shape}, got shape '
                     f'{rewards.shape}.')
  if group_ids.shape != rewards.shape[:1]:
    raise ValueError(f'group_ids must have shape [batch] = {rewards.shape[:1]}, got '
                     f'{group_ids.shape}.')
  if not jnp.issubdtype(group_ids.dtype, jnp.integer):
    raise ValueError(f'group_ids must be integers, got dtype {group_ids.dtype}.')
  if valid is not None and valid.shape != rewards.shape[:1]:
    raise ValueError(f'valid must have shape [batch] = {rewards.shape[:1]}, got {valid.shape}.')


def group_advantages(rewards: jax.Array, group_ids: jax.Array, estimator: str = 'grpo', *,
                     valid: jax.Array | None = None, eps: float = 1e-6,
                     reward_weights: jax.Array | None = None,
                     positive_weight: float = POSITIVE_WEIGHT) -> jax.Array:
  """Per-sample advantages from rewards and group ids (see the module table).

  Args:
    rewards: float ``[B]`` (``[B, R]`` for ``gdpo``).
    group_ids: int ``[B]``; samples with equal ids form a group.
    estimator: one of ``ESTIMATORS``.
    valid: optional bool ``[B]``; False rows are ignored and get 0.
    eps: added to standard deviations.
    reward_weights: ``gdpo`` only, float ``[R]`` (default all ones).
    positive_weight: ``w_reinforce`` only, the weight of right answers (lambda).
  Returns:
    float32 ``[B]``.
  """
  rewards = jnp.asarray(rewards)
  group_ids = jnp.asarray(group_ids)
  _check_inputs(rewards, group_ids, valid, estimator)
  rewards = rewards.astype(jnp.float32)
  valid = jnp.ones(group_ids.shape, bool) if valid is None else jnp.asarray(valid, bool)
  ids = _dense_ids(group_ids)

  if estimator == 'reinforce':
    return jnp.where(valid, rewards, 0.0)
  if estimator == 'w_reinforce':
    return jnp.where(valid, positive_weight * rewards - (1.0 - rewards), 0.0)
  if estimator == 'gdpo':
    weights = (jnp.ones(rewards.shape[1]) if reward_weights is None
               else jnp.asarray(reward_weights, jnp.float32))
    per_reward = jax.vmap(lambda r: group_advantages(r, group_ids, 'grpo', valid=valid,
                                                     eps=eps), in_axes=1, out_axes=1)(rewards)
    return batch_normalize(per_reward @ weights, valid, eps)

  count, mean, var, constant = _group_stats(rewards, ids, valid)
  if estimator == 'grpo':
    adv = (rewards - mean) / (jnp.sqrt(var) + eps)
  elif estimator == 'drgrpo':
    adv = rewards - mean
  elif estimator == 'rloo':
    adv = count / jnp.maximum(count - 1.0, 1.0) * (rewards - mean)
  elif estimator == 'median':
    adv = (rewards - _group_median(rewards, ids, valid)) / (jnp.sqrt(var) + eps)
  else:  # reinforce_pp
    adv = rewards - mean
  adv = jnp.where(valid & (count > 1) & ~constant, adv, 0.0)
  if estimator == 'reinforce_pp':
    adv = batch_normalize(adv, valid, eps)
  return adv
