"""Int8 weight-only quantisation of the decoder's projections, for sampling only.

A projection weight ``w`` (``Execution.weight_layout`` order, ``K`` inputs by ``N`` outputs)
becomes ``Int8Weight(q, scale)``: ``q = round(w / scale)`` in int8 (the weight's shape) and
one float32 ``scale = max |w| / 127`` per output channel (``[N]``, the outputs flattened),
symmetric, so ``|w - q * scale| <= scale / 2`` element-wise. ``decoder.linear`` computes
``x @ (q * scale)`` as ``(x @ q) * scale``: the int8 weights are converted inside the dot, so
the program reads one byte per weight. The token embedding and the lm head (or the tied
embedding) stay in the model's param dtype.

A mixture of experts' stacked expert weights (``EXPERTS``: ``[..., experts, K, N]``, always
inputs first, the leading axes the layers' in a scanned stack) are quantised the same way with
one float32 scale per (layer, expert, output channel), kept with the inputs axis as 1
(``scale [..., experts, 1, N]``) so that ``q * scale`` broadcasts: ``models.moe`` converts
``q`` inside its grouped or dense products and scales each row by its expert's scales. The
router stays in the param dtype (its top-k choices are what routing replay records).

An ``Int8Weight`` is a pytree (two array leaves) that stands in for the weight's value in the
params tree: ``w[...]`` and ``w.astype(dtype)`` (how the modules read a weight) return it as it
is, so the modules run unchanged. ``quantize_params`` quantises a model's params once per
version (the engine does it in ``place_params``: a worker holds, checksums and applies deltas to
the unquantised copy it pulls, and samples with the quantised one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rlax_llm import model_spec
from rlax_llm.models.decoder_config import LAYERS_AXIS

# A model (``rlax_llm.models.model.Model``) and its params, named loosely: model.py imports
# the decoder, which imports this module.
Model = Any
Params = Any

INT8_MAX = 127
QUANT_MODES = model_spec.QUANT_MODES
# The decoder's projection weights (the attention's and the MLP's): what ``quantize_params``
# quantises; LoRA adapters (``{name}_lora``), norms, the embedding and the lm head are kept.
PROJECTIONS = ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down')
# A mixture of experts' stacked expert weights (``decoder.MoE``), also quantised; the router
# is kept.
EXPERTS = ('experts_gate', 'experts_up', 'experts_down')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
  """A projection weight in int8 with per-output-channel scales.

  Attributes:
    q: int8, the weight's shape (``Execution.weight_layout`` order).
    scale: float32 ``[N]``, one per output channel (the weight's outputs flattened); a
      weight stacked over the decoder's layers (``q`` ``[layers, ...]``) has
      ``[layers, N]``, one per layer and output channel. Expert weights (``EXPERTS``, ``q``
      ``[..., experts, K, N]``): ``[..., experts, 1, N]``, ``q``'s rank (``quantize_experts``).
  """
  q: jax.Array
  scale: jax.Array

  def __getitem__(self, key: Any) -> Int8Weight:
    """``w[...]`` (how a module reads its ``nnx.Param``): the weight itself."""
    if key is not Ellipsis:
      raise TypeError(f'an Int8Weight is read whole (w[...]); got index {key!r}.')
    return self

  def astype(self, dtype: Any) -> Int8Weight:
    """The weight itself: ``decoder.linear`` converts ``q`` to the activations' dtype inside
    the dot, whatever compute dtype the module asks for."""
    del dtype
    return self

  @property
  def shape(self) -> tuple[int, ...]:
    return self.q.shape


def _channels(axes: tuple[str, ...], layout: str) -> int:
  """How many of a projection's axes (its logical ``axes`` in ``layout`` order) are its
  outputs. Every projection reads or writes ``embed``: one that reads it (q, k, v, gate, up)
  has the rest as outputs; one that writes it (o, down) has ``embed`` alone."""
  inputs_first = layout == 'in_out'
  reads_embed = (axes[0] if inputs_first else axes[-1]) == 'embed'
  return len(axes) - 1 if reads_embed else 1


def quantize(w: jax.Array, num_outputs: int, layout: str, *, stacked: bool = False
             ) -> Int8Weight:
  """``w`` (``[K..., N...]`` for ``'in_out'``, ``[N..., K...]`` for ``'out_in'``, its last or
  first ``num_outputs`` axes the outputs) in int8 with a float32 scale per output channel
  (``max |w| / 127`` over its inputs; 1 for an all-zero channel). ``stacked``: ``w`` has a
  leading layer axis (the decoder's stacked blocks), each layer quantised on its own
  (``scale`` ``[layers, N]``)."""
  if stacked:
    return jax.vmap(lambda layer: quantize(layer, num_outputs, layout))(w)
  w32 = jnp.asarray(w, jnp.float32)
  if layout == 'in_out':
    flat = w32.reshape(-1, math.prod(w32.shape[w32.ndim - num_outputs:]))
    q, scale = _symmetric(flat, axis=0)
    return Int8Weight(q=q.reshape(w32.shape), scale=scale[0])
  flat = w32.reshape(math.prod(w32.shape[:num_outputs]), -1)
  q, scale = _symmetric(flat, axis=1)
  return Int8Weight(q=q.reshape(w32.shape), scale=scale[:, 0])


def quantize_experts(w: jax.Array) -> Int8Weight:
  """A mixture of experts' stacked weights ``w [..., experts, K, N]`` (``EXPERTS``, inputs
  first; leading layer axes in a scanned stack) in int8 with a float32 scale per (layer,
  expert, output channel): ``scale [..., experts, 1, N]`` (``max |w| / 127`` over the ``K``
  inputs, as ``quantize``), so that ``q * scale`` is the dequantised weight."""
  if w.ndim < 3:
    raise ValueError(f'quantize_experts takes stacked expert weights [..., experts, K, N]; got '
                     f'shape {w.shape}. Quantise a single projection with quantize.')
  q, scale = _symmetric(jnp.asarray(w, jnp.float32), axis=-2)
  return Int8Weight(q=q, scale=scale)


def _symmetric(w32: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """The rule of every int8 weight here: ``(q int8, scale float32)`` with ``scale = max |w| /
  127`` over ``axis`` (kept, as 1; 1 for an all-zero channel) and ``q = round(w / scale)``."""
  amax = jnp.max(jnp.abs(w32), axis=axis, keepdims=True)
  scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)
  q = jnp.clip(jnp.round(w32 / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return q, scale


def dequantize(w: Int8Weight, layout: str) -> jax.Array:
  """``q * scale`` in float32, ``w.q``'s shape (``layout``: the weight's order; a stacked
  weight, ``scale`` ``[layers, N]``, layer by layer; expert weights, ``scale`` of ``q``'s rank
  (``quantize_experts``), whatever ``layout``)."""
  if w.scale.ndim == w.q.ndim:
    return w.q.astype(jnp.float32) * w.scale
  if w.scale.ndim > 1:
    return jax.vmap(lambda layer: dequantize(layer, layout))(w)
  if layout == 'in_out':
    flat = w.q.reshape(-1, w.scale.shape[0]).astype(jnp.float32) * w.scale[None, :]
  else:
    flat = w.q.reshape(w.scale.shape[0], -1).astype(jnp.float32) * w.scale[:, None]
  return flat.reshape(w.q.shape)


class _Quantised(NamedTuple):
  """How ``quantize_params`` quantises one leaf: ``expert`` (``quantize_experts``) or a
  projection of ``outputs`` output axes, ``stacked`` over the layers (``quantize``); ``rank``:
  the leaf's."""
  expert: bool
  outputs: int
  stacked: bool
  rank: int


def _projections(model: Model) -> dict[str, _Quantised]:
  """Leaf path (``jax.tree_util.keystr``) -> how it is quantised, for every projection the
  int8 copy quantises (``PROJECTIONS``: stacked in a ``layer_loop='scan'`` model, one leaf
  per layer in an ``'unrolled'`` one) and every expert weight (``EXPERTS``)."""
  layout = model.config.execution.weight_layout
  axes, _ = jax.tree_util.tree_flatten_with_path(
      model.logical_axes(), is_leaf=lambda x: isinstance(x, PartitionSpec))
  out = {}
  for path, spec in axes:
    spec = tuple(spec)
    if (path[0].key not in model.config.stack_names
        or path[-1].key not in PROJECTIONS + EXPERTS):
      continue
    stacked = spec[0] == LAYERS_AXIS
    expert = path[-1].key in EXPERTS
    out[jax.tree_util.keystr(path)] = _Quantised(
        expert, 1 if expert else _channels(spec[stacked:], layout), stacked, len(spec))
  return out


def quantize_params(params: Params, model: Model) -> Params:
  """``params`` (``model``'s, its weight layout) with every attention and MLP weight an
  ``Int8Weight`` (``quantize``) and, in a mixture of experts, every expert weight too
  (``quantize_experts``); the embedding, lm head, norms and router as they are."""
  layout = model.config.execution.weight_layout
  projections = _projections(model)

  def visit(path, value):
    how = projections.get(jax.tree_util.keystr(path))
    if how is None:
      return value
    if how.expert:
      return quantize_experts(value)
    return quantize(value, how.outputs, layout, stacked=how.stacked)
  return jax.tree_util.tree_map_with_path(visit, params)


def quantized_shardings(shardings: Any, model: Model) -> Any:
  """The shardings of ``quantize_params``' output from the params' (``shardings``, a tree of
  ``NamedSharding`` like the params): ``q`` sharded as the weight; ``scale`` replicated, but
  an expert weight's sharded as its ``q`` but for the inputs axis (the scales lie with their
  experts and output channels: ``expert_scale_spec``)."""
  projections = _projections(model)

  def visit(path, sharding: NamedSharding):
    how = projections.get(jax.tree_util.keystr(path))
    if how is None:
      return sharding
    scale = expert_scale_spec(sharding.spec, how.rank) if how.expert else PartitionSpec()
    return Int8Weight(q=sharding, scale=NamedSharding(sharding.mesh, scale))
  return jax.tree_util.tree_map_with_path(visit, shardings)


def expert_scale_spec(spec: PartitionSpec, rank: int) -> PartitionSpec:
  """The ``PartitionSpec`` of an expert weight's ``scale`` (``quantize_experts``) from its
  ``q``'s (``spec``, of a rank-``rank`` weight ``[..., experts, K, N]``): the same with the
  inputs axis ``K`` unsplit."""
  entries = list(spec) + [None] * (rank - len(spec))
  entries[rank - 2] = None
  return PartitionSpec(*entries)
