"""GGUF metadata and tensor names -> the Hugging Face config, parameter names and layouts.

The part of reading a GGUF checkpoint that needs no file (``rlax_llm.models.files.gguf`` opens
the file and dequantises its tensors): ``hf_config_from_metadata`` derives the Hugging Face
config dict from a GGUF file's key/value fields, ``hf_parameter_shapes`` lists every parameter
that config implies with its numpy shape, ``hf_name`` maps a GGUF tensor name onto its Hugging
Face name (``token_embd`` / ``output_norm`` / ``output`` and ``blk.{i}.<stem>``: see
``_GLOBAL_NAMES`` and ``_BLOCK_NAMES``), and ``unpermute_rope_rows`` undoes the row interleave
llama.cpp's converter applies to llama q / k heads.

Reference: GGUF format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

# GGUF ``general.architecture`` -> Hugging Face ``architectures`` entry.
_ARCHITECTURES = {
    'llama': 'LlamaForCausalLM',
    'qwen2': 'Qwen2ForCausalLM',
    'qwen3': 'Qwen3ForCausalLM',
}

# GGUF names of tensors outside the blocks -> Hugging Face names.
_GLOBAL_NAMES = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}

# GGUF block tensor stem (``blk.{i}.<stem>.weight``) -> module path inside ``model.layers.{i}``.
_BLOCK_NAMES = {
    'attn_norm': 'input_layernorm',
    'ffn_norm': 'post_attention_layernorm',
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'attn_q_norm': 'self_attn.q_norm',
    'attn_k_norm': 'self_attn.k_norm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
}
_BLOCK_PATTERN = re.compile(r'blk\.(\d+)\.(\w+)\.(weight|bias)')

_REQUIRED = object()


def hf_config_from_metadata(
    metadata: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, Any]:
  """Maps GGUF metadata to a Hugging Face config dict.

  Args:
    metadata: GGUF key/value fields as Python values (``read_gguf``'s third output), e.g.
      ``{'general.architecture': 'llama', 'llama.embedding_length': 576, ...}``.
    tensor_shapes: ``{gguf_tensor_name: numpy-order shape}`` of the file's tensors. Only
      ``token_embd.weight`` (its rows are the vocabulary size) and the presence of
      ``output.weight`` (untied head), ``blk.0.attn_q.bias`` (attention biases) and
      ``rope_freqs.weight`` (unsupported) are read.

  Returns:
    A dict with ``architectures``, ``model_type``, ``vocab_size``, ``hidden_size``,
    ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``hidden_act`` (``'silu'``),
    ``max_position_embeddings``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling`` (``None``
    or e.g. ``{'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32768}``),
    ``attention_bias``, ``tie_word_embeddings``, ``bos_token_id``, ``eos_token_id`` and
    ``pad_token_id`` (``None`` when absent). Float32 metadata values are given as the shortest
    decimal that round-trips in float32 (``1e-05``, not ``9.999999747378752e-06``).
    ``vocab_size`` is the embedding's row count: GGUF files of padded-vocabulary models (Qwen)
    list fewer tokenizer tokens than embedding rows, and the state dict must agree with the
    config.

  Raises:
    ValueError: the architecture is not llama / qwen2 / qwen3, a required field is missing, or
      the fields describe something the Hugging Face classes cannot hold (per-layer head counts,
      partial rotary, key and value head sizes that differ, llama3 rope frequency factors).
  """
  arch = metadata.get('general.architecture')
  if arch not in _ARCHITECTURES:
    raise ValueError(
        f'GGUF general.architecture {arch!r} is not supported; supported architectures are '
        f'{sorted(_ARCHITECTURES)}. Convert the model from its Hugging Face checkpoint instead.')

  def field(suffix: str, default: Any = _REQUIRED) -> Any:
    key = f'{arch}.{suffix}'
    if key in metadata:
      value = metadata[key]
      if isinstance(value, list):
        raise ValueError(
            f'GGUF field {key!r} is a per-layer list {value[:8]}...; only models with the same '
            'value in every layer are supported.')
      return value
    if default is _REQUIRED:
      raise ValueError(
          f'GGUF metadata lacks the required field {key!r} (fields present under {arch!r}: '
          f'{sorted(k for k in metadata if k.startswith(arch + "."))}); the file is not a '
          'complete llama.cpp model export.')
    return default

  hidden = int(field('embedding_length'))
  num_heads = int(field('attention.head_count'))
  num_kv_heads = int(field('attention.head_count_kv', num_heads))
  head_dim = int(field('attention.key_length', hidden // num_heads))
  value_dim = int(field('attention.value_length', head_dim))
  if value_dim != head_dim:
    raise ValueError(
        f'GGUF {arch}.attention.key_length={head_dim} differs from attention.value_length='
        f'{value_dim}; {_ARCHITECTURES[arch]} needs one head_dim for keys and values.')
  rope_dim = int(field('rope.dimension_count', head_dim))
  if rope_dim != head_dim:
    raise ValueError(
        f'GGUF {arch}.rope.dimension_count={rope_dim} differs from head_dim={head_dim}: partial '
        f'rotary embeddings are not supported by {_ARCHITECTURES[arch]}.')
  if 'rope_freqs.weight' in tensor_shapes:
    raise ValueError(
        'GGUF tensor \'rope_freqs.weight\' (llama3-style per-frequency rope factors) is not '
        'supported: Hugging Face configs hold those as rope_scaling parameters this file does '
        'not record. Convert the model from its Hugging Face checkpoint instead.')
  if 'token_embd.weight' not in tensor_shapes:
    raise ValueError(
        f'GGUF file has no \'token_embd.weight\' tensor (tensors: {sorted(tensor_shapes)[:8]}...)'
        '; it is not a complete decoder checkpoint.')
  vocab_size = int(tensor_shapes['token_embd.weight'][0])
  tokens = metadata.get('tokenizer.ggml.tokens')
  if tokens is not None and len(tokens) > vocab_size:
    raise ValueError(
        f'GGUF tokenizer.ggml.tokens lists {len(tokens)} tokens but token_embd.weight has only '
        f'{vocab_size} rows; the tokenizer and the weights come from different models.')

  def token_id(name: str) -> int | None:
    value = metadata.get(f'tokenizer.ggml.{name}_token_id')
    return None if value is None else int(value)

  return {
      'architectures': [_ARCHITECTURES[arch]],
      'model_type': arch,
      'vocab_size': vocab_size,
      'hidden_size': hidden,
      'intermediate_size': int(field('feed_forward_length')),
      'num_hidden_layers': int(field('block_count')),
      'num_attention_heads': num_heads,
      'num_key_value_heads': num_kv_heads,
      'head_dim': head_dim,
      'hidden_act': 'silu',
      'max_position_embeddings': int(field('context_length')),
      'rms_norm_eps': _float32(field('attention.layer_norm_rms_epsilon')),
      # 10000 is llama.cpp's default when a converter wrote no base.
      'rope_theta': _float32(field('rope.freq_base', 10000.0)),
      'rope_scaling': _rope_scaling(metadata, arch),
      'attention_bias': arch == 'qwen2' or 'blk.0.attn_q.bias' in tensor_shapes,
      'tie_word_embeddings': 'output.weight' not in tensor_shapes,
      'bos_token_id': token_id('bos'),
      'eos_token_id': token_id('eos'),
      'pad_token_id': token_id('padding'),
  }


def hf_parameter_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
  """Every parameter name and numpy shape a config from ``hf_config_from_metadata`` implies.

  Shapes are in Hugging Face layout (``[out_features, in_features]`` for projections).
  qwen2 has q/k/v biases; llama and qwen3 with ``attention_bias`` have q/k/v/o biases; qwen3 has
  ``q_norm`` / ``k_norm`` ``[head_dim]``; ``lm_head.weight`` appears only when untied.
  """
  hidden = config['hidden_size']
  vocab = config['vocab_size']
  inner = config['intermediate_size']
  q_dim = config['num_attention_heads'] * config['head_dim']
  kv_dim = config['num_key_value_heads'] * config['head_dim']
  shapes: dict[str, tuple[int, ...]] = {
      'model.embed_tokens.weight': (vocab, hidden),
      'model.norm.weight': (hidden,),
  }
  if not config['tie_word_embeddings']:
    shapes['lm_head.weight'] = (vocab, hidden)
  for layer in range(config['num_hidden_layers']):
    prefix = f'model.layers.{layer}.'
    block = {
        'input_layernorm.weight': (hidden,),
        'post_attention_layernorm.weight': (hidden,),
        'self_attn.q_proj.weight': (q_dim, hidden),
        'self_attn.k_proj.weight': (kv_dim, hidden),
        'self_attn.v_proj.weight': (kv_dim, hidden),
        'self_attn.o_proj.weight': (hidden, q_dim),
        'mlp.gate_proj.weight': (inner, hidden),
        'mlp.up_proj.weight': (inner, hidden),
        'mlp.down_proj.weight': (hidden, inner),
    }
    if config['attention_bias']:
      block.update({
          'self_attn.q_proj.bias': (q_dim,),
          'self_attn.k_proj.bias': (kv_dim,),
          'self_attn.v_proj.bias': (kv_dim,),
      })
      if config['model_type'] != 'qwen2':
        block['self_attn.o_proj.bias'] = (hidden,)
    if config['model_type'] == 'qwen3':
      block['self_attn.q_norm.weight'] = (config['head_dim'],)
      block['self_attn.k_norm.weight'] = (config['head_dim'],)
    shapes.update({prefix + name: shape for name, shape in block.items()})
  return shapes


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head q/k row interleave (``LlamaModel.permute``).

  Within each head of ``head_dim = rows / num_heads`` rows, GGUF row ``2 * j + s`` holds
  Hugging Face row ``s * head_dim / 2 + j`` (``j < head_dim / 2``, ``s`` in {0, 1}); this maps
  the rows back.

  Args:
    weight: ``[num_heads * head_dim, ...]`` (a projection matrix or its bias), any float dtype.
    num_heads: query heads for q, key/value heads for k.

  Returns:
    The same shape and dtype, rows in Hugging Face rotate-half order.
  """
  rows = weight.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(
        f'Cannot unpermute {rows} rows into {num_heads} heads of an even head_dim; pass the '
        'head count that belongs to this projection (num_key_value_heads for k).')
  half = rows // num_heads // 2
  per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])
  return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def hf_name(gguf_name: str, config: Mapping[str, Any]) -> str:
  """Hugging Face name of a GGUF tensor; ``ValueError`` for a name outside the mapping."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  match = _BLOCK_PATTERN.fullmatch(gguf_name)
  if match is None or match.group(2) not in _BLOCK_NAMES:
    raise ValueError(
        f'Unknown GGUF tensor {gguf_name!r}: it has no Hugging Face counterpart in the '
        f'{config["model_type"]} mapping (known: {sorted(_GLOBAL_NAMES)} and blk.{{i}}.'
        f'{{{", ".join(_BLOCK_NAMES)}}}.{{weight,bias}}).')
  layer, stem, kind = int(match.group(1)), match.group(2), match.group(3)
  if layer >= config['num_hidden_layers']:
    raise ValueError(
        f'GGUF tensor {gguf_name!r} belongs to block {layer}, but the metadata says '
        f'block_count={config["num_hidden_layers"]}; the file is inconsistent.')
  return f'model.layers.{layer}.{_BLOCK_NAMES[stem]}.{kind}'


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
  """Hugging Face ``rope_scaling`` from ``{arch}.rope.scaling.*`` (or legacy ``scale_linear``)."""
  prefix = f'{arch}.rope.'
  rope_type = metadata.get(prefix + 'scaling.type')
  if rope_type is None and prefix + 'scale_linear' in metadata:
    factor = _float32(metadata[prefix + 'scale_linear'])
    return None if factor == 1.0 else {'rope_type': 'linear', 'factor': factor}
  if rope_type in (None, 'none'):
    return None
  scaling: dict[str, Any] = {'rope_type': rope_type}
  if prefix + 'scaling.factor' in metadata:
    scaling['factor'] = _float32(metadata[prefix + 'scaling.factor'])
  if prefix + 'scaling.original_context_length' in metadata:
    scaling['original_max_position_embeddings'] = int(
        metadata[prefix + 'scaling.original_context_length'])
  if prefix + 'scaling.attn_factor' in metadata:
    scaling['attention_factor'] = _float32(metadata[prefix + 'scaling.attn_factor'])
  return scaling


def _float32(value: Any) -> float:
  """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99...e-06)."""
  return float(str(np.float32(value)))
