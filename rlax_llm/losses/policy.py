"""Policy-gradient losses in the modular form of RLAX (arXiv 2512.06392):

``J = E[ sum_i sum_t sg[Agg_it * IS_it] * (sg[Adv_it] * GradTerm1_it + GradTerm2_it) ]``

The building blocks (aggregation, importance ratio, clipping) are small functions here;
each named algorithm composes them. All losses return ``(loss, diagnostics)`` where
``loss`` is a float32 scalar to *minimise* and ``diagnostics`` a dict of float32 scalars.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rlax_llm.losses.kl import kl_penalty


def masked_token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of ``x`` over the tokens where ``mask`` is set (0 when there are none)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sequence_mean_aggregate(per_token: jax.Array, mask: jax.Array) -> jax.Array:
  """GRPO aggregation ``1/G sum_i 1/|o_i| sum_t x_it``.

  Each sequence's tokens are averaged, then sequences are averaged. Sequences without any
  loss token are left out of the outer mean.

  Args:
    per_token: float ``[B, T]``.
    mask: ``[B, T]``, 1 for loss tokens.
  Returns:
    float32 scalar.
  """
  mask = mask.astype(jnp.float32)
  lengths = jnp.sum(mask, axis=-1)
  per_seq = jnp.sum(per_token * mask, axis=-1) / jnp.maximum(lengths, 1.0)
  has_tokens = (lengths > 0).astype(jnp.float32)
  return jnp.sum(per_seq * has_tokens) / jnp.maximum(jnp.sum(has_tokens), 1.0)


def importance_ratio(logp: jax.Array, behaviour_logp: jax.Array) -> jax.Array:
  """``r = exp(logp - sg[behaviour_logp])``; gradient flows through ``logp`` only."""
  log_ratio = logp.astype(jnp.float32) - jax.lax.stop_gradient(behaviour_logp).astype(
      jnp.float32)
  return jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))


def ppo_clip_objective(ratio: jax.Array, advantages: jax.Array, eps_low: float,
                       eps_high: float) -> tuple[jax.Array, jax.Array]:
  """PPO clipped surrogate ``min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` per token.

  Schulman et al., "Proximal Policy Optimization Algorithms", arXiv 1707.06347.
  Returns ``(objective [B, T], clipped [B, T] bool)`` where ``clipped`` marks tokens whose
  gradient the clip removes.
  """
  unclipped = ratio * advantages
  clipped_obj = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
  objective = jnp.minimum(unclipped, clipped_obj)
  clipped = clipped_obj < unclipped
  return objective, clipped


def grpo_loss(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array,
              loss_mask: jax.Array, *, clip_eps: float = 0.2, kl_beta: float = 0.0,
              ref_logp: jax.Array | None = None, kl_estimator: str = 'k3'):
  """GRPO loss: PPO-clipped surrogate with sequence-mean aggregation and optional KL.

  Shao et al., "DeepSeekMath", arXiv 2402.03300, eq. (3):
  ``L = -1/G sum_i 1/|o_i| sum_t [min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i)
        - beta KL_k3(pi_theta || pi_ref)_it]``.

  Args:
    logp: float ``[B, T]`` log-probs of the taken tokens under the policy being trained.
    behaviour_logp: float ``[B, T]`` log-probs under the policy that sampled them
      (never differentiated).
    advantages: float ``[B]`` per-sample (or ``[B, T]`` per-token) advantages.
    loss_mask: ``[B, T]``, 1 on completion tokens that count.
    clip_eps: PPO clip range.
    kl_beta: weight of the KL penalty; requires ``ref_logp`` when > 0.
    ref_logp: float ``[B, T]`` reference-policy log-probs.
    kl_estimator: 'k1' | 'k2' | 'k3'.
  Returns:
    ``(loss, diagnostics)``.
  """
  chex.assert_rank([logp, behaviour_logp, loss_mask], 2)
  chex.assert_equal_shape([logp, behaviour_logp, loss_mask])
  if advantages.ndim == 1:
    chex.assert_axis_dimension(advantages, 0, logp.shape[0])
    advantages = advantages[:, None]
  advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  mask = loss_mask.astype(jnp.float32)
  ratio = importance_ratio(logp, behaviour_logp)
  objective, clipped = ppo_clip_objective(ratio, advantages, clip_eps, clip_eps)
  per_token = -objective
  diagnostics = {}
  if kl_beta > 0:
    if ref_logp is None:
      raise ValueError('grpo_loss: kl_beta > 0 needs ref_logp (reference log-probs).')
    kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp), kl_estimator)
    per_token = per_token + kl_beta * kl
    diagnostics['kl'] = sequence_mean_aggregate(kl, mask)
  loss = sequence_mean_aggregate(per_token, mask)
  diagnostics.update({
      'clip_fraction': masked_token_mean(clipped.astype(jnp.float32), mask),
      'ratio/mean': masked_token_mean(ratio, mask),
      'ratio/max': jnp.max(jnp.where(mask > 0, ratio, 0.0)),
      'mismatch/abs_dlogp': masked_token_mean(
          jnp.abs(logp - behaviour_logp).astype(jnp.float32), mask),
      'advantage/mean': masked_token_mean(jnp.broadcast_to(advantages, mask.shape), mask),
  })
  return loss, jax.lax.stop_gradient(diagnostics)


POLICY_LOSSES = {'grpo': grpo_loss}


def policy_loss(name: str, *args, **kwargs):
  """Dispatches to a named policy loss (``POLICY_LOSSES``); returns ``(loss, diagnostics)``."""
  if name not in POLICY_LOSSES:
    raise ValueError(f'Unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}.')
  return POLICY_LOSSES[name](*args, **kwargs)
