"""Mixture-of-experts routing and experts (Qwen3-MoE, Mixtral): a top-k softmax router over
``num_experts`` SwiGLU experts, dropless. ``rlax_llm.models.decoder.MoE`` is the block's
module (its params) built on these functions.

Every token goes to the ``num_experts_per_tok`` experts of largest router probability, the
output is their SwiGLU outputs weighted by those probabilities (renormalised over the top k
with ``norm_topk_prob``; Mixtral always does). No capacity factor: every token's k experts
are computed, whatever the load. ``Execution.moe_impl`` picks how (the same function to
rounding): ``'ragged'``, the (token, expert) pairs sorted by expert and one grouped matmul
per projection (``grouped_matmul``: ``jax.lax.ragged_dot``, which lowers to TPU's
grouped-matmul kernel, with a grouped weight gradient; ``k / num_experts`` of the dense
FLOPs), ``'dense'``, every expert on every token and the outputs combined by the sparse
gates (exact and simple), or ``'blocked'``, the sorted pairs padded to blocks of one expert
each and a scan over the blocks (``_blocked_experts``: about the routed FLOPs with static
shapes on any backend, where XLA:CPU lowers ``ragged_dot`` as every expert over every row).

Expert parallelism: under the trainer's mesh (``sharding.activation_sharding``) with the
experts split over a mesh axis that splits the tokens too (``LOGICAL_RULES``: expert ->
data, data > 1), ``'ragged'`` dispatches per device (``expert_parallel_experts``): each
device sorts its own tokens, sends each row to its expert's device with a ragged
all-to-all, runs its own experts and sends the results back; elsewhere (one device, the
engine, data 1) it is the one-device path that XLA partitions (``run_experts``).

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

Int8 experts (the engine's copy with ``model.inference_quant='int8'``, ``quant.quantize_experts``):
each expert weight an ``Int8Weight`` (int8 ``q [experts, K, N]``, a float32 scale per expert
and output channel ``[experts, 1, N]``) in place of the float array, in every path: the
grouped matmul converts ``q`` inside the product and scales each sorted row by its expert's
scales (``grouped_matmul``), the dense fallback scales each expert's gate and up products
(``_expert_product``) and takes the down weights as ``q * scale``, and the expert-parallel
dispatch sends the scales with their experts.

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
  Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and Automatic
  Sharding", arXiv 2006.16668 (experts split over devices, tokens dispatched all-to-all).
  Qwen Team, "Qwen3 Technical Report", arXiv 2505.09388.
  Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
  Routers", arXiv 2510.11370 (rollout routing replay, R3).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from rlax_llm.model_spec import NO_ROUTE, route_dtype  # noqa: F401  (R3's, re-exported)
from rlax_llm.models.quant import Int8Weight, expert_scale_spec
from rlax_llm.sharding import activation_context, logical_to_spec, mesh_axes_of

Array = jax.Array
# An expert weight ``[experts, K, N]``: float, or int8 (``quant.quantize_experts``).
Experts = Array | Int8Weight

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


# The weight gradient's tiles on TPU (megablox ``tgmm``: rows, in, out), each at most this and
# a multiple of 128 that divides its dimension (else the whole dimension).
_TGMM_TILE = 512


def grouped_matmul(x: Array, w: Experts, sizes: Array) -> Array:
  """A grouped matmul (MegaBlocks' dropless experts, Gale et al. 2022): the rows of ``x``
  ``[rows, in]`` in consecutive groups of ``sizes`` (int32 ``[groups]``) rows, group ``g``
  times ``w[g]`` (``w [groups, in, out]``); ``[rows, out]``, 0 in the rows past
  ``sum(sizes)``.

  An ``Int8Weight`` ``w`` (int8 ``q [groups, in, out]``, float32 ``scale [groups, 1, out]``):
  ``ragged_dot(x, q)`` with ``q`` converted to ``x``'s dtype inside it and float32
  accumulation, each row then times its group's scales, in ``x``'s dtype (differentiable in
  ``x`` by ``ragged_dot``'s own rules; ``q`` is not trained).

  The forward and the gradient of ``x`` are ``jax.lax.ragged_dot`` (on TPU XLA's
  grouped-matmul kernel); the gradient of ``w`` is ``grouped_weight_gradient``, one
  transposed product ``x_g^T @ dy_g`` per group (XLA:TPU lowers ``ragged_dot``'s own weight
  gradient as a dense product over every group with a mask: ``groups`` times the FLOPs).
  """
  chex.assert_rank([x, sizes], [2, 1])
  if isinstance(w, Int8Weight):
    chex.assert_rank([w.q, w.scale], [3, 3])
    y = jax.lax.ragged_dot(x, w.q.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    rows = jnp.repeat(w.scale[:, 0], sizes, axis=0, total_repeat_length=x.shape[0])
    return (y * rows).astype(x.dtype)
  chex.assert_rank(w, 3)
  return _grouped_matmul(x, w, sizes)


@jax.custom_vjp
def _grouped_matmul(x: Array, w: Array, sizes: Array) -> Array:
  return jax.lax.ragged_dot(x, w, sizes)


def _grouped_matmul_fwd(x, w, sizes):
  return _grouped_matmul(x, w, sizes), (x, w, sizes)


def _grouped_matmul_bwd(residuals, dy):
  x, w, sizes = residuals
  dx = jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), sizes)
  return dx.astype(x.dtype), grouped_weight_gradient(x, dy, sizes).astype(w.dtype), None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_weight_gradient(x: Array, dy: Array, sizes: Array) -> Array:
  """float32 ``[groups, in, out]``: per group ``g`` of consecutive rows (``sizes`` int32
  ``[groups]``), ``x_g^T @ dy_g`` for ``x [rows, in]``, ``dy [rows, out]`` (rows past
  ``sum(sizes)`` count nowhere): ``grouped_matmul``'s weight gradient.

  With ``jax.default_backend()`` 'tpu' (as the TPU compile traces, launch/recipes/compile.py)
  megablox's transposed grouped matmul ``tgmm`` (a Pallas kernel that visits each group's row
  tiles only); elsewhere ``jax.lax.ragged_dot_general`` with the rows as the ragged
  contracting dimension (jax's own ``ragged_dot`` transpose).
  """
  chex.assert_rank([x, dy, sizes], [2, 2, 1])
  chex.assert_equal_shape_prefix([x, dy], 1)
  if jax.default_backend() == 'tpu':
    return _tgmm_weight_gradient(x, dy, sizes)
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(x, dy, sizes, dims, preferred_element_type=jnp.float32)


def _tile(n: int) -> int:
  """The largest multiple of 128 up to ``_TGMM_TILE`` that divides ``n``, else ``n``."""
  return next((t for t in range(_TGMM_TILE, 127, -128) if n % t == 0), n)


def _tgmm_weight_gradient(x: Array, dy: Array, sizes: Array, interpret: bool = False) -> Array:
  """``grouped_weight_gradient`` by megablox ``tgmm`` (rows padded to its row tile);
  ``interpret`` runs the kernel in Pallas' interpreter (any backend: the tests')."""
  from jax.experimental.pallas.ops.tpu.megablox.gmm import \
      tgmm  # pylint: disable=import-outside-toplevel  (TPU only)
  rows = x.shape[0]
  tm = min(_TGMM_TILE, -(-rows // 128) * 128)
  pad = ((0, -rows % tm), (0, 0))
  x, dy = jnp.pad(x, pad), jnp.pad(dy, pad)
  return tgmm(x.T, dy, sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
              tiling=(tm, _tile(x.shape[1]), _tile(dy.shape[1])), interpret=interpret)


def _swiglu_experts(rows: Array, sizes: Array, w_gate: Experts, w_up: Experts,
                    w_down: Experts) -> Array:
  """The experts' SwiGLU over ``rows [m, embed]`` grouped by expert (``sizes [experts]``):
  ``[m, embed]``, 0 past ``sum(sizes)``."""
  hidden = (jax.nn.silu(grouped_matmul(rows, w_gate, sizes))
            * grouped_matmul(rows, w_up, sizes))
  return grouped_matmul(hidden, w_down, sizes)


def _expert_order(experts: Array, num_experts: int) -> tuple[Array, Array]:
  """``(order int32 [tokens k], sizes int32 [num_experts])``: the (token, slot) pairs of
  ``experts`` (int32 ``[tokens, k]``) sorted by expert (stable) and each expert's count; an
  expert id of ``num_experts`` or more (padding) sorts last and is counted nowhere."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[
      jnp.minimum(flat, num_experts)].add(1)[:num_experts]
  return order, sizes


def _sort_by_expert(x: Array, experts: Array, num_experts: int) -> tuple[Array, Array, Array]:
  """``(order int32 [tokens k], rows [tokens k, embed], sizes int32 [num_experts])``:
  ``_expert_order``'s pairs and counts, and the pairs' tokens' rows of ``x``."""
  order, sizes = _expert_order(experts, num_experts)
  return order, jnp.take(x, order // experts.shape[1], axis=0), sizes


def _combine(out: Array, order: Array, gates: Array) -> Array:
  """The sorted rows' outputs ``out [tokens k, embed]`` back in (token, slot) order, summed
  over each token's slots weighted by ``gates [tokens, k]``: ``[tokens, embed]``."""
  tokens, k = gates.shape
  out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
  return jnp.einsum('tkd,tk->td', out.reshape(tokens, k, -1), gates.astype(out.dtype))


def _ragged_experts(x: Array, experts: Array, gates: Array, w_gate: Experts, w_up: Experts,
                    w_down: Experts) -> Array:
  """Each token's k experts by grouped matmuls over the (token, slot) rows sorted by
  expert; ``[tokens, embed]``."""
  order, rows, sizes = _sort_by_expert(x, experts, w_gate.shape[0])
  return _combine(_swiglu_experts(rows, sizes, w_gate, w_up, w_down), order, gates)


# The devices' platforms without XLA's ragged all-to-all, where ``expert_parallel_experts``
# exchanges rows by a padded ``all_to_all`` instead (``_exchange``).
_PADDED_EXCHANGE = ('cpu',)


def _exclusive_cumsum(x: Array, axis: int) -> Array:
  return jnp.cumsum(x, axis=axis) - x


def _axis_name(axes: tuple[str, ...]) -> str | tuple[str, ...]:
  return axes[0] if len(axes) == 1 else axes


def _exchange(operand: Array, output: Array, input_offsets: Array, send_sizes: Array,
              output_offsets: Array, recv_sizes: Array, *, axis: tuple[str, ...], parts: int,
              padded: bool) -> Array:
  """``jax.lax.ragged_all_to_all`` over the mesh axes ``axis`` (``parts`` devices), its
  slices ``i`` going to device ``i // (len(send_sizes) // parts)``; with ``padded`` (XLA:CPU,
  which has no ragged all-to-all) the same result by an ``all_to_all`` of a ``[parts,
  operand rows]`` block per device, each row sent with the place it lands at."""
  name = _axis_name(axis)
  if not padded:
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=name)
  cap, per = operand.shape[0], send_sizes.shape[0] // parts
  sizes = send_sizes.reshape(parts, per)
  ends = jnp.cumsum(sizes, axis=1)
  r = jnp.arange(cap, dtype=ends.dtype)
  piece = jax.vmap(lambda e: jnp.searchsorted(e, r, side='right'))(ends)  # [parts, cap]
  valid = piece < per
  piece = jnp.minimum(piece, per - 1)
  within = r[None] - jnp.take_along_axis(ends - sizes, piece, 1)
  at = lambda offsets: jnp.take_along_axis(offsets.reshape(parts, per), piece, 1) + within
  rows = jnp.take(operand, jnp.where(valid, at(input_offsets), 0), axis=0)
  dest = jnp.where(valid, at(output_offsets), output.shape[0])
  rows = jax.lax.all_to_all(rows, name, 0, 0)
  dest = jax.lax.all_to_all(dest, name, 0, 0)
  return output.at[dest.reshape(-1)].set(rows.reshape(-1, *operand.shape[1:]), mode='drop')


def _gathered(w: Experts, dims: tuple) -> Experts:
  """An expert weight (``[experts, K, N]`` on one device) all-gathered over ``dims`` (``(dim,
  mesh axes)`` pairs); an ``Int8Weight``'s scales (``[experts, 1, N]``) with it, but for the
  inputs dimension 1 they do not have."""
  def gather(a, dims):
    return functools.reduce(lambda a, g: jax.lax.all_gather(a, _axis_name(g[1]), axis=g[0],
                                                            tiled=True), dims, a)
  if isinstance(w, Int8Weight):
    return Int8Weight(q=gather(w.q, dims), scale=gather(w.scale, [g for g in dims if g[0] != 1]))
  return gather(w, dims)


def _local_experts(x: Array, experts: Array, gates: Array, *weights: Experts,
                   ep: tuple[str, ...], parts: int, gather: tuple, summed: tuple[str, ...],
                   padded: bool) -> Array:
  """One device's part of ``expert_parallel_experts`` (the body of its ``shard_map``): its
  own tokens ``x [n, embed]`` (``experts``, ``gates [n, k]``) and its ``experts / parts``
  experts' ``weights`` (gate, up, down; float or ``Int8Weight``), whose dimensions ``gather``
  (per weight, ``(dim, mesh axes)`` pairs) are all-gathered first (``_gathered``);
  ``summed``: the mesh axes that split the experts' width, over which the output is
  summed."""
  w_gate, w_up, w_down = (_gathered(w, dims) for w, dims in zip(weights, gather))
  local = w_gate.shape[0]
  n, k = experts.shape
  order, rows, counts = _sort_by_expert(x, experts, local * parts)
  name = _axis_name(ep)
  me = jax.lax.axis_index(name)
  table = jax.lax.all_gather(counts, name).reshape(parts, parts, local)  # [source, owner, j]
  held = jnp.sum(table, axis=0)  # [owner, j]: the rows each owner gets of its expert j
  mine = table[:, me]  # [source, j]: the rows I get from each source of my expert j
  # There: my slice e (my rows of expert e) -> its owner, landing after the owner's rows of
  # its lower experts and, within expert e, after the lower sources' rows.
  landing = _exclusive_cumsum(held, 1) + _exclusive_cumsum(table, 0)[me]
  received = _exchange(rows, jnp.zeros((parts * n * k, x.shape[1]), x.dtype),
                       _exclusive_cumsum(counts, 0), counts, landing.reshape(-1),
                       mine.reshape(-1), axis=ep, parts=parts, padded=padded)
  out = _swiglu_experts(received, held[me], w_gate, w_up, w_down)
  # Back: the slice (source s, my expert j) -> s, where s's rows of that expert started.
  sent_from = _exclusive_cumsum(held[me], 0)[None] + _exclusive_cumsum(mine, 0)
  starts = _exclusive_cumsum(table.reshape(parts, -1), 1)  # [source, expert]
  back_to = jax.lax.dynamic_slice_in_dim(starts, me * local, local, axis=1)
  back = _exchange(out, jnp.zeros((n * k, out.shape[1]), out.dtype), sent_from.reshape(-1),
                   mine.reshape(-1), back_to.reshape(-1), counts, axis=ep, parts=parts,
                   padded=padded)
  y = _combine(back, order, gates)
  return jax.lax.psum(y, _axis_name(summed)) if summed else y


def expert_parallel_axes(mesh: jax.sharding.Mesh | Mapping[str, int],
                         rules: Sequence[tuple[str, Any]], num_experts: int
                         ) -> tuple[str, ...]:
  """The mesh axes ``'ragged'`` dispatches tokens over (``expert_parallel_experts``): those
  ``rules`` map ``EXPERT_AXIS`` to (size > 1) when they divide ``num_experts`` (so the
  experts are split over them) and split the tokens too (the logical ``batch``); else ``()``
  (the experts are not split, or each of their devices holds the same tokens). ``mesh``: a
  ``Mesh`` or its axis sizes (``presets.memory_plan``'s)."""
  ep = mesh_axes_of(EXPERT_AXIS, mesh, rules)
  sizes = mesh.shape if isinstance(mesh, jax.sharding.Mesh) else mesh
  if (not ep or num_experts % math.prod(sizes[a] for a in ep)
      or not set(ep) <= set(mesh_axes_of('batch', mesh, rules))):
    return ()
  return ep


def expert_parallel_experts(x: Array, experts: Array, gates: Array, w_gate: Experts,
                            w_up: Experts, w_down: Experts, mesh: jax.sharding.Mesh,
                            rules: Sequence[tuple[str, Any]]) -> Array | None:
  """``_ragged_experts`` with per-device token dispatch (expert parallelism, GShard's
  layout: Lepikhin et al., arXiv 2006.16668), or None where ``mesh`` and ``rules`` split the
  experts over no mesh axis that also splits the tokens (``expert_parallel_axes``).

  A ``jax.shard_map`` over ``mesh``: each device sorts only its own tokens' (token, slot)
  rows by expert (the tokens split as the logical ``batch`` axis, padded to the devices),
  sends each expert's rows to the device holding that expert (``EXPERT_AXIS``'s mesh axes,
  where the weights already lie: ``rules``) with one ragged all-to-all, lands them grouped
  by its local expert, runs its local experts' grouped matmuls (``grouped_matmul``; each
  expert's matrices all-gathered over the axes that split their embedding, fsdp's, and
  split over tensor as the dense MLP's, the outputs summed), and sends the results back the
  same way. Dropless: the receiving buffer holds ``devices x tokens x k`` rows (every
  source's every row on one device). The same function as ``_ragged_experts`` to rounding.

  Args:
    x, experts, gates, w_gate, w_up, w_down: as ``EXPERT_IMPLS``' (``x [tokens, embed]``,
      ``experts`` int32 ``[tokens, k]``, ``gates [tokens, k]``, ``w_gate``/``w_up
      [experts, embed, moe_mlp]``, ``w_down [experts, moe_mlp, embed]``; or ``Int8Weight``s,
      whose scales go to the devices of their experts and output channels).
    mesh, rules: the activations' mesh and logical-axis rules
      (``sharding.activation_context``).
  Returns:
    ``[tokens, embed]`` in ``x``'s dtype, or None.
  """
  chex.assert_rank([x, experts, gates], [2, 2, 2])
  chex.assert_rank([w.q if isinstance(w, Int8Weight) else w for w in (w_gate, w_up, w_down)], 3)
  ep = expert_parallel_axes(mesh, rules, w_gate.shape[0])
  if not ep:
    return None
  axes = lambda entry: () if entry is None else (  # noqa: E731
      (entry,) if isinstance(entry, str) else tuple(entry))
  up = logical_to_spec(PartitionSpec(EXPERT_AXIS, 'embed', 'mlp'), w_gate.shape, mesh, rules)
  down = logical_to_spec(PartitionSpec(EXPERT_AXIS, 'mlp', 'embed'), w_down.shape, mesh,
                         rules)
  assert axes(up[0]) == axes(down[0]) == ep, (up, down, ep)  # the expert dimension leads
  tokens = mesh_axes_of('batch', mesh, rules)
  width = axes(up[2])
  summed = width if width == axes(down[1]) and not set(width) & set(tokens) else ()
  gather = tuple(tuple((dim, axes(spec[dim])) for dim in dims
                       if axes(spec[dim]) and (dim == embed or not summed))
                 for spec, dims, embed in ((up, (1, 2), 1), (up, (1, 2), 1), (down, (2, 1), 2)))
  n = x.shape[0]
  pad = -n % math.prod(mesh.shape[a] for a in tokens)
  if pad:  # a padding token's slots sort past every expert: never sent, never computed
    x = jnp.pad(x, ((0, pad), (0, 0)))
    experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=w_gate.shape[0])
    gates = jnp.pad(gates, ((0, pad), (0, 0)))
  rows = PartitionSpec(_axis_name(tokens), None)
  body = functools.partial(_local_experts, ep=ep, parts=math.prod(mesh.shape[a] for a in ep),
                           gather=gather, summed=summed,
                           padded=mesh.devices.flat[0].platform in _PADDED_EXCHANGE)
  specs = tuple(Int8Weight(q=spec, scale=expert_scale_spec(spec, 3))
                if isinstance(w, Int8Weight) else spec
                for w, spec in ((w_gate, up), (w_up, up), (w_down, down)))
  out = jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, *specs),
                      out_specs=rows, check_vma=False)(x, experts, gates, w_gate, w_up, w_down)
  return out[:n]


def _expert_product(x: Array, w: Experts) -> Array:
  """Every expert's product ``x [tokens, in]`` times ``w [experts, in, out]``: ``[experts,
  tokens, out]``; an ``Int8Weight`` as ``(x @ q) * scale`` per expert (float32 accumulation,
  ``x``'s dtype)."""
  if not isinstance(w, Int8Weight):
    return jnp.einsum('td,edf->etf', x, w)
  y = jnp.einsum('td,edf->etf', x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
  return (y * w.scale).astype(x.dtype)


def _dense_experts(x: Array, experts: Array, gates: Array, w_gate: Experts, w_up: Experts,
                   w_down: Experts) -> Array:
  """Every expert on every token, combined by the sparse gates; ``[tokens, embed]``."""
  num_experts = w_gate.shape[0]
  combine = jnp.einsum('tke,tk->te', jax.nn.one_hot(experts, num_experts, dtype=gates.dtype),
                       gates).astype(x.dtype)
  hidden = jax.nn.silu(_expert_product(x, w_gate)) * _expert_product(x, w_up)
  if isinstance(w_down, Int8Weight):
    # q * scale in the product: scaling each expert's [tokens, embed] output before the sum
    # over experts would make (and on XLA:TPU all-reduce) an [experts, tokens, embed] array.
    w_down = w_down.q.astype(x.dtype) * w_down.scale.astype(x.dtype)
  return jnp.einsum('etf,efd,te->td', hidden, w_down, combine)


# The most rows a block of ``'blocked'`` holds (``block_rows``): past it XLA:CPU's products
# gain little per row and the padding (up to ``experts x (B - 1)`` rows) grows.
_MAX_BLOCK_ROWS = 128


def block_rows(rows: int, num_experts: int) -> int:
  """``'blocked'``'s rows per block ``B`` for ``rows`` (token, slot) pairs over
  ``num_experts`` experts: the largest power of two at most the mean rows per expert
  (``rows / num_experts``), within ``[1, _MAX_BLOCK_ROWS]``. Static (shapes only). So the
  padding, at most ``B - 1`` rows per expert, is at most the routed rows, and each block's
  product is as long as the mean expert's rows allow; a decode step (a few rows per expert
  or fewer) gets ``B = 1``: one row per block, the routed experts' weights only."""
  if rows < 1 or num_experts < 1:
    raise ValueError(f'block_rows needs rows >= 1 and num_experts >= 1, got rows={rows}, '
                     f'num_experts={num_experts}.')
  mean = max(rows // num_experts, 1)
  return min(1 << (mean.bit_length() - 1), _MAX_BLOCK_ROWS)


def num_blocks(rows: int, num_experts: int, block: int) -> int:
  """The blocks of ``block`` rows that ``'blocked'`` lays ``rows`` (token, slot) pairs over
  (``_block_layout``), static: ``(rows + E (B - 1)) // B``, so that every expert's group,
  padded to whole blocks (at most ``B - 1`` padding rows each), fits; the memory plan counts
  the same ``num_blocks * block`` rows (``presets``)."""
  return (rows + num_experts * (block - 1)) // block


def _block_layout(experts: Array, num_experts: int, block: int
                  ) -> tuple[Array, Array, Array, Array]:
  """Where ``'blocked'`` puts each (token, slot) pair: the pairs sorted by expert
  (``_expert_order``), each expert's group padded to a multiple of ``block`` rows, so each
  block of ``block`` consecutive rows holds one expert's pairs.

  Args:
    experts: int32 ``[tokens, k]``; an id of ``num_experts`` or more (padding) is placed
      nowhere.
    num_experts: the experts' count ``E``.
    block: rows per block ``B``.
  Returns:
    ``(block_experts int32 [blocks], token int32 [blocks B], valid bool [blocks B],
    position int32 [tokens k])``: each block's expert (the last expert for the blocks past
    the used ones, whose rows are all invalid), each padded row's token (0 where
    invalid), whether it holds a pair, and each pair's padded row (``blocks B`` where it has
    none), over ``num_blocks(tokens k, E, B)`` blocks.
  """
  tokens, k = experts.shape
  pairs = tokens * k
  blocks = num_blocks(pairs, num_experts, block)
  order, sizes = _expert_order(experts, num_experts)
  starts = _exclusive_cumsum(sizes, 0)  # each expert's first sorted pair
  owned = -(-sizes // block)  # each expert's blocks
  ends = jnp.cumsum(owned)
  block_experts = jnp.minimum(
      jnp.searchsorted(ends, jnp.arange(blocks, dtype=jnp.int32), side='right'),
      num_experts - 1).astype(jnp.int32)
  row = jnp.arange(blocks * block, dtype=jnp.int32)
  expert = block_experts[row // block]
  within = row - (ends - owned)[expert] * block
  valid = within < sizes[expert]
  pair = jnp.where(valid, order[jnp.where(valid, starts[expert] + within, 0)], pairs)
  position = jnp.full((pairs + 1,), blocks * block, jnp.int32).at[pair].set(row)[:pairs]
  return block_experts, jnp.where(valid, pair // k, 0), valid, position


def _expert_weight(w: Array, expert: Array) -> Array:
  """Expert ``expert``'s (int32 scalar) slice of ``w [experts, ...]``, a dynamic slice
  (read in place inside a loop)."""
  return jax.lax.dynamic_index_in_dim(w, expert, keepdims=False)


def _block_product(rows: Array, w: Experts, expert: Array) -> Array:
  """One block's rows ``rows [B, in]`` times expert ``expert``'s (int32 scalar) weight of
  ``w [experts, in, out]``, read in place (a dynamic slice, no copy of the experts):
  ``[B, out]``; an ``Int8Weight`` as ``(rows @ q) * scale`` (``q`` converted inside the
  product, float32 accumulation, ``rows``' dtype)."""
  if not isinstance(w, Int8Weight):
    return rows @ _expert_weight(w, expert)
  y = jnp.dot(rows, _expert_weight(w.q, expert).astype(rows.dtype),
              preferred_element_type=jnp.float32)
  return (y * _expert_weight(w.scale, expert)).astype(rows.dtype)


def _blocked_swiglu(rows: Array, block_experts: Array, used: Array, w_gate: Experts,
                    w_up: Experts, w_down: Experts) -> Array:
  """Each block's SwiGLU with its expert's weights: ``rows [blocks, B, embed]``,
  ``block_experts`` int32 ``[blocks]``, ``used`` bool ``[blocks]`` (whether the block holds
  a pair: the others are skipped, 0), ``w_gate, w_up [experts, embed, moe_mlp]``, ``w_down
  [experts, moe_mlp, embed]``; ``[blocks, B, embed]`` (``rows``' dtype).

  A ``jax.lax.scan`` over the blocks, each expert's weights read in place
  (``_block_product``). Float weights have their own backward (``_blocked_swiglu_float``);
  ``Int8Weight`` experts (not trained) are differentiated in ``rows`` by autodiff.
  """
  if not any(isinstance(w, Int8Weight) for w in (w_gate, w_up, w_down)):
    return _blocked_swiglu_float(rows, block_experts, used, w_gate, w_up, w_down)
  return _blocked_swiglu_scan(rows, block_experts, used, w_gate, w_up, w_down)[0]


def _blocked_swiglu_scan(rows: Array, block_experts: Array, used: Array, w_gate: Experts,
                         w_up: Experts, w_down: Experts) -> tuple[Array, Array, Array]:
  """``_blocked_swiglu``'s scan: ``(out [blocks, B, embed], gate, up [blocks, B,
  moe_mlp])``, ``gate``/``up`` the blocks' products before the SwiGLU (the float backward's
  residuals); 0 in the blocks not ``used``."""
  def swiglu(rows, expert):
    gate = _block_product(rows, w_gate, expert)
    up = _block_product(rows, w_up, expert)
    return _block_product(jax.nn.silu(gate) * up, w_down, expert), gate, up

  def skip(rows, _):
    hidden = jnp.zeros(rows.shape[:1] + w_gate.shape[2:], rows.dtype)
    return jnp.zeros_like(rows), hidden, hidden

  def block(carry, block_in):
    rows, expert, used = block_in
    return carry, jax.lax.cond(used, swiglu, skip, rows, expert)

  return jax.lax.scan(block, None, (rows, block_experts, used))[1]


@jax.custom_vjp
def _blocked_swiglu_float(rows: Array, block_experts: Array, used: Array, w_gate: Array,
                          w_up: Array, w_down: Array) -> Array:
  """``_blocked_swiglu`` for float weights, with a backward of its own
  (``_blocked_swiglu_bwd``)."""
  return _blocked_swiglu_scan(rows, block_experts, used, w_gate, w_up, w_down)[0]


def _blocked_swiglu_fwd(rows, block_experts, used, w_gate, w_up, w_down):
  out, gate, up = _blocked_swiglu_scan(rows, block_experts, used, w_gate, w_up, w_down)
  return out, (rows, block_experts, used, w_gate, w_up, w_down, gate, up)


def _blocked_swiglu_bwd(residuals, d_out):
  """A scan over the blocks: each block's row gradient, and its weight gradients added into
  its expert's slice of carried ``[experts, ...]`` float32 accumulators
  (``acc.at[expert].add``, in place in XLA's loop); the residuals are the rows and the
  blocks' gate and up products. Autodiff's transpose of the forward scan saves a copy of
  every block's expert weights instead (``[blocks, in, out]`` per weight): 1.6x this
  layer's forward and backward time on XLA:CPU (benchmarks/LAB_NOTES.md)."""
  rows, block_experts, used, w_gate, w_up, w_down, gate, up = residuals
  weights = (w_gate, w_up, w_down)

  def grads(acc, rows, expert, d_out, gate, up):
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_hidden = d_out @ _expert_weight(w_down, expert).T
    d_up = d_hidden * silu
    d_gate = d_hidden * up * sig * (1 + gate * (1 - sig))  # silu' = sig (1 + x (1 - sig))
    d_rows = d_gate @ _expert_weight(w_gate, expert).T + d_up @ _expert_weight(w_up, expert).T
    weight_grads = (rows.T @ d_gate, rows.T @ d_up, (silu * up).T @ d_out)
    acc = tuple(a.at[expert].add(g.astype(a.dtype)) for a, g in zip(acc, weight_grads))
    return acc, d_rows.astype(rows.dtype)

  def block(acc, block_in):
    used = block_in[0]
    return jax.lax.cond(used, grads, lambda acc, rows, *_: (acc, jnp.zeros_like(rows)), acc,
                        *block_in[1:])

  acc = tuple(jnp.zeros(w.shape, jnp.promote_types(w.dtype, jnp.float32)) for w in weights)
  acc, d_rows = jax.lax.scan(block, acc, (used, rows, block_experts, d_out, gate, up))
  return (d_rows, None, None) + tuple(a.astype(w.dtype) for a, w in zip(acc, weights))


_blocked_swiglu_float.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)


def _blocked_experts(x: Array, experts: Array, gates: Array, w_gate: Experts, w_up: Experts,
                     w_down: Experts) -> Array:
  """Each token's k experts over blocks of ``B`` rows (``block_rows``), each block one
  expert's (token, slot) pairs (``_block_layout``: sorted by expert, each expert's group
  padded to a multiple of ``B``): a ``jax.lax.scan`` over the blocks computes each block's
  SwiGLU with its expert's weights (``_blocked_swiglu``: ``[B, embed] x [embed, moe_mlp]``
  products), then each pair's row comes back and the slots are combined by the gates;
  ``[tokens, embed]``.

  Plain JAX with static shapes (``(tokens k + E (B - 1)) // B`` blocks): about the routed
  FLOPs (``tokens k`` rows plus at most ``B - 1`` padding rows per expert) on any backend,
  where XLA:CPU's ``ragged_dot`` computes every expert over every row (``'ragged'``) and
  ``'dense'`` every expert on every token. The backward of float experts is a scan of its
  own that adds each block's weight gradient into its expert's only
  (``_blocked_swiglu_bwd``). The blocks past the used ones (all padding, fewer than ``E``) are
  skipped (a ``jax.lax.cond``), forward and backward.
  """
  chex.assert_rank([x, experts, gates], 2)
  chex.assert_equal_shape([experts, gates])
  tokens, k = experts.shape
  num_experts = w_gate.shape[0]
  block = block_rows(tokens * k, num_experts)
  block_experts, token, valid, position = _block_layout(experts, num_experts, block)
  rows = jnp.where(valid[:, None], jnp.take(x, token, axis=0), 0)
  used = valid.reshape(-1, block)[:, 0]  # a used block's first row holds a pair
  out = _blocked_swiglu(rows.reshape(-1, block, x.shape[1]), block_experts, used, w_gate,
                        w_up, w_down)
  out = jnp.take(out.reshape(-1, x.shape[1]), position, axis=0, mode='fill', fill_value=0)
  return jnp.einsum('tkd,tk->td', out.reshape(tokens, k, -1), gates.astype(out.dtype))


# ``Execution.moe_impl`` -> how the experts run: ``(x [tokens, embed], experts int32
# [tokens, k], gates [tokens, k], w_gate, w_up [experts, embed, moe_mlp], w_down [experts,
# moe_mlp, embed]) -> [tokens, embed]``.
EXPERT_IMPLS = {'ragged': _ragged_experts, 'dense': _dense_experts,
                'blocked': _blocked_experts}


def run_experts(impl: str, x: Array, experts: Array, gates: Array, w_gate: Experts,
                w_up: Experts, w_down: Experts) -> Array:
  """The experts of ``Execution.moe_impl`` ``impl`` (``EXPERT_IMPLS``' arguments and result).

  ``'ragged'`` inside ``sharding.activation_sharding`` (the trainer's step) on a mesh whose
  ``EXPERT_AXIS`` axes split the experts and the tokens (``LOGICAL_RULES``: expert -> data,
  data > 1) dispatches each device's tokens to the experts' devices
  (``expert_parallel_experts``); anywhere else (one device, the engine, no data axis) every
  device runs ``_ragged_experts`` on the tokens XLA's partitioner gives it.
  """
  if impl == 'ragged':
    context = activation_context()
    if context is not None:
      out = expert_parallel_experts(x, experts, gates, w_gate, w_up, w_down, *context)
      if out is not None:
        return out
  return EXPERT_IMPLS[impl](x, experts, gates, w_gate, w_up, w_down)
