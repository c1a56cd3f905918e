"""A decoder's architecture as a value, the named presets, the model choices' names, and
the checks of a run config's model (``check_config``).

A leaf module (no JAX): the config boundary (``rlax_llm.config``) checks ``model.*`` and
``lora.*`` with these without loading the model code, and ``rlax_llm.models`` builds on
them: ``models.decoder_config.DecoderConfig`` is an ``Architecture`` with an ``Execution``
(how it runs), ``models.presets.PRESETS`` are ``PRESET_ARCHITECTURES`` as ``DecoderConfig``s,
and ``models.quant``, ``models.kv_cache``, ``models.lora`` and ``models.files.hub`` take their
mode names and the hub-id syntax from here.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import Any

from rlax_llm.errors import ConfigError

# Execution choices (``models.decoder_config.Execution``).
REMAT_POLICIES = ('none', 'full', 'dots')  # what each block rematerialises in the backward
INVARIANT_ROWS_MODES = ('chunks', 'floor')  # numerics.invariant_matmul
WEIGHT_LAYOUTS = ('in_out', 'out_in')  # decoder.linear
DECODE_ATTENTIONS = ('xla', 'cpu_kernel')  # decoder.Attention
LAYER_LOOPS = ('scan', 'unrolled')  # decoder_config.Execution.layer_loop
# How a mixture-of-experts block computes its experts (``models.moe``): 'ragged', a grouped
# matmul (``jax.lax.ragged_dot``) over the tokens sorted by expert, 'dense', every expert
# on every token weighted by the sparse gates, or 'blocked', the sorted rows in blocks of one
# expert each (about the routed FLOPs; XLA:CPU's fastest).
MOE_IMPLS = ('ragged', 'dense', 'blocked')
# Rollout routing replay (``models.moe.replay``): a token's recorded expert index where none
# was recorded (padding, a sample's last token), and the indices' compact dtype name: int8
# for up to 127 experts, else int16 (``route_dtype``).
NO_ROUTE = -1


def route_dtype(num_experts: int) -> str:
  """The dtype (a numpy / JAX dtype name) of recorded expert indices: ``'int8'`` for up to
  127 experts, else ``'int16'`` (2 bytes per (token, layer, slot))."""
  return 'int8' if num_experts <= 127 else 'int16'
# Hugging Face architectures a decoder exports to.
FAMILIES = ('llama', 'qwen2', 'qwen3', 'qwen3_moe', 'mixtral')
# The families whose MLPs are mixtures of experts (``Architecture.num_experts > 0``).
MOE_FAMILIES = ('qwen3_moe', 'mixtral')
# The dtypes params are stored and computed in, by name (``model.param_dtype``,
# ``model.dtype``).
DTYPES = ('float32', 'bfloat16')
# Inference weights (``models.quant``) and KV cache (``models.kv_cache``) quantisation.
QUANT_MODES = ('none', 'int8')
KV_CACHE_QUANT_MODES = ('none', 'int8')
# How a LoRA trainer sends each version to the workers (``lora.sync``): the adapters alone
# (the base once), or the merged weights.
LORA_SYNCS = ('adapters', 'merged')
# The dtype adapter versions travel in (``lora.sync_dtype``, adapter-only sync): as trained,
# rounded to bfloat16 (half the bytes), or int8 with a float32 scale per rank component (a
# quarter of the bytes; ``models.lora.synced_adapters``). The workers' policy is then the
# merge of the rounded adapters, a mismatch the trainer's recompute and ``rl.mismatch`` see
# like any other.
LORA_SYNC_DTYPES = ('float32', 'bfloat16', 'int8')


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.x RoPE frequency scaling (Hugging Face ``rope_type='llama3'``)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


def block_run_name(index: int) -> str:
  """The decoder attribute (and params key) of the ``index``-th run of layers
  (``Architecture.layer_runs``): ``'blocks'``, then ``'blocks_1'``, ``'blocks_2'``, ..."""
  return 'blocks' if index == 0 else f'blocks_{index}'


@dataclasses.dataclass(frozen=True)
class LayerRun:
  """Consecutive layers ``first .. first + count - 1`` of one kind (``moe``: mixtures of
  experts, else dense MLPs), stacked in the params under ``name`` (leading layer axis of
  ``count``); ``first_moe``: the number of MoE layers before ``first`` (a MoE run's offset on
  the layer axis of recorded routes)."""

  name: str
  first: int
  count: int
  moe: bool
  first_moe: int

  @property
  def layers(self) -> range:
    """The run's layer indices in the whole stack."""
    return range(self.first, self.first + self.count)


@dataclasses.dataclass(frozen=True)
class Architecture:
  """Architecture of a decoder (what a checkpoint's ``config.json`` says), validated when
  built. Sizes are per model, not per device. ``models.DecoderConfig`` adds how it runs."""

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
  # Mixture of experts (``models.moe``; Qwen3-MoE and Mixtral ``config.json`` fields):
  # ``num_experts`` experts per MoE layer (HF ``num_experts`` / ``num_local_experts``; 0 =
  # dense), each token routed to ``num_experts_per_tok`` of them, each a SwiGLU of width
  # ``moe_mlp_dim`` (HF ``moe_intermediate_size``; Mixtral's experts use
  # ``intermediate_size``). ``norm_topk_prob``: the top-k gates renormalised to sum to 1
  # (Qwen3-MoE's flag; Mixtral always does). Layer ``i`` is MoE iff ``i`` is not in
  # ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (HF Qwen3MoeDecoderLayer),
  # else a dense SwiGLU of width ``mlp_dim`` (HF ``intermediate_size``); ``layer_runs``.
  # ``router_aux_loss_coef``: the weight of the router's load-balancing loss (Switch /
  # Mixtral form) in the trainer's loss; 0 (off) in RL.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_mlp_dim: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.0

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'DecoderConfig.family={self.family!r}; choose one of {FAMILIES}.')
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
    self._check_moe()

  def _check_moe(self) -> None:
    """Raises ValueError naming the MoE field, its value and the fix."""
    moe = self.family in MOE_FAMILIES
    for name in ('num_experts', 'num_experts_per_tok', 'moe_mlp_dim', 'decoder_sparse_step'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f'DecoderConfig.{name} must be a non-negative int, got {value!r}.')
    if not moe:
      if self.num_experts:
        raise ValueError(
            f'DecoderConfig.num_experts={self.num_experts} makes a mixture of experts, but '
            f'family={self.family!r} is dense; set family to one of {MOE_FAMILIES} or '
            'num_experts=0.')
      return
    if self.num_experts < 1:
      raise ValueError(f'DecoderConfig.family={self.family!r} is a mixture of experts but '
                       f'num_experts={self.num_experts}; set num_experts >= 1.')
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f'DecoderConfig.num_experts_per_tok={self.num_experts_per_tok} must be '
                       f'in [1, num_experts={self.num_experts}]; set it to the experts each '
                       'token is routed to (HF num_experts_per_tok).')
    if self.moe_mlp_dim < 1:
      raise ValueError(f'DecoderConfig.moe_mlp_dim={self.moe_mlp_dim} must be positive: each '
                       'expert\'s SwiGLU width (HF moe_intermediate_size; Mixtral\'s '
                       'intermediate_size).')
    if self.family == 'mixtral' and not self.norm_topk_prob:
      raise ValueError('DecoderConfig.norm_topk_prob=False, but family=\'mixtral\' always '
                       'renormalises its top-k gates; set norm_topk_prob=True.')
    if self.decoder_sparse_step < 1:
      raise ValueError(f'DecoderConfig.decoder_sparse_step={self.decoder_sparse_step} must be '
                       '>= 1: every decoder_sparse_step-th layer is MoE (HF '
                       'decoder_sparse_step; 1 = every layer).')
    if self.family == 'mixtral' and (self.decoder_sparse_step != 1 or self.mlp_only_layers):
      raise ValueError(
          f'DecoderConfig.decoder_sparse_step={self.decoder_sparse_step} and mlp_only_layers='
          f'{tuple(self.mlp_only_layers)} mix dense and MoE layers, which Mixtral does not '
          '(every layer is MoE); set decoder_sparse_step=1 and mlp_only_layers=(), or '
          "family='qwen3_moe'.")
    layers = self.mlp_only_layers
    if (not isinstance(layers, tuple) or len(set(layers)) != len(layers)
        or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers
               for i in layers)):
      raise ValueError(
          f'DecoderConfig.mlp_only_layers={layers!r} must be a tuple of distinct layer indices '
          f'in [0, num_layers={self.num_layers}): the layers that keep a dense MLP (HF '
          'mlp_only_layers).')
    if not self.num_moe_layers:
      raise ValueError(
          f'DecoderConfig.decoder_sparse_step={self.decoder_sparse_step} and mlp_only_layers='
          f'{layers} leave none of the {self.num_layers} layers MoE; set num_experts=0 and a '
          'dense family for a dense model, or make some layer MoE.')
    coef = self.router_aux_loss_coef
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
      raise ValueError(f'DecoderConfig.router_aux_loss_coef={coef!r} must be a float >= 0 '
                       '(0 turns the load-balancing loss off).')

  @property
  def is_moe(self) -> bool:
    """Whether the model has mixtures of experts (``num_experts > 0``; some of its layers
    may still be dense: ``is_moe_layer``)."""
    return self.num_experts > 0

  def is_moe_layer(self, i: int) -> bool:
    """Whether layer ``i``'s MLP is a mixture of experts: HF Qwen3MoeDecoderLayer's rule,
    ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``."""
    return (self.num_experts > 0 and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0)

  @property
  def num_moe_layers(self) -> int:
    """How many layers are MoE (``is_moe_layer``): the layer axis of recorded routes."""
    return sum(self.is_moe_layer(i) for i in range(self.num_layers))

  @property
  def stack_names(self) -> tuple[str, ...]:
    """The params keys of the decoder's layers: each run's (``layer_runs``), the first
    always ``'blocks'`` (an ``'unrolled'`` decoder's list of every layer's block)."""
    return tuple(run.name for run in self.layer_runs())

  def layer_runs(self) -> tuple[LayerRun, ...]:
    """The layers split into maximal runs of consecutive layers of one kind (dense or
    MoE), in order: each run is one stacked, scanned params subtree of the decoder. A
    homogeneous stack is one run named ``'blocks'``; the others are named ``'blocks_1'``,
    ``'blocks_2'``, ... (``LayerRun``)."""
    runs: list[LayerRun] = []
    moe_seen = 0
    for i in range(self.num_layers):
      moe = self.is_moe_layer(i)
      if runs and runs[-1].moe == moe:
        runs[-1] = dataclasses.replace(runs[-1], count=runs[-1].count + 1)
      else:
        runs.append(LayerRun(block_run_name(len(runs)), i, 1, moe, moe_seen))
      moe_seen += moe
    return tuple(runs)

  def fields(self) -> dict:
    """The architecture's fields by name (``rope_scaling`` kept a ``RopeScaling``)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(Architecture)}


_QWEN3 = dict(vocab_size=151_936, head_dim=128, rope_theta=1_000_000.0, norm_eps=1e-6,
              qk_norm=True, family='qwen3', max_seq_len=40_960)
# What the small Qwen2.5 checkpoints' config.json files share.
_QWEN25_SMALL = dict(vocab_size=151_936, rope_theta=1_000_000.0, norm_eps=1e-6,
                     tie_embeddings=True, qkv_bias=True, max_seq_len=32_768, family='qwen2')
# What Llama 3.1 and 3.2 share (their rope_scaling: low_freq_factor 1, high_freq_factor 4,
# original_max_position_embeddings 8192, RopeScaling's defaults; the factor differs).
_LLAMA3 = dict(vocab_size=128_256, rope_theta=500_000.0, norm_eps=1e-5, max_seq_len=131_072,
               family='llama')

# The real targets' architectures (``model.name``), as each model's published ``config.json``
# on the Hugging Face hub gives them (``models.presets`` names the hub fields).
PRESET_ARCHITECTURES: dict[str, Architecture] = {
    'smollm2-135m': Architecture(
        vocab_size=49_152, num_layers=30, embed_dim=576, num_heads=9, num_kv_heads=3,
        head_dim=64, mlp_dim=1536, rope_theta=100_000.0, norm_eps=1e-5, tie_embeddings=True,
        max_seq_len=8192, family='llama'),
    'qwen3-0.6b': Architecture(num_layers=28, embed_dim=1024, num_heads=16, num_kv_heads=8,
                               mlp_dim=3072, tie_embeddings=True, **_QWEN3),
    'qwen3-1.7b': Architecture(num_layers=28, embed_dim=2048, num_heads=16, num_kv_heads=8,
                               mlp_dim=6144, tie_embeddings=True, **_QWEN3),
    'qwen3-8b': Architecture(num_layers=36, embed_dim=4096, num_heads=32, num_kv_heads=8,
                             mlp_dim=12_288, tie_embeddings=False, **_QWEN3),
    'qwen3-32b': Architecture(num_layers=64, embed_dim=5120, num_heads=64, num_kv_heads=8,
                              mlp_dim=25_600, tie_embeddings=False, **_QWEN3),
    # Qwen/Qwen2.5-0.5B-Instruct config.json: hidden_size 896, intermediate_size 4864, 24
    # layers, 14 heads, 2 kv heads (head_dim 896 / 14 = 64), vocab 151936, rope_theta 1e6,
    # rms_norm_eps 1e-6, tie_word_embeddings true, max_position_embeddings 32768.
    'qwen2.5-0.5b': Architecture(num_layers=24, embed_dim=896, num_heads=14, num_kv_heads=2,
                                 head_dim=64, mlp_dim=4864, **_QWEN25_SMALL),
    # Qwen/Qwen2.5-1.5B-Instruct config.json: hidden_size 1536, intermediate_size 8960, 28
    # layers, 12 heads, 2 kv heads (head_dim 1536 / 12 = 128), vocab 151936, rope_theta 1e6,
    # rms_norm_eps 1e-6, tie_word_embeddings true, max_position_embeddings 32768.
    'qwen2.5-1.5b': Architecture(num_layers=28, embed_dim=1536, num_heads=12, num_kv_heads=2,
                                 head_dim=128, mlp_dim=8960, **_QWEN25_SMALL),
    'qwen2.5-7b': Architecture(
        vocab_size=152_064, num_layers=28, embed_dim=3584, num_heads=28, num_kv_heads=4,
        head_dim=128, mlp_dim=18_944, rope_theta=1_000_000.0, norm_eps=1e-6,
        tie_embeddings=False, qkv_bias=True, max_seq_len=32_768, family='qwen2'),
    'llama-3.1-8b': Architecture(num_layers=32, embed_dim=4096, num_heads=32, num_kv_heads=8,
                                 head_dim=128, mlp_dim=14_336, tie_embeddings=False,
                                 rope_scaling=RopeScaling(factor=8.0), **_LLAMA3),
    # meta-llama/Llama-3.2-1B-Instruct config.json: hidden_size 2048, intermediate_size 8192,
    # 16 layers, 32 heads, 8 kv heads, head_dim 64, vocab 128256, rope_theta 5e5, rope_scaling
    # llama3 (factor 32, low_freq_factor 1, high_freq_factor 4, original 8192), rms_norm_eps
    # 1e-5, tie_word_embeddings true, max_position_embeddings 131072.
    'llama-3.2-1b': Architecture(num_layers=16, embed_dim=2048, num_heads=32, num_kv_heads=8,
                                 head_dim=64, mlp_dim=8192, tie_embeddings=True,
                                 rope_scaling=RopeScaling(factor=32.0), **_LLAMA3),
    'qwq-32b': Architecture(
        vocab_size=152_064, num_layers=64, embed_dim=5120, num_heads=40, num_kv_heads=8,
        head_dim=128, mlp_dim=27_648, rope_theta=1_000_000.0, norm_eps=1e-5,
        tie_embeddings=False, qkv_bias=True, max_seq_len=40_960, family='qwen2'),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, 48 layers, 32 heads, 4 kv heads,
    # head_dim 128, 128 experts, num_experts_per_tok 8, moe_intermediate_size 768,
    # norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [], intermediate_size 6144
    # (unused: every layer is MoE), vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6,
    # tie_word_embeddings false, max_position_embeddings 40960, router_aux_loss_coef 0.001
    # (0 here: off in RL).
    'qwen3-30b-a3b': Architecture(
        num_layers=48, embed_dim=2048, num_heads=32, num_kv_heads=4, mlp_dim=6144,
        tie_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_mlp_dim=768,
        norm_topk_prob=True, **{**_QWEN3, 'family': 'qwen3_moe'}),
    # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336 (each
    # expert's), 32 layers, 32 heads, 8 kv heads (head_dim 128), num_local_experts 8,
    # num_experts_per_tok 2, vocab 32000, rope_theta 1e6, rms_norm_eps 1e-5,
    # tie_word_embeddings false, max_position_embeddings 32768.
    'mixtral-8x7b': Architecture(
        vocab_size=32_000, num_layers=32, embed_dim=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, rope_theta=1_000_000.0, norm_eps=1e-5,
        tie_embeddings=False, max_seq_len=32_768, family='mixtral', num_experts=8,
        num_experts_per_tok=2, moe_mlp_dim=14_336, norm_topk_prob=True),
}

# Presets whose checkpoint ships as a pip package (nothing is downloaded at run time;
# ``models.presets.packaged_checkpoint`` finds its file).
PACKAGED_CHECKPOINTS = ('smollm2-135m',)

# ORG/NAME as the hub spells repository ids (letters, digits, '-', '_', '.'; at most 96
# characters each side).
_REPO_ID = re.compile(r'[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}')


def is_hub_id(path: str | os.PathLike[str]) -> bool:
  """Whether ``path`` names a hub model repository: ``ORG/NAME``, not a path on this machine.

  Syntactic only (nothing is fetched): a relative ``dir/file`` that does not exist here reads
  as a hub id too, which ``models.files.hub.resolve_model_path`` reports as such when the hub
  lacks it.
  """
  text = os.fspath(path)
  return (bool(_REPO_ID.fullmatch(text)) and '--' not in text and '..' not in text
          and not text.endswith(('.', '.gguf')) and not os.path.exists(text))


def inference_param_dtype(config: Any) -> str:
  """The name of the dtype the inference workers hold the params in:
  ``model.inference_param_dtype``, or ``model.param_dtype`` when it is ''."""
  return config.model.inference_param_dtype or config.model.param_dtype


def check_config(config: Any) -> None:
  """Checks a run config's model (``model.*``, ``lora.*``) before any compute: the name (a
  preset, ``'tiny'`` or ``'auto'``), the path (a file or directory here, or a hub id; a
  preset without one must ship packaged), the tiny model's architecture and every length
  against ``model.max_seq_len``, and the combinations that cannot hold (batch invariance
  with a split contraction, a second param dtype, quantised weights or cache; LoRA options
  without adapters). Raises ``ConfigError`` naming the key, the value seen and the fix.
  ``rlax_llm.config.validate_config`` calls it after the choices were checked.
  """
  m = config.model
  valid = ('tiny', 'auto', *sorted(PRESET_ARCHITECTURES))
  if m.name not in valid:
    raise ConfigError(f'config.model.name={m.name!r} is not valid; choose one of '
                      f'{list(valid)}.')
  split = {f'mesh.{role}.{axis}': config.mesh[role][axis]
           for role in ('trainer', 'inference') for axis in ('fsdp', 'tensor')}
  if m.batch_invariant and any(size != 1 for size in split.values()):
    raise ConfigError(
        'config.model.batch_invariant=True makes sampler and trainer log-probs equal only when '
        'no role splits a matmul\'s contraction across devices (fsdp and tensor both do), but '
        + ', '.join(f'{k}={v}' for k, v in split.items() if v != 1)
        + '; shard with the data axis only or turn batch_invariant off.')
  if m.batch_invariant and inference_param_dtype(config) != m.param_dtype:
    raise ConfigError(
        f'config.model.batch_invariant=True makes sampler and trainer log-probs bitwise equal, '
        f'but the workers hold the params in model.inference_param_dtype='
        f'{m.inference_param_dtype!r} and the trainer in model.param_dtype={m.param_dtype!r}: '
        'the sampler would not run the trainer\'s weights. Set model.inference_param_dtype=\'\' '
        '(the same dtype) or turn batch_invariant off.')
  if m.batch_invariant and m.inference_quant != 'none':
    raise ConfigError(
        f'config.model.batch_invariant=True makes sampler and trainer log-probs bitwise equal, '
        f'but model.inference_quant={m.inference_quant!r} samples with a quantised copy of the '
        'trainer\'s weights. Set model.inference_quant=\'none\' or turn batch_invariant off.')
  if m.batch_invariant and m.kv_cache_quant != 'none':
    raise ConfigError(
        f'config.model.batch_invariant=True makes sampler and trainer log-probs bitwise equal, '
        f'but model.kv_cache_quant={m.kv_cache_quant!r} samples attending to quantised keys '
        'and values. Set model.kv_cache_quant=\'none\' or turn batch_invariant off.')
  if config.lora.base_quant != 'none' and config.lora.rank == 0:
    raise ConfigError(
        f'config.lora.base_quant={config.lora.base_quant!r} quantises the frozen base under LoRA '
        'adapters, but lora.rank=0 trains the full model (whose weights cannot be int8). Set '
        'lora.rank > 0 or lora.base_quant=\'none\'.')
  if config.lora.sync_dtype != 'float32' and (config.lora.rank == 0
                                              or config.lora.sync != 'adapters'):
    raise ConfigError(
        f'config.lora.sync_dtype={config.lora.sync_dtype!r} rounds the adapter versions of '
        f'adapter-only sync, but lora.rank={config.lora.rank} and lora.sync='
        f'{config.lora.sync!r} push no adapters (whole weights travel in '
        'model.inference_param_dtype). Set lora.rank > 0 with lora.sync=\'adapters\', or '
        'lora.sync_dtype=\'float32\'.')
  if config.lora.base_quant != 'none' and m.batch_invariant:
    raise ConfigError(
        f'config.model.batch_invariant=True makes sampler and trainer log-probs bitwise equal, '
        f'but lora.base_quant={config.lora.base_quant!r} has the trainer compute (x @ q) * scale '
        'over an int8 base while the workers run its dequantised weights. Set '
        'lora.base_quant=\'none\' or turn batch_invariant off.')
  s = config.sampling
  # An episode's last sampled token follows a full cache: its rows are one token longer.
  needed = s.max_prompt_len + s.max_new_tokens + (1 if config.env.name else 0)
  if m.name == 'tiny':
    if m.path is not None:
      raise ConfigError(f'config.model.path={m.path!r} is set but model.name=\'tiny\' builds '
                        'a model from scratch; set model.name to the checkpoint\'s preset (or '
                        '\'auto\') or clear model.path.')
    try:
      Architecture(vocab_size=1, max_seq_len=m.max_seq_len, **m.tiny.to_dict())
    except (ValueError, TypeError) as e:
      raise ConfigError(f'config.model.tiny.{e}') from None
    if m.max_seq_len < needed:
      raise ConfigError(
          f'config.model.max_seq_len={m.max_seq_len} is shorter than sampling.max_prompt_len '
          f'({s.max_prompt_len}) + sampling.max_new_tokens ({s.max_new_tokens})'
          + (' + 1 (an episode\'s last sampled token)' if config.env.name else '')
          + f' = {needed}; raise model.max_seq_len or shorten the prompts/completions.')
  elif m.path is None and m.name not in PACKAGED_CHECKPOINTS:
    raise ConfigError(
        f'config.model.name={m.name!r} needs config.model.path (an HF directory, a .gguf file '
        f'or a hub id ORG/NAME of the model): no checkpoint of it ships with rlax_llm '
        f'(packaged: {sorted(PACKAGED_CHECKPOINTS)}).')
  elif m.path is not None and not (pathlib.Path(m.path).exists() or is_hub_id(m.path)):
    raise ConfigError(f'config.model.path={m.path!r} does not exist and is not a Hugging Face '
                      'hub id (ORG/NAME); pass an HF directory, a .gguf file or a hub id of '
                      'the model.')
  elif m.revision and (m.path is None or not is_hub_id(m.path)):
    raise ConfigError(f'config.model.revision={m.revision!r} picks a revision of a hub model, '
                      f'but config.model.path={m.path!r} is not a hub id (ORG/NAME); clear '
                      'model.revision.')
  elif m.max_seq_len is not None and m.max_seq_len < needed:
    raise ConfigError(
        f'config.model.max_seq_len={m.max_seq_len} is shorter than sampling.max_prompt_len + '
        'sampling.max_new_tokens' + (' + 1 (an episode\'s last sampled token)'
                                     if config.env.name else '') + f' = {needed}.')
