"""Load and save real checkpoints: Hugging Face directories and GGUF files.

``from_pretrained(path, mesh=None, dtype=...)`` returns ``(model, tokenizer)``: ``model`` is
an NNX ``Decoder`` (``model(tokens)`` with int32 ``[batch, length]`` gives float32 logits
``[batch, length, vocab]``) whose params are already placed with their target
``NamedSharding`` when a mesh is given. Each tensor is read lazily (memory-mapped
safetensors, or dequantised GGUF), converted on the host once, and handed to
``jax.make_array_from_callback``, so every device receives only its own shard: no device
ever holds a full unsharded copy of a sharded tensor.

``save_pretrained(model, tokenizer, out_dir)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files, loadable by ``transformers``.
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
from rlax_llm.models.files import hf
from rlax_llm.models.files import tokenizer as tokenizer_lib
from rlax_llm.models.model import abstract_model


def from_pretrained(path: str | pathlib.Path, mesh: Mesh | None = None,
                    dtype: Any = jnp.float32, *, param_dtype: Any = jnp.float32,
                    remat: str = 'none', batch_invariant: bool = False,
                    invariant_rows: str = 'chunks', max_seq_len: int | None = None,
                    rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES
                    ) -> tuple[Decoder, Any]:
  """Loads a Hugging Face directory or a ``.gguf`` file.

  Args:
    path: a directory with ``config.json`` and ``*.safetensors`` (single file or sharded
      with ``model.safetensors.index.json``), or a ``.gguf`` file.
    mesh: if given, params are placed with the shardings that the logical-axis ``rules``
      give on this mesh; else on the default device.
    dtype, param_dtype, remat, batch_invariant, invariant_rows: how the model runs, its
      ``DecoderConfig.execution`` (``Execution``: compute and storage dtypes, the blocks'
      rematerialisation policy, batch-invariant numerics and how they fix the matmul
      kernel).
    max_seq_len: override of the config's maximum sequence length.
  Returns:
    ``(model, tokenizer)``; tokenizer is None for a directory without ``tokenizer.json``.
  Raises:
    FileNotFoundError for a missing file; ``errors.CheckpointError`` naming the file, tensor or
    field for a corrupt or truncated file (GGUF, safetensors, ``config.json``,
    ``tokenizer.json``), a missing tensor, a shape mismatch or an unsupported architecture.
  """
  path = pathlib.Path(path)
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


def save_pretrained(model: Decoder, tokenizer: Any, out_dir: str | pathlib.Path) -> None:
  """Writes ``model`` (and ``tokenizer`` if it can ``save``) as a Hugging Face directory."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  config: DecoderConfig = model.config
  params = jax.tree.map(np.asarray,
                        jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
  hf.write_safetensors(out / 'model.safetensors', hf.params_to_hf(params, config))
  special = {}
  if tokenizer is not None and getattr(tokenizer, 'bos_id', None) is not None:
    special = {'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id}
  (out / 'config.json').write_text(json.dumps(hf.config_to_hf(config, **special), indent=2))
  (out / 'generation_config.json').write_text(json.dumps(special, indent=2))
  if tokenizer is not None and hasattr(tokenizer, 'save'):
    tokenizer.save(out)
