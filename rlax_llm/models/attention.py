"""The attention functions the decoder chooses between, on queries grouped per kv head.

Every function takes queries ``q`` ``[B, kv_heads, M, head_dim]`` (a kv head's ``groups``
query heads times ``T`` positions, ``M = groups * T``) and consecutive key and value blocks
in the cache layouts (``kv_cache``; an int8 cache's blocks arrive dequantised, as
``kv_cache.layer_update`` returns them, so none of these reads int8), and returns
``[B, kv_heads, M, head_dim]``:

* ``xla_attention``: softmax attention as jnp products (the default);
* ``invariant_attention``: the same, with batch-invariant numerics (``numerics``);
* ``cpu_attention.decode_attention``: a compiled XLA:CPU kernel for decode steps of two or
  more rows (``Execution.decode_attention='cpu_kernel'``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_llm.models.kv_cache import KEY_POSITION_AXIS, VALUE_POSITION_AXIS
from rlax_llm.models.numerics import INVARIANT_KEYS, invariant_max, invariant_sum

Array = jax.Array


def xla_attention(q: Array, ks: tuple[Array, ...], vs: tuple[Array, ...], query_mask: Array,
                  dtype, *, keys_transposed: bool = True) -> Array:
  """Softmax attention, float32 scores and softmax, the products in ``dtype``.

  Args:
    q: ``[B, kv, M, d]``; ks, vs: consecutive key and value blocks, ``[B, kv, d, S]`` (the
      cache layout; ``[B, kv, S, d]`` unless ``keys_transposed``) and ``[B, kv, S, d]``;
      query_mask: bool ``[B, 1, M, S]`` over the blocks' positions.
  Returns:
    ``[B, kv, M, d]`` in ``dtype``, the value products summed over the blocks in order.
  """
  score = 'bkqd,bkds->bkqs' if keys_transposed else 'bkqd,bksd->bkqs'
  scores = [jnp.einsum(score, q, kb) for kb in ks]
  scores = scores[0] if len(scores) == 1 else jnp.concatenate(scores, -1)
  scores = scores.astype(jnp.float32) * (q.shape[-1] ** -0.5)
  scores = jnp.where(query_mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out, lo = None, 0
  for vb in vs:
    part = jnp.einsum('bkqs,bksd->bkqd', probs[..., lo:lo + vb.shape[2]], vb)
    out, lo = (part if out is None else out + part), lo + vb.shape[2]
  return out


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


def invariant_attention(q: Array, ks: tuple[Array, ...], vs: tuple[Array, ...],
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
  if len(vs) > 1 and vs[0].shape[VALUE_POSITION_AXIS] % INVARIANT_KEYS:
    raise ValueError(f'batch_invariant attention needs cache blocks of a multiple of '
                     f'{INVARIANT_KEYS} positions, got {vs[0].shape[VALUE_POSITION_AXIS]}; '
                     'the engine keeps them so.')
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
    if dim % 64:  # as a product, the rounding depended on M for these head dims (24, 32,
      # 48, 80, 96) on some CPUs whichever operand order; elementwise products summed over
      # the piece's positions by a fixed tree (``invariant_sum``) round alike everywhere.
      products = weight[..., None].astype(jnp.float32) * v[:, :, None].astype(jnp.float32)
      part = invariant_sum(jnp.swapaxes(products, -1, -2))[..., 0]
    else:
      part = jnp.einsum('bkqs,bksd->bkqd', weight, v)
    out = out + part.astype(jnp.float32)
  total = invariant_sum(weights)
  return (out / total)[:, :, :rows]
