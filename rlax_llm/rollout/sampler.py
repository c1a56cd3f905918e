"""Static-batch autoregressive generation with the KV cache (behaviour log-probs, versions).

``generate`` is one jitted program: a prefill of the right-padded prompts, then a
``lax.scan`` of single-token decode steps. Each token is drawn from the policy
(``rlax_llm.policy``: the same transform the trainer's recompute uses) and comes with its
behaviour log-prob and the version of the params that produced it.
"""

from __future__ import annotations

import functools

import chex
import flax.struct
import jax
import jax.numpy as jnp

from rlax_llm.models.model import Params
from rlax_llm.policy import Policy


@flax.struct.dataclass
class Samples:
  """Sampled completions. ``N = max_new_tokens``."""

  tokens: jax.Array  # int32 [B, N]; pad_id after the end
  logprobs: jax.Array  # float32 [B, N]; behaviour log-prob, 0 where mask is False
  mask: jax.Array  # bool [B, N]; True for generated tokens (the eos token included)
  versions: jax.Array  # int32 [B, N]; policy version of each token, -1 where mask is False
  lengths: jax.Array  # int32 [B]; number of generated tokens
  finished: jax.Array  # bool [B]; True when the row emitted eos (else it hit the length cap)


@functools.partial(jax.jit, static_argnames=('policy', 'max_new_tokens', 'eos_id', 'pad_id'))
def generate(policy: Policy, params: Params, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, rng: jax.Array, version: jax.Array | int, *,
             max_new_tokens: int, eos_id: int, pad_id: int) -> Samples:
  """Samples one completion per row.

  Args:
    policy: model and sampling transform (static).
    params: the model's params.
    prompt_tokens: int32 ``[B, P]``, right-padded.
    prompt_lengths: int32 ``[B]``, each in ``[1, P]``.
    rng: PRNG key; the same key, params and prompts give the same samples.
    version: int policy version of ``params``, stamped on every token.
    max_new_tokens, eos_id, pad_id: static decoding settings.
  Returns:
    ``Samples`` with ``N = max_new_tokens``.
  """
  chex.assert_rank(prompt_tokens, 2)
  chex.assert_shape(prompt_lengths, (prompt_tokens.shape[0],))
  model = policy.model
  batch, prompt_len = prompt_tokens.shape
  cache = model.init_cache(batch, prompt_len + max_new_tokens)
  last, cache = model.prefill(params, prompt_tokens, prompt_lengths, cache)

  def step(carry, key):
    cache, last_logits, done = carry
    token, logp = policy.sample(last_logits, key)
    live = ~done
    token = jnp.where(live, token, pad_id)
    logp = jnp.where(live, logp, 0.0)
    done = done | (token == eos_id)
    next_logits, cache = model.decode_step(params, token, cache)
    return (cache, next_logits, done), (token, logp, live)

  keys = jax.random.split(rng, max_new_tokens)
  done0 = jnp.zeros((batch,), bool)
  (_, _, done), (tokens, logps, live) = jax.lax.scan(step, (cache, last, done0), keys)
  tokens, logps, live = tokens.T, logps.T, live.T
  version = jnp.asarray(version, jnp.int32)
  return Samples(tokens=tokens, logprobs=logps, mask=live,
                 versions=jnp.where(live, version, -1),
                 lengths=live.sum(axis=1).astype(jnp.int32), finished=done)
