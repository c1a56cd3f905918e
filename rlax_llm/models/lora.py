"""LoRA: low-rank adapters on a frozen decoder's projections, and their export.

Each adapted weight ``W`` (any of the ``TARGETS``: ``q, k, v, o, gate, up, down``) gains
``A [in..., r]`` and ``B [r, out...]`` (``nnx.LoRAParam``, the only trained state), and its
projection computes ``x @ W + s * (x @ A) @ B`` with ``s = alpha / r`` (Hu et al., "LoRA:
Low-Rank Adaptation of Large Language Models", arXiv 2106.09685). ``A`` is drawn as PEFT draws
it (``kaiming_uniform(a=sqrt(5))``: uniform in ``+-1/sqrt(in)``), ``B`` starts at zeros, so a
fresh adapter leaves the model unchanged. ``A`` keeps the adapted weight's input axes and
``B`` its output axes (logical axes, so they shard like the weight they adapt; ``r`` is
replicated). The adapters live on the decoder's ``Attention``/``MLP`` modules as
``{weight}_lora`` (an ``Adapter``); ``decoder.linear`` applies them (its ``low_rank``).

A ``LoRAModel`` is a ``Model`` whose params hold the base and the adapters, stacked over the
layers like the weights they adapt (``params['blocks']['attn']['wq_lora'] = {'a': A [layers,
in..., r], 'b': B [layers, r, out...]}``; in a stack mixing dense and MoE layers, in each run's
stack: ``Architecture.layer_runs``, the MLP targets in the dense runs only, ``run_targets``);
``trainable_mask`` marks the adapters (by their ``nnx.LoRAParam`` type) for
``Trainer(trainable=...)``. ``merge`` folds them into the base (``W + s * A @ B``);
``save_merged`` writes that as a Hugging Face checkpoint and ``save_peft`` the adapters alone
in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``).

Weight sync (``LoRAConfig.sync``, ``lora.sync``): with ``'adapters'`` a trainer pushes
``pushed_base`` once (the base, in the workers' dtype) and ``pushed_params`` per version,
``adapter_tree(params)`` alone; the workers merge each version into the base they hold
(``merge_program``; ``rlax_llm.rollout.worker``). With ``'merged'`` ``pushed_params`` is the
merged weights. ``delta`` computes ``s * A @ B`` with the same bits on any device and
sharding, so both give the same weights. ``LoRAConfig.sync_dtype`` (``lora.sync_dtype``) narrows
the adapters for the wire (``synced_adapters``: bfloat16, or int8 with a scale per rank
component); the workers then merge the rounded adapters (``wire_factor``), a policy a rounding
away from the trainer's.

QLoRA (``LoRAConfig.base_quant``, ``lora.base_quant='int8'``; Dettmers et al., "QLoRA:
Efficient Finetuning of Quantized LLMs", arXiv 2305.14314, with int8 in place of NF4): ``create``
stores the base's seven projection weights as ``quant.Int8Weight`` (``quant.quantize_params``:
int8, a float32 scale per output channel), the adapters float32 on top; ``decoder.linear``
computes ``(x @ q) * scale + x @ A @ (s * B)``. The policy is the dequantised base plus the
adapters: ``merge`` and ``pushed_base`` dequantise (``quant.dequantize``), so workers sample with
the weights the trainer differentiates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from rlax_llm import model_spec
from rlax_llm.errors import ConfigError
from rlax_llm.models.decoder import Decoder, stack_layers
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.files import hf
from rlax_llm.models.files.pretrained import save_pretrained
from rlax_llm.models.model import Model, Params, abstract_model, cast_params, describe
from rlax_llm.models.quant import QUANT_MODES, Int8Weight, dequantize, quantize, quantize_params

TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
# target -> (module in a block, weight name, how many leading (in_out) axes are inputs,
# PEFT's module name inside ``model.layers.{i}.``).
_WEIGHTS = {
    'q': ('attn', 'wq', 1, 'self_attn.q_proj'),
    'k': ('attn', 'wk', 1, 'self_attn.k_proj'),
    'v': ('attn', 'wv', 1, 'self_attn.v_proj'),
    'o': ('attn', 'wo', 2, 'self_attn.o_proj'),
    'gate': ('mlp', 'w_gate', 1, 'mlp.gate_proj'),
    'up': ('mlp', 'w_up', 1, 'mlp.up_proj'),
    'down': ('mlp', 'w_down', 1, 'mlp.down_proj'),
}
# The targets in a block's dense MLP: a MoE layer has none (its experts get no adapters).
MLP_TARGETS = tuple(t for t in TARGETS if _WEIGHTS[t][0] == 'mlp')
SUFFIX = '_lora'  # an adapter's attribute: f'{weight}{SUFFIX}' (decoder.low_rank reads it)
# How a LoRA trainer sends each version (``lora.sync``) and the dtype adapter versions travel
# in (``lora.sync_dtype``): named in ``model_spec``, where they are described.
SYNCS = model_spec.LORA_SYNCS
SYNC_DTYPES = model_spec.LORA_SYNC_DTYPES
# How each adapter factor is quantised for the int8 wire (``quant.quantize``'s layout, one
# output axis): ``A [in..., r]`` with a scale per rank column, ``B [r, out...]`` with one per
# rank row, so the scales cost ``2 r`` floats per adapter (a scale per output of ``B`` would
# add a quarter to its bytes at rank 16).
_WIRE_LAYOUT = {'a': 'in_out', 'b': 'out_in'}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Which projections are adapted, at what rank, the scale ``alpha / rank``, and how a
  trainer sends each version to the workers (``sync``, one of ``SYNCS``: ``'adapters'``, the
  adapter tree alone over a base pushed once; ``'merged'``, the merged weights), and how the
  frozen base is stored (``base_quant``, one of ``quant.QUANT_MODES``: ``'none'``, in the
  model's param dtype; ``'int8'``, its projections as ``quant.Int8Weight``, QLoRA-style)."""

  rank: int
  alpha: float
  targets: tuple[str, ...] = TARGETS
  sync: str = 'adapters'
  base_quant: str = 'none'
  sync_dtype: str = 'float32'

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ConfigError(f'lora.rank={self.rank!r} must be an int >= 1 (0 turns LoRA off).')
    if not self.alpha > 0:
      raise ConfigError(f'lora.alpha={self.alpha!r} must be > 0 (the scale is alpha / rank).')
    unknown = sorted(set(self.targets) - set(TARGETS))
    if unknown or not self.targets:
      raise ConfigError(f'lora.targets={self.targets!r}: {unknown or "empty"}; choose a '
                        f'non-empty subset of {TARGETS}.')
    if self.sync not in SYNCS:
      raise ConfigError(f'lora.sync={self.sync!r}; choose one of {SYNCS}.')
    if self.sync_dtype not in SYNC_DTYPES:
      raise ConfigError(f'lora.sync_dtype={self.sync_dtype!r}; choose one of {SYNC_DTYPES}.')
    if self.sync_dtype != 'float32' and self.sync != 'adapters':
      raise ConfigError(f'lora.sync_dtype={self.sync_dtype!r} rounds the adapter versions of '
                        f'adapter-only sync, but lora.sync={self.sync!r} pushes merged weights '
                        '(their dtype is model.inference_param_dtype). Set '
                        "lora.sync='adapters' or lora.sync_dtype='float32'.")
    if self.base_quant not in QUANT_MODES:
      raise ConfigError(f'lora.base_quant={self.base_quant!r}; choose one of {QUANT_MODES}.')
    object.__setattr__(self, 'targets', tuple(t for t in TARGETS if t in self.targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


class Adapter(nnx.Module):
  """One weight's ``A [in..., r]`` (PEFT's uniform ``+-1/sqrt(in)``) and ``B [r, out...]``
  (zeros), in ``dtype``, and the scale ``s``."""

  def __init__(self, inputs: tuple[tuple[int, str], ...], outputs: tuple[tuple[int, str], ...],
               rank: int, scale: float, dtype: Any, *, rngs: nnx.Rngs):
    in_sizes, in_axes = zip(*inputs)
    out_sizes, out_axes = zip(*outputs)
    bound = math.prod(in_sizes) ** -0.5
    self.a = nnx.LoRAParam(
        jax.random.uniform(rngs.params(), in_sizes + (rank,), dtype, -bound, bound),
        logical_axes=in_axes + (None,))
    self.b = nnx.LoRAParam(jnp.zeros((rank,) + out_sizes, dtype), logical_axes=(None,) + out_axes)
    self.scale = scale

  def pair(self, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(A [K, r], s * B [r, N])`` in ``dtype`` (``decoder.linear``'s ``low_rank``)."""
    return _pair(self.a[...], self.b[...], self.scale, dtype)


def _pair(a, b, scale: float, dtype: Any):
  rank = a.shape[-1]
  return (a.astype(dtype).reshape(-1, rank),
          (b.astype(dtype) * jnp.asarray(scale, dtype)).reshape(rank, -1))


def _sides(weight: nnx.Param, num_in: int, layout: str):
  """The ``(size, logical axis)`` pairs of a stacked weight's inputs and outputs (its
  leading layer axis left out)."""
  pairs = tuple(zip(weight.shape, weight.get_metadata()['logical_axes']))[1:]
  if layout == 'in_out':
    return pairs[:num_in], pairs[num_in:]
  return pairs[-num_in:], pairs[:-num_in]


def run_targets(lora: LoRAConfig, moe: bool) -> tuple[str, ...]:
  """The targets of ``lora`` adapted in a layer (or run of layers,
  ``Architecture.layer_runs``) that is a MoE layer (``moe``) or not: all of them in a dense
  layer, the attention's alone in a MoE layer (its experts have no adapters: ``MLP_TARGETS``
  adapt the dense layers of a stack mixing both). The memory plan counts the same ones
  (``presets.activation_bytes``)."""
  return tuple(t for t in lora.targets if not (moe and t in MLP_TARGETS))


def add_adapters(decoder: Decoder, lora: LoRAConfig, rngs: nnx.Rngs) -> Decoder:
  """Attaches a fresh ``Adapter`` to each of ``lora.targets`` in every block of ``decoder``
  (in place; returned for convenience): one per target stacked over the layers
  (``decoder.stack_layers``), as the blocks are (per run of layers in a stack mixing dense
  and MoE layers, ``Architecture.layer_runs``). Adapters are float32 whatever the base's
  ``param_dtype`` (a bfloat16 base keeps float32 trained state, as PEFT does).

  The MLP targets (``MLP_TARGETS``: ``gate, up, down``) adapt dense MLPs only
  (``run_targets``): in a stack mixing dense and MoE layers (Qwen3-MoE's
  ``decoder_sparse_step``, ``mlp_only_layers``) the dense layers' MLPs, the MoE layers'
  experts staying without adapters. Raises ConfigError naming them when the model has no
  dense layer (every layer a mixture of experts)."""
  run = decoder.config.execution
  dense_mlp = sorted(t for t in lora.targets if t in MLP_TARGETS)
  c = decoder.config
  if c.is_moe and dense_mlp and c.num_moe_layers == c.num_layers:
    raise ConfigError(f'lora.targets includes {dense_mlp}, but every layer of this mixture of '
                      'experts is MoE: none has a dense MLP (adapters on the experts are not '
                      'built yet); set lora.targets to attention weights only, e.g. '
                      '\'q,k,v,o\'.')
  for layers in decoder.config.layer_runs():
    for target in run_targets(lora, layers.moe):
      part, name, num_in, _ = _WEIGHTS[target]
      module = getattr(getattr(decoder, layers.name), part)
      inputs, outputs = _sides(getattr(module, name), num_in, run.weight_layout)
      setattr(module, name + SUFFIX, stack_layers(
          lambda r, inputs=inputs, outputs=outputs: Adapter(
              inputs, outputs, lora.rank, lora.scale, jnp.float32, rngs=r),
          layers.count, rngs))
  return decoder


@functools.cache
def abstract_tree(config: DecoderConfig, lora: LoRAConfig):
  """``(graphdef, abstract params, logical axes)`` of the base with ``lora``'s adapters; with
  ``lora.base_quant='int8'`` each projection an ``Int8Weight`` (``q`` on the weight's axes,
  ``scale`` replicated)."""
  graphdef, abstract, axes = describe(
      lambda: add_adapters(Decoder(config, rngs=nnx.Rngs(0)), lora, nnx.Rngs(0)))
  if lora.base_quant == 'int8':
    abstract = jax.eval_shape(functools.partial(quantize_params, model=abstract_model(config)),
                              abstract)
    axes = jax.tree.map(
        lambda spec, value: (Int8Weight(q=spec, scale=PartitionSpec(None))
                             if isinstance(value, Int8Weight) else spec),
        axes, abstract, is_leaf=lambda x: isinstance(x, (PartitionSpec, Int8Weight)))
  return graphdef, abstract, axes


@dataclasses.dataclass(frozen=True, eq=False)
class LoRAModel(Model):
  """A ``Model`` whose params hold the frozen base and ``lora``'s adapters."""

  lora: LoRAConfig

  def logical_axes(self) -> dict[str, Any]:
    return abstract_tree(self.config, self.lora)[2]

  def abstract_params(self) -> Params:
    return abstract_tree(self.config, self.lora)[1]


def create(model: Model, params: Params, lora: LoRAConfig, seed: int = 0
           ) -> tuple[LoRAModel, Params]:
  """``model``'s params (the base, kept as they are: same arrays; with
  ``lora.base_quant='int8'`` its projections quantised, ``quant.quantize_params``) with fresh
  adapters (``A`` drawn from ``seed``, ``B`` zeros). Returns ``(LoRAModel, params)``."""
  if isinstance(model, LoRAModel):
    raise ConfigError('create: the model already has LoRA adapters; pass its base model.')
  module = add_adapters(nnx.merge(model.graphdef, params), lora, nnx.Rngs(params=seed))
  graphdef, state = nnx.split(module, nnx.Param)
  params = nnx.to_pure_dict(state)
  if lora.base_quant == 'int8':
    params = jax.jit(functools.partial(quantize_params, model=model))(params)
  return LoRAModel(config=model.config, graphdef=graphdef, lora=lora), params


def is_adapter_path(path: tuple) -> bool:
  """Whether a params path (``jax.tree_util`` keys) is inside an adapter."""
  return any(str(getattr(key, 'key', '')).endswith(SUFFIX) for key in path)


def trainable_mask(model: LoRAModel) -> Params:
  """A params-shaped tree of bools: True at the adapters (the ``nnx.LoRAParam`` leaves), False
  at the frozen base (``Trainer``'s ``trainable``; one False for an ``Int8Weight``)."""
  abstract = nnx.eval_shape(
      lambda: add_adapters(Decoder(model.config, rngs=nnx.Rngs(0)), model.lora, nnx.Rngs(0)))
  mask = jax.tree.map(lambda v: isinstance(v, nnx.LoRAParam), nnx.state(abstract, nnx.Param),
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(mask)


def _adapted(model: LoRAModel, params: Params):
  """``(run of layers, target, the run's blocks' params dict of its part, weight name,
  adapter params)`` of every adapted weight (all stacked over the run's layers;
  ``Architecture.layer_runs``; a MoE run's attention targets only, ``run_targets``)."""
  for layers in model.config.layer_runs():
    for target in run_targets(model.lora, layers.moe):
      part, name, _, _ = _WEIGHTS[target]
      node = params[layers.name][part]
      yield layers, target, node, name, node[name + SUFFIX]


def delta(model: LoRAModel, a: jax.Array, b: jax.Array) -> jax.Array:
  """An adapter's ``s * A @ B`` as float32 ``[K, N]`` (``A [in..., r]`` flattened to ``K``
  rows, ``B [r, out...]`` to ``N`` columns), summed over the rank in a fixed order of
  elementwise products: the same bits on whichever devices and shardings it runs (a dot's
  summation order, and on TPU its precision, depend on both), so a worker merging the
  adapters it pulls gets the weights a trainer merging them would."""
  a, b = _pair(a, b, model.lora.scale, jnp.float32)
  out = a[:, :1] * b[:1, :]
  for i in range(1, a.shape[1]):
    out = out + a[:, i:i + 1] * b[i:i + 1, :]
  return out


def dequantized(model: Model, params: Params, dtype: Any = jnp.float32) -> Params:
  """``params`` with every ``Int8Weight`` (a QLoRA base, ``lora.base_quant='int8'``) as the
  weight it stands for, ``q * scale`` (``quant.dequantize``, in float32, stored in ``dtype``;
  ``model``'s layout); every other leaf as it is."""
  layout = model.config.execution.weight_layout
  return jax.tree.map(
      lambda w: dequantize(w, layout).astype(dtype) if isinstance(w, Int8Weight) else w,
      params, is_leaf=lambda x: isinstance(x, Int8Weight))


def merge(model: LoRAModel, params: Params) -> tuple[Model, Params]:
  """The base model and its params with every adapter folded in: ``W + s * A @ B``
  (``delta``, in float32, stored in ``W``'s dtype, or the model's param dtype for an int8
  base's dequantised ``W``; ``W``'s layout). Host or device arrays alike (``merge_program`` is
  the jitted form)."""
  out = jax.tree.map(lambda x: x, params, is_leaf=lambda x: isinstance(x, Int8Weight))
  dtype = model.config.execution.param_dtype
  for _, _, node, name, adapter in _adapted(model, out):
    weight = dequantized(model, node[name])
    change = jax.vmap(functools.partial(delta, model))(  # layer by layer: [layers, K, N]
        wire_factor(adapter['a'], 'a'), wire_factor(adapter['b'], 'b'))
    if model.config.execution.weight_layout == 'out_in':
      change = jnp.swapaxes(change, 1, 2)
    stored = dtype if isinstance(node[name], Int8Weight) else weight.dtype
    node[name] = (weight.astype(jnp.float32) + change.reshape(weight.shape)).astype(stored)
  for _, _, node, name, _ in list(_adapted(model, out)):
    del node[name + SUFFIX]
  return abstract_model(model.config), dequantized(model, out, dtype)


def save_merged(model: LoRAModel, params: Params, tokenizer: Any, out_dir: str | pathlib.Path,
                *, base_model: str = '') -> None:
  """The merged model (``merge``) as a Hugging Face directory (``save_pretrained``)."""
  merged = merge_program(model)(params)
  save_pretrained(nnx.merge(abstract_model(model.config).graphdef, merged), tokenizer, out_dir,
                  base_model=base_model)


def peft_tensors(model: LoRAModel, params: Params) -> dict[str, np.ndarray]:
  """The adapters under PEFT's names and layouts: ``base_model.model.model.layers.{i}.
  self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (the
  scale is not folded in: PEFT applies ``lora_alpha / r`` itself). Host arrays, stored dtype."""
  if model.config.execution.weight_layout != 'in_out':
    raise ConfigError('peft_tensors exports in_out params (the trainer\'s layout); got '
                      f'weight_layout={model.config.execution.weight_layout!r}.')
  tensors = {}
  rank = model.lora.rank
  for layers, target, _, _, adapter in _adapted(model, params):
    a, b = (np.asarray(jax.device_get(adapter[factor])) for factor in 'ab')
    for j, i in enumerate(layers.layers):
      prefix = f'base_model.model.model.layers.{i}.{_WEIGHTS[target][3]}'
      tensors[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(a[j].reshape(-1, rank).T)
      tensors[f'{prefix}.lora_B.weight'] = np.ascontiguousarray(b[j].reshape(rank, -1).T)
  return tensors


def save_peft(model: LoRAModel, params: Params, out_dir: str | pathlib.Path, *,
              base_model: str = '') -> None:
  """The adapters alone in PEFT's format: ``adapter_config.json`` and
  ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads onto the
  ``transformers`` model of the base (``base_model``: its hub id or path, recorded as
  ``base_model_name_or_path``). ``target_modules`` names the adapted projections
  (``['q_proj', ...]``); with MLP targets on a stack mixing dense and MoE layers it is a
  regular expression (which PEFT matches whole against each module's name) naming the
  projections by their place in a layer (``self_attn.q_proj``, ``mlp.gate_proj``), so the
  MoE layers' experts (``mlp.experts...``) are never adapted. PEFT 0.21 on transformers 5
  does not load those onto the dense MLPs: it rewrites a Qwen3-MoE model's ``gate_proj``,
  ``up_proj`` and ``down_proj`` targets to its fused experts' parameters whatever the
  pattern (docs/models.md#lora; ``save_merged`` exports such a model)."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  config = {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path': base_model,
      'r': model.lora.rank, 'lora_alpha': model.lora.alpha, 'lora_dropout': 0.0,
      'target_modules': _peft_target_modules(model),
      'bias': 'none', 'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
      'init_lora_weights': True, 'inference_mode': True, 'modules_to_save': None,
      'layers_to_transform': None, 'rank_pattern': {}, 'alpha_pattern': {},
  }
  (out / 'adapter_config.json').write_text(json.dumps(config, indent=2))
  hf.write_safetensors(out / 'adapter_model.safetensors', peft_tensors(model, params))


def _peft_target_modules(model: LoRAModel) -> list[str] | str:
  """PEFT's ``target_modules`` for ``model``'s adapters (``save_peft``)."""
  targets = model.lora.targets
  if not (model.config.is_moe and any(t in MLP_TARGETS for t in targets)):
    return sorted(_WEIGHTS[t][3].split('.')[-1] for t in targets)
  places = '|'.join(_WEIGHTS[t][3].replace('.', r'\.') for t in targets)
  return rf'.*\.layers\.\d+\.({places})'


@functools.cache
def merge_program(model: LoRAModel) -> Any:
  """``merge(model, params)[1]`` as one jitted program (compiled once per model)."""
  return jax.jit(lambda params: merge(model, params)[1])


def lora_model(model: Model, lora: LoRAConfig) -> LoRAModel:
  """The ``LoRAModel`` of base ``model`` (any dtypes and layout) with ``lora``'s adapters."""
  return LoRAModel(config=model.config, graphdef=abstract_tree(model.config, lora)[0], lora=lora)


def _split(tree: Params, adapters: bool) -> Params:
  """The adapters' subtrees of ``tree`` (``adapters``) or everything else, same nesting."""
  out = {}
  for key, value in tree.items():
    if str(key).endswith(SUFFIX):
      if adapters:
        out[key] = value
    elif isinstance(value, dict):
      part = _split(value, adapters)
      if part or not adapters:
        out[key] = part
    elif not adapters:
      out[key] = value
  return out


def adapter_tree(params: Params) -> Params:
  """The adapters of a ``LoRAModel``'s params alone, nested as in ``params``
  (``{'blocks': {'attn': {'wq_lora': {'a': A, 'b': B}, ...}, 'mlp': {...}}}``; ``A``
  float32 ``[layers, in..., r]``, ``B`` float32 ``[layers, r, out...]``, the same arrays):
  the tree a LoRA trainer pushes per version with ``lora.sync='adapters'``."""
  return _split(params, adapters=True)


def base_tree(params: Params) -> Params:
  """A ``LoRAModel``'s params without the adapters: the frozen base (the same arrays)."""
  return _split(params, adapters=False)


def with_adapters(base: Params, adapters: Params) -> Params:
  """``base`` (``base_tree``) and ``adapters`` (``adapter_tree``) as one ``LoRAModel`` params
  tree (fresh containers, the same arrays)."""
  out = jax.tree.map(lambda x: x, base)
  def put(node: dict, part: dict) -> None:
    for key, value in part.items():
      if str(key).endswith(SUFFIX):
        node[key] = value
      else:
        put(node[key], value)
  put(out, adapters)
  return out


def syncs_adapters(model: Model) -> bool:
  """Whether a trainer of ``model`` pushes adapter versions over a base pushed once (a
  ``LoRAModel`` with ``lora.sync='adapters'``)."""
  return isinstance(model, LoRAModel) and model.lora.sync == 'adapters'


def synced_adapters(lora: LoRAConfig, adapters: Params) -> Params:
  """An adapter tree (``adapter_tree``: arrays or ``jax.ShapeDtypeStruct``s) as a version
  travels with adapter-only sync: every ``A`` and ``B`` in ``lora.sync_dtype`` (float32: the
  trained arrays themselves; bfloat16: rounded to nearest even; int8: an ``Int8Weight`` each,
  ``quant.quantize`` with one float32 scale per rank component, ``_WIRE_LAYOUT``). The
  trainer's push (``pushed_params``) and the worker's expected tree (``rollout.worker``) both
  come from it; ``merge`` (the worker's ``merge_program``) takes its int8 factors as they come
  (``wire_factor``)."""
  if lora.sync_dtype == 'int8':
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(adapters)):
      return jax.eval_shape(_int8_wire, adapters)
    return _int8_wire_program(adapters)
  dtype = jnp.dtype(lora.sync_dtype)
  def cast(leaf):
    if leaf.dtype == dtype:
      return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
    return leaf.astype(dtype)
  return jax.tree.map(cast, adapters)


def _int8_wire(adapters: Params) -> Params:
  """Every factor of ``adapters`` on the int8 wire: ``quantize`` with the rank as its one
  output axis (``A``'s last, ``B``'s first; ``_WIRE_LAYOUT`` by the factor's name), layer by
  layer (the factors are stacked)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: quantize(leaf, 1, _WIRE_LAYOUT[path[-1].key], stacked=True), adapters)


_int8_wire_program = jax.jit(_int8_wire)  # one program per version, not ~6 ops per factor


def wire_factor(factor: Any, name: str) -> jax.Array:
  """An adapter factor (``name``: ``'a'`` or ``'b'``) as ``merge`` uses it: an ``Int8Weight``
  from the int8 wire (``synced_adapters``) dequantised to float32 (``q * scale``), any other
  array as it is."""
  if isinstance(factor, Int8Weight):
    return dequantize(factor, _WIRE_LAYOUT[name])
  return factor


def pushed_params(model: Model, params: Params, inference: Model) -> Params:
  """What a trainer of ``model`` pushes to the workers as each version, whose model is
  ``inference`` (the base model in the workers' dtypes, ``roles.inference_model``):
  ``adapter_tree(params)`` in ``lora.sync_dtype`` (``synced_adapters``; float32, the default:
  as trained) when ``syncs_adapters(model)``; else the params, a ``LoRAModel``'s merged
  first (``merge_program``, on the trainer's devices), cast to ``inference``'s dtypes
  (``cast_params``)."""
  if syncs_adapters(model):
    return synced_adapters(model.lora, adapter_tree(params))
  if isinstance(model, LoRAModel):
    params = merge_program(model)(params)
  return cast_params(params, inference)


def pushed_base(model: Model, params: Params, inference: Model) -> Params | None:
  """What a trainer of ``model`` pushes to the workers once, before its first version: the
  base (``base_tree``; an int8 base dequantised, ``dequantized``, the policy the trainer
  differentiates) cast to ``inference``'s dtypes when ``syncs_adapters(model)``, else None
  (every version carries the whole weights)."""
  if not syncs_adapters(model):
    return None
  return cast_params(dequantized(model, base_tree(params)), inference)


def from_config(config: Any) -> LoRAConfig | None:
  """The run config's ``lora`` section as a ``LoRAConfig``; None when ``lora.rank`` is 0."""
  if config.lora.rank == 0:
    return None
  targets = tuple(t.strip() for t in config.lora.targets.split(',') if t.strip())
  return LoRAConfig(config.lora.rank, float(config.lora.alpha), targets, config.lora.sync,
                    config.lora.base_quant, config.lora.sync_dtype)
