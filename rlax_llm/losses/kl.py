"""Per-token KL estimators between the policy and a reference policy.

Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
With ``log_ratio = logp_ref - logp`` evaluated at tokens sampled from the policy:
  k1 = -log_ratio                       (unbiased, high variance, can be negative)
  k2 = 0.5 * log_ratio ** 2             (biased, low variance)
  k3 = exp(log_ratio) - 1 - log_ratio   (unbiased, low variance, >= 0; used by GRPO)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_llm.loss_spec import KL_ESTIMATORS
from rlax_llm.losses.components import as_float

_K3_LINEAR_FROM = 20.0


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str = 'k3') -> jax.Array:
  """Per-token KL(policy || ref) estimate: float ``[B, T]`` -> ``[B, T]`` (>= float32)."""
  log_ratio = as_float(ref_logp) - as_float(logp)
  if estimator == 'k1':
    return -log_ratio
  if estimator == 'k2':
    return 0.5 * jnp.square(log_ratio)
  if estimator == 'k3':
    # expm1 keeps k3 >= 0 in float32 near log_ratio = 0. Past log_ratio = 20, exp is
    # continued linearly (value and slope exp(20)), so a far-off reference gives a large
    # finite penalty whose gradient still points back toward the reference.
    capped = jnp.minimum(log_ratio, _K3_LINEAR_FROM)
    linear_tail = jnp.exp(_K3_LINEAR_FROM) * jnp.maximum(log_ratio - _K3_LINEAR_FROM, 0.0)
    return jnp.expm1(capped) + linear_tail - log_ratio
  raise ValueError(f'Unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}.')
