"""Named model presets (architectures of the real targets), and memory per device on a mesh.

The architectures are ``model_spec.PRESET_ARCHITECTURES`` (a leaf module, so that the config
boundary checks ``model.name`` without JAX); ``PRESETS`` holds them as ``DecoderConfig``s.
Sizes follow each model's published ``config.json`` on the Hugging Face hub (the fields, in
hub terms: ``vocab_size``, ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` (else ``hidden_size / num_attention_heads``),
``intermediate_size``, ``rope_theta``, ``rope_scaling``, ``rms_norm_eps``,
``tie_word_embeddings``, ``max_position_embeddings``). ``memory_per_device`` uses
``jax.eval_shape`` (nothing is allocated) and the logical-axis sharding rules to report the
bytes of params and optimizer state each device holds; ``memory_plan`` adds the rest of a
run's bytes per chip (gradients, activations, the inference copy, its KV cache), with LoRA
(``models.lora``) and int8 workers (``models.quant``) counted as those modules build them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from rlax_llm import model_spec
from rlax_llm import sharding as sharding_lib
from rlax_llm.errors import ConfigError
from rlax_llm.models import lora as lora_lib
from rlax_llm.models import moe
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.files.gguf import smollm2_gguf_path
from rlax_llm.models.kv_cache import KV_CACHE_QUANT_MODES, block_layout
from rlax_llm.models.model import abstract_model
from rlax_llm.models.quant import QUANT_MODES, Int8Weight, quantize_params, quantized_shardings

# The presets' architectures are ``model_spec.PRESET_ARCHITECTURES`` (a leaf module: the
# config boundary checks ``model.name`` without JAX); here each runs with the default
# ``Execution``.
PRESETS: dict[str, DecoderConfig] = {
    name: DecoderConfig(**architecture.fields())
    for name, architecture in model_spec.PRESET_ARCHITECTURES.items()}

# Tiny random mixtures of experts of each MoE family for tests and benchmarks (Qwen3-30B-A3B's
# and Mixtral-8x7B's shapes scaled down: 8 experts, top-2, 2 layers); not model names.
_TINY_MOE = dict(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                 head_dim=8, max_seq_len=64, tie_embeddings=False, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True)
TINY_MOE_PRESETS: dict[str, DecoderConfig] = {
    'tiny-qwen3-moe': DecoderConfig(family='qwen3_moe', qk_norm=True, mlp_dim=64,
                                    moe_mlp_dim=16, **_TINY_MOE),
    'tiny-mixtral': DecoderConfig(family='mixtral', mlp_dim=16, moe_mlp_dim=16, **_TINY_MOE),
}

# Presets whose checkpoint ships as a pip package (``model_spec.PACKAGED_CHECKPOINTS``): the
# function that finds its file.
_PACKAGED_FILES = {'smollm2-135m': smollm2_gguf_path}
PACKAGED_CHECKPOINTS = {name: _PACKAGED_FILES[name] for name in model_spec.PACKAGED_CHECKPOINTS}


def packaged_checkpoint(name: str):
  """The local path of preset ``name``'s packaged checkpoint.

  Raises ValueError when none ships with rlax_llm (pass the checkpoint's path instead), and
  FileNotFoundError when its package is not installed.
  """
  if name not in PACKAGED_CHECKPOINTS:
    raise ValueError(f'no checkpoint of {name!r} ships with rlax_llm (packaged: '
                     f'{sorted(PACKAGED_CHECKPOINTS)}); pass the path of an HF directory or a '
                     '.gguf file of the model.')
  return PACKAGED_CHECKPOINTS[name]()


def get_preset(name: str, **overrides: Any) -> DecoderConfig:
  """A named config (``PRESETS``) with optional field overrides (e.g. ``max_seq_len``, or
  ``execution=Execution(dtype=jnp.bfloat16)``)."""
  if name not in PRESETS:
    raise ValueError(f'Unknown model {name!r}; choose one of {sorted(PRESETS)}.')
  return dataclasses.replace(PRESETS[name], **overrides)


def count_params(config: DecoderConfig) -> int:
  """Number of parameters (tied embeddings counted once)."""
  params = abstract_model(config).abstract_params()
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def active_params(config: DecoderConfig) -> int:
  """Parameters one token's forward pass uses: ``count_params`` less, in a mixture of
  experts, the ``num_experts - num_experts_per_tok`` experts it is not routed to
  (``3 * embed * moe_mlp_dim`` each per MoE layer). The ``N`` of the ``2 N`` / ``6 N`` model
  FLOPs per token (Qwen3-30B-A3B: 3.35 B of 30.53 B; Mixtral-8x7B: 12.88 B of 46.70 B, the
  published 3.3 B and 12.9 B active)."""
  idle = config.num_experts - config.num_experts_per_tok
  return count_params(config) - config.num_moe_layers * idle * 3 * config.embed_dim * (
      config.moe_mlp_dim)


def _leaf_shards(abstract: Any, shardings: Any) -> list[tuple[tuple, int, int]]:
  """``(path, elements, bytes)`` of each leaf of ``abstract`` (``ShapeDtypeStruct`` leaves)
  on one device of its ``NamedSharding`` (``shardings``, the same tree), the most loaded one:
  shards are equal-sized under the logical rules, and a replicated leaf is whole on each."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(abstract)
  out = []
  for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
    elements = math.prod(sharding.shard_shape(leaf.shape))
    out.append((path, elements, elements * jnp.dtype(leaf.dtype).itemsize))
  return out


def _abstract_mesh(axis_sizes: Mapping[str, int]) -> AbstractMesh:
  return AbstractMesh(tuple(axis_sizes[a] for a in sharding_lib.MESH_AXES),
                      sharding_lib.MESH_AXES)


def _param_shards(config: DecoderConfig, axis_sizes: Mapping[str, int],
                  rules: Sequence[tuple[str, Any]], *, lora: lora_lib.LoRAConfig | None = None,
                  quant: str = 'none') -> list[tuple[tuple, int, int]]:
  """``_leaf_shards`` of ``config``'s params on a mesh of ``axis_sizes`` (``{'data': n,
  'fsdp': n, 'tensor': n}``), placed by the logical ``rules`` as ``sharding.param_shardings``
  places them: with ``lora`` the base and its adapters (``lora.add_adapters``; adapter paths
  satisfy ``lora.is_adapter_path``), with ``quant='int8'`` as ``quant.quantize_params``
  makes them and ``quant.quantized_shardings`` places them (int8 ``q`` like the weight, the
  float32 scales replicated)."""
  model = abstract_model(config)
  abstract, logical = ((model.abstract_params(), model.logical_axes()) if lora is None
                       else lora_lib.abstract_tree(config, lora)[1:])
  shardings = sharding_lib.param_shardings(abstract, logical, _abstract_mesh(axis_sizes), rules)
  if quant == 'int8':
    abstract = jax.eval_shape(functools.partial(quantize_params, model=model), abstract)
    shardings = quantized_shardings(shardings, model)
  return _leaf_shards(abstract, shardings)


def _base_cast_bytes(config: DecoderConfig, inference: DecoderConfig,
                     axis_sizes: Mapping[str, int], rules: Sequence[tuple[str, Any]]) -> int:
  """Bytes on the most loaded device of ``config``'s params cast to ``inference``'s dtypes
  where the trainer holds them (``model.cast_params`` keeps each leaf's sharding, and returns
  a leaf already in its dtype as it is: only the others make a copy)."""
  model = abstract_model(config)
  source, target = model.abstract_params(), abstract_model(inference).abstract_params()
  shardings = sharding_lib.param_shardings(source, model.logical_axes(),
                                           _abstract_mesh(axis_sizes), rules)
  cast = [s.dtype != t.dtype for s, t in zip(jax.tree.leaves(source), jax.tree.leaves(target),
                                             strict=True)]
  return sum(b for (_, _, b), copied in zip(_leaf_shards(target, shardings), cast, strict=True)
             if copied)


def _dequantized_bytes(config: DecoderConfig, axis_sizes: Mapping[str, int],
                       rules: Sequence[tuple[str, Any]]) -> int:
  """Bytes on the most loaded device of the float32 weights ``lora.dequantized`` makes of
  a QLoRA base's projections (``quant.quantize_params``' ``Int8Weight`` leaves), placed like
  the weights."""
  model = abstract_model(config.with_execution(param_dtype=jnp.float32))
  abstract = model.abstract_params()
  quantised = jax.eval_shape(functools.partial(quantize_params, model=model), abstract)
  is_int8 = [isinstance(leaf, Int8Weight) for leaf in jax.tree.leaves(
      quantised, is_leaf=lambda x: isinstance(x, Int8Weight))]
  shardings = sharding_lib.param_shardings(abstract, model.logical_axes(),
                                           _abstract_mesh(axis_sizes), rules)
  return sum(b for (_, _, b), int8 in zip(_leaf_shards(abstract, shardings), is_int8,
                                          strict=True) if int8)


def worker_param_bytes(config: DecoderConfig, mesh: Mapping[str, int], *, quant: str = 'none',
                       lora: lora_lib.LoRAConfig | None = None,
                       rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES
                       ) -> dict[str, float]:
  """Bytes of the params one inference worker keeps on its most loaded device (nothing is
  allocated): the one definition the memory plan (``memory_plan``) and the pre-run fit check
  (``memory_fit.rollout_memory_bytes``) share.

  Args:
    config: the workers' model (its ``param_dtype``: the dtype of the copy they pull,
      ``model.inference_param_dtype``).
    mesh: the worker's axis sizes (``{'data', 'fsdp', 'tensor'}``; all 1: the whole copy).
    quant: ``model.inference_quant``. ``'int8'``: the copy the engine samples with is
      ``quant.quantize_params``' tree (one byte per projection weight, a float32 scale per
      output channel, replicated; a mixture of experts' expert weights likewise, a scale per
      layer, expert and output channel, placed with their experts; the embedding, lm head,
      norms and routers in ``param_dtype``), as ``quant.quantized_shardings`` places it; the
      unquantised version the worker applies deltas to is on its host (``rollout.worker``),
      not counted.
    lora: the trainer's adapters (None: no LoRA). With ``sync='adapters'`` the worker also
      keeps the base it pulled once on its devices, unquantised, and merges each version's
      adapters into it (``lora.merge_program``); its host then keeps the adapters alone. With
      ``sync='merged'`` it holds the merged weights as without LoRA.
  Returns:
    ``{'params': the copy the engine samples with, 'base': the LoRA base (0 without
    adapter-only sync)}``. A pull briefly holds the new version beside the old one (with
    int8 and adapter-only sync also the merged weights before they are quantised); that
    transient is not counted.
  """
  if quant not in QUANT_MODES:
    raise ConfigError(f'inference_quant={quant!r}; choose one of {QUANT_MODES} '
                      '(model.inference_quant).')
  unquantised = sum(b for _, _, b in _param_shards(config, mesh, rules))
  params = (unquantised if quant == 'none'
            else sum(b for _, _, b in _param_shards(config, mesh, rules, quant=quant)))
  base = unquantised if lora is not None and lora.sync == 'adapters' else 0
  return {'params': float(params), 'base': float(base)}


def _param_shard_bytes(config: DecoderConfig, axis_sizes: Mapping[str, int],
                       rules: Sequence[tuple[str, Any]]) -> tuple[int, int]:
  """``(elements, bytes)`` of the params on the most loaded device (``_param_shards``)."""
  shards = _param_shards(config, axis_sizes, rules)
  return sum(e for _, e, _ in shards), sum(b for _, _, b in shards)


def memory_per_device(config: DecoderConfig, mesh: Mesh, *, optimizer_moments: int = 2,
                      optimizer_dtype: Any = jnp.float32,
                      rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES
                      ) -> dict[str, float]:
  """Bytes of params and optimizer state on the most loaded device.

  Args:
    config: the model.
    mesh: the trainer mesh (a ``Mesh`` or an ``AbstractMesh``: only its axis sizes are
      read); shardings come from the logical-axis ``rules``.
    optimizer_moments: state tensors per param (AdamW: 2).
    optimizer_dtype: dtype of the optimizer state.
  Returns:
    ``{'params_bytes', 'optimizer_bytes', 'total_bytes', 'total_gib', 'num_params'}`` per
    device (the max over devices; shards are equal-sized under these rules).
  """
  elements, params_bytes = _param_shard_bytes(config, dict(mesh.shape), rules)
  opt_bytes = optimizer_moments * elements * jnp.dtype(optimizer_dtype).itemsize
  total = params_bytes + opt_bytes
  return {'params_bytes': float(params_bytes), 'optimizer_bytes': float(opt_bytes),
          'total_bytes': float(total), 'total_gib': total / 2**30,
          'num_params': float(count_params(config))}


# Bytes per token per layer that a block's attention keeps for the backward pass, in units of
# the compute dtype's itemsize, as multiples of the widths below (``activation_bytes``); the
# MLP's part is ``_mlp_saved_per_token``.
_SAVED_ATTENTION = {
    # every intermediate: the block input and its two norms (3 d), q, k, v before and after
    # RoPE (2 q + 4 kv), the attention output (q) and its projection (d).
    'none': lambda d, q, kv: 4 * d + 3 * q + 4 * kv,
    # the matmul outputs only (jax.checkpoint_policies.checkpoint_dots): q, k, v and the
    # attention output's projection.
    'dots': lambda d, q, kv: d + q + 2 * kv,
    # the block input only; the block is recomputed in the backward pass.
    'full': lambda d, q, kv: d,
}


def _blocked_rows(config: DecoderConfig, tokens: int) -> int:
  """The padded rows ``P`` of ``moe_impl='blocked'`` over ``tokens`` tokens (``tokens k``
  (token, slot) pairs): ``moe.num_blocks`` blocks of ``B = moe.block_rows(tokens k, E)``
  rows (every expert's group padded to whole blocks), the rows its scan runs and keeps."""
  pairs, e = tokens * config.num_experts_per_tok, config.num_experts
  block = moe.block_rows(pairs, e)
  return moe.num_blocks(pairs, e, block) * block


def _mlp_saved_per_token(config: DecoderConfig, remat: str, tensor: int, *, moe_layer: bool,
                         tokens: int, experts: int = 1) -> float:
  """What a block's MLP keeps per token for the backward pass, in units of the compute
  dtype's itemsize (``activation_bytes``), ``mlp`` / ``f`` split over ``tensor`` where they
  divide; ``moe_layer``: whether the block is one of ``config``'s MoE layers
  (``is_moe_layer``; a mixed stack has both kinds), ``tokens``: the device's tokens of one
  micro-batch (``'blocked'``'s padding depends on them).

  A dense SwiGLU of width ``mlp``: its gate, up, silu(gate) and product and its output
  (``4 mlp + d``); with remat 'dots' the gate's and up's products and the output
  (``2 mlp + d``). A mixture of ``E`` experts of width ``f``, ``k`` per token
  (``models.moe``): the router's logits and float32 probabilities ``E (1 + 4 / itemsize)``,
  then with ``moe_impl='ragged'`` the ``k`` sorted copies of the token, the grouped
  products' outputs and the unsorted copies ``k (3 d + 4 f)`` and the combined output ``d``;
  with ``'dense'`` every expert on every token, ``7 E f`` (gate, up, silu, product, the
  gated product and, in flight in the backward pass, the gradients of gate and up; within
  7% of XLA:CPU's compiled step at 8 and 16 experts, tests/test_configs_real_sizes.py) and
  the combine weights ``E`` and output ``d``; with ``'blocked'`` the residuals of its scan
  over ``P`` padded rows (``_blocked_rows``: the sorted pairs, each expert's padded to whole
  blocks of ``moe.block_rows`` rows), ``P / t (d + 2 f)`` per token (the rows and their gate
  and up products, ``moe._blocked_swiglu_fwd``), the ``k`` outputs gathered back ``k d`` and
  the output ``d``. With 'dots' the dot outputs alone: ragged ``E + d``
  (``jax.lax.ragged_dot`` is recomputed: the policy saves ``dot_general``'s outputs only),
  dense ``E (2 + 3 f) + d``, blocked ``E + P / t (d + 2 f) + d`` (the policy keeps its
  custom backward's residuals whole). 0 with 'full'. Dispatched over ``experts`` devices
  (``moe.expert_parallel_experts``, ``experts > 1``), 'ragged' keeps ``k 3 d`` (the sorted
  copies, the rows come back and unsorted) and, in buffers sized for every source's rows on
  one device, ``experts k (2 d + 4 f)`` (the rows received and their outputs, the grouped
  products) in place of ``k (3 d + 4 f)``.
  """
  if remat == 'full':
    return 0.0
  d = config.embed_dim
  split = lambda n: n // tensor if n % tensor == 0 else n  # noqa: E731  (replicated else)
  if not moe_layer:
    mlp = split(config.mlp_dim)
    return float((4 if remat == 'none' else 2) * mlp + d)
  e, k, f = config.num_experts, config.num_experts_per_tok, split(config.moe_mlp_dim)
  impl = config.execution.moe_impl
  # 'blocked''s padded rows per token and their gate and up products
  rows = _blocked_rows(config, tokens) / tokens if impl == 'blocked' else 0.0
  if remat == 'dots':
    return float(e + d + rows * (d + 2 * f) if impl != 'dense' else e * (2 + 3 * f) + d)
  router = e * (1 + 4 / jnp.dtype(config.execution.dtype).itemsize)
  if impl == 'ragged':
    if experts > 1:
      return float(router + k * 3 * d + experts * k * (2 * d + 4 * f) + d)
    return float(router + k * (3 * d + 4 * f) + d)
  if impl == 'blocked':
    return float(router + rows * (2 * d + 2 * f) + k * d + d)
  return float(router + 7 * e * f + e + d)


# Off TPU and GPU, jax lowers ``jax.lax.ragged_dot`` as a dense product over a masked copy of
# its operand per expert (``lax._ragged_dot_general_impl``: ``[experts, rows, in]``), so
# XLA:CPU's MoE step holds, beside one block in flight, about this many of the three
# products' masked copies (``k E (2 d + f)`` per token) by remat policy: the forward's and
# the backward's, and with remat the recomputed forward's too. Fitted to XLA:CPU's compiled
# step at 16 experts k = 2 and 8 experts k = 4 (the plan 1.07-1.12x of it; counted as a dense
# MLP of ``mlp_dim``, 0.32-0.54x).
_CPU_RAGGED_COPIES = {'none': 2, 'dots': 3, 'full': 3}


# Attention-sized float32 buffers ``[rows, heads, T, T]`` per layer that the backward pass
# reads (``activation_bytes``), as XLA:CPU's compiled train step kept them: the softmax's
# exponentials, its normaliser broadcast to their shape and the probabilities without remat;
# the scores (a dot's output) with 'dots'; none with 'full'.
_SAVED_SCORES = {'none': 3, 'dots': 1, 'full': 0}
# XLA:TPU's step without remat keeps about one (benchmarks/RESULTS.md, "Compiled for TPU at
# real depth": configs/math.py's 416 positions, a float32 and a bfloat16 copy of the
# probabilities, 0.94 of one float32 buffer per layer in all).
_TPU_SAVED_SCORES = {'none': 1, 'dots': 1, 'full': 0}


def activation_bytes(config: DecoderConfig, *, rows: int, length: int, tensor: int = 1,
                     logprob_chunk: int = 0, lora: lora_lib.LoRAConfig | None = None,
                     platform: str = 'cpu', experts: int = 1) -> dict[str, float]:
  """Activation bytes of one micro-batch's forward and backward pass on one device.

  ``rows`` and ``length``: the device's rows of one micro-batch and their length (tokens
  ``t = rows * length``); heads, kv heads and the MLP are split over ``tensor`` where they
  divide. With ``remat`` (``config.execution.remat``) of ``'none'`` / ``'dots'`` / ``'full'``:

    saved  = layers * t * itemsize(dtype) * S(remat)      what the backward pass reads
             + layers * A(remat) * 4 * rows * heads/tensor * length^2
                                                            float32 attention-sized buffers
    work   = t * itemsize(dtype) * S('none')               one block recomputed / in flight
             + (0 with 'none', else 3) * 4 * rows * heads/tensor * length^2
             (+ XLA:CPU's masked copies of a ragged MoE, ``_CPU_RAGGED_COPIES``)
             (+ 2 * P * d * itemsize, a blocked MoE's backward cotangents of its ``P``
             padded rows and their outputs, ``_blocked_rows``)
             (+ 2 * 3 * E / experts * d * moe_mlp/tensor * itemsize, an expert-parallel
             MoE's experts gathered whole on their device and their gradients)
    logits = 3 * 4 * rows * L * vocab/tensor                float32 logits, log-softmax and
                                                            gradient, L = logprob_chunk or length

  where ``S('none') = 4 d + 3 q + 4 kv + M('none')``, ``S('dots') = d + q + 2 kv +
  M('dots')``, ``S('full') = d``, ``M`` the MLP's part (``_mlp_saved_per_token``: a dense
  SwiGLU's ``M('none') = 4 mlp + d``, ``M('dots') = 2 mlp + d``; a mixture of experts' router,
  its ``k`` experts' products and the ragged path's sorted copies of the tokens, with
  ``moe_impl='dense'`` every expert on every token, with ``'blocked'`` its rows padded to
  whole blocks per expert), ``A('none') = 3`` (the softmax's
  exponentials, its normaliser broadcast to their shape and the probabilities; 1 with
  ``platform='tpu'``, as XLA:TPU keeps them),
  ``A('dots') = 1`` (the scores), ``A('full') = 0``, ``experts`` the devices a ragged
  mixture of experts dispatches each device's tokens over (``moe.expert_parallel_axes``:
  the trainer's data axis; 1: none)
  (``d`` the embedding width, ``q = heads * head_dim / tensor``,
  ``kv = kv_heads * head_dim / tensor``, ``mlp = mlp_dim / tensor``). With ``lora`` (not with
  remat 'full'), ``saved`` adds one ``[t, N]`` per adapted projection of ``N`` outputs
  (``q``: q, ``k``/``v``: kv, ``o``/``down``: d, ``gate``/``up``: mlp): the base product beside
  its sum with the low-rank one (``decoder.linear``), which XLA:CPU's compiled step kept
  (tests/test_configs_real_sizes.py); the MLP adapters (``gate``, ``up``, ``down``) are on
  the dense layers alone. A stack mixing dense and MoE layers (``decoder_sparse_step``,
  ``mlp_only_layers``) sums ``saved`` over its layers, each with its own kind's ``M`` (the
  ``num_moe_layers`` MoE layers' and the rest's dense SwiGLU), and ``work`` holds the
  larger kind's block. Returns
  ``{'saved_bytes', 'work_bytes', 'logits_bytes', 'total_bytes'}``. With ``memory_plan``'s
  other parts, checked on XLA:CPU against the compiled train step's memory analysis
  (tests/test_configs_real_sizes.py: remat 'none' at 128 positions, where the widths
  dominate, and 'none' and 'full' with micro-batches at 512, where attention does;
  tests/models/test_moe_plan.py: 'blocked' and a mixed stack).
  """
  c = config
  split = lambda n: n // tensor if n % tensor == 0 else n  # noqa: E731  (replicated else)
  heads = split(c.num_heads)
  d, q, kv, mlp = c.embed_dim, heads * c.head_dim, split(c.num_kv_heads) * c.head_dim, split(
      c.mlp_dim)
  itemsize = jnp.dtype(c.execution.dtype).itemsize
  tokens = rows * length
  scores = 4 * rows * heads * length * length  # one float32 [rows, heads, T, T]
  remat = c.execution.remat
  # The layers of each kind: a mixed stack's MoE and dense layers (``is_moe_layer``).
  kinds = {True: c.num_moe_layers, False: c.num_layers - c.num_moe_layers}
  kinds = {moe_layer: n for moe_layer, n in kinds.items() if n}
  per_token = lambda policy, moe_layer: (  # noqa: E731
      _SAVED_ATTENTION[policy](d, q, kv) + _mlp_saved_per_token(
          c, policy, tensor, moe_layer=moe_layer, tokens=tokens, experts=experts))
  outputs = {'q': q, 'k': kv, 'v': kv, 'o': d, 'gate': mlp, 'up': mlp, 'down': d}
  # MLP adapters are on the dense layers only (``lora.run_targets``: not on experts).
  adapted = lambda moe_layer: (  # noqa: E731
      0 if lora is None or remat == 'full' else
      sum(outputs[t] for t in lora_lib.run_targets(lora, moe_layer)))
  kept = (_TPU_SAVED_SCORES if platform == 'tpu' else _SAVED_SCORES)[remat]
  saved = sum(n * (tokens * itemsize * (per_token(remat, moe_layer) + adapted(moe_layer))
                   + kept * scores) for moe_layer, n in kinds.items())
  work = (tokens * itemsize * max(per_token('none', moe_layer) for moe_layer in kinds)
          + (0 if remat == 'none' else _SAVED_SCORES['none']) * scores)
  if c.is_moe and c.execution.moe_impl == 'ragged' and platform == 'cpu':
    work += (_CPU_RAGGED_COPIES[remat] * tokens * itemsize * c.num_experts_per_tok
             * c.num_experts * (2 * d + split(c.moe_mlp_dim)))
  if c.is_moe and c.execution.moe_impl == 'blocked':
    # its backward's row cotangents: the outputs' and the rows' over the padded rows
    work += 2 * _blocked_rows(c, tokens) * d * itemsize
  if c.is_moe and c.execution.moe_impl == 'ragged' and experts > 1:
    work += 2 * 3 * c.num_experts // experts * d * split(c.moe_mlp_dim) * itemsize
  logits = 3 * 4 * rows * (logprob_chunk or length) * split(c.vocab_size)
  return {'saved_bytes': float(saved), 'work_bytes': float(work), 'logits_bytes': float(logits),
          'total_bytes': float(saved + work + logits)}


def kv_cache_bytes(config: DecoderConfig, *, slots: int, length: int,
                   quant: str = 'none') -> float:
  """The KV cache of ``slots`` sequences of ``length`` positions, all devices together:
  ``slots * length * layers * kv_heads * 2 (keys, values)`` times ``head_dim *
  itemsize(dtype)``, or with ``quant='int8'`` (``model.kv_cache_quant``, ``KVCache.init``)
  ``head_dim`` int8 bytes and a float32 scale per (position, head)."""
  if quant not in KV_CACHE_QUANT_MODES:
    raise ConfigError(f'kv_cache_quant={quant!r}; choose one of {KV_CACHE_QUANT_MODES} '
                      '(model.kv_cache_quant).')
  per_head = (config.head_dim + 4 if quant == 'int8'
              else config.head_dim * jnp.dtype(config.execution.dtype).itemsize)
  return float(slots * length * config.num_layers * config.num_kv_heads * 2 * per_head)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per chip of a run's roles (``memory_plan``), each part on its most loaded device.

  Attributes:
    params, optimizer, gradients: the trainer's params (``param_dtype``: the master copy;
      with LoRA the frozen base and the float32 adapters), the optimizer state and one
      gradient (plus the accumulator with micro-batches) of the trained params (with LoRA the
      adapters alone).
    reference: the KL reference copy of the params (0 without a KL penalty).
    activations: one micro-batch's forward and backward pass (``activation_bytes``).
    update: the optimizer step's new trained params and optimizer state, held until the
      step's finiteness check selects them over the old ones; it follows the backward pass,
      so the trainer's peak holds the larger of ``activations`` and ``update``.
    push: the trainer's device bytes for a push to the workers beyond what it holds, at a
      time no gradient or activation is alive. With LoRA and ``lora.sync='merged'``: the
      merged params (``lora.pushed_params``: the base's shapes in ``param_dtype``) made
      between steps for each version. With ``lora.sync='adapters'`` (the default): the
      larger of what a version's push makes and what the base's one push makes (at the
      start, before any step: ``lora.pushed_base``), which is the base's. A version is
      ``lora.adapter_tree`` of the trainer's params, its own adapter arrays (the server
      copies them to its host), so it makes nothing; the base is cast to the workers' dtype,
      a copy of the leaves whose dtype differs (``model.cast_params``; none when
      ``inference_param_dtype`` is ``param_dtype``). 0 without LoRA (the params are pushed
      as they are).
    inference_params: one worker's copy of the params the engine samples with (in
      ``memory_plan``'s ``inference_param_dtype``, by default ``param_dtype``; with int8
      workers one byte per projection weight and its float32 scales, ``models.quant``), on
      its mesh (``worker_param_bytes``).
    inference_base: with LoRA and ``lora.sync='adapters'``, the base one worker keeps on its
      mesh beside ``inference_params`` (unquantised, in ``inference_param_dtype``), into
      which it merges each version's adapters; 0 otherwise.
    kv_cache: one worker's KV cache (``kv_cache_bytes``), on its mesh.
    inference_logits: a decode step's float32 ``[slots, vocab]`` logits (4 buffers).
    workers_per_chip: inference workers whose meshes share a chip (roles not disjoint:
      every worker's mesh starts at the first chip).
    shared: whether the trainer and the workers share chips (one sum) or not (two).
    lookup: XLA:TPU's update of the embedding table in the lookup's layout, beside the
      gradients instead of the update when larger (``tpu_trainer_terms``; 0 for XLA:CPU,
      ``memory_plan(platform='cpu')``).
    gathered: XLA:TPU with FSDP: the largest weight gathered whole for the forward and
      backward passes (``tpu_trainer_terms``; 0 for XLA:CPU).
    head: XLA:TPU with FSDP and log-probs in chunks: the peak of the chunks' backward pass
      (``tpu_trainer_terms``' ``head`` and what lies beside it: the blocks' saved inputs,
      the chunk's logits, with a tied table its lookup's gradient, ``lookup``); the
      trainer's peak holds it instead of the rest of the step when larger. 0 otherwise.
    teacher_params, teacher_scoring: on-policy distillation's teacher: its params (its
      dtype, int8 with ``teacher.quant``) and one batch's scoring pass
      (``memory_fit.teacher_memory_bytes``); 0 without distillation.
    teacher_apart: whether the teacher has a chip of its own (the Ray backend's teacher
      actor, ``ray.teacher_resources``): a row of its own in ``needs``. Else (the local
      backend) it lies on the trainer's first chip and counts on the trainer's row.
  """
  params: float
  optimizer: float
  gradients: float
  reference: float
  activations: float
  update: float
  inference_params: float
  kv_cache: float
  inference_logits: float
  workers_per_chip: int = 1
  shared: bool = True
  push: float = 0.0
  inference_base: float = 0.0
  lookup: float = 0.0
  gathered: float = 0.0
  head: float = 0.0
  teacher_params: float = 0.0
  teacher_scoring: float = 0.0
  teacher_apart: bool = False

  @property
  def trainer_bytes(self) -> float:
    """The trainer's peak per chip: what it holds between steps, then the gradients beside
    the largest of the activations, the update and the embedding's update (``lookup``), plus
    the weights FSDP gathers (``gathered``), or beside the log-prob chunks' backward
    (``head``) when larger; or, with no step running, the LoRA push."""
    step = self.gradients + max(max(self.activations, self.update, self.lookup) + self.gathered,
                                self.head)
    return self.params + self.optimizer + self.reference + max(step, self.push)

  @property
  def inference_bytes(self) -> float:
    return self.workers_per_chip * (self.inference_base + self.inference_params + self.kv_cache
                                    + self.inference_logits)

  @property
  def teacher_bytes(self) -> float:
    return self.teacher_params + self.teacher_scoring

  def needs(self, trainer_hbm_bytes: float, inference_hbm_bytes: float | None = None,
            teacher_hbm_bytes: float | None = None, *,
            teacher_on_host: bool = False) -> list[tuple[str, float, float]]:
    """``(chips, bytes needed per chip, bytes of HBM per chip)``: one row when the roles
    share chips, else one for the trainer's and one for the workers'. A teacher counts on
    the trainer's (its first chip is the teacher's), or with ``teacher_apart`` on a row of
    its own, against ``teacher_hbm_bytes`` (None: a trainer chip's); with
    ``teacher_on_host`` (an apart teacher placed on a CPU host) on no chip's row."""
    on_trainer = 0.0 if self.teacher_apart else self.teacher_bytes
    if self.shared:
      rows = [('trainer + inference', self.trainer_bytes + self.inference_bytes + on_trainer,
               trainer_hbm_bytes)]
    else:
      rows = [('trainer', self.trainer_bytes + on_trainer, trainer_hbm_bytes),
              ('inference', self.inference_bytes,
               trainer_hbm_bytes if inference_hbm_bytes is None else inference_hbm_bytes)]
    if self.teacher_apart and self.teacher_bytes and not teacher_on_host:
      rows.append(('teacher', self.teacher_bytes,
                   trainer_hbm_bytes if teacher_hbm_bytes is None else teacher_hbm_bytes))
    return rows

  def table(self, trainer_hbm_bytes: float, inference_hbm_bytes: float | None = None,
            teacher_hbm_bytes: float | None = None, *, teacher_on_host: bool = False
            ) -> list[str]:
    """The plan as lines of text: each part in GiB, then each total against the HBM
    (``needs``' rows, with the same arguments)."""
    gib = lambda n: f'{n / 2**30:.2f} GiB'  # noqa: E731
    lines = [
        (f'trainer: params {gib(self.params)}, optimizer {gib(self.optimizer)}, gradients '
         f'{gib(self.gradients)}, KL reference {gib(self.reference)}, the larger of '
         f'activations {gib(self.activations)} and the update {gib(self.update)}'
         + (f' (XLA:TPU: and the embedding\'s update {gib(self.lookup)}; FSDP\'s gathered '
            f'weights {gib(self.gathered)}'
            + (f'; or the log-prob chunks\' backward {gib(self.head)}' if self.head else '')
            + ')'
            if self.lookup or self.gathered else '')
         + (f' (or, with no step running, the LoRA push {gib(self.push)})' if self.push
            else '') + f' = {gib(self.trainer_bytes)}'),
        (f'inference: {self.workers_per_chip} worker(s) x (params '
         f'{gib(self.inference_params)}'
         + (f', LoRA base {gib(self.inference_base)}' if self.inference_base else '')
         + f', KV cache {gib(self.kv_cache)}, logits '
         f'{gib(self.inference_logits)}) = {gib(self.inference_bytes)}')]
    if self.teacher_bytes:
      where = ('a CPU host, in host memory' if self.teacher_apart and teacher_on_host else
               'its own chip' if self.teacher_apart else 'the first trainer chip')
      lines.append(f'teacher (on {where}): params {gib(self.teacher_params)}, '
                   f'scoring {gib(self.teacher_scoring)} = {gib(self.teacher_bytes)}')
    for chips, need, hbm in self.needs(trainer_hbm_bytes, inference_hbm_bytes,
                                       teacher_hbm_bytes, teacher_on_host=teacher_on_host):
      lines.append(f'{chips}: {gib(need)} of {gib(hbm)} HBM per chip ({100 * need / hbm:.0f}%)')
    return lines


PLATFORMS = ('cpu', 'tpu')

# XLA:TPU's tiles: the minor dimension of an array in HBM is padded to 128 lanes and the
# second-minor to 8 sublanes (float32; 16 for 2-byte types).
_TPU_LANES, _TPU_SUBLANES = 128, 8
# Table-sized buffers XLA:TPU's trainer step holds at once while it updates the embedding
# (benchmarks/RESULTS.md, "Compiled for TPU at real depth": the buffer assignment of
# SmolLM2-135M's step on v5e-4, tied and untied, data 4 and fsdp 4): the table in the
# lookup's row-major layout, the lookup's gradient (two scatters, then their sum), the two
# moments copied into that layout and the new moments and table.
_LOOKUP_COPIES = 6


def tpu_trainer_terms(config: DecoderConfig, trainer_mesh: Mapping[str, int],
                      rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES, *,
                      trained_table: bool = True, optimizer_moments: int = 2,
                      chunked: bool = False) -> dict[str, float]:
  """What XLA:TPU's compiled trainer step holds beyond ``memory_plan``'s XLA:CPU terms.

  Read from the buffer assignment of the step compiled for v5e (``launch.recipes.compile``):

  - ``lookup``: the embedding table's update. The table's parameter lies vocabulary-minor
    (``{0,1}``) and the lookup (a gather of rows) wants it embedding-minor, so the update of
    the ``[vocab, embed]`` shard runs in a row-major copy, padded to XLA:TPU's tiles (the
    embedding shard to a multiple of 128: 576 -> 640 for SmolLM2, 144 -> 256 for its fsdp 4
    shard), ``_LOOKUP_COPIES`` at once (with ``optimizer_moments`` other than 2, two fewer or
    more per moment). 0 without a trained table (LoRA).
  - ``gathered``: with ``fsdp > 1``, the weights the forward and backward passes gather whole
    before their products: at most the largest leaf whole (the embedding or lm head; with the
    scanned layer stack one layer's slice of a stacked weight), in ``param_dtype``. 0 without
    FSDP.
  - ``head``: with ``fsdp > 1`` and log-probs in chunks (``chunked``: ``logprob_chunk``
    shorter than the rows' length), what the chunks' backward pass holds of the head's weight (the
    tied table or the lm head): the weight gathered whole in the compute dtype, the chunk's
    gradient of it whole in float32 and that gradient all-reduced over the batch's chips in
    the compute dtype, ``vocab / tensor * embed * (4 + 2 * itemsize(dtype))`` bytes (the
    buffer assignment of Qwen3-1.7B's and Qwen2.5-0.5B's steps on v5e-8, fsdp 8:
    ``convolution_bitcast_fusion``, ``all-gather``, ``all-reduce``, benchmarks/RESULTS.md
    "TPU compile: the 1.7B plan"). Each chunk makes its gradient of the whole weight and
    all-reduces it instead of reduce-scattering it. 0 otherwise, and without a trained table
    (LoRA: the head is frozen, no gradient of it; ``gathered`` counts the weight).

  Args:
    config: the model (``param_dtype``: the trainer's master copy).
    trainer_mesh: axis sizes (``{'data', 'fsdp', 'tensor'}``).
    rules: the logical sharding rules.
    trained_table: whether the embedding is trained (False under LoRA: frozen).
    optimizer_moments: float32 state tensors per param (AdamW: 2).
    chunked: whether the step makes its log-probs in chunks (``logprob_chunk``).
  Returns:
    ``{'lookup', 'gathered', 'head'}`` in bytes per chip.
  """
  model = abstract_model(config)
  abstract, logical = model.abstract_params(), model.logical_axes()
  shardings = sharding_lib.param_shardings(abstract, logical, _abstract_mesh(trainer_mesh),
                                           rules)
  itemsize = jnp.dtype(config.execution.param_dtype).itemsize
  lookup = 0.0
  if trained_table:
    rows, cols = shardings['embed'].shard_shape(abstract['embed'].shape)
    sublanes = _TPU_SUBLANES * max(1, 4 // itemsize)
    padded = (math.ceil(rows / sublanes) * sublanes * math.ceil(cols / _TPU_LANES) * _TPU_LANES)
    lookup = float((_LOOKUP_COPIES + 2 * (optimizer_moments - 2)) * padded * itemsize)
  gathered = 0.0
  if trainer_mesh['fsdp'] > 1:
    flat = jax.tree.leaves(abstract)
    axes = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    whole = [math.prod(leaf.shape[1:] if spec and spec[0] == 'layers' else leaf.shape)
             * jnp.dtype(leaf.dtype).itemsize for leaf, spec in zip(flat, axes, strict=True)]
    gathered = float(max(whole))
  head = 0.0
  if trainer_mesh['fsdp'] > 1 and chunked and trained_table:
    tensor = trainer_mesh['tensor']
    vocab = config.vocab_size // tensor if config.vocab_size % tensor == 0 else config.vocab_size
    head = float(vocab * config.embed_dim
                 * (4 + 2 * jnp.dtype(config.execution.dtype).itemsize))
  return {'lookup': lookup, 'gathered': gathered, 'head': head}


def memory_plan(config: DecoderConfig, trainer_mesh: Mapping[str, int],
                inference_mesh: Mapping[str, int], *, train_rows: int, train_length: int,
                micro_batches: int = 1, logprob_chunk: int = 0, slots: int,
                cache_length: int, inference_param_dtype: Any = None,
                workers_per_chip: int = 1, shared: bool = True,
                reference: bool = False, optimizer_moments: int = 2,
                optimizer_dtype: Any = jnp.float32, lora: lora_lib.LoRAConfig | None = None,
                inference_quant: str = 'none', kv_cache_quant: str = 'none',
                rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES,
                platform: str = 'cpu') -> MemoryPlan:
  """The bytes per chip a run's trainer and inference workers hold (nothing is allocated).

  Args:
    config: the model, with its ``execution`` (``param_dtype``: the trainer's master copy,
      and the workers' copy unless ``inference_param_dtype``; ``dtype``: activations and KV
      cache; ``remat``).
    trainer_mesh, inference_mesh: axis sizes (``{'data', 'fsdp', 'tensor'}``, resolved:
      ``sharding.mesh_shape``).
    train_rows, train_length: the rows of one train batch (``prompts_per_step *
      group_size``) and their length (prompt + completion), split over the trainer's
      ``data * fsdp`` devices and into ``micro_batches``.
    logprob_chunk: positions whose logits are made at once (0: all).
    slots, cache_length: one worker's KV-cache slots (split over its ``data * fsdp``
      devices) and positions (counted as the whole blocks the engine allocates for them,
      ``kv_cache.block_layout``).
    inference_param_dtype: the dtype of the workers' copy of the params (None:
      ``param_dtype``), e.g. bfloat16 beside float32 master weights.
    workers_per_chip, shared, reference: see ``MemoryPlan``.
    optimizer_moments, optimizer_dtype: the optimizer state per trained param (AdamW: 2,
      float32).
    lora: the run's adapters (``lora.from_config``; None: full fine-tuning). The trainer
      then holds the frozen base in ``param_dtype`` and the float32 adapters (``rank *
      (in + out)`` params per adapted weight per layer), and optimizer state, gradients and
      the update for the adapters alone; activations as without LoRA plus one product per
      adapted projection (``activation_bytes``). The workers hold the merged weights, and
      with ``lora.sync='adapters'`` the base too (``worker_param_bytes``); the trainer's push
      is counted as ``MemoryPlan.push`` says.
    kv_cache_quant: ``model.kv_cache_quant``: ``'int8'`` counts the KV cache as int8 with a
      float32 scale per (position, head) (``kv_cache_bytes``).
    inference_quant: ``model.inference_quant``: ``'int8'`` counts the workers' copy as
      ``quant.quantize_params`` makes it (``worker_param_bytes``). Only the quantised copy
      (and a LoRA base) is on the devices: the unquantised one a worker applies deltas to is
      on its host.
    platform: whose compiled trainer step the trainer's peak follows (``PLATFORMS``):
      ``'cpu'`` (XLA:CPU) or ``'tpu'`` (XLA:TPU: ``tpu_trainer_terms``, and the attention
      buffers ``activation_bytes`` counts for it).
  Returns:
    The ``MemoryPlan``. Gradients are the trained params' shape in their dtype, twice with
    micro-batches (the accumulator); the update holds new trained params and optimizer state
    (XLA:CPU's compiled full fine-tuning step held 2.25 x the params there, against the 3 x
    counted for AdamW); XLA's other scratch and fragmentation are not counted.
  """
  if platform not in PLATFORMS:
    raise ConfigError(f'memory_plan(platform={platform!r}); choose one of {PLATFORMS} (the '
                      'compiler whose trainer step the plan follows).')
  inference = (config if inference_param_dtype is None
               else config.with_execution(param_dtype=inference_param_dtype))
  worker = worker_param_bytes(inference, inference_mesh, quant=inference_quant, lora=lora,
                              rules=rules)
  shards = _param_shards(config, trainer_mesh, rules, lora=lora)
  trained = [(e, b) for path, e, b in shards if lora is None or lora_lib.is_adapter_path(path)]
  params = sum(b for _, _, b in shards)
  trained_bytes = sum(b for _, b in trained)
  optimizer = (optimizer_moments * sum(e for e, _ in trained)
               * jnp.dtype(optimizer_dtype).itemsize)
  gradients = trained_bytes * (2 if micro_batches > 1 else 1)
  batch_shards = trainer_mesh['data'] * trainer_mesh['fsdp']
  rows = max(1, math.ceil(train_rows / micro_batches / batch_shards))
  dispatch = (moe.expert_parallel_axes(trainer_mesh, rules, config.num_experts)
              if config.is_moe else ())
  activation = activation_bytes(config, rows=rows, length=train_length,
                                tensor=trainer_mesh['tensor'], logprob_chunk=logprob_chunk,
                                lora=lora, platform=platform,
                                experts=math.prod(trainer_mesh[a] for a in dispatch))
  if lora is None:
    push = 0
  elif lora.sync == 'adapters':
    push = _base_cast_bytes(config, inference, trainer_mesh, rules)
    if lora.base_quant == 'int8':  # lora.pushed_base dequantises the projections (float32)
      push += _dequantized_bytes(config, trainer_mesh, rules)
  else:
    push = params - trained_bytes
  slot_shards = inference_mesh['data'] * inference_mesh['fsdp']
  kv_split = inference_mesh['tensor'] if config.num_kv_heads % inference_mesh['tensor'] == 0 \
      else 1
  # The positions the engine allocates: whole blocks (kv_cache.block_layout), which can be
  # more than cache_length (configs/math.py: 512 for 416).
  _, block_length, num_blocks = block_layout(
      cache_length, batch_invariant=config.execution.batch_invariant)
  kv = (kv_cache_bytes(config, slots=slots, length=block_length * num_blocks,
                       quant=kv_cache_quant) / (slot_shards * kv_split))
  logits = 4 * math.ceil(slots / slot_shards) * config.vocab_size * 4
  tpu = (tpu_trainer_terms(config, trainer_mesh, rules, trained_table=lora is None,
                           optimizer_moments=optimizer_moments,
                           chunked=0 < logprob_chunk < train_length)
         if platform == 'tpu' else {'lookup': 0.0, 'gathered': 0.0, 'head': 0.0})
  # The log-prob chunks' backward (XLA:TPU, FSDP): the blocks' saved inputs, the chunk's
  # logits and the head's whole weight and gradients; a tied table's lookup gradient is made
  # in the same pass.
  head = (activation['saved_bytes'] + activation['logits_bytes'] + tpu['head']
          + (tpu['lookup'] if config.tie_embeddings else 0.0)) if tpu['head'] else 0.0
  return MemoryPlan(params=float(params), optimizer=float(optimizer),
                    gradients=float(gradients), reference=float(params if reference else 0),
                    activations=activation['total_bytes'],
                    update=float(trained_bytes + optimizer),
                    inference_params=worker['params'], inference_base=worker['base'],
                    kv_cache=kv, inference_logits=float(logits),
                    workers_per_chip=workers_per_chip, shared=shared, push=float(push),
                    lookup=tpu['lookup'], gathered=tpu['gathered'], head=head)
