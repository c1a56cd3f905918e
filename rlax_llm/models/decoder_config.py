"""``DecoderConfig``, a decoder's architecture, and ``Execution``, how it runs; validated once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# The declarative parts (the architecture, its checks and the choices' names) are the leaf
# module ``model_spec``'s, for the config boundary to check a model without JAX.
from rlax_llm import model_spec
from rlax_llm.model_spec import (  # noqa: F401  (re-exported)
    DECODE_ATTENTIONS,
    FAMILIES,
    INVARIANT_ROWS_MODES,
    LAYER_LOOPS,
    MOE_IMPLS,
    REMAT_POLICIES,
    WEIGHT_LAYOUTS,
    Architecture,
    RopeScaling,
)

# Execution.param_dtype and dtype by the name a config gives them (model.param_dtype,
# model.dtype, model.inference_param_dtype; the names are model_spec.DTYPES).
DTYPES = {name: getattr(jnp, name) for name in model_spec.DTYPES}

# How the decoder runs its layers (``Execution.layer_loop``, one of LAYER_LOOPS): 'scan', the
# blocks' params stacked over a leading ``LAYERS_AXIS`` and run by one ``jax.lax.scan`` (one
# layer compiled whatever the depth: the trainer, and the engine on accelerators), or
# 'unrolled', a Python list of per-layer blocks run one after another (the engine on
# XLA:CPU, where a scan's per-layer weight slices are copies: docs/models.md "The layer
# loop").
LAYERS_AXIS = 'layers'  # the stacked blocks' leading logical axis (never sharded)


@dataclasses.dataclass(frozen=True)
class Execution:
  """How a decoder runs: the same params compute the same function under any of these
  (to rounding), so none of them is in a checkpoint's ``config.json``."""

  remat: str = 'none'  # REMAT_POLICIES: what each block rematerialises in the backward pass
  param_dtype: Any = jnp.float32  # storage dtype of the params
  dtype: Any = jnp.float32  # compute dtype
  batch_invariant: bool = False  # see rlax_llm.models.numerics
  # How batch-invariant weight matmuls fix their kernel (INVARIANT_ROWS_MODES,
  # numerics.invariant_matmul).
  invariant_rows: str = 'chunks'
  # How weight matrices store their sides (WEIGHT_LAYOUTS, ``decoder.linear``): 'in_out'
  # (inputs first, ``x @ w``) everywhere params are trained, saved or loaded; an inference
  # engine on XLA:CPU converts its copy to 'out_in'
  # (``rlax_llm.models.model.with_weight_layout``).
  weight_layout: str = 'in_out'
  # How a decode step (one new token per row, two or more rows, with a cache) attends
  # (DECODE_ATTENTIONS): 'xla' (jnp products), or 'cpu_kernel' (``cpu_attention``, XLA:CPU
  # only, float32, one device; the inference engine picks it where it applies). The
  # trainer, the prefill and one-row steps always use 'xla'.
  decode_attention: str = 'xla'
  # LAYER_LOOPS: 'scan' everywhere params are trained, saved or loaded; an inference engine
  # on XLA:CPU runs 'unrolled' (``rlax_llm.models.model.with_weight_layout``).
  layer_loop: str = 'scan'
  # MOE_IMPLS: how a mixture-of-experts block computes its experts (``models.moe``; dropless
  # either way, equal to rounding): 'ragged', a grouped matmul (``jax.lax.ragged_dot``, TPU's
  # grouped-matmul kernel) over the tokens sorted by expert, 'dense', every expert on
  # every token weighted by the sparse gates (num_experts / top-k times the FLOPs), or
  # 'blocked', the sorted rows in blocks of one expert each (``moe._blocked_experts``:
  # about the routed FLOPs on any backend; XLA:CPU's fastest, where ``ragged_dot`` computes
  # every expert over every row). The default is 'ragged' on every platform (docs/models.md
  # says why); a CPU run picks 'blocked'. Dense models ignore it. 'ragged' is
  # expert-parallel by itself where the mesh splits the experts (``moe.run_experts``: under
  # the trainer's mesh with expert -> data and data > 1, each device's tokens go to the
  # experts' devices by all-to-all).
  moe_impl: str = 'ragged'
  # How a decode step's experts compute (one token per row, ``MoE`` on a length-1 input):
  # one of MOE_IMPLS, or '' (``moe_impl``). The engine's copy sets it with
  # ``model.inference_moe_impl='dense_decode'`` (``roles.inference_model``): decode is
  # bound by reading the experts' weights, where XLA:TPU's dense path reads fewer bytes than
  # its grouped matmul, while prefill and the trainer keep ``moe_impl`` (docs/models.md).
  decode_moe_impl: str = ''

  def __post_init__(self):
    for name, choices in (('remat', REMAT_POLICIES), ('invariant_rows', INVARIANT_ROWS_MODES),
                          ('weight_layout', WEIGHT_LAYOUTS),
                          ('decode_attention', DECODE_ATTENTIONS),
                          ('layer_loop', LAYER_LOOPS), ('moe_impl', MOE_IMPLS),
                          ('decode_moe_impl', ('', *MOE_IMPLS))):
      if getattr(self, name) not in choices:
        raise ValueError(f'Execution.{name}={getattr(self, name)!r}; choose one of '
                         f'{choices}.')
    if self.batch_invariant and self.decode_attention != 'xla':
      raise ValueError('batch_invariant decoding needs decode_attention=\'xla\' (its '
                       f'attention is fixed piece by piece), got {self.decode_attention!r}.')


@dataclasses.dataclass(frozen=True)
class DecoderConfig(Architecture):
  """Architecture of a decoder (``model_spec.Architecture``: what a checkpoint's
  ``config.json`` says), and ``execution``, how it runs. Sizes are per model, not per
  device."""

  execution: Execution = Execution()

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.execution, Execution):
      raise ValueError(f'DecoderConfig.execution must be an Execution, got '
                       f'{self.execution!r}; build one with Execution(...).')
    if self.is_moe and self.execution.batch_invariant:
      raise ValueError(f'DecoderConfig.num_experts={self.num_experts} with '
                       'Execution.batch_invariant=True: the experts\' grouped matmuls are not '
                       'batch-invariant; turn batch_invariant off for a mixture of experts.')

  def with_execution(self, **changes: Any) -> DecoderConfig:
    """This architecture with ``changes`` to its ``Execution`` fields."""
    return dataclasses.replace(self, execution=dataclasses.replace(self.execution, **changes))
