"""A Llama-style decoder-only transformer in Flax NNX, with a fixed-size KV cache.

One readable file (after nanoGPT): RMSNorm, rotary position embeddings (RoPE, the
"rotate half" layout used by Hugging Face Llama), grouped-query attention (GQA) and a
SwiGLU MLP. Every parameter carries its logical axis names in the ``logical_axes``
metadata (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``);
``rlax_llm.sharding`` maps them to mesh axes.

References:
  Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", arXiv 2302.13971.
  Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv 2104.09864.
  Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models", arXiv 2305.13245.
  Shazeer, "GLU Variants Improve Transformer", arXiv 2002.05202.
  Meta, "The Llama 3 Herd of Models", arXiv 2407.21783 (RoPE frequency scaling).
  Qwen Team, "Qwen2.5 Technical Report", arXiv 2412.15115; "Qwen3 Technical Report",
  arXiv 2505.09388.

KV cache contract (``KVCache``): ``k[i]`` and ``v[i]`` for layer ``i`` are tuples of
*blocks*; block ``j`` holds positions ``j * block_length .. (j + 1) * block_length - 1``,
values as ``[batch, kv_heads, block_length, head_dim]`` and keys transposed,
``[batch, kv_heads, head_dim, block_length]``: the layouts in which both attention matmuls
of a decode step read the cache as their plain (untransposed) right-hand operand (with keys
stored like values, XLA:CPU's score matmul ran at less than half the speed of the value
matmul over the same bytes). ``max_len`` is ``num_blocks * block_length``. One block (the
default) is the plain contiguous cache. Several blocks let a decode step that attends to the
first ``attend`` positions read whole blocks (separate buffers) instead of slicing a prefix
out of one buffer, which XLA materialises as a copy of that prefix in every layer and step.
With ``batch_invariant`` blocks must be a multiple of ``INVARIANT_KEYS`` positions.
``lengths`` is ``int32 [batch]``, the number of valid positions of each slot. A call with
``cache`` writes the ``T`` new keys/values of row ``b`` at positions
``lengths[b] .. lengths[b] + T - 1`` and advances ``lengths[b]`` by ``num_valid[b]``
(default ``T``). Query ``t`` of row ``b`` sits at position
``lengths[b] + t`` and attends to every cached position ``<=`` its own. Rows may be
right-padded: positions past ``num_valid`` hold junk that later writes overwrite before any
query can see it.

Batch-invariant numerics (``DecoderConfig.batch_invariant``): XLA:CPU picks a float32
matmul's kernel from its shapes and fuses reductions, products and transcendentals
differently in different programs, so one row's result depends on how many rows come with
it. The same token scored by the trainer (a ``[B, T]`` forward) and by a decode step (one
query per slot over a KV cache) then differs by rounding, which 30 layers grow to ~5e-5 in
a log-prob. With ``batch_invariant`` every such computation runs in a form whose rounding
cannot depend on the batch: weight matmuls in chunks of exactly ``INVARIANT_ROWS`` rows (the
rest in one product of at least two), or of at least ``INVARIANT_MIN_ROWS``
(``DecoderConfig.invariant_rows``, ``invariant_matmul``);
attention over pieces of ``INVARIANT_KEYS`` key positions, the
value products summed in position order, the scale applied to the queries
(``_invariant_attention``); sums and maxima as fixed trees of elementwise ops
(``invariant_sum``, ``invariant_max``; RMSNorm and the log-softmax use them too); RoPE's
cos/sin looked up in a host-computed table. A row's logits are then bitwise the same
whatever shares its batch, its padding or the cache layout, so sampler and trainer
log-probs agree exactly (He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines Lab 2025, argue the same for GPU kernels). Verified on XLA:CPU by
``tests/models/test_batch_invariant.py``; the cost is in benchmarks/RESULTS.md. It holds on
data-parallel meshes; FSDP and tensor parallelism split contractions across devices (the
config refuses them with it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_llm.models import cpu_attention
from rlax_llm.sharding import constrain

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.x RoPE frequency scaling (Hugging Face ``rope_type='llama3'``)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


REMAT_POLICIES = ('none', 'full', 'dots')
FAMILIES = ('llama', 'qwen2', 'qwen3')
# DecoderConfig.invariant_rows (see invariant_matmul).
INVARIANT_ROWS_MODES = ('chunks', 'floor')
# DecoderConfig.weight_layout (see linear).
WEIGHT_LAYOUTS = ('in_out', 'out_in')
# DecoderConfig.decode_attention (see Attention).
DECODE_ATTENTIONS = ('xla', 'cpu_kernel')


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Architecture of a decoder. Sizes are per model, not per device."""

  vocab_size: int
  num_layers: int = 2
  embed_dim: int = 64
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 256
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = False  # Qwen2 / Qwen2.5
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys, before RoPE
  max_seq_len: int = 64
  family: str = 'llama'  # the Hugging Face architecture it exports to
  remat: str = 'none'
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32  # compute dtype
  batch_invariant: bool = False  # see the module docstring
  # How batch-invariant weight matmuls fix their kernel (INVARIANT_ROWS_MODES, module doc).
  invariant_rows: str = 'chunks'
  # How weight matrices store their sides (WEIGHT_LAYOUTS, ``linear``): 'in_out' (inputs
  # first, ``x @ w``) everywhere params are trained, saved or loaded; an inference engine on
  # XLA:CPU converts its copy to 'out_in' (``rlax_llm.models.model.with_weight_layout``).
  weight_layout: str = 'in_out'
  # How a decode step (one new token per row, two or more rows, with a cache) attends
  # (DECODE_ATTENTIONS): 'xla' (jnp products), or 'cpu_kernel' (``cpu_attention``, XLA:CPU
  # only, float32, one device; the inference engine picks it where it applies). The
  # trainer, the prefill and one-row steps always use 'xla'.
  decode_attention: str = 'xla'

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'DecoderConfig.family={self.family!r}; choose one of {FAMILIES}.')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'DecoderConfig.remat={self.remat!r}; choose one of {REMAT_POLICIES}.')
    if self.invariant_rows not in INVARIANT_ROWS_MODES:
      raise ValueError(f'DecoderConfig.invariant_rows={self.invariant_rows!r}; choose one of '
                       f'{INVARIANT_ROWS_MODES}.')
    if self.weight_layout not in WEIGHT_LAYOUTS:
      raise ValueError(f'DecoderConfig.weight_layout={self.weight_layout!r}; choose one of '
                       f'{WEIGHT_LAYOUTS}.')
    if self.decode_attention not in DECODE_ATTENTIONS:
      raise ValueError(f'DecoderConfig.decode_attention={self.decode_attention!r}; choose one '
                       f'of {DECODE_ATTENTIONS}.')
    if self.batch_invariant and self.decode_attention != 'xla':
      raise ValueError('batch_invariant decoding needs decode_attention=\'xla\' (its '
                       f'attention is fixed piece by piece), got {self.decode_attention!r}.')
    for name in ('vocab_size', 'num_layers', 'embed_dim', 'num_heads', 'num_kv_heads',
                 'head_dim', 'mlp_dim', 'max_seq_len'):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f'DecoderConfig.{name} must be a positive int, got {value!r}.')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads ({self.num_heads}) must be a multiple of num_kv_heads '
          f'({self.num_kv_heads}) for grouped-query attention.')
    if self.head_dim % 2:
      raise ValueError(f'head_dim must be even for RoPE, got {self.head_dim}.')


# The logical axes of the cache blocks, values ``[B, kv, S, d]`` and keys transposed
# ``[B, kv, d, S]`` (see the module docstring), and their position axes.
VALUE_BLOCK_AXES = ('batch', 'kv_heads', 'length', 'head_dim')
VALUE_POSITION_AXIS = VALUE_BLOCK_AXES.index('length')
KEY_BLOCK_AXES = ('batch', 'kv_heads', 'head_dim', 'length')
KEY_POSITION_AXIS = KEY_BLOCK_AXES.index('length')
# The axes of the keys and values the attention projections produce, ``[B, T, kv, d]``.
_PROJECTED_AXES = ('batch', 'length', 'kv_heads', 'head_dim')

# Batch-invariant numerics: the rows of each weight matmul chunk, and the key positions of
# each attention piece (cache blocks must be a multiple of it).
INVARIANT_ROWS = 32
INVARIANT_KEYS = 64
# invariant_rows='floor': at least this many rows per weight matmul.
INVARIANT_MIN_ROWS = 64
# invariant_rows='chunks': a product of at most INVARIANT_ROWS rows has at least this many
# (one row takes a matrix-vector path that rounds differently from the small-row kernel).
INVARIANT_MIN_CHUNK_ROWS = 2
# Up to this many rows, a weight stored [N, K] multiplies on XLA:CPU as ``w @ x.T``
# (``flipped_product``).
FLIPPED_MAX_ROWS = 64
# RoPE cos/sin come from a host table of every position (``rope_tables(max_len=...)``) when
# it has at most this many entries (max_seq_len * head_dim / 2; 8 MiB of float32 each, about
# 0.5 s more compile per program at this size); larger ones are evaluated in the program.
ROPE_TABLE_MAX_ENTRIES = 2 ** 21


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def invariant_matmul(x: Array, w: Array, spec: str = 'ck,kn->cn',
                     rows: str = 'chunks') -> Array:
  """``x [..., K]`` times the 2-D weight ``w`` (``spec`` contracts a chunk ``c`` of rows
  with it, e.g. ``'ck,nk->cn'`` for a ``[N, K]`` weight) -> ``[..., N]``, each row's result
  independent of the other rows.

  XLA:CPU picks a matmul's kernel from its row count: one for up to 32 rows, another for
  more (from 33 to 51 rows on, depending on the weight's shape), and the two round a row
  differently; each rounds a row the same for any row count in its range, wherever the row
  sits (measured). ``rows`` (``DecoderConfig.invariant_rows``) keeps every row in one range:

  * ``'chunks'``: the rows are multiplied ``INVARIANT_ROWS`` (32) at a time (``lax.map``),
    all with the small-row kernel; the rows past the last whole chunk (all of them, up to
    32: a decode step of up to 32 slots) are one product of their own count, zero-padded
    only to ``INVARIANT_MIN_CHUNK_ROWS`` (2). The small-row kernel rounds a row the same for
    any count from 2 to 32, and a single row takes a matrix-vector path that does not.
  * ``'floor'``: the rows are zero-padded to at least ``INVARIANT_MIN_ROWS`` (64) and
    multiplied at once, with the large-row kernel: no loop, so the prefill and the trainer
    run at the default numerics' speed, and so do decode steps of 64 slots or more; a decode
    step with fewer slots pays for 64 rows. Each device must see at least 64 rows, so a
    data-parallel mesh would need that many per device (``config.py`` refuses the pair).

  ``w``, and a product outside the loop, pass an optimization barrier: without it XLA folded
  the tied head's transpose into the matmul in some programs and not in others, and the two
  kernels round differently.

  Only the values need the fixed rounding (they are the log-probs sampler and trainer
  compare); the gradient is the plain matmul's (``_plain_matmul_bwd``), whole-batch GEMMs
  instead of a loop of 32-row products and rank-32 weight updates.
  """
  lead = x.shape[:-1]
  flat = x.reshape(-1, x.shape[-1])
  count = flat.shape[0]
  w = jax.lax.optimization_barrier(w)

  def product(rows_in: Array, least: int) -> Array:  # one product of >= least rows
    padded = jnp.pad(rows_in, ((0, max(least - rows_in.shape[0], 0)), (0, 0)))
    return jnp.einsum(spec, jax.lax.optimization_barrier(padded), w)[:rows_in.shape[0]]

  if rows == 'floor':
    out = product(flat, INVARIANT_MIN_ROWS)
  else:
    whole = count // INVARIANT_ROWS * INVARIANT_ROWS
    parts = []
    if whole > INVARIANT_ROWS:  # the whole chunks, in a loop
      chunks = flat[:whole].reshape(-1, INVARIANT_ROWS, flat.shape[-1])
      out = jax.lax.map(lambda chunk: jnp.einsum(spec, chunk, w), chunks)
      parts.append(out.reshape(whole, -1))
    elif whole:  # one chunk: the same product without the loop around it
      parts.append(product(flat[:whole], INVARIANT_ROWS))
    if count > whole:  # the rest: one product of its own row count (at least 2)
      parts.append(product(flat[whole:], INVARIANT_MIN_CHUNK_ROWS))
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return out.reshape(lead + out.shape[-1:])


def _plain_matmul(spec: str, x: Array, w: Array) -> Array:
  """``invariant_matmul``'s product in XLA's own way (any kernel, no chunks)."""
  return jnp.einsum(spec, x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (-1,))


def _invariant_matmul_fwd(x, w, spec, rows):
  return invariant_matmul(x, w, spec, rows), (x, w)


def _plain_matmul_bwd(spec, rows, residuals, g):
  del rows
  x, w = residuals
  return jax.vjp(functools.partial(_plain_matmul, spec), x, w)[1](g)


invariant_matmul.defvjp(_invariant_matmul_fwd, _plain_matmul_bwd)


def _halving(x: Array, op, fill) -> Array:
  """``op`` over the last axis (keeping it, length 1) by halving: the axis, padded with
  ``fill`` to a power of two, is combined with itself folded in half until one entry is
  left."""
  size = 1 << max(x.shape[-1] - 1, 0).bit_length()
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])], constant_values=fill)
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = op(x[..., :half], x[..., half:])
  return x


def invariant_sum(x: Array) -> Array:
  """``x.sum(-1, keepdims=True)`` as a fixed tree of elementwise adds (pairwise
  summation), which XLA does not reorder: a row's sum does not depend on the other rows or
  on the fusion around it, where a fused ``jnp.sum`` rounded differently for one row than
  for many."""
  return _halving(x, jnp.add, 0)


def invariant_max(x: Array) -> Array:
  """``x.max(-1, keepdims=True)`` as a tree of elementwise maxima. The max is exact either
  way; a reduction, though, lets XLA:CPU fuse the ``exp`` that follows it into a YNNPACK
  kernel in some programs and not in others, and the two evaluate ``exp`` differently."""
  return _halving(x, jnp.maximum, -jnp.inf)


def flipped_product(x: Array, w: Array) -> Array:
  """``x [..., K] @ w.T`` for a weight stored ``[N, K]``, computed as ``(w @ x.T).T``.

  On XLA:CPU, for up to ``FLIPPED_MAX_ROWS`` rows, ``[N, K] @ [K, rows]`` on a materialised
  transpose of ``x`` runs 1.2-2x faster than either ``x @ w.T`` or ``x @ [K, N]`` (the wide
  side of the product is then its rows, which the kernel splits over cores; measured in
  benchmarks/RESULTS.md). The barriers stop XLA from folding the transposes back into the
  dot, which picks the slower kernel again. Same products as ``x @ w.T``, its own rounding.
  """
  rows = math.prod(x.shape[:-1])
  flat = jax.lax.optimization_barrier(x.reshape(rows, x.shape[-1]).T)
  return jax.lax.optimization_barrier(w @ flat).T.reshape(x.shape[:-1] + (w.shape[0],))


def _flips(rows: int) -> bool:
  """Whether a product of ``rows`` rows with an ``[N, K]`` weight takes ``flipped_product``."""
  return rows <= FLIPPED_MAX_ROWS and jax.default_backend() == 'cpu'


def linear(x: Array, w: Array, config: DecoderConfig) -> Array:
  """``x [..., K]`` times a weight of ``K`` inputs -> ``[..., N]`` (its outputs flattened).

  ``w`` is stored in ``config.weight_layout`` order: ``[K..., N...]`` (``'in_out'``,
  ``x @ w``) or ``[N..., K...]`` (``'out_in'``: ``flipped_product`` for a decode step's few
  rows on XLA:CPU, else ``x @ w.T``); batch-invariant (``invariant_matmul``) with
  ``config.batch_invariant``.
  """
  k = x.shape[-1]
  out_in = config.weight_layout == 'out_in'
  w = w.reshape(-1, k) if out_in else w.reshape(k, -1)
  if config.batch_invariant:
    return invariant_matmul(x, w, 'ck,nk->cn' if out_in else 'ck,kn->cn',
                            config.invariant_rows)
  if not out_in:
    return x @ w
  if _flips(math.prod(x.shape[:-1])):
    return flipped_product(x, w)
  return jnp.einsum('...k,nk->...n', x, w)


def _pieces(blocks: tuple[Array, ...], axis: int) -> list[Array]:
  """The position axis ``axis`` of consecutive blocks cut into pieces of
  ``INVARIANT_KEYS`` positions, the last zero-padded."""
  pieces = []
  for block in blocks:
    pad = [(0, 0)] * block.ndim
    pad[axis] = (0, -block.shape[axis] % INVARIANT_KEYS)
    block = jnp.pad(block, pad)
    pieces += [jax.lax.slice_in_dim(block, i, i + INVARIANT_KEYS, axis=axis)
               for i in range(0, block.shape[axis], INVARIANT_KEYS)]
  return pieces


def _invariant_attention(q: Array, ks: tuple[Array, ...], vs: tuple[Array, ...],
                         query_mask: Array) -> Array:
  """Softmax attention whose result for a query does not depend on how many queries,
  cache slots or masked key positions come with it.

  Args:
    q: ``[B, kv, M, d]``; ks, vs: consecutive key and value blocks in the cache layouts,
      ``[B, kv, d, S]`` and ``[B, kv, S, d]``; query_mask: bool ``[B, 1, M, S]`` over the
      blocks' positions.
  Returns:
    ``[B, kv, M, d]`` float32.

  Measured on XLA:CPU: a score matmul rounds the same for any query count from 2 (one
  query is a matrix-vector product, another kernel: a lone query is padded to 2) and any
  key count that is a multiple of 64, ``INVARIANT_KEYS``; a value matmul's sum over
  positions is grouped by its key count. So keys and values go in pieces of
  ``INVARIANT_KEYS`` positions from position 0 (whole cache blocks in the engine, so nothing
  is copied out of the cache), and a query meets the same pieces whatever the total length:
  a piece past it is all masked and adds exact zeros. The scores of all pieces share one
  softmax, whose max and normaliser are ``invariant_max`` and ``invariant_sum`` (halving
  trees over the row padded to a power of two, so masked positions past the query add exact
  zeros wherever the row ends).
  """
  rows, dim = q.shape[2:]
  pad = max(2 - rows, 0)
  key_pieces, value_pieces = _pieces(ks, KEY_POSITION_AXIS), _pieces(vs, VALUE_POSITION_AXIS)
  width = len(key_pieces) * INVARIANT_KEYS
  # The scale goes on the queries: on the scores, XLA moved it into whichever matmul operand
  # was smaller, which differs between programs (it is exact only for powers of two).
  q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0))) * dim ** -0.5
  query_mask = jnp.pad(query_mask,
                       ((0, 0), (0, 0), (0, pad), (0, width - query_mask.shape[-1])))
  scores = [jnp.einsum('bkqd,bkds->bkqs', q, k) for k in key_pieces]
  scores = (scores[0] if len(scores) == 1 else jnp.concatenate(scores, -1)).astype(jnp.float32)
  scores = jnp.where(query_mask, scores, jnp.finfo(jnp.float32).min)
  weights = jnp.exp(scores - invariant_max(scores))
  out = 0.0
  for i, v in enumerate(value_pieces):
    weight = weights[..., i * INVARIANT_KEYS:(i + 1) * INVARIANT_KEYS].astype(v.dtype)
    if dim % 64:  # as [M, d], the product's rounding depended on M for these head dims
      # (measured: 24, 32, 48, 80, 96); as [d, M] behind a barrier (else XLA turns it back)
      # it does not, but runs about 4x slower.
      part = jnp.swapaxes(jax.lax.optimization_barrier(
          jnp.einsum('bksd,bkqs->bkdq', v, weight)), 2, 3)
    else:
      part = jnp.einsum('bkqs,bksd->bkqd', weight, v)
    out = out + part.astype(jnp.float32)
  total = invariant_sum(weights)
  return (out / total)[:, :, :rows]


def cache_block_shape(axes: tuple[str, ...], config: DecoderConfig, batch: int,
                      block_length: int) -> tuple[int, ...]:
  """The shape of a cache block with logical ``axes`` (``VALUE_BLOCK_AXES`` or
  ``KEY_BLOCK_AXES``) for ``batch`` slots of ``block_length`` positions."""
  sizes = {'batch': batch, 'kv_heads': config.num_kv_heads, 'head_dim': config.head_dim,
           'length': block_length}
  return tuple(sizes[axis] for axis in axes)


def _to_block(x: Array, axes: tuple[str, ...]) -> Array:
  """Projected keys or values ``[B, T, kv, d]`` laid out as a cache block with ``axes``."""
  return x.transpose(tuple(_PROJECTED_AXES.index(axis) for axis in axes))


@flax.struct.dataclass
class KVCache:
  """Fixed-size per-layer key/value cache in blocks (see the module docstring)."""

  k: tuple[tuple[Array, ...], ...]  # [layer][block]: [batch, kv_heads, head_dim, block_length]
  v: tuple[tuple[Array, ...], ...]  # [layer][block]: [batch, kv_heads, block_length, head_dim]
  lengths: Array  # int32 [batch]

  @classmethod
  def init(cls, config: DecoderConfig, batch: int, max_len: int | None = None,
           block_length: int | None = None) -> 'KVCache':
    """An empty cache of at least ``max_len`` positions (default ``config.max_seq_len``) in
    blocks of ``block_length`` (default: one block of ``max_len``)."""
    max_len = max_len or config.max_seq_len
    block = max_len if block_length is None else block_length
    if block < 1:
      raise ValueError(f'block_length must be >= 1, got {block_length}.')
    layer = lambda axes: tuple(jnp.zeros(cache_block_shape(axes, config, batch, block),
                                         config.dtype) for _ in range(-(-max_len // block)))
    return cls(k=tuple(layer(KEY_BLOCK_AXES) for _ in range(config.num_layers)),
               v=tuple(layer(VALUE_BLOCK_AXES) for _ in range(config.num_layers)),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def block_length(self) -> int:
    return self.v[0][0].shape[VALUE_POSITION_AXIS]

  @property
  def num_blocks(self) -> int:
    return len(self.k[0])

  @property
  def max_len(self) -> int:
    return self.num_blocks * self.block_length


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
  ``config.weight_layout`` order. Drawn in the ``in_out`` order either way: one seed gives
  the same weights in both layouts."""
  sizes, axes = zip(*(inputs + outputs))
  param = _param(rngs, sizes, axes, config.param_dtype, scale)
  if config.weight_layout == 'in_out':
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
  return config.max_seq_len if small or config.batch_invariant else None


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


def _write_positions(buffer: Array, update: Array, starts: Array, axis: int) -> Array:
  """Writes ``update[b]`` into ``buffer[b]`` (a one-block cache) at position ``starts[b]``
  along ``axis`` (2 for values ``[B, kv, S, d]``, ``KEY_POSITION_AXIS`` for keys);
  ``update`` is laid out like ``buffer`` with ``T`` positions."""
  def one(buf, upd, start):
    index = [jnp.zeros((), start.dtype)] * (buf.ndim)
    index[axis - 1] = start
    return jax.lax.dynamic_update_slice(buf, upd.astype(buf.dtype), index)
  return jax.vmap(one)(buffer, update, starts)


def _write_blocks(blocks: tuple[Array, ...], values: Array, starts: Array, axis: int
                  ) -> tuple[Array, ...]:
  """Writes ``values[b, t]`` ``[kv, d]`` at position ``starts[b] + t`` (along ``axis`` of
  each ``[B, ...]`` block, 2 for values, ``KEY_POSITION_AXIS`` for keys) of the leading
  cache blocks ``blocks``;
  positions past them are dropped."""
  batch, length = values.shape[:2]
  block = blocks[0].shape[axis]
  positions = starts[:, None] + jnp.arange(length, dtype=starts.dtype)  # [B, T]
  rows = jnp.arange(batch)[:, None]
  written = []
  for j, buf in enumerate(blocks):
    local = positions - j * block
    local = jnp.where((local >= 0) & (local < block), local, block)  # block: dropped
    # Advanced indices (rows, local) index [B, T] first, then the sliced (kv, d) dims.
    index = (rows, slice(None), local) if axis == 2 else (rows, slice(None), slice(None), local)
    written.append(buf.at[index].set(values.astype(buf.dtype), mode='drop'))
  return tuple(written)


def _write_after(out: Array, kv, used: int, k: Array, v: Array, starts: Array):
  """The layer's new cache blocks: ``k``, ``v`` ``[B, T, kv, d]`` written into the first
  ``used`` blocks of ``kv`` (keys, values) once attention's output ``out`` ``[B, ...]``
  exists.

  XLA:CPU updates a donated block in place only if the update depends by data on every
  other read of that block; otherwise it copies the block twice first. So the written values
  are ``k - 0 * |out[b, first]|``: bitwise ``k`` (``x - 0`` is ``x``, signed zeros included)
  while ``out`` is finite, and a non-finite ``out`` has already made its row's logits NaN.
  """
  zero = 0 * jnp.abs(out.reshape(out.shape[0], -1)[:, :1])  # [B, 1]: data, not a constant
  zero = zero.astype(k.dtype)[:, :, None, None]
  return (_write_blocks(kv[0][:used], k - zero, starts, KEY_POSITION_AXIS) + kv[0][used:],
          _write_blocks(kv[1][:used], v - zero, starts, VALUE_POSITION_AXIS) + kv[1][used:])


def _blocks_with(blocks: tuple[Array, ...], values: Array, starts: Array, axis: int
                 ) -> tuple[Array, ...]:
  """The blocks ``_write_blocks(blocks, values, starts, axis)`` returns, bitwise, as a select
  between the old blocks and ``values`` (gathered to their positions) that reads neither the
  written blocks nor anything that aliases them."""
  batch, length = values.shape[:2]
  block = blocks[0].shape[axis]
  axes = KEY_BLOCK_AXES if axis == KEY_POSITION_AXIS else VALUE_BLOCK_AXES
  new = _to_block(values, axes).astype(blocks[0].dtype)  # T positions along ``axis``
  along = lambda x: x.reshape((batch,) + tuple(-1 if a == axis else 1  # [B, S] -> ``axis``
                                               for a in range(1, len(axes))))
  out = []
  for j, buf in enumerate(blocks):
    local = j * block + jnp.arange(block, dtype=starts.dtype) - starts[:, None]  # [B, S]
    hit = along((local >= 0) & (local < length))
    source = new if length == 1 else jnp.take_along_axis(
        new, along(jnp.clip(local, 0, length - 1)), axis=axis)
    out.append(jnp.where(hit, source, buf))
  return tuple(out)


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
    if c.qkv_bias:
      self.bq = _zeros(rngs, (c.num_heads, c.head_dim), ('heads', 'head_dim'), c.param_dtype)
      self.bk = _zeros(rngs, (c.num_kv_heads, c.head_dim), ('kv_heads', 'head_dim'),
                       c.param_dtype)
      self.bv = _zeros(rngs, (c.num_kv_heads, c.head_dim), ('kv_heads', 'head_dim'),
                       c.param_dtype)
    if c.qk_norm:
      self.q_norm = RMSNorm(c.head_dim, c.norm_eps, c.param_dtype, rngs=rngs, axis='head_dim',
                            invariant=c.batch_invariant)
      self.k_norm = RMSNorm(c.head_dim, c.norm_eps, c.param_dtype, rngs=rngs, axis='head_dim',
                            invariant=c.batch_invariant)
    self.config = c

  def __call__(self, x: Array, rope_cs: tuple[Array, Array], mask: Array,
               kv: tuple[tuple[Array, ...], tuple[Array, ...]] | None,
               starts: Array | None):
    """x: [B, T, E]; rope_cs: (cos, sin) tables; mask: bool [B, T, S]; kv: one layer's
    cache blocks (keys, values) in the ``KVCache`` layouts, or None.

    The queries of a kv head's group are ``[B, kv_heads, groups * T, head_dim]``, so both
    attention matmuls contract the cache in its stored layout (no per-step transposes of
    the cache). Returns ``(out [B, T, E], the layer's new cache blocks or None)``.
    """
    c = self.config
    dt = c.dtype
    q, k, v = (linear(x, w[...].astype(dt), c).reshape(x.shape[:-1] + (-1, c.head_dim))
               for w in (self.wq, self.wk, self.wv))
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
    write = None  # with several cache blocks: the writes, given attention's output
    # The compiled kernel takes decode steps of two or more rows (one row keeps the
    # dynamic-update-slice path below, which XLA handles best).
    kernel = (c.decode_attention == 'cpu_kernel' and kv is not None and x.shape[1] == 1
              and x.shape[0] > 1)
    if kv is not None:  # keys in the cache layout, KEY_BLOCK_AXES
      attend = mask.shape[-1]
      key_axis = KEY_POSITION_AXIS
      if len(kv[0]) == 1:
        new_kv = ((_write_positions(kv[0][0], _to_block(k, KEY_BLOCK_AXES), starts,
                                    key_axis),),
                  (_write_positions(kv[1][0], _to_block(v, VALUE_BLOCK_AXES), starts,
                                    VALUE_POSITION_AXIS),))
        if kernel:  # reads each slot's positions itself: no slice (a copy) of the buffer
          ks, vs = new_kv
        else:
          ks = (jax.lax.slice_in_dim(new_kv[0][0], 0, attend, axis=key_axis),)
          vs = (new_kv[1][0][:, :, :attend],)
      else:  # whole blocks (the decoder rounds attend up to a multiple of the block); the
        # new positions lie below attend, so the blocks past it are neither read nor written
        used = attend // kv[1][0].shape[VALUE_POSITION_AXIS]
        if x.shape[0] == 1:
          # One row: XLA:CPU makes the write a dynamic-update-slice, duplicates it into
          # attention's fusion when attention reads the written block, and copies every
          # written block four times a step. So attention reads the blocks as written,
          # computed from the old blocks and the new values (``_blocks_with``), and the
          # writes follow it in place (``_write_after``). With more rows the write stays a
          # scatter that attention reads in place (no copies), and this path measured 2%
          # slower at 8 rows and no faster at 32 (benchmarks/RESULTS.md).
          ks = _blocks_with(kv[0][:used], k, starts, key_axis)
          vs = _blocks_with(kv[1][:used], v, starts, VALUE_POSITION_AXIS)
          write = lambda out: _write_after(out, kv, used, k, v, starts)
        else:
          ks = _write_blocks(kv[0][:used], k, starts, key_axis)
          vs = _write_blocks(kv[1][:used], v, starts, VALUE_POSITION_AXIS)
          new_kv = (ks + kv[0][used:], vs + kv[1][used:])
      score = 'bkqd,bkds->bkqs'
    else:  # keys as [B, kv, T, d]; batch-invariant attention takes them as cached
      new_kv = None
      ks = (_to_block(k, KEY_BLOCK_AXES if c.batch_invariant else VALUE_BLOCK_AXES),)
      vs = (_to_block(v, VALUE_BLOCK_AXES),)
      score = 'bkqd,bksd->bkqs'
    batch, length = q.shape[:2]
    groups = c.num_heads // c.num_kv_heads
    q = q.reshape(batch, length, c.num_kv_heads, groups, c.head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(batch, c.num_kv_heads, groups * length, c.head_dim)
    query_mask = jnp.broadcast_to(mask[:, None, None], (batch, 1, groups) + mask.shape[1:])
    query_mask = query_mask.reshape(batch, 1, groups * length, mask.shape[-1])
    wo = self.wo[...].astype(dt)
    if c.batch_invariant:
      if len(vs) > 1 and vs[0].shape[VALUE_POSITION_AXIS] % INVARIANT_KEYS:
        raise ValueError(f'batch_invariant attention needs cache blocks of a multiple of '
                         f'{INVARIANT_KEYS} positions, got {vs[0].shape[VALUE_POSITION_AXIS]}; '
                         'the engine keeps them so.')
      out = _invariant_attention(q, ks, vs, query_mask).astype(dt)
    elif kernel:  # positions <= the row's own (the mask's), within the blocks read
      out = cpu_attention.decode_attention(q, ks, vs, jnp.minimum(starts + 1, attend))
    else:
      scores = [jnp.einsum(score, q, kb) for kb in ks]
      scores = scores[0] if len(scores) == 1 else jnp.concatenate(scores, -1)
      scores = scores.astype(jnp.float32) * (c.head_dim ** -0.5)
      scores = jnp.where(query_mask, scores, jnp.finfo(jnp.float32).min)
      probs = jax.nn.softmax(scores, axis=-1).astype(dt)
      out, lo = None, 0  # [B, kv, groups * T, d], summed over the blocks in order
      for vb in vs:
        part = jnp.einsum('bkqs,bksd->bkqd', probs[..., lo:lo + vb.shape[2]], vb)
        out, lo = (part if out is None else out + part), lo + vb.shape[2]
    if write is not None:
      new_kv = write(out)
    out = out.reshape(batch, c.num_kv_heads, groups, length, c.head_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, length, c.num_heads * c.head_dim)
    return constrain(linear(out, wo, c), ('batch', 'length', 'embed')), new_kv


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
    dt = c.dtype
    gate = jax.nn.silu(linear(x, self.w_gate[...].astype(dt), c))
    hidden = constrain(gate * linear(x, self.w_up[...].astype(dt), c),
                       ('batch', 'length', 'mlp'))
    return constrain(linear(hidden, self.w_down[...].astype(dt), c),
                     ('batch', 'length', 'embed'))


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    norm = lambda: RMSNorm(config.embed_dim, config.norm_eps, config.param_dtype, rngs=rngs,
                           invariant=config.batch_invariant)
    self.attn_norm = norm()
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, rope_cs, mask, kv, starts):
    h, new_kv = self.attn(self.attn_norm(x), rope_cs, mask, kv, starts)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), new_kv


def _block_call(block, *args):
  return block(*args)


_REMAT_CALL = {
    'none': _block_call,
    'full': nnx.remat(_block_call, policy=jax.checkpoint_policies.nothing_saveable),
    'dots': nnx.remat(_block_call, policy=jax.checkpoint_policies.checkpoint_dots),
}


def head_is_vocab_major(config: DecoderConfig, rows: int) -> bool:
  """Whether ``head_logits`` of ``rows`` hidden states computes ``[V, rows]`` and returns
  its transpose (``flipped_product``): a ``[V, E]`` head (tied, or ``'out_in'``) of 2 to
  ``FLIPPED_MAX_ROWS`` rows on XLA:CPU, without batch-invariant numerics. The sampler's
  ``argmax(vocab_major=...)`` reads such logits in place."""
  vocab_first = config.tie_embeddings or config.weight_layout == 'out_in'
  return vocab_first and not config.batch_invariant and rows > 1 and _flips(rows)


def head_logits(x: Array, weight: Array, config: DecoderConfig) -> Array:
  """float32 logits of hidden states ``x`` ``[..., E]``: ``x @ weight`` (``weight`` is the
  lm head, ``[E, V]``) or ``x @ weight.T`` (``weight`` is the ``[V, E]`` embedding, with
  ``config.tie_embeddings``, or the lm head in the ``'out_in'`` layout); in
  ``config.dtype``, batch-invariant (``invariant_matmul``) with ``config.batch_invariant``.
  On XLA:CPU a ``[V, E]`` head of 2 to ``FLIPPED_MAX_ROWS`` rows (a decode step's) runs as
  ``flipped_product``."""
  vocab_first = config.tie_embeddings or config.weight_layout == 'out_in'
  weight = weight.astype(config.dtype)
  rows = math.prod(x.shape[:-1])
  if config.batch_invariant:
    logits = invariant_matmul(x, weight, 'ce,ve->cv' if vocab_first else 'ce,ev->cv',
                              config.invariant_rows)
  elif head_is_vocab_major(config, rows):
    logits = flipped_product(x, weight)
  elif vocab_first:
    logits = jnp.einsum('...e,ve->...v', x, weight)
  else:
    logits = x @ weight
  return logits.astype(jnp.float32)


class Decoder(nnx.Module):
  """Decoder-only language model.

  ``model(tokens)`` -> logits ``float32 [batch, length, vocab]`` (causal, positions 0..T-1).
  ``model(tokens, cache=cache, num_valid=n)`` -> ``(logits, new_cache)`` (see module doc).
  """

  def head(self, x: Array) -> Array:
    """float32 logits ``[..., V]`` of final-normed hidden states ``x`` ``[..., E]``."""
    c = self.config
    weight = self.embed[...] if c.tie_embeddings else self.lm_head[...]
    logits = head_logits(x, weight, c)
    return constrain(logits, ('batch', 'length', 'vocab')) if logits.ndim == 3 else logits

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    # std 1/sqrt(embed): with tied embeddings the initial logits then have unit scale.
    self.embed = _param(rngs, (c.vocab_size, c.embed_dim), ('vocab', 'embed'), c.param_dtype,
                        c.embed_dim ** -0.5)
    self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
    self.final_norm = RMSNorm(c.embed_dim, c.norm_eps, c.param_dtype, rngs=rngs,
                              invariant=c.batch_invariant)
    if not c.tie_embeddings:
      self.lm_head = _kernel(rngs, c, ((c.embed_dim, 'embed'),), ((c.vocab_size, 'vocab'),),
                             c.embed_dim ** -0.5)

  def __call__(self, tokens: Array, *, cache: KVCache | None = None,
               num_valid: Array | None = None, attend: int | None = None,
               features: bool = False):
    """``attend`` (static, with a cache): attention reads only the first ``attend`` cache
    positions; every row's ``lengths + T`` must be ``<= attend``. Decoding passes the
    smallest bucket that holds its longest row, so short sequences do not pay for the whole
    cache. ``features``: return the final-normed hidden states ``[B, T, E]`` instead of
    logits (``head`` turns them into logits, in chunks if wanted); with a cache, as
    ``(hidden, new_cache)``."""
    c = self.config
    chex.assert_rank(tokens, 2)
    batch, length = tokens.shape
    x = constrain(jnp.take(self.embed[...], tokens, axis=0).astype(c.dtype),
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
    new_k, new_v = [], []
    call = _REMAT_CALL[c.remat]
    for i, block in enumerate(self.blocks):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      x, layer_kv = call(block, x, rope_cs, mask, kv, starts)
      if layer_kv is not None:
        new_k.append(layer_kv[0])
        new_v.append(layer_kv[1])
    x = self.final_norm(x)
    out = x if features else self.head(x)
    if cache is None:
      return out
    if num_valid is None:
      num_valid = jnp.full((batch,), length, jnp.int32)
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v),
                        lengths=cache.lengths + num_valid.astype(jnp.int32))
    return out, new_cache
