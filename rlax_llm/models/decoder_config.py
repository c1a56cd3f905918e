"""``DecoderConfig``, a decoder's architecture, and ``Execution``, how it runs; validated once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.x RoPE frequency scaling (Hugging Face ``rope_type='llama3'``)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


REMAT_POLICIES = ('none', 'full', 'dots')
FAMILIES = ('llama', 'qwen2', 'qwen3')
# Execution.invariant_rows (see numerics.invariant_matmul).
INVARIANT_ROWS_MODES = ('chunks', 'floor')
# Execution.weight_layout (see decoder.linear).
WEIGHT_LAYOUTS = ('in_out', 'out_in')
# Execution.decode_attention (see decoder.Attention).
DECODE_ATTENTIONS = ('xla', 'cpu_kernel')
# Execution.param_dtype and dtype by the name a config gives them (model.param_dtype,
# model.dtype, model.inference_param_dtype).
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


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

  def __post_init__(self):
    for name, choices in (('remat', REMAT_POLICIES), ('invariant_rows', INVARIANT_ROWS_MODES),
                          ('weight_layout', WEIGHT_LAYOUTS),
                          ('decode_attention', DECODE_ATTENTIONS)):
      if getattr(self, name) not in choices:
        raise ValueError(f'Execution.{name}={getattr(self, name)!r}; choose one of '
                         f'{choices}.')
    if self.batch_invariant and self.decode_attention != 'xla':
      raise ValueError('batch_invariant decoding needs decode_attention=\'xla\' (its '
                       f'attention is fixed piece by piece), got {self.decode_attention!r}.')


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Architecture of a decoder (what a checkpoint's ``config.json`` says), and ``execution``,
  how it runs. Sizes are per model, not per device."""

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
  execution: Execution = Execution()

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'DecoderConfig.family={self.family!r}; choose one of {FAMILIES}.')
    if not isinstance(self.execution, Execution):
      raise ValueError(f'DecoderConfig.execution must be an Execution, got '
                       f'{self.execution!r}; build one with Execution(...).')
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

  def with_execution(self, **changes: Any) -> DecoderConfig:
    """This architecture with ``changes`` to its ``Execution`` fields."""
    return dataclasses.replace(self, execution=dataclasses.replace(self.execution, **changes))
