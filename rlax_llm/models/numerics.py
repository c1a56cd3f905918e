"""Batch-invariant numerics and the fast weight products of XLA:CPU.

Batch-invariant numerics (``Execution.batch_invariant``): XLA:CPU picks a float32
matmul's kernel from its shapes and fuses reductions, products and transcendentals
differently in different programs, so one row's result depends on how many rows come with
it. The same token scored by the trainer (a ``[B, T]`` forward) and by a decode step (one
query per slot over a KV cache) then differs by rounding, which 30 layers grow to ~5e-5 in
a log-prob. With ``batch_invariant`` every such computation runs in a form whose rounding
cannot depend on the batch: weight matmuls in chunks of exactly ``INVARIANT_ROWS`` rows (the
rest in one product of at least two), or of at least ``INVARIANT_MIN_ROWS``
(``Execution.invariant_rows``, ``invariant_matmul``);
attention over pieces of ``INVARIANT_KEYS`` key positions, the
value products summed in position order, the scale applied to the queries
(``attention.invariant_attention``); sums and maxima as fixed trees of elementwise ops
(``invariant_sum``, ``invariant_max``; RMSNorm and the log-softmax use them too); RoPE's
cos/sin looked up in a host-computed table. A row's logits are then bitwise the same
whatever shares its batch, its padding or the cache layout, so sampler and trainer
log-probs agree exactly (He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines Lab 2025, argue the same for GPU kernels). Verified on XLA:CPU by
``tests/models/test_batch_invariant.py``; the cost is in benchmarks/RESULTS.md. It holds on
data-parallel meshes; FSDP and tensor parallelism split contractions across devices (the
config refuses them with it).

``flipped_product``: the faster form of a decode step's few-row products with a weight
stored ``[N, K]`` on XLA:CPU (not batch-invariant; its own rounding).

``accumulated_product``: a bfloat16 (or float16) weight product accumulated in float32 in
the forward and the backward, which XLA:CPU runs about twice as fast as its own bfloat16 dot.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp

Array = jax.Array

# The rows of each weight matmul chunk, and the key positions of each attention piece
# (cache blocks must be a multiple of it).
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def invariant_matmul(x: Array, w: Array, spec: str = 'ck,kn->cn',
                     rows: str = 'chunks') -> Array:
  """``x [..., K]`` times the 2-D weight ``w`` (``spec`` contracts a chunk ``c`` of rows
  with it, e.g. ``'ck,nk->cn'`` for a ``[N, K]`` weight) -> ``[..., N]``, each row's result
  independent of the other rows.

  XLA:CPU picks a matmul's kernel from its row count: one for up to 32 rows, another for
  more (from 33 to 51 rows on, depending on the weight's shape), and the two round a row
  differently; each rounds a row the same for any row count in its range, wherever the row
  sits (measured). ``rows`` (``Execution.invariant_rows``) keeps every row in one range:

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def accumulated_product(x: Array, w: Array, out_in: bool = False,
                        out_dtype: jnp.dtype | None = None) -> Array:
  """``x [M, K]`` times ``w`` (``[K, N]``, or ``[N, K]`` with ``out_in``) -> ``[M, N]`` in
  ``out_dtype`` (default ``x``'s), the products summed in float32; its gradient's two
  products likewise (the cotangent taken in ``x``'s dtype first, as a cast back from
  ``out_dtype`` would give it).

  For ``x`` and ``w`` of one narrow dtype (bfloat16, float16). The values are those of a
  bfloat16 dot on a TPU's matrix units, which sum in float32 and round the result once.
  XLA:CPU lowers a ``bf16 x bf16 -> bf16`` dot as a float32 dot on converted operands plus
  conversions it does not fuse, and differentiates it into more of them: asking for the
  float32 result (``preferred_element_type``) took a ``[1024, 576] x [576, 1536]`` product
  from 9.0 to 4.2 ms, and this gradient took a SwiGLU block's input gradient from 37.9 to
  24.5 ms (benchmarks/LAB_NOTES.md, "LoRA train step"). One row takes a matrix-vector path
  that is slower still (a decode step's ``[1, 576] x [576, 49152]`` head: 62 ms, against
  3.4 ms for two rows), so on XLA:CPU a single row is padded to two.
  """
  chex.assert_rank([x, w], 2)
  chex.assert_type(w, x.dtype)
  rows = x.shape[0]
  if rows == 1 and jax.default_backend() == 'cpu':  # the slow one-row path (docstring)
    x = jnp.pad(x, ((0, 1), (0, 0)))
  y = jax.lax.dot_general(x, w, (((1,), (1 if out_in else 0,)), ((), ())),
                          preferred_element_type=jnp.float32)
  return y[:rows].astype(out_dtype or x.dtype)


def _accumulated_product_fwd(x, w, out_in, out_dtype):
  return accumulated_product(x, w, out_in, out_dtype), (x, w)


def _accumulated_product_bwd(out_in, out_dtype, residuals, g):
  del out_dtype
  x, w = residuals
  g = g.astype(x.dtype)
  f32 = jnp.float32
  # x: [M, K]; g: [M, N]; w: [K, N] (in_out) or [N, K] (out_in).
  dx = jax.lax.dot_general(g, w, (((1,), (0 if out_in else 1,)), ((), ())),
                           preferred_element_type=f32)
  if out_in:  # dw [N, K] = g.T @ x
    dw = jax.lax.dot_general(g, x, (((0,), (0,)), ((), ())), preferred_element_type=f32)
  else:  # dw [K, N] = x.T @ g
    dw = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=f32)
  return dx.astype(x.dtype), dw.astype(w.dtype)


accumulated_product.defvjp(_accumulated_product_fwd, _accumulated_product_bwd)


def narrow_dtype(dtype) -> bool:
  """Whether ``dtype`` is a floating dtype narrower than float32 (bfloat16, float16)."""
  return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def narrow(x: Array, w: Array) -> bool:
  """Whether ``x`` and ``w`` share a ``narrow_dtype`` (the products ``accumulated_product``
  takes)."""
  return x.dtype == w.dtype and narrow_dtype(x.dtype)


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


def flips(rows: int) -> bool:
  """Whether a product of ``rows`` rows with an ``[N, K]`` weight takes ``flipped_product``."""
  return rows <= FLIPPED_MAX_ROWS and jax.default_backend() == 'cpu'
