"""Supervised (teacher-forced) token losses, used for the warm-up before RL."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rlax_llm.losses.components import masked_token_mean


def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array,
                        total_tokens: jax.Array | None = None):
  """Token-mean cross-entropy over masked positions.

  Args:
    logits: float ``[B, T, V]`` predicting ``targets``.
    targets: int ``[B, T]``.
    mask: ``[B, T]``, 1 where the target counts.
    total_tokens: the mean's denominator when these rows are one micro-batch of a larger
      batch (its loss tokens); default ``sum(mask)``.
  Returns:
    ``(loss, diagnostics)``: float32 scalar, and ``{'accuracy': token accuracy}``.
  """
  chex.assert_rank(logits, 3)
  chex.assert_equal_shape([targets, mask])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  mask = mask.astype(jnp.float32)
  denominator = jnp.sum(mask) if total_tokens is None else total_tokens
  loss = jnp.sum(nll * mask) / jnp.maximum(denominator, 1.0)
  return loss, {'accuracy': masked_token_mean(correct, mask)}
