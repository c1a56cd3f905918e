"""The shared parts every policy loss is built from (RLAX modular form, arXiv 2512.06392).

``J = E[ sum_i sum_t sg[Agg_it * IS_it] * (sg[Adv_it] * GradTerm1_it + GradTerm2_it) ]``

* aggregation: how per-token terms become one scalar (``aggregate``);
* importance weights: token ratio, sequence (geometric-mean) ratio, train-inference
  mismatch weights (``token_log_ratio``, ``sequence_log_ratio``, ``mismatch_weights``);
* gradient masks: PPO clipping and M2PO second-moment masking (``ppo_clip_objective``,
  ``m2po_mask``).

All inputs are ``[B, T]`` (batch, tokens) with a ``loss_mask`` that is 1 on completion tokens
that count; nothing outside the mask ever reaches a result. Values are computed in at least
float32 (``as_float``: bf16 inputs in float32, float64 inputs in float64).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlax_llm.loss_spec import AGGREGATIONS, MismatchConfig

_LOG_RATIO_CAP = 20.0


def as_float(x: jax.Array) -> jax.Array:
  """``x`` in at least float32: bf16/fp16/ints become float32, float64 stays float64."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def masked_token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of ``x`` over the tokens where ``mask`` is set (0 when there are none)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class Totals(NamedTuple):
  """Whole-batch normalisers, for losses computed one micro-batch at a time: with them each
  micro-batch's ``aggregate`` is its exact share of the whole batch's (the shares sum to it).

  tokens: loss tokens; sequences: rows with at least one loss token; rows: all rows.
  """

  tokens: jax.Array
  sequences: jax.Array
  rows: jax.Array


def batch_totals(loss_mask: jax.Array) -> Totals:
  """``Totals`` of a ``[B, T]`` loss mask."""
  mask = loss_mask.astype(jnp.float32)
  return Totals(tokens=jnp.sum(mask), sequences=jnp.sum(jnp.sum(mask, -1) > 0).astype(
      jnp.float32), rows=jnp.asarray(mask.shape[0], jnp.float32))


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str,
              max_length: int | None = None, totals: Totals | None = None) -> jax.Array:
  """Reduces per-token terms ``[B, T]`` to a scalar.

  ``token-mean``: ``sum_it x / sum_i |o_i|`` (DAPO, arXiv 2503.14476).
  ``seq-mean-token-mean``: ``1/G' sum_i 1/|o_i| sum_t x`` (GRPO), over the ``G'`` sequences
    with at least one loss token.
  ``seq-mean-token-sum``: ``1/G' sum_i sum_t x`` (sequence-level REINFORCE).
  ``seq-mean-token-sum-norm``: ``1/(G * L_max) sum_it x`` (Dr. GRPO, arXiv 2503.20783), with
    ``G`` the batch size and ``L_max = max_length`` (default: the padded width ``T``); a
    constant, so it does not depend on the lengths sampled.

  ``totals`` (``batch_totals`` of the whole batch) replaces the denominators computed from
  this ``mask``: for a micro-batch, the result is its share of the whole batch's value.
  """
  mask = mask.astype(jnp.float32)
  x = as_float(per_token) * mask
  if totals is None:
    totals = batch_totals(mask)
  if mode == 'token-mean':
    return jnp.sum(x) / jnp.maximum(totals.tokens, 1.0)
  lengths = jnp.sum(mask, axis=-1)
  num_seqs = jnp.maximum(totals.sequences, 1.0)
  if mode == 'seq-mean-token-mean':
    return jnp.sum(jnp.sum(x, -1) / jnp.maximum(lengths, 1.0)) / num_seqs
  if mode == 'seq-mean-token-sum':
    return jnp.sum(x) / num_seqs
  if mode == 'seq-mean-token-sum-norm':
    length = per_token.shape[-1] if max_length is None else max_length
    return jnp.sum(x) / (totals.rows * length)
  raise ValueError(f'Unknown aggregation {mode!r}; choose one of {AGGREGATIONS}.')


def token_log_ratio(logp: jax.Array, old_logp: jax.Array) -> jax.Array:
  """``log r = logp - sg[old_logp]`` per token (>= float32); gradient flows through ``logp``."""
  return as_float(logp) - as_float(jax.lax.stop_gradient(old_logp))


def sequence_log_ratio(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
  """GSPO's length-normalised sequence log-ratio ``1/|o_i| sum_t log r_it``: ``[B, T] -> [B]``.

  Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071.
  """
  mask = mask.astype(jnp.float32)
  return jnp.sum(log_ratio * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)


def safe_exp(log_ratio: jax.Array) -> jax.Array:
  """``exp`` with the exponent capped at +-20, so extreme stale tokens stay finite."""
  return jnp.exp(jnp.clip(log_ratio, -_LOG_RATIO_CAP, _LOG_RATIO_CAP))


def ppo_clip_objective(ratio: jax.Array, advantages: jax.Array, eps_low: float,
                       eps_high: float) -> tuple[jax.Array, jax.Array]:
  """PPO clipped surrogate ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``.

  Schulman et al., arXiv 1707.06347; clip-higher (``eps_high > eps_low``) from DAPO.
  Returns ``(objective, clipped)``; ``clipped`` marks the terms whose gradient the clip
  removes (the clipped branch is strictly smaller).
  """
  unclipped = ratio * advantages
  clipped_obj = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
  return jnp.minimum(unclipped, clipped_obj), clipped_obj < unclipped


def m2po_mask(log_ratio: jax.Array, loss_mask: jax.Array, tau: float = 0.04) -> jax.Array:
  """M2PO second-moment mask: which candidate tokens to keep.

  Zheng, Zhao & Chen, "Prosperity before Collapse" (M2PO), arXiv 2510.01161, Algorithm 1.
  Over the candidate tokens (``loss_mask`` True), repeatedly drop the one with the largest
  ``(log r)^2`` until the mean of ``(log r)^2`` over the kept candidates is ``<= tau``.
  Computed without a loop: the mean of the ``m`` smallest values never decreases with ``m``,
  so the kept set is the largest prefix of the ascending sort whose mean is ``<= tau``. Ties
  are broken by position (the earlier token is kept first). The whole batch is one pool.

  Args:
    log_ratio: float ``[...]``, ``log pi_theta - log pi_behav``.
    loss_mask: ``[...]``, the candidates.
    tau: threshold on the mean second moment.
  Returns:
    bool ``[...]``: True for kept candidates; False for dropped ones and for non-candidates.
  """
  shape = log_ratio.shape
  m2 = jnp.square(jax.lax.stop_gradient(log_ratio).astype(jnp.float32)).reshape(-1)
  cand = loss_mask.reshape(-1).astype(bool)
  order = jnp.argsort(jnp.where(cand, m2, jnp.inf), stable=True)
  sorted_m2 = jnp.where(cand[order], m2[order], 0.0)
  prefix = jnp.cumsum(sorted_m2)
  m = jnp.arange(1, m2.shape[0] + 1, dtype=jnp.float32)
  ok = (prefix <= tau * m) & cand[order]
  keep_count = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))  # longest prefix satisfying it
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  return ((rank < keep_count) & cand).reshape(shape)


def m2po_trust_region_candidates(log_ratio: jax.Array, advantages: jax.Array,
                                 loss_mask: jax.Array) -> jax.Array:
  """Tokens whose update pushes ``r`` further from 1 in the advantage's direction.

  ``(A > 0 and r > 1) or (A < 0 and r < 1)``: the paper's candidate set (these are the
  tokens a PPO clip could act on). Returns bool ``[B, T]``.
  """
  lr = jax.lax.stop_gradient(log_ratio)
  return loss_mask.astype(bool) & (((advantages > 0) & (lr > 0)) | ((advantages < 0) & (lr < 0)))


def mismatch_weights(old_logp: jax.Array, rollout_logp: jax.Array, loss_mask: jax.Array,
                     config: MismatchConfig) -> tuple[jax.Array, jax.Array]:
  """Train-inference mismatch correction weights ``w = pi_train_old / pi_rollout``.

  Truncated / masked importance sampling over the rollout engine's distribution:
  Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
  (TIS, 2025); Liu et al., "When Speed Kills Stability" (MIS, sequence-level, 2025).

  ``config.level='token'``: ``w_t = exp(old_t - rollout_t)``; ``'sequence'``: one weight per
  sequence, ``exp(sum_t (old_t - rollout_t))``, broadcast over its tokens.
  ``mode='truncate'`` (TIS): ``min(w, threshold)``; ``mode='mask'`` (MIS): ``w`` where
  ``w <= threshold`` else 0. ``veto_threshold``: a sequence containing any token with
  ``w_t < veto_threshold`` is zeroed entirely (catastrophic-token veto).

  Returns ``(weights float32 [B, T] without gradient, kept bool [B, T])``.
  """
  level, mode = config.level, config.mode
  threshold, veto_threshold = config.threshold, config.veto_threshold
  mask = loss_mask.astype(jnp.float32)
  token_log_w = (as_float(jax.lax.stop_gradient(old_logp))
                 - as_float(jax.lax.stop_gradient(rollout_logp))) * mask
  log_w = token_log_w
  if level == 'sequence':
    log_w = jnp.broadcast_to(jnp.sum(token_log_w, -1, keepdims=True), token_log_w.shape)
  w = safe_exp(log_w)
  if mode == 'truncate':
    kept = jnp.ones(w.shape, bool)
    w = jnp.minimum(w, threshold)
  else:
    kept = w <= threshold
    w = jnp.where(kept, w, 0.0)
  if veto_threshold is not None:
    vetoed = jnp.any((safe_exp(token_log_w) < veto_threshold) & (mask > 0), axis=-1,
                     keepdims=True)
    kept = kept & ~vetoed
    w = jnp.where(vetoed, 0.0, w)
  kept = kept & (mask > 0)
  return w * mask, kept
