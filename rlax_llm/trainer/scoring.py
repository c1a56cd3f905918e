"""The model-running side of the policy: log-probs of sequences under params (trainer only).

``Policy`` pairs a model with its ``SamplingSpec`` and scores token sequences with the pure
functions of ``rlax_llm.policy`` (``token_log_probs``, ``entropy``), the same definition the
inference engine samples with (``rlax_llm.policy.sample_rows``), so on-policy ratios are 1.
The trainer's objectives recompute log-probs through it; whole sequences
(``sequence_log_probs``) or only the completion windows after a shared prompt
(``window_log_probs``, Prefix Grouper).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp

from rlax_llm.models.model import Model, Params
from rlax_llm.policy import entropy, log_probs, token_log_probs
from rlax_llm.sampling_spec import SamplingSpec


def full_support(spec: SamplingSpec) -> SamplingSpec:
  """``spec``'s temperature without its top-k/top-p truncation: the distribution on-policy
  distillation compares, the teacher's and the student's alike (a token outside one model's
  truncated support would have log-prob -inf there; docs/losses.md "On-policy
  distillation")."""
  return SamplingSpec(temperature=spec.temperature)


@flax.struct.dataclass
class SequenceLogProbs:
  """Per-position outputs of ``Policy.sequence_log_probs`` for ``tokens [B, T]``.

  Position ``t`` scores token ``t + 1`` (predicted from tokens ``<= t``).
  ``Policy.window_log_probs`` returns ``[B, width]`` fields instead.
  """

  logp: jax.Array  # float32 [B, T - 1]
  in_support: jax.Array  # bool [B, T - 1]
  entropy: jax.Array  # float32 [B, T - 1], stop-gradient
  # float32 [B, T - 1, K]: with ``support_ids``, the log-probs (``full_support`` of the
  # policy's transform) of those ids; None without.
  support_logp: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Policy:
  """A model plus its sampling transform, scoring sequences for the trainer (the engine
  samples with the same transform through ``rlax_llm.policy.sample_rows``).

  Hashable (the model by identity, the spec by value), so it is a ``jax.jit`` static
  argument and equal policies share one compilation.
  """

  model: Model
  sampling: SamplingSpec

  def with_sampling(self, sampling: SamplingSpec) -> 'Policy':
    return Policy(self.model, sampling)

  def sequence_log_probs(self, params: Params, tokens: jax.Array,
                         support_sizes: jax.Array | None = None, *, chunk: int = 0,
                         support_ids: jax.Array | None = None) -> SequenceLogProbs:
    """Log-probs of each next token of ``tokens`` (int32 ``[B, T]``) under ``params``.

    ``support_sizes``: optional int ``[B, T]`` aligned with ``tokens`` (the support size the
    sampler recorded when it drew token ``t``; see ``token_log_probs``).
    ``chunk`` > 0: the ``[B, T, V]`` logits are never materialised: hidden states go through
    the lm head ``chunk`` positions at a time, each chunk's logits rematerialised in the
    backward pass, so the log-prob computation's memory is ``B * chunk * V``, not
    ``B * T * V``. The results equal the unchunked ones to float rounding.
    ``support_ids``: optional int ``[B, T, K]`` aligned with ``tokens`` (ids of the
    distribution predicting token ``t``, e.g. the teacher's top-k of on-policy distillation):
    ``support_logp`` is then the full-support log-softmax at those ids (``full_support``),
    computed chunk by chunk like the log-probs.
    """
    sizes = None if support_sizes is None else support_sizes[:, 1:]
    ids = None if support_ids is None else support_ids[:, 1:]
    if chunk <= 0:
      return self._score(self.model.apply(params, tokens)[:, :-1], tokens[:, 1:], sizes, ids)
    hidden = self.model.apply(params, tokens, features=True)[:, :-1]
    return self._score_hidden(params, hidden, tokens[:, 1:], sizes, chunk, ids)

  def window_log_probs(self, params: Params, tokens: jax.Array,
                       support_sizes: jax.Array | None, starts: jax.Array, *, width: int,
                       share: int = 1, chunk: int = 0,
                       support_ids: jax.Array | None = None) -> SequenceLogProbs:
    """Log-probs of ``width`` tokens of each row from ``starts[b]`` on; the positions before
    (the prompt) run through the model as context but are never scored.

    The prompt of a sequence is most of its tokens in short-answer RL, and every sample of a
    GRPO group repeats it. Here each row's prefix ``tokens[b, :starts[b]]`` goes through the
    model into a KV cache, once per block of ``share`` rows, and the rows' windows attend to
    it (Prefix Grouper: Liu et al., "Prefix Grouper: Efficient GRPO Training through
    Shared-Prefix Forward", arXiv 2506.05433). Forward and backward then cost
    ``(T - width) / share + width`` positions per row instead of ``T``, and the lm head and
    log-softmax run on ``width`` positions instead of ``T``. The results equal
    ``sequence_log_probs`` at the same positions to float rounding (another program computes
    them; bit for bit with the model's ``batch_invariant`` numerics), gradients included.

    Args:
      params: the model's params.
      tokens: int32 ``[B, T]``. Row ``b``'s window is ``tokens[b, s : s + width]`` with
        ``s = starts[b]``, in ``[1, T - width]``.
      support_sizes: optional int ``[B, T]`` aligned with ``tokens`` (``sequence_log_probs``).
      starts: int32 ``[B]``, the first scored token of each row.
      width: static window length.
      share: static; rows come in consecutive blocks of ``share`` with equal prefixes (equal
        ``starts`` and equal tokens before them), e.g. the samples of one group. Only each
        block's first row's prefix is read, up to the block's largest start (a row whose
        window is all masked out may give any start <= it). ``B`` must be a multiple of
        ``share``.
      chunk: as in ``sequence_log_probs``, over the window.
      support_ids: optional int ``[B, T, K]`` aligned with ``tokens`` (``sequence_log_probs``).
    Returns:
      ``SequenceLogProbs`` of ``[B, width]``: entry ``j`` scores token ``starts[b] + j``.
      Entries whose token lies past ``T`` score a clipped position: mask them out.
    """
    batch, length = tokens.shape
    chex.assert_shape(starts, (batch,))
    if not 0 < width < length:
      raise ValueError(f'width={width} must be in [1, T - 1] = [1, {length - 1}].')
    if share < 1 or batch % share:
      raise ValueError(f'share={share} must be >= 1 and divide the batch ({batch} rows).')
    starts = starts.astype(jnp.int32)
    lead = starts.reshape(-1, share).max(axis=1)  # a row with nothing to score may say 0
    cache = self.model.init_cache(batch // share, length)
    hidden, cache = self.model.apply(params, tokens[::share, :length - width], cache=cache,
                                     num_valid=lead, features=True)
    # The hidden state of each prefix's last token predicts the window's first token.
    last = jnp.take_along_axis(hidden, jnp.maximum(lead - 1, 0)[:, None, None], axis=1)
    repeat = lambda x: jnp.repeat(x, share, axis=0)
    cache = cache.repeat(share)
    index = jnp.minimum(starts[:, None] + jnp.arange(width, dtype=jnp.int32), length - 1)
    window = jnp.take_along_axis(tokens, index, axis=1)
    hidden, _ = self.model.apply(params, window, cache=cache, features=True)
    hidden = jnp.concatenate([repeat(last), hidden[:, :-1]], axis=1)
    sizes = (None if support_sizes is None
             else jnp.take_along_axis(support_sizes, index, axis=1))
    ids = (None if support_ids is None
           else jnp.take_along_axis(support_ids, index[..., None], axis=1))
    if chunk <= 0:
      logits = self.model.logits(params, hidden)
      return self._score(logits, window, sizes, ids)
    return self._score_hidden(params, hidden, window, sizes, chunk, ids)

  def _score(self, logits, targets, sizes, ids=None) -> SequenceLogProbs:
    invariant = self.model.config.execution.batch_invariant
    logp, in_support = token_log_probs(logits, targets, self.sampling, sizes,
                                       invariant=invariant)
    support_logp = None
    if ids is not None:
      full, _ = log_probs(logits, full_support(self.sampling), invariant=invariant)
      support_logp = jnp.take_along_axis(full, ids.astype(jnp.int32), axis=-1)
    return SequenceLogProbs(logp, in_support,
                            jax.lax.stop_gradient(entropy(logits, self.sampling, sizes)),
                            support_logp)

  def _score_hidden(self, params, hidden, targets, sizes, chunk, ids=None
                    ) -> SequenceLogProbs:
    """``_score`` of hidden states ``[B, n, E]``, ``chunk`` positions at a time, each chunk's
    logits rematerialised in the backward pass."""

    @jax.checkpoint
    def one(h, t, z, i):
      scored = self._score(self.model.logits(params, h), t, z, i)
      return scored.logp, scored.in_support, scored.entropy, scored.support_logp

    return SequenceLogProbs(*map_chunks(one, chunk, hidden, targets, sizes, ids))


def map_chunks(fn: Callable[..., Any], chunk: int, *arrays: jax.Array | None) -> Any:
  """``fn(*arrays)`` computed ``chunk`` positions at a time (``jax.lax.map`` over chunks of
  axis 1), for functions of ``[B, n, ...]`` arrays (None passes through as None) whose
  outputs are ``[B, n, ...]`` arrays (or None): at most ``B * chunk`` positions of ``fn``'s
  intermediates (e.g. ``[B, chunk, V]`` logits) live at once. The last chunk is zero-padded.
  """
  batch, n = next(x for x in arrays if x is not None).shape[:2]
  size = min(chunk, n)
  count = -(-n // size)

  def split(x):  # [B, n, ...] -> [count, B, size, ...]
    x = jnp.pad(x, [(0, 0), (0, count * size - n)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((batch, count, size) + x.shape[2:]), 1, 0)

  def join(x):  # [count, B, size, ...] -> [B, n, ...]
    return jnp.moveaxis(x, 0, 1).reshape((batch, count * size) + x.shape[3:])[:, :n]

  outs = jax.lax.map(lambda parts: fn(*parts),
                     tuple(None if x is None else split(x) for x in arrays))
  return jax.tree.map(join, outs)
