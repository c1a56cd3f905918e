"""The decoder's fixed-size KV cache: its layout (``KVCache``) and how a layer writes it.

KV cache contract (``KVCache``): ``k`` and ``v`` are tuples of *blocks*, each stacked over
the layers (leading axis ``num_layers``, the decoder's scan reads and writes layer ``i``'s
``[i]``), or, for a decoder that runs its layers unrolled (``Execution.layer_loop``,
``KVCache.stacked`` False), tuples of each layer's own tuple of blocks (separate buffers: on
XLA:CPU a slice of a stacked buffer is a copy); block ``j`` holds positions
``j * block_length .. (j + 1) * block_length - 1``, a layer's values as ``[batch, kv_heads, block_length, head_dim]`` and its keys transposed,
``[batch, kv_heads, head_dim, block_length]``: the layouts in which both attention matmuls
of a decode step read the cache as their plain (untransposed) right-hand operand (with keys
stored like values, XLA:CPU's score matmul ran at less than half the speed of the value
matmul over the same bytes). ``max_len`` is ``num_blocks * block_length``. One block (the
default) is the plain contiguous cache. Several blocks let a decode step that attends to the
first ``attend`` positions read whole blocks (separate buffers) instead of slicing a prefix
out of one buffer, which XLA materialises as a copy of that prefix in every layer and step.
With ``batch_invariant`` blocks must be a multiple of ``numerics.INVARIANT_KEYS`` positions.
``lengths`` is ``int32 [batch]``, the number of valid positions of each slot. A call with
``cache`` writes the ``T`` new keys/values of row ``b`` at positions
``lengths[b] .. lengths[b] + T - 1`` and advances ``lengths[b]`` by ``num_valid[b]``
(default ``T``). Query ``t`` of row ``b`` sits at position
``lengths[b] + t`` and attends to every cached position ``<=`` its own. Rows may be
right-padded: positions past ``num_valid`` hold junk that later writes overwrite before any
query can see it.

An int8 cache (``KVCache.init(..., quant='int8')``, ``model.kv_cache_quant``) stores the
blocks as int8 and, in ``k_scale`` and ``v_scale``, a float32 scale per (token, kv head) in
the same block layouts with a ``head_dim`` of 1: symmetric, ``max |x| / 127`` over the head's
``head_dim`` values (``quantize_kv``). Writes quantise the new keys and values; attention
reads the blocks dequantised (``int8 * scale``, in the compute dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rlax_llm import model_spec
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.numerics import INVARIANT_KEYS

Array = jax.Array
# (keys, values), or (keys, values, key scales, value scales) of an int8 cache: tuples of
# blocks, one layer's or (``KVCache.layers``) all layers' stacked.
LayerBlocks = tuple[tuple[Array, ...], ...]

KV_CACHE_QUANT_MODES = model_spec.KV_CACHE_QUANT_MODES
_INT8_MAX = 127

# The logical axes of one layer's cache blocks, values ``[B, kv, S, d]`` and keys transposed
# ``[B, kv, d, S]`` (see the module docstring), and their position axes; the cache stores
# them behind a leading ``layers`` axis (``LAYERED``).
VALUE_BLOCK_AXES = ('batch', 'kv_heads', 'length', 'head_dim')
VALUE_POSITION_AXIS = VALUE_BLOCK_AXES.index('length')
KEY_BLOCK_AXES = ('batch', 'kv_heads', 'head_dim', 'length')
KEY_POSITION_AXIS = KEY_BLOCK_AXES.index('length')
LAYERED = 1  # how many axes the stored blocks have before a layer's block axes
# The axes of the keys and values the attention projections produce, ``[B, T, kv, d]``.
_PROJECTED_AXES = ('batch', 'length', 'kv_heads', 'head_dim')
# KV-cache blocks hold a multiple of this many positions: XLA:CPU's batched attention
# matmuls read the cache at memory bandwidth when the positions dimension is a multiple of
# 32, and at about half of it otherwise (benchmarks/RESULTS.md, engine section).
BLOCK_ALIGN = 32
ATTEND_BUCKETS = 4  # the engine's default: at most this many blocks per cache


def block_layout(cache_length: int, *, batch_invariant: bool,
                 attend_buckets: int = ATTEND_BUCKETS, block_align: int = BLOCK_ALIGN
                 ) -> tuple[int, int, int]:
  """How an engine keeps a cache of ``cache_length`` positions: ``(step, block_length,
  num_blocks)``. A decode step attends to a multiple of ``step`` positions (at most
  ``attend_buckets`` of them, each a multiple of ``block_align``); the cache is kept in
  ``num_blocks`` blocks of ``block_length`` positions (``step``, or ``INVARIANT_KEYS`` for a
  batch-invariant model, which reads its cache in pieces of that many). The cache holds
  ``block_length * num_blocks >= cache_length`` positions: the engine allocates that many and
  the memory plan (``presets.memory_plan``) counts them."""
  size = -(-cache_length // attend_buckets)
  step = -(-size // block_align) * block_align
  block_length = INVARIANT_KEYS if batch_invariant else step
  return step, block_length, -(-cache_length // block_length)


def cache_block_shape(axes: tuple[str, ...], config: DecoderConfig, batch: int,
                      block_length: int, *, scale: bool = False) -> tuple[int, ...]:
  """The shape of a cache block with logical ``axes`` (``VALUE_BLOCK_AXES`` or
  ``KEY_BLOCK_AXES``) for ``batch`` slots of ``block_length`` positions (``scale``: an int8
  cache's scale block, ``head_dim`` 1)."""
  sizes = {'batch': batch, 'kv_heads': config.num_kv_heads,
           'head_dim': 1 if scale else config.head_dim, 'length': block_length}
  return tuple(sizes[axis] for axis in axes)


def quantize_kv(x: Array) -> tuple[Array, Array]:
  """Keys or values ``x`` ``[..., head_dim]`` as int8 ``[..., head_dim]`` and a float32
  scale ``[..., 1]``: symmetric, ``max |x| / 127`` over ``head_dim`` (1 for all zeros), so
  ``|dequantize_kv(q, s) - x| <= s / 2`` elementwise."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
  q = jnp.clip(jnp.round(x32 / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
  return q, scale


def dequantize_kv(q: Array, scale: Array, dtype) -> Array:
  """``q * scale`` in ``dtype``: int8 blocks and their scale blocks (which broadcast over
  ``head_dim``), or ``quantize_kv``'s output."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


def to_block(x: Array, axes: tuple[str, ...]) -> Array:
  """Projected keys or values ``[B, T, kv, d]`` laid out as a cache block with ``axes``."""
  return x.transpose(tuple(_PROJECTED_AXES.index(axis) for axis in axes))


@flax.struct.dataclass
class KVCache:
  """Fixed-size key/value cache in blocks stacked over the layers, or per layer (the module
  docstring)."""

  # stacked: [block]: [layers, batch, kv_heads, head_dim, block_length]; per layer:
  # [layer][block]: [batch, kv_heads, head_dim, block_length]
  k: tuple[Any, ...]
  v: tuple[Any, ...]  # as k, values [..., block_length, head_dim]
  lengths: Array  # int32 [batch]
  # An int8 cache's float32 scales, like k and v with head_dim 1; () if not.
  k_scale: tuple[Any, ...] = ()
  v_scale: tuple[Any, ...] = ()
  # Whether the blocks are stacked over the layers (a decoder whose ``Execution.layer_loop``
  # is 'scan') or each layer's own (its 'unrolled').
  stacked: bool = flax.struct.field(pytree_node=False, default=True)

  @classmethod
  def init(cls, config: DecoderConfig, batch: int, max_len: int | None = None,
           block_length: int | None = None, quant: str = 'none') -> KVCache:
    """An empty cache of at least ``max_len`` positions (default ``config.max_seq_len``) in
    blocks of ``block_length`` (default: one block of ``max_len``); ``quant='int8'``: int8
    blocks with float32 scales (the module docstring)."""
    if quant not in KV_CACHE_QUANT_MODES:
      raise ValueError(f'KV cache quant={quant!r}; choose one of {KV_CACHE_QUANT_MODES}.')
    max_len = max_len or config.max_seq_len
    block = max_len if block_length is None else block_length
    if block < 1:
      raise ValueError(f'block_length must be >= 1, got {block_length}.')
    int8 = quant == 'int8'
    dtype = jnp.int8 if int8 else config.execution.dtype
    stacked = config.execution.layer_loop == 'scan'
    lead = (config.num_layers,) if stacked else ()
    layer = lambda axes, dt=dtype, scale=False: tuple(
        jnp.zeros(lead + cache_block_shape(axes, config, batch, block, scale=scale), dt)
        for _ in range(-(-max_len // block)))
    blocks = lambda axes, **kw: layer(axes, **kw) if stacked else tuple(
        layer(axes, **kw) for _ in range(config.num_layers))
    scales = lambda axes: blocks(axes, dt=jnp.float32, scale=True) if int8 else ()
    return cls(k=blocks(KEY_BLOCK_AXES), v=blocks(VALUE_BLOCK_AXES),
               lengths=jnp.zeros((batch,), jnp.int32), k_scale=scales(KEY_BLOCK_AXES),
               v_scale=scales(VALUE_BLOCK_AXES), stacked=stacked)

  @property
  def quantized(self) -> bool:
    """Whether the blocks are int8 with scales."""
    return bool(self.k_scale)

  def used_blocks(self, attend: int) -> int:
    """How many leading blocks a step that attends to ``attend`` positions reads and writes
    (all of a one-block cache; with several, ``attend`` is a multiple of the block)."""
    return 1 if self.num_blocks == 1 else attend // self.block_length

  @property
  def lead(self) -> int:
    """How many axes the stored blocks have before a layer's block axes (``LAYERED`` if
    ``stacked``, else 0)."""
    return LAYERED if self.stacked else 0

  def layers(self, used: int) -> LayerBlocks | tuple[LayerBlocks, ...]:
    """The first ``used`` blocks: (keys, values), and their scales if ``quantized``,
    stacked over the layers (the decoder's scan carries them; layer ``i`` reads each one's
    ``[i]``), or, unstacked, one such tuple per layer."""
    parts = (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())
    if self.stacked:
      return tuple(part[:used] for part in parts)
    return tuple(tuple(part[i][:used] for part in parts) for i in range(len(self.k)))

  def with_layers(self, layers: LayerBlocks | tuple[LayerBlocks, ...], used: int,
                  lengths: Array) -> KVCache:
    """The cache with its first ``used`` blocks replaced by ``layers`` (``layers``' layout)
    and ``lengths``; the blocks past them as they are."""
    olds = (self.k, self.v, self.k_scale, self.v_scale)
    if self.stacked:
      parts = tuple(new + old[used:] for new, old in zip(layers, olds))
    else:
      parts = tuple(tuple(layer[p] + old[i][used:] for i, layer in enumerate(layers))
                    for p, old in enumerate(olds[:len(layers[0])]))
    return KVCache(*parts[:2], lengths=lengths, k_scale=parts[2] if self.quantized else (),
                   v_scale=parts[3] if self.quantized else (), stacked=self.stacked)

  def repeat(self, times: int) -> KVCache:
    """Every slot repeated ``times`` times in place (slot ``b`` becomes slots
    ``b * times .. (b + 1) * times - 1``), e.g. one prefix's cache for each row sharing it."""
    rows = lambda x, axis: jnp.repeat(x, times, axis=axis)
    blocks = lambda part: jax.tree.map(lambda x: rows(x, self.lead), part)
    return KVCache(blocks(self.k), blocks(self.v), rows(self.lengths, 0),
                   blocks(self.k_scale), blocks(self.v_scale), stacked=self.stacked)

  @property
  def block_length(self) -> int:
    first = self.v[0] if self.stacked else self.v[0][0]
    return first.shape[self.lead + VALUE_POSITION_AXIS]

  @property
  def num_blocks(self) -> int:
    return len(self.k if self.stacked else self.k[0])

  @property
  def max_len(self) -> int:
    return self.num_blocks * self.block_length


def layer_update(kv: LayerBlocks, k: Array, v: Array, starts: Array, attend: int, *,
                 whole_buffer: bool = False
                 ) -> tuple[tuple[Array, ...], tuple[Array, ...], Callable[[Array], LayerBlocks]]:
  """One layer's cache with new keys and values ``k``, ``v`` ``[B, T, kv, d]`` written at
  positions ``starts[b] ..`` of each row.

  Returns ``(keys, values, write)``: the blocks attention reads (its first ``attend``
  positions, in the cache layouts; the whole buffer of a one-block cache with
  ``whole_buffer``, for a kernel that reads each slot's positions itself, with no slice, a
  copy, of the buffer) and ``write(out)``, the layer's new blocks once attention's output
  ``out`` exists. With several blocks ``attend`` is a multiple of the block (the decoder
  rounds it up) and the new positions lie below it, so the blocks past it are neither read
  nor written. An int8 cache's layer (four tuples, ``KVCache.layers``) stores ``k`` and ``v``
  quantised (``quantize_kv``) and returns the blocks attention reads dequantised, in
  ``k``'s dtype.
  """
  if len(kv) == 4:
    (qk, sk), (qv, sv) = quantize_kv(k), quantize_kv(v)
    ks, vs, write = layer_update(kv[:2], qk, qv, starts, attend, whole_buffer=whole_buffer)
    kss, vss, write_scales = layer_update(kv[2:], sk, sv, starts, attend,
                                          whole_buffer=whole_buffer)
    return (tuple(dequantize_kv(q, s, k.dtype) for q, s in zip(ks, kss)),
            tuple(dequantize_kv(q, s, k.dtype) for q, s in zip(vs, vss)),
            lambda out: write(out) + write_scales(out))
  if len(kv[0]) == 1:
    new_kv = ((_write_positions(kv[0][0], to_block(k, KEY_BLOCK_AXES), starts,
                                KEY_POSITION_AXIS),),
              (_write_positions(kv[1][0], to_block(v, VALUE_BLOCK_AXES), starts,
                                VALUE_POSITION_AXIS),))
    if whole_buffer:
      return *new_kv, lambda out: new_kv
    return ((jax.lax.slice_in_dim(new_kv[0][0], 0, attend, axis=KEY_POSITION_AXIS),),
            (new_kv[1][0][:, :, :attend],), lambda out: new_kv)
  used = attend // kv[1][0].shape[VALUE_POSITION_AXIS]
  if k.shape[0] == 1:
    # One row: XLA:CPU makes the write a dynamic-update-slice, duplicates it into
    # attention's fusion when attention reads the written block, and copies every
    # written block four times a step. So attention reads the blocks as written,
    # computed from the old blocks and the new values (``_blocks_with``), and the
    # writes follow it in place (``_write_after``). With more rows the write stays a
    # scatter that attention reads in place (no copies), and this path measured 2%
    # slower at 8 rows and no faster at 32 (benchmarks/RESULTS.md).
    return (_blocks_with(kv[0][:used], k, starts, KEY_POSITION_AXIS),
            _blocks_with(kv[1][:used], v, starts, VALUE_POSITION_AXIS),
            lambda out: _write_after(out, kv, used, k, v, starts))
  ks = _write_blocks(kv[0][:used], k, starts, KEY_POSITION_AXIS)
  vs = _write_blocks(kv[1][:used], v, starts, VALUE_POSITION_AXIS)
  return ks, vs, lambda out: (ks + kv[0][used:], vs + kv[1][used:])


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
  new = to_block(values, axes).astype(blocks[0].dtype)  # T positions along ``axis``
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
