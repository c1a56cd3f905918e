"""Int8 weight-only quantisation of the decoder's projections, for sampling only.

A projection weight ``w`` (``Execution.weight_layout`` order, ``K`` inputs by ``N`` outputs)
becomes ``Int8Weight(q, scale)``: ``q = round(w / scale)`` in int8 (the weight's shape) and
one float32 ``scale = max |w| / 127`` per output channel (``[N]``, the outputs flattened),
symmetric, so ``|w - q * scale| <= scale / 2`` element-wise. ``decoder.linear`` computes
``x @ (q * scale)`` as ``(x @ q) * scale``: the int8 weights are converted inside the dot, so
the program reads one byte per weight. The token embedding and the lm head (or the tied
embedding) stay in the model's param dtype.

An ``Int8Weight`` is a pytree (two array leaves) that stands in for the weight's value in the
params tree: ``w[...]`` and ``w.astype(dtype)`` (how the modules read a weight) return it as it
is, so the modules run unchanged. ``quantize_params`` quantises a model's params once per
version (the engine does it in ``place_params``: a worker holds, checksums and applies deltas to
the unquantised copy it pulls, and samples with the quantised one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
  """A projection weight in int8 with per-output-channel scales.

  Attributes:
    q: int8, the weight's shape (``Execution.weight_layout`` order).
    scale: float32 ``[N]``, one per output channel (the weight's outputs flattened); a
      weight stacked over the decoder's layers (``q`` ``[layers, ...]``) has
      ``[layers, N]``, one per layer and output channel.
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
    amax = jnp.max(jnp.abs(flat), axis=0)
  else:
    flat = w32.reshape(math.prod(w32.shape[:num_outputs]), -1)
    amax = jnp.max(jnp.abs(flat), axis=1)
  scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)
  per = scale[None, :] if layout == 'in_out' else scale[:, None]
  q = jnp.clip(jnp.round(flat / per), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return Int8Weight(q=q.reshape(w32.shape), scale=scale)


def dequantize(w: Int8Weight, layout: str) -> jax.Array:
  """``q * scale`` in float32, ``w.q``'s shape (``layout``: the weight's order; a stacked
  weight, ``scale`` ``[layers, N]``, layer by layer)."""
  if w.scale.ndim > 1:
    return jax.vmap(lambda layer: dequantize(layer, layout))(w)
  if layout == 'in_out':
    flat = w.q.reshape(-1, w.scale.shape[0]).astype(jnp.float32) * w.scale[None, :]
  else:
    flat = w.q.reshape(w.scale.shape[0], -1).astype(jnp.float32) * w.scale[:, None]
  return flat.reshape(w.q.shape)


def _projections(model: Model) -> dict[str, tuple[int, bool]]:
  """Leaf path (``jax.tree_util.keystr``) -> (number of output axes, stacked over the layers)
  of every projection the int8 copy quantises (``PROJECTIONS``; stacked, ``quantize``'s
  ``stacked``, in a ``layer_loop='scan'`` model, one leaf per layer in an ``'unrolled'``
  one)."""
  layout = model.config.execution.weight_layout
  axes, _ = jax.tree_util.tree_flatten_with_path(
      model.logical_axes(), is_leaf=lambda x: isinstance(x, PartitionSpec))
  out = {}
  for path, spec in axes:
    if path[0].key == 'blocks' and path[-1].key in PROJECTIONS:
      stacked = tuple(spec)[0] == LAYERS_AXIS
      out[jax.tree_util.keystr(path)] = (_channels(tuple(spec)[stacked:], layout), stacked)
  return out


def quantize_params(params: Params, model: Model) -> Params:
  """``params`` (``model``'s, its weight layout) with every attention and MLP weight an
  ``Int8Weight`` (``quantize``); the embedding, lm head and norms as they are."""
  layout = model.config.execution.weight_layout
  projections = _projections(model)

  def visit(path, value):
    found = projections.get(jax.tree_util.keystr(path))
    if found is None:
      return value
    outputs, stacked = found
    return quantize(value, outputs, layout, stacked=stacked)
  return jax.tree_util.tree_map_with_path(visit, params)


def quantized_shardings(shardings: Any, model: Model) -> Any:
  """The shardings of ``quantize_params``' output from the params' (``shardings``, a tree of
  ``NamedSharding`` like the params): ``q`` sharded as the weight, ``scale`` replicated."""
  projections = _projections(model)

  def visit(path, sharding: NamedSharding):
    if jax.tree_util.keystr(path) not in projections:
      return sharding
    return Int8Weight(q=sharding, scale=NamedSharding(sharding.mesh, PartitionSpec()))
  return jax.tree_util.tree_map_with_path(visit, shardings)
