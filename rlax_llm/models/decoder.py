"""A Llama-style decoder-only transformer in Flax NNX, with a fixed-size KV cache.

One readable file (after nanoGPT): RMSNorm, rotary position embeddings (RoPE, the
"rotate half" layout used by Hugging Face Llama), grouped-query attention (GQA) and a
SwiGLU MLP. Every parameter carries its logical axis names in the ``logical_axes``
metadata (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``; ``expert``
in a mixture of experts, whose block is ``MoE``);
``rlax_llm.sharding`` maps them to mesh axes.

References:
  Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", arXiv 2302.13971.
  Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv 2104.09864.
  Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models", arXiv 2305.13245.
  Shazeer, "GLU Variants Improve Transformer", arXiv 2002.05202.
  Meta, "The Llama 3 Herd of Models", arXiv 2407.21783 (RoPE frequency scaling).
  Qwen Team, "Qwen2.5 Technical Report", arXiv 2412.15115; "Qwen3 Technical Report",
  arXiv 2505.09388.

The model's other parts live beside it: its configuration (``decoder_config``), the KV
cache's layout and writes (``kv_cache``), the attention functions a layer chooses between
(``attention``, ``cpu_attention``) and the batch-invariant numerics (``numerics``, with
``Execution.batch_invariant``) that make a row's logits bitwise the same whatever shares
its batch.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_llm.models import cpu_attention, moe
from rlax_llm.models.attention import invariant_attention, xla_attention
from rlax_llm.models.decoder_config import LAYERS_AXIS, DecoderConfig, RopeScaling
from rlax_llm.models.kv_cache import (KEY_BLOCK_AXES, VALUE_BLOCK_AXES, KVCache, LayerBlocks,
                                      layer_update, to_block)
from rlax_llm.models.numerics import (accumulated_product, flipped_product, flips, invariant_matmul,
                                     invariant_sum, narrow, narrow_dtype)
from rlax_llm.models.quant import Int8Weight
from rlax_llm.sharding import constrain

Array = jax.Array


# RoPE cos/sin come from a host table of every position (``rope_tables(max_len=...)``) when
# it has at most this many entries (max_seq_len * head_dim / 2; 8 MiB of float32 each, about
# 0.5 s more compile per program at this size); larger ones are evaluated in the program.
ROPE_TABLE_MAX_ENTRIES = 2 ** 21


def linear(x: Array, w: Array | Int8Weight, config: DecoderConfig,
           low_rank: tuple[Array, Array] | None = None) -> Array:
  """``x [..., K]`` times a weight of ``K`` inputs -> ``[..., N]`` (its outputs flattened).

  An ``Int8Weight`` (``quant``: int8 ``q``, float32 per-output-channel ``scale [N]``) gives
  ``(x @ q) * scale``, accumulated in float32.

  ``w`` is stored in ``Execution.weight_layout`` order: ``[K..., N...]`` (``'in_out'``,
  ``x @ w``) or ``[N..., K...]`` (``'out_in'``: ``flipped_product`` for a decode step's few
  rows on XLA:CPU, else ``x @ w.T``); batch-invariant (``invariant_matmul``) with
  ``Execution.batch_invariant``. ``low_rank``: a LoRA pair ``(A [K, r], B [r, N])`` (scale
  folded in, ``rlax_llm.models.lora``) whose ``x @ A @ B`` is added, each factor in the same
  layout and numerics as ``w``. bfloat16 (or float16) ``x`` and ``w`` multiply as
  ``accumulated_product`` (float32 sums, forward and backward).

  The products run on ``x`` flattened to 2-D rows ``[prod(...), K]`` and reshaped back. With
  the leading ``[batch, length]`` kept, XLA:CPU's layout assignment transposed whole
  activations (e.g. the SwiGLU gradient ``[1024, 1536]``) to feed the weight-gradient dots:
  17% of a SmolLM2 LoRA train step (``benchmarks/lora.py``; benchmarks/LAB_NOTES.md).
  """
  if x.ndim > 2:
    return linear(x.reshape(-1, x.shape[-1]), w, config, low_rank).reshape(
        *x.shape[:-1], -1)
  if low_rank is not None:
    a, b = low_rank
    if config.execution.weight_layout == 'out_in':
      a, b = a.T, b.T
    return linear(x, w, config) + linear(linear(x, a, config), b, config)
  k = x.shape[-1]
  run = config.execution
  out_in = run.weight_layout == 'out_in'
  if isinstance(w, Int8Weight):  # (x @ q) * scale: int8 converted in the dot, 1 byte/weight
    q = w.q.reshape(-1, k) if out_in else w.q.reshape(k, -1)
    y = jax.lax.dot_general(x, q.astype(x.dtype), (((x.ndim - 1,), (1 if out_in else 0,)),
                                                   ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * w.scale).astype(x.dtype)
  w = w.reshape(-1, k) if out_in else w.reshape(k, -1)
  if run.batch_invariant:
    return invariant_matmul(x, w, 'ck,nk->cn' if out_in else 'ck,kn->cn', run.invariant_rows)
  if narrow(x, w):
    return accumulated_product(x, w, out_in)
  if not out_in:
    return x @ w
  if flips(math.prod(x.shape[:-1])):
    return flipped_product(x, w)
  return jnp.einsum('...k,nk->...n', x, w)


def low_rank(module: nnx.Module, name: str, dtype) -> tuple[Array, Array] | None:
  """The LoRA pair ``(A [K, r], B [r, N] * scale)`` in ``dtype`` that
  ``rlax_llm.models.lora.add_adapters`` attached to weight ``name`` of ``module`` (as
  ``{name}_lora``), or None."""
  adapter = getattr(module, f'{name}_lora', None)
  return None if adapter is None else adapter.pair(dtype)


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
  """A truncated-normal (fan-in scaled) or ones parameter annotated with logical axes."""
  if scale is None:
    value = jnp.ones(shape, dtype)
  else:
    value = scale * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, dtype)
  return nnx.Param(value, logical_axes=axes)


def _kernel(rngs: nnx.Rngs, config: DecoderConfig, inputs: tuple[tuple[int, str], ...],
            outputs: tuple[tuple[int, str], ...], scale: float) -> nnx.Param:
  """A weight from ``inputs`` to ``outputs`` (``(size, logical axis)`` pairs), stored in
  ``Execution.weight_layout`` order. Drawn in the ``in_out`` order either way: one seed gives
  the same weights in both layouts."""
  sizes, axes = zip(*(inputs + outputs))
  param = _param(rngs, sizes, axes, config.execution.param_dtype, scale)
  if config.execution.weight_layout == 'in_out':
    return param
  order = tuple(range(len(inputs), len(sizes))) + tuple(range(len(inputs)))
  return nnx.Param(param[...].transpose(order), logical_axes=tuple(axes[i] for i in order))


def _zeros(rngs: nnx.Rngs, shape, axes, dtype) -> nnx.Param:
  del rngs
  return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  """Root-mean-square layer norm (Zhang & Sennrich, arXiv 1910.07467), fp32 statistics."""

  def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs,
               axis: str = 'embed', invariant: bool = False):
    self.scale = _param(rngs, (dim,), (axis,), param_dtype)
    self.eps = eps
    self.invariant = invariant  # batch-invariant mean (``invariant_sum``)

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    mean = (invariant_sum(x32 * x32) / x.shape[-1] if self.invariant
            else jnp.mean(x32 * x32, axis=-1, keepdims=True))
    normed = x32 * jax.lax.rsqrt(mean + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None
                  ) -> np.ndarray:
  """RoPE inverse frequencies ``theta^(-2i/d)``, float32 ``[head_dim // 2]``.

  With ``scaling`` (Llama 3.x): wavelengths longer than ``original / low_freq_factor`` are
  divided by ``factor``, shorter than ``original / high_freq_factor`` kept, and the band in
  between interpolated smoothly.
  """
  half = head_dim // 2
  inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2.0 / head_dim))
  if scaling is not None:
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2.0 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1.0 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def rope_tables(positions: Array, inv_freq: np.ndarray, max_len: int | None = None
                ) -> tuple[Array, Array]:
  """``(cos, sin)`` float32 ``[batch, length, 1, head_dim // 2]`` of ``positions * inv_freq``
  (computed once per forward pass and shared by every layer).

  ``max_len``: look the values up in a table of positions ``0 .. max_len - 1`` computed on
  the host (float64, rounded once; positions past it are clipped) instead of evaluating cos
  and sin in the program. XLA:CPU fuses the in-program cos and sin into every consumer: each
  layer's rope of q and k evaluated them again for every head (the q rope of a 32-row
  SmolLM2 decode step took 3.5 ms of one thread per step against 1.0 ms from the table; the
  batch-32 rollout 1.056x faster, benchmarks/RESULTS.md), and in different fusions it
  evaluated them differently (which batch-invariant numerics cannot have).
  """
  inv_freq = np.asarray(inv_freq, np.float32)
  if max_len is not None:
    angles = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq
    index = jnp.clip(positions, 0, max_len - 1)
    look_up = lambda table: jnp.take(jnp.asarray(table, jnp.float32), index, axis=0)
    return (look_up(np.cos(angles.astype(np.float64)))[:, :, None, :],
            look_up(np.sin(angles.astype(np.float64)))[:, :, None, :])
  angles = positions[..., None].astype(jnp.float32) * inv_freq
  return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rope_table_length(config: DecoderConfig) -> int | None:
  """The positions of the host cos/sin table the decoder reads (``rope_tables``'s
  ``max_len``): all ``max_seq_len`` of them when the table has at most
  ``ROPE_TABLE_MAX_ENTRIES`` entries, and always with batch-invariant numerics; else
  ``None`` (cos and sin evaluated in the program)."""
  small = config.max_seq_len * (config.head_dim // 2) <= ROPE_TABLE_MAX_ENTRIES
  return config.max_seq_len if small or config.execution.batch_invariant else None


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotary embedding, Hugging Face "rotate half" layout: ``x`` ``[B, T, heads, head_dim]``
  rotated by the ``rope_tables``; same shape and dtype."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rope(x: Array, positions: Array, theta: float | np.ndarray) -> Array:
  """Rotary embedding, Hugging Face "rotate half" layout.

  Args:
    x: ``[batch, length, heads, head_dim]``.
    positions: int ``[batch, length]`` absolute positions.
    theta: RoPE base frequency, or the inverse frequencies ``[head_dim // 2]``
      (``rope_inv_freq``).
  Returns:
    ``x`` rotated, same shape and dtype.
  """
  inv_freq = (rope_inv_freq(x.shape[-1], theta) if np.ndim(theta) == 0
              else np.asarray(theta, np.float32))
  return apply_rope(x, *rope_tables(positions, inv_freq))


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE and an optional KV cache."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    c = config
    s_in = c.embed_dim ** -0.5
    s_out = (c.num_heads * c.head_dim) ** -0.5
    embed = ((c.embed_dim, 'embed'),)
    heads = ((c.num_heads, 'heads'), (c.head_dim, 'head_dim'))
    kv_heads = ((c.num_kv_heads, 'kv_heads'), (c.head_dim, 'head_dim'))
    self.wq = _kernel(rngs, c, embed, heads, s_in)
    self.wk = _kernel(rngs, c, embed, kv_heads, s_in)
    self.wv = _kernel(rngs, c, embed, kv_heads, s_in)
    self.wo = _kernel(rngs, c, heads, embed, s_out)
    run = c.execution
    if c.qkv_bias:
      self.bq = _zeros(rngs, (c.num_heads, c.head_dim), ('heads', 'head_dim'), run.param_dtype)
      self.bk = _zeros(rngs, (c.num_kv_heads, c.head_dim), ('kv_heads', 'head_dim'),
                       run.param_dtype)
      self.bv = _zeros(rngs, (c.num_kv_heads, c.head_dim), ('kv_heads', 'head_dim'),
                       run.param_dtype)
    if c.qk_norm:
      self.q_norm = RMSNorm(c.head_dim, c.norm_eps, run.param_dtype, rngs=rngs, axis='head_dim',
                            invariant=run.batch_invariant)
      self.k_norm = RMSNorm(c.head_dim, c.norm_eps, run.param_dtype, rngs=rngs, axis='head_dim',
                            invariant=run.batch_invariant)
    self.config = c

  def __call__(self, x: Array, rope_cs: tuple[Array, Array], mask: Array,
               kv: tuple[tuple[Array, ...], tuple[Array, ...]] | None,
               starts: Array | None):
    """x: [B, T, E]; rope_cs: (cos, sin) tables; mask: bool [B, T, S]; kv: one layer's
    cache blocks (keys, values, and their scales in an int8 cache: layer ``i``'s ``[i]`` of
    ``KVCache.layers``) in the ``KVCache`` layouts, or None.

    The queries of a kv head's group are ``[B, kv_heads, groups * T, head_dim]``, so both
    attention matmuls contract the cache in its stored layout (no per-step transposes of
    the cache). Returns ``(out [B, T, E], the layer's new cache blocks or None)``.
    """
    c, run = self.config, self.config.execution
    dt = run.dtype
    q, k, v = (linear(x, getattr(self, w)[...].astype(dt), c, low_rank(self, w, dt))
               .reshape(x.shape[:-1] + (-1, c.head_dim)) for w in ('wq', 'wk', 'wv'))
    if c.qkv_bias:
      q = q + self.bq[...].astype(dt)
      k = k + self.bk[...].astype(dt)
      v = v + self.bv[...].astype(dt)
    if c.qk_norm:
      q = self.q_norm(q)
      k = self.k_norm(k)
    q = constrain(q, ('batch', 'length', 'heads', 'head_dim'))
    q = apply_rope(q, *rope_cs)
    k = apply_rope(k, *rope_cs)
    # The compiled kernel takes decode steps of two or more rows (one row keeps the
    # dynamic-update-slice path of ``layer_update``, which XLA handles best).
    # It reads float blocks only: an int8 cache (four tuples) attends with XLA.
    kernel = (run.decode_attention == 'cpu_kernel' and kv is not None and len(kv) == 2
              and x.shape[1] == 1 and x.shape[0] > 1)
    if kv is None:  # keys as [B, kv, T, d]; batch-invariant attention takes them as cached
      ks = (to_block(k, KEY_BLOCK_AXES if run.batch_invariant else VALUE_BLOCK_AXES),)
      vs = (to_block(v, VALUE_BLOCK_AXES),)
      write = lambda out: None
    else:
      ks, vs, write = layer_update(kv, k, v, starts, mask.shape[-1], whole_buffer=kernel)
    batch, length = q.shape[:2]
    groups = c.num_heads // c.num_kv_heads
    q = q.reshape(batch, length, c.num_kv_heads, groups, c.head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(batch, c.num_kv_heads, groups * length, c.head_dim)
    query_mask = jnp.broadcast_to(mask[:, None, None], (batch, 1, groups) + mask.shape[1:])
    query_mask = query_mask.reshape(batch, 1, groups * length, mask.shape[-1])
    wo = self.wo[...].astype(dt)
    if run.batch_invariant:
      out = invariant_attention(q, ks, vs, query_mask).astype(dt)
    elif kernel:  # positions <= the row's own (the mask's), within the blocks read
      out = cpu_attention.decode_attention(q, ks, vs, jnp.minimum(starts + 1, mask.shape[-1]))
    else:
      out = xla_attention(q, ks, vs, query_mask, dt, keys_transposed=kv is not None)
    new_kv = write(out)
    out = out.reshape(batch, c.num_kv_heads, groups, length, c.head_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, length, c.num_heads * c.head_dim)
    return (constrain(linear(out, wo, c, low_rank(self, 'wo', dt)), ('batch', 'length', 'embed')),
            new_kv)


class MLP(nnx.Module):
  """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    c = config
    embed, mlp = ((c.embed_dim, 'embed'),), ((c.mlp_dim, 'mlp'),)
    self.w_gate = _kernel(rngs, c, embed, mlp, c.embed_dim ** -0.5)
    self.w_up = _kernel(rngs, c, embed, mlp, c.embed_dim ** -0.5)
    self.w_down = _kernel(rngs, c, mlp, embed, c.mlp_dim ** -0.5)
    self.config = c

  def __call__(self, x: Array) -> Array:
    c = self.config
    dt = c.execution.dtype
    gate = jax.nn.silu(linear(x, self.w_gate[...].astype(dt), c, low_rank(self, 'w_gate', dt)))
    hidden = constrain(gate * linear(x, self.w_up[...].astype(dt), c, low_rank(self, 'w_up', dt)),
                       ('batch', 'length', 'mlp'))
    return constrain(linear(hidden, self.w_down[...].astype(dt), c,
                            low_rank(self, 'w_down', dt)), ('batch', 'length', 'embed'))


class MoE(nnx.Module):
  """Sparse mixture of SwiGLU experts with a top-k softmax router (dropless;
  ``rlax_llm.models.moe``).

  Params: ``router [embed, experts]`` (in ``Execution.weight_layout`` order), and
  ``experts_gate``/``experts_up [experts, embed, moe_mlp]``, ``experts_down [experts,
  moe_mlp, embed]`` (logical axes ``expert``, ``embed``, ``mlp``; inputs first whatever the
  weight layout); in the engine's int8 copy each expert weight a ``quant.Int8Weight``
  (``quant.quantize_experts``), which ``moe.run_experts`` computes with.
  """

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    c = config
    dt = c.execution.param_dtype
    e, d, f = c.num_experts, c.embed_dim, c.moe_mlp_dim
    self.router = _kernel(rngs, c, ((d, 'embed'),), ((e, moe.EXPERT_AXIS),), d ** -0.5)
    self.experts_gate = _param(rngs, (e, d, f), (moe.EXPERT_AXIS, 'embed', 'mlp'), dt, d ** -0.5)
    self.experts_up = _param(rngs, (e, d, f), (moe.EXPERT_AXIS, 'embed', 'mlp'), dt, d ** -0.5)
    self.experts_down = _param(rngs, (e, f, d), (moe.EXPERT_AXIS, 'mlp', 'embed'), dt, f ** -0.5)
    self.config = c

  def __call__(self, x: Array, routes: Array | None = None, weights: Array | None = None
               ) -> tuple[Array, Array, Array]:
    """x ``[batch, length, embed]`` -> ``(out [batch, length, embed] in Execution.dtype,
    moe.router_stats float32 [2, experts], the router's own top-k experts int32 [batch,
    length, k])``. ``routes`` (int ``[batch, length, k]``, ``moe.NO_ROUTE`` where none):
    replay these experts (``moe.replay``). ``weights`` (float ``[batch, length]``): the
    tokens' weights in the router statistics (a padding mask)."""
    c = self.config
    dt = c.execution.dtype
    chex.assert_rank(x, 3)
    flat = x.reshape(-1, x.shape[-1]).astype(dt)
    probs, gates, own = moe.route(linear(flat, self.router[...].astype(dt), c),
                                  c.num_experts_per_tok, c.norm_topk_prob)
    experts = own
    if routes is not None:
      gates, experts = moe.replay(probs, own, routes.reshape(own.shape), c.norm_topk_prob)
    kernels = [w[...].astype(dt) for w in (self.experts_gate, self.experts_up,
                                           self.experts_down)]
    run = c.execution  # a decode step (one token per row) may compute its own way
    impl = run.decode_moe_impl if run.decode_moe_impl and x.shape[1] == 1 else run.moe_impl
    out = moe.run_experts(impl, flat, experts, gates, *kernels).astype(dt)
    stats = moe.router_stats(probs, experts, None if weights is None else weights.reshape(-1))
    return (constrain(out.reshape(x.shape), ('batch', 'length', 'embed')), stats,
            own.reshape(x.shape[:2] + own.shape[-1:]))


class Block(nnx.Module):
  """Pre-norm transformer block: attention, then a SwiGLU ``mlp`` (of width ``mlp_dim``) or,
  with ``moe`` (a mixture of experts' MoE layer, ``Architecture.is_moe_layer``), a ``moe``
  (``MoE``)."""

  def __init__(self, config: DecoderConfig, *, moe: bool, rngs: nnx.Rngs):
    run = config.execution
    norm = lambda: RMSNorm(config.embed_dim, config.norm_eps, run.param_dtype, rngs=rngs,
                           invariant=run.batch_invariant)
    self.attn_norm = norm()
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = norm()
    if moe:
      self.moe = MoE(config, rngs=rngs)
    else:
      self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, rope_cs, mask, kv, starts, routes=None, weights=None):
    """``(x, the layer's new cache blocks or None, the MoE's ``(router_stats float32
    [2, experts], own top-k experts int32 [B, T, k])`` or None in a dense block)``;
    ``routes`` and ``weights`` go to the ``MoE``."""
    h, new_kv = self.attn(self.attn_norm(x), rope_cs, mask, kv, starts)
    x = x + h
    if hasattr(self, 'moe'):
      h, stats, own = self.moe(self.mlp_norm(x), routes, weights)
      return x + h, new_kv, (stats, own)
    return x + self.mlp(self.mlp_norm(x)), new_kv, None


def stack_layers(build, num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
  """``num_layers`` modules ``build(rngs)`` as one module whose every variable has a leading
  layer axis: layer ``i``'s values are ``[i]`` of each. ``LAYERS_AXIS`` is prefixed to every
  variable's logical axes.

  The layers are drawn one after another from ``rngs``, as a Python list of them would be,
  then stacked: one seed gives the weights an unrolled stack of the same layers gets (the
  runs, tests and figures of a seed keep their starting points)."""
  layers = [build(rngs) for _ in range(num_layers)]
  graphdef, _ = nnx.split(layers[0])
  states = [nnx.state(layer) for layer in layers]
  stacked = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
  for _, variable in nnx.iter_graph(stacked):
    if isinstance(variable, nnx.Variable):
      axes = variable.get_metadata().get('logical_axes')
      if axes is not None:
        variable.set_metadata('logical_axes', (LAYERS_AXIS,) + tuple(axes))
  return stacked


_REMAT_POLICY = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.checkpoint_dots,
}


def run_layers(blocks: Block | nnx.List, x: Array, rope_cs: tuple[Array, Array], mask: Array,
               kv: LayerBlocks | tuple[LayerBlocks, ...] | None, starts: Array | None,
               remat: str, routes: Array | None = None, weights: Array | None = None,
               record: bool = False, first: int = 0
               ) -> tuple[Array, LayerBlocks | tuple[LayerBlocks, ...] | None, Array | None,
                          Array | None]:
  """``x`` ``[B, T, E]`` through ``blocks`` in order (``Execution.layer_loop``): one run of
  the decoder's layers (``Architecture.layer_runs``) or, unrolled, all of them.

  Stacked ``blocks`` (``stack_layers``, ``'scan'``: the layers ``first ..`` of one kind):
  one ``jax.lax.scan`` over their layer axis, so one layer is compiled whatever the depth;
  ``kv``, the cache blocks of all the decoder's layers (``KVCache.layers``: tuples of
  ``[num_layers, ...]`` blocks), is carried through the scan and updated in place, the
  run's layer ``i`` reading and writing its own ``[first + i]``. A list of blocks
  (``'unrolled'``, every layer, ``first`` 0): a Python loop, layer ``i`` reading its own
  weight buffers and ``kv[i]`` (its own blocks). None without a cache.

  ``remat`` (``Execution.remat``, ``'none'``, ``'full'`` or ``'dots'``): each layer is a
  ``jax.checkpoint`` that keeps only what the policy saves for the backward pass, which
  recomputes the rest layer by layer (in a scan the backward scan runs after the forward
  one, so XLA cannot merge the two; the unrolled loop is the engine's, which has no backward
  pass).

  A mixture of experts: ``routes`` (int ``[B, T, moe_layers, k]``, one per MoE layer among
  ``blocks``, ``moe.NO_ROUTE`` where none) are replayed layer by layer (``moe.replay``);
  ``weights`` (float ``[B, T]``) weigh the tokens in the router statistics; ``record``
  returns each MoE layer's own top-k experts. Returns ``(x, the new cache blocks, in
  ``kv``'s layout, or None, the MoE layers' ``moe.router_stats`` summed over the layers
  (float32 ``[2, experts]``) or None when all are dense, the router's own experts int32
  ``[B, T, moe_layers, k]`` with ``record`` (None when all are dense), else None)``.
  """
  def layer(graphdef):  # (its state, x, its cache blocks, its routes) -> (x, kv, moe out)
    def call(state, x, kv, layer_routes):
      return nnx.merge(graphdef, state)(x, rope_cs, mask, kv, starts, layer_routes, weights)
    if remat == 'none':
      return call
    return jax.checkpoint(call, policy=_REMAT_POLICY[remat], prevent_cse=False)

  add = lambda total, stats: None if stats is None else (
      stats if total is None else total + stats)
  if isinstance(blocks, nnx.List):
    new, total, chosen = [], None, []
    for block in blocks:
      graphdef, state = nnx.split(block)
      replay = None if routes is None or not hasattr(block, 'moe') else routes[:, :, len(chosen)]
      x, layer_kv, out = layer(graphdef)(state, x, None if kv is None else kv[len(new)],
                                         replay)
      new.append(layer_kv)
      if out is not None:
        total = add(total, out[0])
        chosen.append(out[1])
    own = jnp.stack(chosen, axis=2) if record and chosen else None
    return x, None if kv is None else tuple(new), total, own
  graphdef, state = nnx.split(blocks)
  step = layer(graphdef)
  num_layers = jax.tree.leaves(state)[0].shape[0]
  experts = getattr(blocks, 'moe', None)
  total = None if experts is None else jnp.zeros((2, experts.config.num_experts), jnp.float32)

  def body(carry, xs):
    x, cache, total = carry
    state, i, layer_routes = xs  # i: the layer's index in the whole stack (the cache's)
    at = lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False)
    x, new, out = step(state, x, None if cache is None else jax.tree.map(at, cache),
                       layer_routes)
    if cache is not None:
      cache = jax.tree.map(lambda b, n: jax.lax.dynamic_update_index_in_dim(b, n, i, 0),
                           cache, new)
    own = out[1] if record and out is not None else None
    return (x, cache, add(total, None if out is None else out[0])), own

  layer_routes = None if routes is None else jnp.moveaxis(routes, 2, 0)
  (x, kv, total), own = jax.lax.scan(body, (x, kv, total),
                                     (state, jnp.arange(first, first + num_layers), layer_routes))
  return x, kv, total, None if own is None else jnp.moveaxis(own, 0, 2)


def head_is_vocab_major(config: DecoderConfig, rows: int) -> bool:
  """Whether ``head_logits`` of ``rows`` hidden states computes ``[V, rows]`` and returns
  its transpose (``flipped_product``): a ``[V, E]`` head (tied, or ``'out_in'``) of 2 to
  ``FLIPPED_MAX_ROWS`` rows on XLA:CPU, without batch-invariant numerics, in float32 (a
  ``narrow_dtype`` head is ``accumulated_product``'s). The sampler's ``argmax(vocab_major=...)``
  reads such logits in place."""
  run = config.execution
  vocab_first = config.tie_embeddings or run.weight_layout == 'out_in'
  return (vocab_first and not run.batch_invariant and not narrow_dtype(run.dtype)
          and rows > 1 and flips(rows))


def head_logits(x: Array, weight: Array, config: DecoderConfig) -> Array:
  """float32 logits of hidden states ``x`` ``[..., E]``: ``x @ weight`` (``weight`` is the
  lm head, ``[E, V]``) or ``x @ weight.T`` (``weight`` is the ``[V, E]`` embedding, with
  ``config.tie_embeddings``, or the lm head in the ``'out_in'`` layout); in
  ``Execution.dtype``, batch-invariant (``invariant_matmul``) with
  ``Execution.batch_invariant``. On XLA:CPU a ``[V, E]`` head of 2 to ``FLIPPED_MAX_ROWS``
  rows (a decode step's) runs as ``flipped_product``. In bfloat16 (float16) the products
  are ``accumulated_product``'s, the logits its float32 sums (not rounded to bfloat16).
  Otherwise the product runs on ``x`` flattened to 2-D rows, as ``linear``'s."""
  run = config.execution
  vocab_first = config.tie_embeddings or run.weight_layout == 'out_in'
  weight = weight.astype(run.dtype)
  rows = math.prod(x.shape[:-1])
  # The products on 2-D rows, as ``linear``'s: with [B, T] kept, XLA:CPU fed the head's
  # weight gradient a transposed copy of the whole logits' gradient (benchmarks/LAB_NOTES.md).
  flat = x.reshape(rows, x.shape[-1])
  unflat = lambda y: y.reshape(*x.shape[:-1], -1)
  if run.batch_invariant:
    logits = invariant_matmul(x, weight, 'ce,ve->cv' if vocab_first else 'ce,ev->cv',
                              run.invariant_rows)
  elif narrow(x, weight):
    logits = unflat(accumulated_product(flat, weight, vocab_first, jnp.float32))
  elif head_is_vocab_major(config, rows):
    logits = flipped_product(x, weight)
  else:
    logits = unflat(flat @ (weight.T if vocab_first else weight))
  return logits.astype(jnp.float32)


class Decoder(nnx.Module):
  """Decoder-only language model.

  ``model(tokens)`` -> logits ``float32 [batch, length, vocab]`` (causal, positions 0..T-1).
  ``model(tokens, cache=cache, num_valid=n)`` -> ``(logits, new_cache)`` (the cache contract
  is ``kv_cache``'s).
  """

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    # std 1/sqrt(embed): with tied embeddings the initial logits then have unit scale.
    run = c.execution
    self.embed = _param(rngs, (c.vocab_size, c.embed_dim), ('vocab', 'embed'), run.param_dtype,
                        c.embed_dim ** -0.5)
    # 'scan': each run of layers of one kind (``Architecture.layer_runs``: all the layers of
    # a homogeneous stack, as ``blocks``) with its params stacked on a leading layer axis,
    # run by one scan; 'unrolled': ``blocks``, a list of every layer's block
    # (``run_layers``). One seed draws the same weights (layer by layer, in order).
    if run.layer_loop == 'scan':
      for layers in c.layer_runs():
        setattr(self, layers.name, stack_layers(
            lambda r, moe=layers.moe: Block(c, moe=moe, rngs=r), layers.count, rngs))
    else:
      self.blocks = nnx.List([Block(c, moe=c.is_moe_layer(i), rngs=rngs)
                              for i in range(c.num_layers)])
    self.final_norm = RMSNorm(c.embed_dim, c.norm_eps, run.param_dtype, rngs=rngs,
                              invariant=run.batch_invariant)
    if not c.tie_embeddings:
      self.lm_head = _kernel(rngs, c, ((c.embed_dim, 'embed'),), ((c.vocab_size, 'vocab'),),
                             c.embed_dim ** -0.5)

  def _run_layers(self, x, rope_cs, mask, kv, starts, routes, weights, record):
    """``run_layers`` over every layer: the ``'unrolled'`` list at once, or each run's
    stack in turn (``Architecture.layer_runs``), the cache carried from run to run, each
    MoE run replaying its own slice of ``routes``; the router statistics summed and the
    recorded experts joined over the runs."""
    c = self.config
    if isinstance(self.blocks, nnx.List):
      return run_layers(self.blocks, x, rope_cs, mask, kv, starts, c.execution.remat, routes,
                        weights, record)
    total, chosen = None, []
    for layers in c.layer_runs():
      replay = None if routes is None or not layers.moe else (
          routes[:, :, layers.first_moe:layers.first_moe + layers.count])
      x, kv, stats, own = run_layers(getattr(self, layers.name), x, rope_cs, mask, kv, starts,
                                     c.execution.remat, replay, weights, record, layers.first)
      if stats is not None:
        total = stats if total is None else total + stats
      if own is not None:
        chosen.append(own)
    return x, kv, total, jnp.concatenate(chosen, axis=2) if chosen else None

  def head(self, x: Array) -> Array:
    """float32 logits ``[..., V]`` of final-normed hidden states ``x`` ``[..., E]``, by the
    tied embedding or the lm head (``head_logits``)."""
    weight = self.embed[...] if self.config.tie_embeddings else self.lm_head[...]
    return head_logits(x, weight, self.config)

  def __call__(self, tokens: Array, *, cache: KVCache | None = None,
               num_valid: Array | None = None, attend: int | None = None,
               features: bool = False, aux_loss: bool = False, routes: Array | None = None,
               return_routes: bool = False, token_mask: Array | None = None):
    """``attend`` (static, with a cache): attention reads only the first ``attend`` cache
    positions; every row's ``lengths + T`` must be ``<= attend``. Decoding passes the
    smallest bucket that holds its longest row, so short sequences do not pay for the whole
    cache. ``features``: return the final-normed hidden states ``[B, T, E]`` instead of
    logits (``head`` turns them into logits, in chunks if wanted); with a cache, as
    ``(hidden, new_cache)``. ``aux_loss`` (a mixture of experts, without a cache): return
    ``(out, loss)``, ``loss`` the router's load-balancing loss over all layers and tokens
    (``moe.load_balancing_loss``, float32 scalar, not yet scaled by
    ``router_aux_loss_coef``), over the tokens where ``token_mask`` (float ``[B, T]``, e.g.
    the non-padding positions) is nonzero, or all.

    Rollout routing replay (a mixture of experts): ``routes`` (int ``[B, T, moe_layers,
    k]``, ``moe_layers = Architecture.num_moe_layers``: the MoE layers only, in order;
    ``moe.NO_ROUTE`` where none was recorded) routes each token by the recorded experts
    (``moe.replay``); ``return_routes`` appends the experts the router itself chose at each
    token (``[B, T, moe_layers, k]`` in ``moe.route_dtype``) to what is returned: ``(out,
    routes)``, ``(out, loss, routes)`` or ``(out, new_cache, routes)``."""
    c = self.config
    chex.assert_rank(tokens, 2)
    batch, length = tokens.shape
    x = constrain(jnp.take(self.embed[...], tokens, axis=0).astype(c.execution.dtype),
                  ('batch', 'length', 'embed'))
    if cache is None:
      positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
      mask = jnp.broadcast_to(causal, (batch, length, length))
      starts = None
    else:
      starts = cache.lengths
      positions = starts[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
      attend = cache.max_len if attend is None else attend
      if cache.num_blocks > 1:  # attention reads whole blocks
        attend = min(-(-attend // cache.block_length) * cache.block_length, cache.max_len)
      key_pos = jnp.arange(attend, dtype=jnp.int32)
      mask = key_pos[None, None, :] <= positions[:, :, None]
    rope_cs = rope_tables(positions, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                          rope_table_length(c))
    used = None if cache is None else cache.used_blocks(mask.shape[-1])
    if aux_loss and (cache is not None or not c.is_moe):
      raise ValueError(f'Decoder(aux_loss=True) returns the router\'s load-balancing loss of a '
                       f'mixture of experts without a cache, but num_experts={c.num_experts} '
                       f'and cache={"given" if cache is not None else None}; pass '
                       'aux_loss=False.')
    if (routes is not None or return_routes) and not c.is_moe:
      raise ValueError('Decoder(routes=..., return_routes=True) replays or records the '
                       f'experts of a mixture of experts, but num_experts={c.num_experts}; '
                       'route replay needs a MoE model.')
    if routes is not None:
      chex.assert_shape(routes, (batch, length, c.num_moe_layers, c.num_experts_per_tok))
    x, new_kv, stats, own = self._run_layers(x, rope_cs, mask,
                                             None if cache is None else cache.layers(used),
                                             starts, routes, token_mask, return_routes)
    x = self.final_norm(x)
    out = x if features else constrain(self.head(x), ('batch', 'length', 'vocab'))
    recorded = (own.astype(moe.route_dtype(c.num_experts)),) if return_routes else ()
    if cache is None:
      loss = (moe.load_balancing_loss(stats, c.num_experts_per_tok),) if aux_loss else ()
      result = (out, *loss, *recorded)
      return result if len(result) > 1 else out
    if num_valid is None:
      num_valid = jnp.full((batch,), length, jnp.int32)
    new_cache = cache.with_layers(new_kv, used, cache.lengths + num_valid.astype(jnp.int32))
    return (out, new_cache, *recorded)
