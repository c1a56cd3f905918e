"""The functional face of a decoder: a static graph plus a pure params pytree.

Every other role (trainer, parameter server, sampler) sees a model as ``Model`` (static,
equal and hashed by value: its config and graph, safe as a ``jax.jit`` static argument, so
two models built alike share their compiled programs) and ``params``: a nested
``dict`` of arrays (``flax.nnx.to_pure_dict`` layout, e.g. ``params['blocks']['attn']['wq']``,
the blocks stacked over a leading layer axis; a stack mixing dense and MoE layers has one such
subtree per run of layers of one kind, ``blocks``, ``blocks_1``, ...:
``Architecture.layer_runs``). Keeping params a plain pytree lets optax update
them, the parameter server validate and copy them, and ``NamedSharding`` trees mirror them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from rlax_llm.models.decoder import Decoder
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.kv_cache import KVCache

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
  """A decoder's static structure. Build with ``create_model``.

  Equal, and hashed alike, when of the same class with equal fields (the config and the NNX
  graph, a subclass's own fields too: ``LoRAModel``'s adapters): what a program traced with
  the model depends on, so equal models share a ``jax.jit`` cache entry (a second run in one
  process reuses the first's programs) and different ones never do. The hash is computed
  once (a deep model's graph is large and ``jax.jit`` hashes its static arguments per call).
  """

  config: DecoderConfig
  graphdef: Any

  def _fields(self) -> tuple[Any, ...]:
    return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    return type(other) is type(self) and self._fields() == other._fields()

  def __hash__(self) -> int:
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:
    return hash((type(self), *self._fields()))

  def __getstate__(self) -> dict[str, Any]:
    # Not the cached hash: a string's hash differs between processes (a Ray actor's model).
    return {name: value for name, value in self.__dict__.items() if name != '_hash'}

  def apply(self, params: Params, tokens: jax.Array, *, cache: KVCache | None = None,
            num_valid: jax.Array | None = None, attend: int | None = None,
            features: bool = False, aux_loss: bool = False, routes: jax.Array | None = None,
            return_routes: bool = False, token_mask: jax.Array | None = None):
    """Runs the decoder. tokens: int32 ``[batch, length]``.

    Returns float32 logits ``[batch, length, vocab]``, or ``(logits, new_cache)`` when a
    ``cache`` is given (see ``rlax_llm.models.kv_cache`` for the cache contract and
    ``attend``). With ``features`` the final-normed hidden states ``[batch, length, embed]``
    take the logits' place (``logits`` makes them logits). ``aux_loss`` (a mixture of
    experts, no cache): ``(logits, the router's load-balancing loss)``, a float32 scalar
    (``rlax_llm.models.moe.load_balancing_loss``; the trainer weighs it by
    ``config.router_aux_loss_coef``), over the tokens where ``token_mask`` (float
    ``[batch, length]``) is nonzero. ``routes`` (int ``[batch, length, layers, k]``) replays
    recorded experts and ``return_routes`` appends the router's own (rollout routing replay,
    ``Decoder``; ``rlax_llm.models.moe.replay``).
    """
    module = nnx.merge(self.graphdef, params)
    extra = {name: value for name, value in (('aux_loss', aux_loss), ('routes', routes),
                                             ('return_routes', return_routes),
                                             ('token_mask', token_mask)) if value is not None
             and value is not False}
    return module(tokens, cache=cache, num_valid=num_valid, attend=attend, features=features,
                  **extra)

  def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
    """float32 logits ``[..., vocab]`` of final-normed hidden states ``[..., embed]`` (what
    ``apply(..., features=True)`` returns), by the tied embedding or the lm head."""
    return nnx.merge(self.graphdef, params).head(hidden)

  def init_cache(self, batch: int, max_len: int | None = None,
                 block_length: int | None = None) -> KVCache:
    """An empty cache of ``max_len`` positions, per layer in blocks of ``block_length``
    (default one block; layouts in ``KVCache``)."""
    return KVCache.init(self.config, batch, max_len, block_length)

  def prefill(self, params: Params, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
              *, return_routes: bool = False):
    """Writes right-padded prompts into the cache slots.

    Args:
      tokens: int32 ``[batch, P]``, row ``b`` valid for its first ``lengths[b]`` tokens.
      lengths: int32 ``[batch]`` in ``[1, P]``.
      cache: slots to append to (each row continues at its own ``cache.lengths[b]``).
    Returns:
      ``(logits of each row's last valid token, float32 [batch, vocab], new cache)``. Only
      those rows go through the lm head: logits at every position would cost SmolLM2-135M
      a fifth more FLOPs and a ``[batch, P, vocab]`` buffer nobody reads.
      ``return_routes`` (a mixture of experts) appends the experts each token was routed to,
      ``[batch, P, layers, k]`` (``Decoder``).
    """
    hidden, cache, *routes = self.apply(params, tokens, cache=cache, num_valid=lengths,
                                        features=True, return_routes=return_routes)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return (self.logits(params, last), cache, *routes)

  def decode_step(self, params: Params, tokens: jax.Array, cache: KVCache
                  ) -> tuple[jax.Array, KVCache]:
    """One token per slot: int32 ``[batch]`` -> (float32 logits ``[batch, vocab]``, cache)."""
    logits, cache = self.apply(params, tokens[:, None], cache=cache,
                               num_valid=jnp.ones(tokens.shape, jnp.int32))
    return logits[:, 0], cache

  def logical_axes(self) -> dict[str, Any]:
    """Logical axis names of every parameter, as a params-shaped tree of ``PartitionSpec``."""
    return _abstract(self.config)[2]

  def abstract_params(self) -> Params:
    """Params as ``jax.ShapeDtypeStruct`` leaves, without allocating."""
    return _abstract(self.config)[1]


@functools.cache
def _abstract(config: DecoderConfig) -> tuple[Any, Params, dict[str, Any]]:
  """``(graphdef, abstract params, logical axes)`` of a decoder via ``nnx.eval_shape``.

  Cached per (frozen, hashable) config: tracing a 64-layer model's init is not free, and the
  trainer, loaders and memory report all ask for it.
  """
  return describe(lambda: Decoder(config, rngs=nnx.Rngs(0)))


def describe(build: Callable[[], nnx.Module]) -> tuple[Any, Params, dict[str, Any]]:
  """``(graphdef, abstract params, logical axes)`` of the module ``build()`` makes, traced
  with ``nnx.eval_shape`` (nothing allocated)."""
  abstract = nnx.eval_shape(build)
  graphdef, state = nnx.split(abstract, nnx.Param)
  specs = jax.tree.map(lambda v: PartitionSpec(*v.get_metadata()['logical_axes']), state,
                       is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(specs)


def abstract_model(config: DecoderConfig) -> Model:
  """A ``Model`` for ``config`` without allocating params (loaders fill them in)."""
  return Model(config=config, graphdef=_abstract(config)[0])


def with_weight_layout(model: Model, layout: str, decode_attention: str | None = None,
                       layer_loop: str | None = None) -> Model:
  """``model`` with its weights stored in ``layout`` (``Execution.weight_layout``) and, if
  given, decoding with ``decode_attention`` (``Execution.decode_attention``) and running its
  layers as ``layer_loop`` (``Execution.layer_loop``: 'unrolled' keeps each layer's blocks
  in their own buffers): how the same params run, not what they are."""
  run = model.config.execution
  attention = run.decode_attention if decode_attention is None else decode_attention
  loop = run.layer_loop if layer_loop is None else layer_loop
  if (layout, attention, loop) == (run.weight_layout, run.decode_attention, run.layer_loop):
    return model
  return abstract_model(model.config.with_execution(weight_layout=layout,
                                                    decode_attention=attention,
                                                    layer_loop=loop))


def with_param_dtype(model: Model, dtype: Any) -> Model:
  """``model`` storing its params in ``dtype`` (``Execution.param_dtype``), e.g. an inference
  worker's bfloat16 copy of float32 master weights; ``model`` itself when it already does.
  The compute dtype is unchanged (weights are cast to it in each matmul either way)."""
  if jnp.dtype(dtype) == jnp.dtype(model.config.execution.param_dtype):
    return model
  return abstract_model(model.config.with_execution(param_dtype=dtype))


def cast_params(params: Params, model: Model) -> Params:
  """``params`` (of a model of ``model``'s architecture) with every leaf in ``model``'s dtype
  for it (``with_param_dtype``), rounded to nearest even. A ``jax.Array`` is converted where
  it lies, keeping its sharding (on a trainer spanning several processes every process must
  call it); a host array by numpy. A leaf already in its dtype is returned as it is (no
  copy)."""
  def cast(value, want: jax.ShapeDtypeStruct):
    if value.dtype == want.dtype:
      return value
    return value.astype(want.dtype)
  return jax.tree.map(cast, params, model.abstract_params())


def to_weight_layout(params: Params, source: Model, target: Model) -> Params:
  """``source``'s params in ``target``'s weight layout and layer loop (the models otherwise
  equal, but for ``decode_attention``, which does not touch the params).

  Each weight is transposed so that its logical axes (``Model.logical_axes``, which record
  the layout) come in ``target``'s order; every other param is passed through. Blocks
  stacked over the layers (``layer_loop='scan'``: one stack per run of layers,
  ``Architecture.layer_runs``) going to an ``'unrolled'`` model become one tree per layer
  (``params['blocks'][i]``, ``i`` over the whole stack), leaf by leaf: each leaf's layers
  are sliced out and transposed one at a time (the only transient copy: one layer's slice),
  so nothing is built beyond the per-layer copy; the other way they are stacked run by
  run. One definition for both
  directions: the engine converts the trainer's params with it, and a round trip is the
  identity (tested).
  """
  target_run = target.config.execution
  if source.config.with_execution(weight_layout=target_run.weight_layout,
                                  decode_attention=target_run.decode_attention,
                                  layer_loop=target_run.layer_loop) != target.config:
    raise ValueError('to_weight_layout converts between models that differ only in '
                     f'weight_layout and layer_loop; got {source.config} and {target.config}.')

  def move(value, axes_from: PartitionSpec, axes_to: PartitionSpec):
    axes_from, axes_to = tuple(axes_from), tuple(axes_to)
    if axes_from == axes_to:
      return value
    return jnp.transpose(value, [axes_from.index(axis) for axis in axes_to])
  axes_from, axes_to = source.logical_axes(), target.logical_axes()
  loops = (source.config.execution.layer_loop, target_run.layer_loop)
  if loops[0] == loops[1]:
    return jax.tree.map(move, params, axes_from, axes_to)
  runs = source.config.layer_runs()
  out = {name: jax.tree.map(move, value, axes_from[name], axes_to[name])
         for name, value in params.items() if name not in source.config.stack_names}
  unstacked = lambda spec: PartitionSpec(*tuple(spec)[1:])
  if loops == ('scan', 'unrolled'):
    out['blocks'] = {}
    for run in runs:
      unstack = lambda value, spec_from, spec_to, n=run.count: [
          move(value[i], unstacked(spec_from), spec_to) for i in range(n)]
      per_leaf = jax.tree.map(unstack, params[run.name], axes_from[run.name],
                              axes_to['blocks'][run.first])
      out['blocks'].update({run.first + i: jax.tree.map(lambda leaf, i=i: leaf[i], per_leaf,
                                                        is_leaf=lambda x: isinstance(x, list))
                            for i in range(run.count)})
  else:
    stack = lambda *values: jnp.stack(values)
    for run in runs:
      moved = [jax.tree.map(move, params['blocks'][i], axes_from['blocks'][i],
                            jax.tree.map(unstacked, axes_to[run.name],
                                         is_leaf=lambda x: isinstance(x, PartitionSpec)))
               for i in run.layers]
      out[run.name] = jax.tree.map(stack, *moved)
  return out


def create_model(config: DecoderConfig, seed: int = 0) -> tuple[Model, Params]:
  """Initialises a decoder. Returns ``(model, params)``; params are fp32 unless configured."""
  module = Decoder(config, rngs=nnx.Rngs(params=seed))
  graphdef, state = nnx.split(module, nnx.Param)
  return Model(config=config, graphdef=graphdef), nnx.to_pure_dict(state)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Log-probability of each target under ``logits``.

  Args:
    logits: float ``[batch, length, vocab]``.
    targets: int ``[batch, length]``.
  Returns:
    float32 ``[batch, length]``: ``log_softmax(logits)[b, t, targets[b, t]]``.
  """
  logp = jax.nn.log_softmax(logits.astype(jax.numpy.float32), axis=-1)
  return jax.numpy.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def split_module(module: Any) -> tuple[Model, Params]:
  """``(Model, params)`` of an NNX ``Decoder`` (e.g. from ``from_pretrained``)."""
  graphdef, state = nnx.split(module, nnx.Param)
  return Model(config=module.config, graphdef=graphdef), nnx.to_pure_dict(state)
