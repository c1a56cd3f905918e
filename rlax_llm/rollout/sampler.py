"""Autoregressive generation with the KV cache, recording behaviour log-probs and versions.

``generate`` is one jitted program: a prefill of the right-padded prompts, then a
``lax.scan`` of single-token decode steps. Each sampled token comes with its behaviour
log-prob (``rlax_llm.rollout.sampling``) and the policy version of the params that produced
it, so off-policy losses (M2PO, TIS) can be computed exactly later. The JetStream-API engine
(prefill / insert / generate over slots) of a later issue drives the same decoder API.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import flax.struct
import jax
import jax.numpy as jnp

from rlax_llm.models.model import Model, Params
from rlax_llm.rollout.sampling import sample_tokens


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to decode. ``temperature == 0`` is greedy."""

  max_new_tokens: int
  eos_id: int
  pad_id: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f'max_new_tokens must be positive, got {self.max_new_tokens}.')
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}.')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}.')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0 (0 disables it), got {self.top_k}.')


@flax.struct.dataclass
class Samples:
  """Sampled completions. ``N = max_new_tokens``."""

  tokens: jax.Array  # int32 [B, N]; pad_id after the end
  logprobs: jax.Array  # float32 [B, N]; behaviour log-prob, 0 where mask is False
  mask: jax.Array  # bool [B, N]; True for generated tokens (the eos token included)
  versions: jax.Array  # int32 [B, N]; policy version of each token, -1 where mask is False
  lengths: jax.Array  # int32 [B]; number of generated tokens
  finished: jax.Array  # bool [B]; True when the row emitted eos (else it hit the length cap)


def generate(model: Model, params: Params, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, rng: jax.Array, version: jax.Array | int,
             config: SamplingConfig) -> Samples:
  """Samples completions for a batch of prompts.

  Args:
    model: the decoder (static).
    params: its params.
    prompt_tokens: int32 ``[B, P]``, right-padded.
    prompt_lengths: int32 ``[B]``, each in ``[1, P]``.
    rng: PRNG key; the same key, params and prompts give the same samples.
    version: int policy version of ``params``, stamped on every token.
    config: decoding settings (static).
  Returns:
    ``Samples`` with ``N = config.max_new_tokens``.
  """
  chex.assert_rank(prompt_tokens, 2)
  chex.assert_shape(prompt_lengths, (prompt_tokens.shape[0],))
  batch, prompt_len = prompt_tokens.shape
  n = config.max_new_tokens
  cache = model.init_cache(batch, prompt_len + n)
  last, cache = model.prefill(params, prompt_tokens, prompt_lengths, cache)

  def step(carry, key):
    cache, last_logits, done = carry
    token, logp = sample_tokens(last_logits, key, temperature=config.temperature,
                                top_k=config.top_k, top_p=config.top_p)
    live = ~done
    token = jnp.where(live, token, config.pad_id)
    logp = jnp.where(live, logp, 0.0)
    done = done | (token == config.eos_id)
    next_logits, cache = model.decode_step(params, token, cache)
    return (cache, next_logits, done), (token, logp, live)

  keys = jax.random.split(rng, n)
  done0 = jnp.zeros((batch,), bool)
  (_, _, done), (tokens, logps, live) = jax.lax.scan(step, (cache, last, done0), keys)
  tokens, logps, live = tokens.T, logps.T, live.T
  version = jnp.asarray(version, jnp.int32)
  return Samples(tokens=tokens, logprobs=logps, mask=live,
                 versions=jnp.where(live, version, -1),
                 lengths=live.sum(axis=1).astype(jnp.int32), finished=done)


class Sampler:
  """Holds one compiled ``generate`` per decoding config."""

  def __init__(self, model: Model, config: SamplingConfig):
    self.model = model
    self.config = config
    self._generate = jax.jit(functools.partial(generate, model, config=config))

  def __call__(self, params: Params, prompt_tokens, prompt_lengths, rng,
               version: int) -> Samples:
    return self._generate(params, jnp.asarray(prompt_tokens, jnp.int32),
                          jnp.asarray(prompt_lengths, jnp.int32), rng, version)
