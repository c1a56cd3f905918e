"""The model-running side of the policy: log-probs of sequences under params (trainer only).

``Policy`` pairs a model with its ``SamplingSpec`` and scores token sequences with the pure
functions of ``rlax_llm.policy`` (``token_log_probs``, ``entropy``), the same definition the
inference engine samples with (``rlax_llm.policy.sample_rows``), so on-policy ratios are 1.
The trainer's objectives recompute log-probs through it; whole sequences
(``sequence_log_probs``) or only the completion windows after a shared prompt
(``window_log_probs``, Prefix Grouper).

A mixture of experts: both take the experts the engine routed each token to (``routes``,
rollout routing replay: ``rlax_llm.models.moe.replay``) and report the fraction of those
choices the trainer's own router would not have made (``route_flips``); the full forward
also returns the router's load-balancing loss over the non-padding tokens (``aux_mask``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp

from rlax_llm.models import moe
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
  # With ``routes``: the fraction of the recorded (token, layer, slot) expert choices the
  # trainer's router would have made otherwise (``moe.flipped``), float32 scalar.
  route_flips: jax.Array | None = None
  # With ``aux_mask``: the router's load-balancing loss (``moe.load_balancing_loss``).
  aux_loss: jax.Array | None = None


def route_flip_fraction(own: jax.Array, routes: jax.Array) -> jax.Array:
  """float32 scalar: of the recorded expert choices ``routes`` (int ``[..., layers, k]``,
  e.g. ``[B, T, layers, k]``; ``moe.NO_ROUTE`` where none), the fraction not among the
  router's own top-k ``own`` (the same shape) at the same (token, layer): the choices
  routing replay overrode. 0 when nothing was recorded."""
  chex.assert_equal_shape([own, routes])
  recorded = jnp.sum(routes[..., 0] >= 0) * routes.shape[-1]
  flips = jnp.sum(moe.flipped(own, routes))
  return (flips / jnp.maximum(recorded, 1)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Policy:
  """A model plus its sampling transform, scoring sequences for the trainer (the engine
  samples with the same transform through ``rlax_llm.policy.sample_rows``).

  Hashable by value (the model's config and graph, the spec), so it is a ``jax.jit`` static
  argument and equal policies share one compilation.
  """

  model: Model
  sampling: SamplingSpec

  def with_sampling(self, sampling: SamplingSpec) -> 'Policy':
    return Policy(self.model, sampling)

  def sequence_log_probs(self, params: Params, tokens: jax.Array,
                         support_sizes: jax.Array | None = None, *, chunk: int = 0,
                         support_ids: jax.Array | None = None, routes: jax.Array | None = None,
                         aux_mask: jax.Array | None = None) -> SequenceLogProbs:
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
    ``routes`` (a mixture of experts): int ``[B, T, layers, k]``, the experts to route each
    token to (``moe.NO_ROUTE``: the router's own), with ``route_flips`` in the result.
    ``aux_mask`` (a mixture of experts): float ``[B, T]``, the tokens the router's
    load-balancing loss counts (``aux_loss`` in the result).
    """
    sizes = None if support_sizes is None else support_sizes[:, 1:]
    ids = None if support_ids is None else support_ids[:, 1:]
    out = self.model.apply(params, tokens, features=chunk > 0, routes=routes,
                           return_routes=routes is not None, aux_loss=aux_mask is not None,
                           token_mask=aux_mask)
    out, *extra = out if isinstance(out, tuple) else (out,)
    aux = extra.pop(0) if aux_mask is not None else None
    flips = None if routes is None else route_flip_fraction(extra[0], routes)
    if chunk <= 0:
      scored = self._score(out[:, :-1], tokens[:, 1:], sizes, ids)
    else:
      scored = self._score_hidden(params, out[:, :-1], tokens[:, 1:], sizes, chunk, ids)
    return scored.replace(route_flips=flips, aux_loss=aux)

  def window_log_probs(self, params: Params, tokens: jax.Array,
                       support_sizes: jax.Array | None, starts: jax.Array, *, width: int,
                       share: int = 1, chunk: int = 0, support_ids: jax.Array | None = None,
                       routes: jax.Array | None = None) -> SequenceLogProbs:
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
      routes: as in ``sequence_log_probs``: the prefix's (each block's first row's) and the
        windows' tokens are routed by them; ``route_flips`` counts the choices of both.
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
    replay = routes is not None
    pick = lambda r: dict(routes=r, return_routes=True) if replay else {}
    prefix_routes = routes[::share, :length - width] if replay else None
    hidden, cache, *own = self.model.apply(params, tokens[::share, :length - width],
                                           cache=cache, num_valid=lead, features=True,
                                           **pick(prefix_routes))
    # The hidden state of each prefix's last token predicts the window's first token.
    last = jnp.take_along_axis(hidden, jnp.maximum(lead - 1, 0)[:, None, None], axis=1)
    repeat = lambda x: jnp.repeat(x, share, axis=0)
    cache = cache.repeat(share)
    index = jnp.minimum(starts[:, None] + jnp.arange(width, dtype=jnp.int32), length - 1)
    window = jnp.take_along_axis(tokens, index, axis=1)
    flips = None
    if replay:  # the prefix's routes past each block's prompt are not its: not counted
      inside = jnp.arange(length - width)[None, :] < lead[:, None]
      prefix_routes = jnp.where(inside[:, :, None, None], prefix_routes, moe.NO_ROUTE)
      window_routes = jnp.take_along_axis(routes, index[:, :, None, None], axis=1)
      scored_here = (starts[:, None] + jnp.arange(width) < length)[:, :, None, None]
      window_routes = jnp.where(scored_here, window_routes, moe.NO_ROUTE)
    hidden, _, *window_own = self.model.apply(params, window, cache=cache, features=True,
                                              **pick(window_routes if replay else None))
    if replay:
      flat = lambda x: x.reshape(-1, *x.shape[-2:])  # [tokens, layers, k]
      flips = route_flip_fraction(jnp.concatenate([flat(own[0]), flat(window_own[0])]),
                                  jnp.concatenate([flat(prefix_routes), flat(window_routes)]))
    hidden = jnp.concatenate([repeat(last), hidden[:, :-1]], axis=1)
    sizes = (None if support_sizes is None
             else jnp.take_along_axis(support_sizes, index, axis=1))
    ids = (None if support_ids is None
           else jnp.take_along_axis(support_ids, index[..., None], axis=1))
    if chunk <= 0:
      scored = self._score(self.model.logits(params, hidden), window, sizes, ids)
    else:
      scored = self._score_hidden(params, hidden, window, sizes, chunk, ids)
    return scored.replace(route_flips=flips)

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
