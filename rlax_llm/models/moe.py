"""Mixture-of-experts routing and experts (Qwen3-MoE, Mixtral): a top-k softmax router over
``num_experts`` SwiGLU experts, dropless. ``rlax_llm.models.decoder.MoE`` is the block's
module (its params) built on these functions.

Every token goes to the ``num_experts_per_tok`` experts of largest router probability, the
output is their SwiGLU outputs weighted by those probabilities (renormalised over the top k
with ``norm_topk_prob``; Mixtral always does). No capacity factor: every token's k experts
are computed, whatever the load. ``Execution.moe_impl`` picks how (the same function to
rounding): ``'ragged'``, the (token, expert) pairs sorted by expert and one grouped matmul
per projection (``jax.lax.ragged_dot``, which lowers to TPU's grouped-matmul kernel;
``k / num_experts`` of the dense FLOPs), or ``'dense'``, every expert on every token and
the outputs combined by the sparse gates (exact and simple; for tiny models and CPU).

The experts' weights are stacked ``[experts, ...]`` under the logical axis ``expert``
(``rlax_llm.sharding.LOGICAL_RULES`` shards it for expert parallelism) and always stored
inputs first (``[experts, in, out]``, whatever ``Execution.weight_layout``); the router is an
ordinary ``[embed, experts]`` weight without bias.

Rollout routing replay (R3): ``replay`` routes tokens to recorded experts (``routes``,
each token's top-k indices per layer, ``route_dtype``: int8 for up to 127 experts, else
int16; ``NO_ROUTE`` where nothing was recorded) with the gates still the router's softmax
at those experts (renormalised as the family does), so the choice is fixed and the router
is trained through the gates; ``flipped`` counts the recorded choices the router's own
top-k would not have made.

The block also returns its router statistics (``router_stats``) from which
``load_balancing_loss`` computes the Switch Transformer auxiliary loss as transformers does
over all layers.

References:
  Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
  Layer", arXiv 1701.06538.
  Fedus et al., "Switch Transformers", arXiv 2101.03961 (load-balancing loss, eqs. 4-6).
  Jiang et al., "Mixtral of Experts", arXiv 2401.04088.
  Gale et al., "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", arXiv
  2211.15841 (dropless grouped matmuls).
  Qwen Team, "Qwen3 Technical Report", arXiv 2505.09388.
  Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
  Routers", arXiv 2510.11370 (rollout routing replay, R3).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rlax_llm.model_spec import NO_ROUTE, route_dtype  # noqa: F401  (R3's, re-exported)

Array = jax.Array

EXPERT_AXIS = 'expert'  # the experts' stacked leading logical axis


def route(logits: Array, top_k: int, renormalize: bool) -> tuple[Array, Array, Array]:
  """Top-k softmax routing (HF ``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter``).

  Args:
    logits: router logits ``[tokens, experts]`` (any float dtype).
    top_k: experts per token.
    renormalize: divide the top-k probabilities by their sum (``norm_topk_prob``).
  Returns:
    ``(probs float32 [tokens, experts], gates float32 [tokens, k], experts int32
    [tokens, k])``: the softmax over all experts, and each token's chosen experts in
    decreasing probability with their gate weights.
  """
  chex.assert_rank(logits, 2)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  gates, experts = jax.lax.top_k(probs, top_k)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return probs, gates, experts.astype(jnp.int32)


def replayed_experts(own: Array, routes: Array) -> Array:
  """int32 ``[..., k]``: the experts routing replay routes each token to: its recorded ones
  ``routes [..., k]``, or the router's own ``own [..., k]`` where none was recorded
  (``NO_ROUTE`` in slot 0)."""
  chex.assert_equal_shape([own, routes])
  return jnp.where(routes[..., :1] >= 0, routes.astype(jnp.int32), own.astype(jnp.int32))


def replay(probs: Array, own: Array, routes: Array, renormalize: bool) -> tuple[Array, Array]:
  """Routing replay (R3): each token routed to its recorded experts, the gates the router's
  probabilities at them (differentiable), renormalised as ``route`` does.

  Args:
    probs: float32 ``[tokens, experts]``, the router's softmax (``route``).
    own: int32 ``[tokens, k]``, the router's own top-k (``route``): a token whose recorded
      route is ``NO_ROUTE`` (slot 0 negative) keeps it.
    routes: int ``[tokens, k]``, the recorded experts.
    renormalize: as in ``route``.
  Returns:
    ``(gates float32 [tokens, k], experts int32 [tokens, k])``.
  """
  experts = replayed_experts(own, routes)
  gates = jnp.take_along_axis(probs, experts, axis=-1)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return gates, experts


def flipped(own: Array, routes: Array) -> Array:
  """int32 ``[...]``: per token, how many of its recorded experts ``routes [..., k]`` are not
  among the router's own top-k ``own [..., k]`` (0 where nothing was recorded): the choices
  routing replay overrides (a set difference: the order of the slots does not count)."""
  chex.assert_equal_shape([own, routes])
  hit = jnp.any(routes[..., :, None].astype(jnp.int32) == own[..., None, :].astype(jnp.int32),
                axis=-1)
  return jnp.where(routes[..., 0] >= 0, jnp.sum(~hit, axis=-1), 0).astype(jnp.int32)


def router_stats(probs: Array, experts: Array, weights: Array | None = None) -> Array:
  """float32 ``[2, num_experts]``: how many of the (token, slot) choices went to each expert,
  and the sum over tokens of each expert's router probability; ``weights`` (float ``[tokens]``,
  e.g. a padding mask) counts each token that many times. Summed over layers they give
  ``load_balancing_loss``."""
  num_experts = probs.shape[-1]
  if weights is None:
    weights = jnp.ones(probs.shape[:1], jnp.float32)
  weights = weights.astype(jnp.float32)
  slots = jnp.broadcast_to(weights[:, None], experts.shape).reshape(-1)
  counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(slots)
  return jnp.stack([jax.lax.stop_gradient(counts), jnp.sum(probs * weights[:, None], axis=0)])


def load_balancing_loss(stats: Array, top_k: int) -> Array:
  """The Switch Transformer load-balancing loss (Fedus et al. eqs. 4-6) as transformers'
  ``load_balancing_loss_func`` computes it over all MoE layers (no attention mask):
  ``num_experts * sum_e f_e * P_e``, ``f_e`` the fraction of (token, layer) rows that chose
  expert ``e`` (summed over the k slots), ``P_e`` its mean router probability; with weighted
  stats (a padding mask) over the weighted tokens only, as transformers' attention mask.

  Args:
    stats: ``router_stats`` summed over the layers, float32 ``[2, num_experts]``.
    top_k: experts per token (``num_experts_per_tok``).
  Returns:
    float32 scalar, 1.0 for perfectly balanced routing with k = 1 (unscaled: the trainer
    multiplies it by ``router_aux_loss_coef``).
  """
  chex.assert_shape(stats, (2, None))
  counts, prob_sums = stats[0], stats[1]
  rows = jnp.maximum(jnp.sum(counts) / top_k, 1e-9)  # tokens x layers
  return stats.shape[-1] * jnp.sum((counts / rows) * (prob_sums / rows))


def _ragged_experts(x: Array, experts: Array, gates: Array, w_gate: Array, w_up: Array,
                    w_down: Array) -> Array:
  """Each token's k experts by grouped matmuls over the (token, slot) rows sorted by
  expert; ``[tokens, embed]``."""
  tokens, k = experts.shape
  num_experts = w_gate.shape[0]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # (token, slot) rows grouped by expert
  rows = jnp.take(x, order // k, axis=0)
  sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  hidden = (jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, sizes))
            * jax.lax.ragged_dot(rows, w_up, sizes))
  out = jax.lax.ragged_dot(hidden, w_down, sizes)
  out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back to (token, slot)
  return jnp.einsum('tkd,tk->td', out.reshape(tokens, k, -1), gates.astype(out.dtype))


def _dense_experts(x: Array, experts: Array, gates: Array, w_gate: Array, w_up: Array,
                   w_down: Array) -> Array:
  """Every expert on every token, combined by the sparse gates; ``[tokens, embed]``."""
  num_experts = w_gate.shape[0]
  combine = jnp.einsum('tke,tk->te', jax.nn.one_hot(experts, num_experts, dtype=gates.dtype),
                       gates).astype(x.dtype)
  hidden = (jax.nn.silu(jnp.einsum('td,edf->etf', x, w_gate))
            * jnp.einsum('td,edf->etf', x, w_up))
  return jnp.einsum('etf,efd,te->td', hidden, w_down, combine)


# ``Execution.moe_impl`` -> how the experts run: ``(x [tokens, embed], experts int32
# [tokens, k], gates [tokens, k], w_gate, w_up [experts, embed, moe_mlp], w_down [experts,
# moe_mlp, embed]) -> [tokens, embed]``.
EXPERT_IMPLS = {'ragged': _ragged_experts, 'dense': _dense_experts}
