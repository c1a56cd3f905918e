"""Load and save real checkpoints: Hugging Face directories (local or hub ids) and GGUF files.

``from_pretrained(path, mesh=None, dtype=...)`` returns ``(model, tokenizer)`` for a local
directory or file, or a hub id ``ORG/NAME`` (``hub.resolve_model_path``): ``model`` is
an NNX ``Decoder`` (``model(tokens)`` with int32 ``[batch, length]`` gives float32 logits
``[batch, length, vocab]``) whose params are already placed with their target
``NamedSharding`` when a mesh is given. Each tensor is read lazily (memory-mapped
safetensors, or dequantised GGUF), converted on the host once, and handed to
``jax.make_array_from_callback``, so every device receives only its own shard: no device
ever holds a full unsharded copy of a sharded tensor.

``save_pretrained(model, tokenizer, out_dir)`` writes ``config.json``, ``model.safetensors``
(or shards and their index), ``generation_config.json``, the tokenizer files and a model card:
a directory ``transformers`` loads and ``huggingface_hub.upload_folder`` uploads as is.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlax_llm import sharding as sharding_lib
from rlax_llm.models.decoder import Decoder
from rlax_llm.models.decoder_config import DecoderConfig, Execution
from rlax_llm.models.files import gguf as gguf_lib
from rlax_llm.models.files import hf, hub
from rlax_llm.models.files import tokenizer as tokenizer_lib
from rlax_llm.models.model import abstract_model


def from_pretrained(path: str | pathlib.Path, mesh: Mesh | None = None,
                    dtype: Any = jnp.float32, *, param_dtype: Any = jnp.float32,
                    remat: str = 'none', batch_invariant: bool = False,
                    invariant_rows: str = 'chunks', max_seq_len: int | None = None,
                    rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES,
                    revision: str = '') -> tuple[Decoder, Any]:
  """Loads a Hugging Face directory (local, or a hub id) or a ``.gguf`` file.

  Args:
    path: a directory with ``config.json`` and ``*.safetensors`` (single file or sharded
      with ``model.safetensors.index.json``), a ``.gguf`` file, or a Hugging Face hub id
      ``ORG/NAME`` that is not a path on this machine (fetched into, or read from, the hub
      cache: ``rlax_llm.models.files.hub``).
    mesh: if given, params are placed with the shardings that the logical-axis ``rules``
      give on this mesh; else on the default device.
    dtype, param_dtype, remat, batch_invariant, invariant_rows: how the model runs, its
      ``DecoderConfig.execution`` (``Execution``: compute and storage dtypes, the blocks'
      rematerialisation policy, batch-invariant numerics and how they fix the matmul
      kernel).
    max_seq_len: override of the config's maximum sequence length.
    revision: for a hub id, a branch, tag or commit sha ('' = the repository's default
      branch).
  Returns:
    ``(model, tokenizer)``; tokenizer is None for a directory without ``tokenizer.json``.
  Raises:
    FileNotFoundError for a missing file; ``errors.CheckpointError`` naming the file, tensor or
    field for a corrupt or truncated file (GGUF, safetensors, ``config.json``,
    ``tokenizer.json``), a missing tensor, a shape mismatch or an unsupported architecture;
    for a hub id, what ``hub.resolve_model_path`` raises.
  """
  path = hub.resolve_model_path(path, revision)
  if path.suffix == '.gguf':
    if not path.is_file():
      raise FileNotFoundError(f'GGUF file {path} does not exist.')
    reader = gguf_lib.open_gguf(path)  # parsed once for weights and tokenizer
    hf_config, state, _ = gguf_lib.read_gguf(path, reader=reader)
    get_tensor, names = state.__getitem__, set(state)
    tokenizer = tokenizer_lib.HFTokenizer.from_gguf(reader)
  else:
    config_file = path / 'config.json'
    if not config_file.is_file():
      raise FileNotFoundError(f'{config_file} does not exist: not a Hugging Face model '
                              'directory (or pass a .gguf file).')
    hf_config = hf.read_json_object(config_file)
    checkpoint = hf.SafetensorsCheckpoint(path)
    get_tensor, names = checkpoint.get, checkpoint.names
    tokenizer = (tokenizer_lib.HFTokenizer.from_directory(path)
                 if (path / 'tokenizer.json').exists() else None)
  execution = Execution(remat=remat, param_dtype=param_dtype, dtype=dtype,
                        batch_invariant=batch_invariant, invariant_rows=invariant_rows)
  config = hf.config_from_hf(hf_config, execution=execution, max_seq_len=max_seq_len)
  model = abstract_model(config)
  abstract = model.abstract_params()

  if mesh is None:
    place = lambda _, x: jnp.asarray(x)
  else:
    shardings = sharding_lib.param_shardings(abstract, model.logical_axes(), mesh, rules)

    def place(param_path, host):
      target = hf.get_path(shardings, param_path)
      return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

  params = hf.params_from_hf(get_tensor, names, config, abstract, place)
  return nnx.merge(model.graphdef, params), tokenizer


# The largest safetensors file ``save_pretrained`` writes before it shards (transformers'
# default ``max_shard_size``; the hub stores files of up to 50 GB).
MAX_SHARD_BYTES = 5 * 10**9


def save_pretrained(model: Decoder, tokenizer: Any, out_dir: str | pathlib.Path, *,
                    max_shard_bytes: int = MAX_SHARD_BYTES, base_model: str = '') -> None:
  """Writes ``model`` (and ``tokenizer`` if it can ``save``) as a Hugging Face directory.

  The directory is what ``transformers.AutoModelForCausalLM.from_pretrained`` loads and what
  ``huggingface_hub.upload_folder`` uploads as is: ``config.json`` (``architectures``,
  ``model_type``, ``torch_dtype``), the weights in their stored dtype as
  ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors`` shards of at most
  ``max_shard_bytes`` (one tensor may exceed it) with ``model.safetensors.index.json``,
  ``generation_config.json``, the tokenizer's files, and a ``README.md`` model card (kept if
  the directory has one; ``base_model``, a hub id, goes in its metadata when given).
  """
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  config: DecoderConfig = model.config
  params = jax.tree.map(np.asarray,
                        jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
  _write_weights(out, hf.params_to_hf(params, config), max_shard_bytes)
  special = {}
  if tokenizer is not None and getattr(tokenizer, 'bos_id', None) is not None:
    special = {'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id}
  hf_config = hf.config_to_hf(config, **special)
  (out / 'config.json').write_text(json.dumps(hf_config, indent=2))
  (out / 'generation_config.json').write_text(json.dumps(special, indent=2))
  if tokenizer is not None and hasattr(tokenizer, 'save'):
    tokenizer.save(out)
  if not (out / 'README.md').exists():
    (out / 'README.md').write_text(_model_card(hf_config, params, out.name, base_model))


def _write_weights(out: pathlib.Path, tensors: dict[str, np.ndarray],
                   max_shard_bytes: int) -> None:
  """``tensors`` as ``model.safetensors``, or as shards and their index past
  ``max_shard_bytes`` (tensors in order, a shard closed before the one that would overflow
  it); stale weight files of an earlier export are removed."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in tensors.items():
    if shards[-1] and size + array.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  for stale in [*out.glob('*.safetensors'), out / 'model.safetensors.index.json']:
    stale.unlink(missing_ok=True)
  if len(shards) == 1:
    hf.write_safetensors(out / 'model.safetensors', shards[0])
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    hf.write_safetensors(out / file, shard)
    weight_map.update(dict.fromkeys(shard, file))
  index = {'metadata': {'total_size': sum(a.nbytes for a in tensors.values())},
           'weight_map': dict(sorted(weight_map.items()))}
  (out / 'model.safetensors.index.json').write_text(json.dumps(index, indent=2))


def _model_card(hf_config: dict[str, Any], params: Any, name: str, base_model: str) -> str:
  """A ``README.md`` for the hub: its metadata block, what the model is, how to load it."""
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  meta = ['library_name: transformers', 'pipeline_tag: text-generation', 'tags:',
          '- rlax_llm'] + ([f'base_model: {base_model}'] if base_model else [])
  origin = (f', fine-tuned from [{base_model}](https://huggingface.co/{base_model})'
            if base_model else '')
  return '\n'.join([
      '---', *meta, '---', '', f'# {name}', '',
      f'A {hf_config["architectures"][0]} ({count:,} parameters, '
      f'{hf_config["torch_dtype"]}){origin}, exported by rlax_llm (`save_pretrained`).', '',
      '```python', 'import transformers', '',
      'model = transformers.AutoModelForCausalLM.from_pretrained(PATH_OR_REPO_ID)',
      'tokenizer = transformers.AutoTokenizer.from_pretrained(PATH_OR_REPO_ID)', '```', ''])
