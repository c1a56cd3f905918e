"""Token sampling as pure functions, returning the exact behaviour log-probability.

The behaviour log-prob of a sampled token is taken under the distribution it was *actually*
drawn from: logits divided by the temperature, then restricted to the top-k and/or top-p
(nucleus, Holtzman et al., arXiv 1904.09751) set and renormalised. Importance ratios against
these log-probs are therefore unbiased even with truncated sampling (a bias reported for
naive implementations; see RESEARCH.md "train-inference mismatch").

``temperature == 0`` means greedy decoding: the behaviour distribution is a point mass, so
the returned log-prob is exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def truncate_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Masks logits outside the top-k / top-p set to a large negative value.

  Args:
    logits: float ``[batch, vocab]`` (already temperature-scaled).
    top_k: keep the k largest logits per row; 0 keeps all.
    top_p: keep the smallest set of highest-probability tokens whose mass reaches ``top_p``
      (the token that crosses the threshold is kept); 1.0 keeps all.
  Returns:
    float32 ``[batch, vocab]``.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if top_k and top_k < vocab:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, _NEG_INF, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p  # always keeps the first token
    # The smallest kept logit is the threshold; ties at the threshold are kept.
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1,
                        keepdims=True)
    logits = jnp.where(logits < threshold, _NEG_INF, logits)
  return logits


def sample_tokens(logits: jax.Array, rng: jax.Array, *, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row and returns its behaviour log-prob.

  Args:
    logits: float ``[batch, vocab]`` raw model logits.
    rng: a PRNG key.
    temperature: > 0 samples; 0 is greedy (log-prob 0).
    top_k, top_p: truncation, see ``truncate_logits``.
  Returns:
    ``(tokens int32 [batch], logprobs float32 [batch])``.
  """
  if temperature < 0:
    raise ValueError(f'temperature must be >= 0, got {temperature}.')
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f'top_p must be in (0, 1], got {top_p}.')
  if temperature == 0:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, jnp.zeros(tokens.shape, jnp.float32)
  scaled = truncate_logits(logits.astype(jnp.float32) / temperature, top_k, top_p)
  tokens = jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
