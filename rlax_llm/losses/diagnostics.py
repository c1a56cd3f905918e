"""Masked statistics the losses report: importance weights, second moments, mismatch.

Every function reads only tokens where ``mask`` is set, returns float32 scalars (except
``log_ratio_histogram``: a fixed-size vector) and carries no gradient. With no masked token a
statistic is 0 (never NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm.losses.components import masked_token_mean, safe_exp
from rlax_llm.losses.kl import kl_penalty


# Bins of the per-token log-ratio histogram (log pi_theta - log pi_behaviour): 40 bins of
# 0.05 over [-1, 1]; values beyond land in the end bins. rlax_llm.metrics draws the
# trainer's 'hist/log_ratio' with these edges.
LOG_RATIO_BIN_EDGES = tuple(float(x) for x in np.linspace(-1.0, 1.0, 41))


def log_ratio_histogram(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
  """Fraction of the masked tokens in each ``LOG_RATIO_BIN_EDGES`` bin.

  Args:
    log_ratio: float [B, T], e.g. ``log pi_theta - log pi_behaviour``.
    mask: [B, T], tokens to count.

  Returns:
    float32 [len(LOG_RATIO_BIN_EDGES) - 1], summing to 1 (0 everywhere with no masked token).
    A fixed shape, so it survives ``jit`` and micro-batch averaging like a scalar metric.
  """
  edges = jnp.asarray(LOG_RATIO_BIN_EDGES, jnp.float32)
  x = jnp.clip(jax.lax.stop_gradient(log_ratio).astype(jnp.float32), edges[0], edges[-1])
  w = mask.astype(jnp.float32)
  counts, _ = jnp.histogram(x, bins=edges, weights=w)
  return counts / jnp.maximum(jnp.sum(w), 1.0)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(bool)
  return jnp.where(jnp.any(mask), jnp.max(jnp.where(mask, x, -jnp.inf)), 0.0)


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(bool)
  return jnp.where(jnp.any(mask), jnp.min(jnp.where(mask, x, jnp.inf)), 0.0)


def masked_quantile(x: jax.Array, mask: jax.Array, q: float) -> jax.Array:
  """Nearest-rank ``q``-quantile of the masked values (NumPy's ``method='inverted_cdf'``)."""
  mask = mask.astype(bool).reshape(-1)
  values = jnp.sort(jnp.where(mask, x.reshape(-1).astype(jnp.float32), jnp.inf))
  n = jnp.sum(mask)
  index = jnp.clip(jnp.ceil(q * n).astype(jnp.int32) - 1, 0, jnp.maximum(n - 1, 0))
  return jnp.where(n > 0, values[index], 0.0)


def _ratio_or_zero(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """``numerator / denominator`` where ``denominator > 0``, else 0 (no NaN in either branch,
  so gradients through ``jnp.where`` stay finite)."""
  safe = jnp.where(denominator > 0, denominator, 1.0)
  return jnp.where(denominator > 0, numerator / safe, 0.0)


def masked_correlation(x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
  """Pearson correlation of ``x`` and ``y`` over the mask (0 if either is constant)."""
  w = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(w), 1.0)
  x = x.astype(jnp.float32)
  y = y.astype(jnp.float32)
  dx = (x - jnp.sum(x * w) / n) * w
  dy = (y - jnp.sum(y * w) / n) * w
  denom = jnp.sqrt(jnp.sum(dx * dx) * jnp.sum(dy * dy))
  return _ratio_or_zero(jnp.sum(dx * dy), denom)


def ratio_diagnostics(log_ratio: jax.Array, mask: jax.Array, prefix: str = 'is'
                      ) -> dict[str, jax.Array]:
  """Importance-ratio stats: mean/max/min of ``r`` and ``M2 = mean (log r)^2``."""
  log_ratio = jax.lax.stop_gradient(log_ratio)
  ratio = safe_exp(log_ratio)
  return {
      f'{prefix}/ratio_mean': masked_token_mean(ratio, mask),
      f'{prefix}/ratio_max': masked_max(ratio, mask),
      f'{prefix}/ratio_min': masked_min(ratio, mask),
      f'{prefix}/m2': masked_token_mean(jnp.square(log_ratio), mask),
  }


def mismatch_diagnostics(trainer_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array
                         ) -> dict[str, jax.Array]:
  """Train-inference mismatch on the same tokens (RLAX / VeXact style reporting).

  ``mismatch/kl``: k3 estimate of ``KL(pi_rollout || pi_trainer)`` (tokens are sampled from
  the rollout engine), ``>= 0``; ``mismatch/max_abs_dlogp`` and ``mismatch/p95_abs_dlogp``:
  ``|trainer_logp - rollout_logp|``; ``mismatch/logp_corr``: Pearson correlation of the two;
  ``mismatch/ess_fraction``: the effective sample size of the per-token importance weights
  ``w = pi_trainer / pi_rollout`` over the ``n`` masked tokens, as a fraction of ``n``:
  ``(sum w)^2 / (n * sum w^2)`` in ``(0, 1]``, 1 when the two policies agree (Kong, "A Note on
  Importance Sampling using Standardized Weights", 1992; the TIS/MIS papers in
  docs/losses.md report it). Every statistic is 0 with no masked token.
  """
  trainer_logp = jax.lax.stop_gradient(trainer_logp).astype(jnp.float32)
  rollout_logp = jax.lax.stop_gradient(rollout_logp).astype(jnp.float32)
  abs_d = jnp.abs(trainer_logp - rollout_logp)
  # (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2), both over the masked tokens.
  w = safe_exp(trainer_logp - rollout_logp)
  mean_w, mean_w2 = masked_token_mean(w, mask), masked_token_mean(w * w, mask)
  return {
      'mismatch/kl': masked_token_mean(kl_penalty(rollout_logp, trainer_logp, 'k3'), mask),
      'mismatch/max_abs_dlogp': masked_max(abs_d, mask),
      'mismatch/p95_abs_dlogp': masked_quantile(abs_d, mask, 0.95),
      'mismatch/logp_corr': masked_correlation(trainer_logp, rollout_logp, mask),
      'mismatch/ess_fraction': _ratio_or_zero(jnp.square(mean_w), mean_w2),
  }
