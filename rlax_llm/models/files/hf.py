"""Hugging Face checkpoint format: config mapping, weight mapping, safetensors I/O.

Everything here is NumPy: a Hugging Face config dict and a state dict of arrays in Hugging
Face names and layouts (``model.layers.{i}.self_attn.q_proj.weight`` is
``[heads * head_dim, hidden]``) on one side, ``DecoderConfig`` and rlax_llm params (nested
dicts, ``wq`` is ``[embed, heads, head_dim]``) on the other. Loaders (safetensors, GGUF) and
the exporter meet at this interface; ``rlax_llm.models.files.pretrained`` places the arrays on
devices.

Supported architectures: ``LlamaForCausalLM`` (Llama 3.x incl. ``llama3`` RoPE scaling,
SmolLM2), ``Qwen2ForCausalLM`` (Qwen2/2.5, QwQ: q/k/v biases), ``Qwen3ForCausalLM`` (q/k
RMSNorm), ``Qwen3MoeForCausalLM`` and ``MixtralForCausalLM`` (mixtures of experts: each
expert's ``gate/up/down`` (``w1/w3/w2``) tensors stacked ``[experts, ...]`` on load and split
on export).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from rlax_llm.errors import CheckpointError
from rlax_llm.models.decoder_config import DecoderConfig, Execution, RopeScaling

ARCHITECTURES = {
    'LlamaForCausalLM': 'llama',
    'Qwen2ForCausalLM': 'qwen2',
    'Qwen3ForCausalLM': 'qwen3',
    'Qwen3MoeForCausalLM': 'qwen3_moe',
    'MixtralForCausalLM': 'mixtral',
}
_FAMILY_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}


# ----------------------------------------------------------------------------- configs


def config_from_hf(hf: Mapping[str, Any], *, execution: Execution = Execution(),
                   max_seq_len: int | None = None) -> DecoderConfig:
  """``DecoderConfig`` from a Hugging Face ``config.json`` dict (transformers 4 or 5 keys),
  run with ``execution``."""
  archs = hf.get('architectures') or []
  family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if family is None:
    model_type = hf.get('model_type')
    family = model_type if model_type in _FAMILY_TO_ARCH else None
  if family is None:
    raise CheckpointError(
        f'config field "architectures" = {archs!r} (model_type {hf.get("model_type")!r}) is '
        f'not supported; supported architectures: {sorted(ARCHITECTURES)}.')

  def need(key):
    if key not in hf:
      raise CheckpointError(f'config.json lacks the field {key!r} needed for {family}.')
    return hf[key]

  rope = dict(hf.get('rope_parameters') or {})
  legacy_scaling = hf.get('rope_scaling') or {}
  rope_theta = rope.get('rope_theta', hf.get('rope_theta', 10_000.0))
  rope_type = rope.get('rope_type', legacy_scaling.get('rope_type',
                                                        legacy_scaling.get('type', 'default')))
  scaling = None
  if rope_type == 'llama3':
    src = rope if 'factor' in rope else legacy_scaling
    scaling = RopeScaling(
        factor=float(src['factor']), low_freq_factor=float(src['low_freq_factor']),
        high_freq_factor=float(src['high_freq_factor']),
        original_max_position_embeddings=int(src['original_max_position_embeddings']))
  elif rope_type not in ('default', None):
    raise CheckpointError(f'config rope_type {rope_type!r} is not supported; supported: '
                          "'default', 'llama3'.")
  num_heads = need('num_attention_heads')
  hidden = need('hidden_size')
  head_dim = hf.get('head_dim') or hidden // num_heads
  moe = {}
  if family == 'qwen3_moe':  # transformers 5 writes num_local_experts, the hub num_experts
    moe = dict(num_experts=hf.get('num_experts') or need('num_local_experts'),
               moe_mlp_dim=need('moe_intermediate_size'),
               norm_topk_prob=bool(hf.get('norm_topk_prob', False)),
               decoder_sparse_step=int(hf.get('decoder_sparse_step', 1)),
               mlp_only_layers=tuple(hf.get('mlp_only_layers') or ()))
  elif family == 'mixtral':
    moe = dict(num_experts=need('num_local_experts'), moe_mlp_dim=need('intermediate_size'),
               norm_topk_prob=True)
  if moe:
    moe['num_experts_per_tok'] = need('num_experts_per_tok')
  try:
    return _decoder_config(hf, family, need, num_heads, hidden, head_dim, rope_theta, scaling,
                           execution, max_seq_len, moe)
  except ValueError as error:
    raise CheckpointError(f'config.json describes a model rlax_llm cannot build: {error}'
                          ) from None


def _decoder_config(hf, family, need, num_heads, hidden, head_dim, rope_theta, scaling,
                    execution, max_seq_len, moe) -> DecoderConfig:
  return DecoderConfig(
      vocab_size=need('vocab_size'), num_layers=need('num_hidden_layers'), embed_dim=hidden,
      num_heads=num_heads, num_kv_heads=hf.get('num_key_value_heads') or num_heads,
      head_dim=head_dim, mlp_dim=need('intermediate_size'), rope_theta=float(rope_theta),
      rope_scaling=scaling, norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      qkv_bias=family == 'qwen2' or bool(hf.get('attention_bias', False)),
      qk_norm=family in ('qwen3', 'qwen3_moe'),
      max_seq_len=max_seq_len or int(hf.get('max_position_embeddings', 4096)),
      family=family, execution=execution, **moe)


def config_to_hf(config: DecoderConfig, **extra: Any) -> dict[str, Any]:
  """A ``config.json`` dict that transformers loads as the same architecture."""
  rope: dict[str, Any] = {'rope_theta': config.rope_theta, 'rope_type': 'default'}
  if config.rope_scaling is not None:
    s = config.rope_scaling
    rope.update(rope_type='llama3', factor=s.factor, low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings)
  hf = {
      'architectures': [_FAMILY_TO_ARCH[config.family]],
      'model_type': config.family,
      'vocab_size': config.vocab_size,
      'hidden_size': config.embed_dim,
      'intermediate_size': config.mlp_dim,
      'num_hidden_layers': config.num_layers,
      'num_attention_heads': config.num_heads,
      'num_key_value_heads': config.num_kv_heads,
      'head_dim': config.head_dim,
      'hidden_act': 'silu',
      'max_position_embeddings': config.max_seq_len,
      'rms_norm_eps': config.norm_eps,
      'rope_theta': config.rope_theta,
      'rope_parameters': rope,
      'tie_word_embeddings': config.tie_embeddings,
      'attention_bias': config.qkv_bias,
      'torch_dtype': 'float32' if config.execution.param_dtype == jnp.float32 else 'bfloat16',
  }
  if config.rope_scaling is not None:
    hf['rope_scaling'] = {k: v for k, v in rope.items() if k != 'rope_theta'}
  if config.family == 'qwen3_moe':
    hf.update(num_experts=config.num_experts, moe_intermediate_size=config.moe_mlp_dim,
              norm_topk_prob=config.norm_topk_prob,
              decoder_sparse_step=config.decoder_sparse_step,
              mlp_only_layers=list(config.mlp_only_layers))
  elif config.family == 'mixtral':
    hf.update(num_local_experts=config.num_experts, intermediate_size=config.moe_mlp_dim)
  if config.is_moe:
    hf.update(num_experts_per_tok=config.num_experts_per_tok,
              router_aux_loss_coef=config.router_aux_loss_coef)
  hf.update(extra)
  return hf


# ----------------------------------------------------------------------------- weights

# (our path inside a layer, HF name inside ``model.layers.{i}.``, kind) — kinds say how to
# convert: 'q'/'kv' projection in, 'o' projection out, 'linear' transposed matrix, 'bias_q',
# 'bias_kv' reshaped biases, 'vector' copied.
_LAYER_WEIGHTS = (
    (('attn', 'wq'), 'self_attn.q_proj.weight', 'q'),
    (('attn', 'wk'), 'self_attn.k_proj.weight', 'kv'),
    (('attn', 'wv'), 'self_attn.v_proj.weight', 'kv'),
    (('attn', 'wo'), 'self_attn.o_proj.weight', 'o'),
    (('mlp', 'w_gate'), 'mlp.gate_proj.weight', 'linear'),
    (('mlp', 'w_up'), 'mlp.up_proj.weight', 'linear'),
    (('mlp', 'w_down'), 'mlp.down_proj.weight', 'linear'),
    (('attn_norm', 'scale'), 'input_layernorm.weight', 'vector'),
    (('mlp_norm', 'scale'), 'post_attention_layernorm.weight', 'vector'),
)
_BIAS_WEIGHTS = (
    (('attn', 'bq'), 'self_attn.q_proj.bias', 'bias_q'),
    (('attn', 'bk'), 'self_attn.k_proj.bias', 'bias_kv'),
    (('attn', 'bv'), 'self_attn.v_proj.bias', 'bias_kv'),
)
_QK_NORM_WEIGHTS = (
    (('attn', 'q_norm', 'scale'), 'self_attn.q_norm.weight', 'vector'),
    (('attn', 'k_norm', 'scale'), 'self_attn.k_norm.weight', 'vector'),
)
# A mixture of experts' MLP per family: the router, then each expert's projections (the
# ``{e}`` of the names is the expert; ours stack them ``[experts, ...]``, see ``layer_of``).
_MOE_WEIGHTS = {
    'qwen3_moe': ((('moe', 'router'), 'mlp.gate.weight', 'linear'),
                  (('moe', 'experts_gate'), 'mlp.experts.{e}.gate_proj.weight', 'linear'),
                  (('moe', 'experts_up'), 'mlp.experts.{e}.up_proj.weight', 'linear'),
                  (('moe', 'experts_down'), 'mlp.experts.{e}.down_proj.weight', 'linear')),
    'mixtral': ((('moe', 'router'), 'block_sparse_moe.gate.weight', 'linear'),
                (('moe', 'experts_gate'), 'block_sparse_moe.experts.{e}.w1.weight', 'linear'),
                (('moe', 'experts_up'), 'block_sparse_moe.experts.{e}.w3.weight', 'linear'),
                (('moe', 'experts_down'), 'block_sparse_moe.experts.{e}.w2.weight', 'linear')),
}


def weight_layout(config: DecoderConfig) -> Iterator[tuple[tuple, str, str]]:
  """Yields ``(our param path, HF tensor name, kind)`` for every tensor of the model; HF
  layer ``i``'s path is ``(run, j, ...)``: layer ``j`` of the stacked leaf ``(run, ...)`` of
  the run of layers holding it (``Architecture.layer_runs``: ``('blocks', i, ...)`` in a
  homogeneous stack); an expert's ``(run, j, ..., e)``: expert ``e`` of that layer
  (``layer_of``). A dense layer has the ``mlp`` tensors, a MoE layer its family's router
  and experts."""
  yield ('embed',), 'model.embed_tokens.weight', 'embed'
  extra = (_BIAS_WEIGHTS if config.qkv_bias else ()) + (
      _QK_NORM_WEIGHTS if config.qk_norm else ())
  for run in config.layer_runs():
    per_layer = (_LAYER_WEIGHTS[:4] + _LAYER_WEIGHTS[7:] + extra + _MOE_WEIGHTS[config.family]
                 if run.moe else _LAYER_WEIGHTS + extra)
    for j, i in enumerate(run.layers):
      for path, name, kind in per_layer:
        if '{e}' not in name:
          yield (run.name, j) + path, f'model.layers.{i}.{name}', kind
          continue
        for e in range(config.num_experts):
          yield (run.name, j) + path + (e,), f'model.layers.{i}.{name.format(e=e)}', kind
  yield ('final_norm', 'scale'), 'model.norm.weight', 'vector'
  if not config.tie_embeddings:
    yield ('lm_head',), 'lm_head.weight', 'linear'


def _hf_shape(kind: str, ours: tuple[int, ...]) -> tuple[int, ...]:
  if kind in ('q', 'kv'):  # ours [E, H, D] <- HF [H*D, E]
    return (ours[1] * ours[2], ours[0])
  if kind == 'o':  # ours [H, D, E] <- HF [E, H*D]
    return (ours[2], ours[0] * ours[1])
  if kind == 'linear':
    return (ours[1], ours[0])
  if kind in ('bias_q', 'bias_kv'):
    return (ours[0] * ours[1],)
  return ours  # embed [V, E] and vectors are stored as-is


def _from_hf(kind: str, array: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
  if kind in ('q', 'kv', 'o', 'linear'):  # HF stores [out, in]; ours is [in, ...out dims]
    return array.T.reshape(ours)
  return array.reshape(ours)


def _to_hf(kind: str, array: np.ndarray) -> np.ndarray:
  if kind in ('q', 'kv'):
    return array.reshape(array.shape[0], -1).T
  if kind == 'o':
    return array.reshape(-1, array.shape[-1]).T
  if kind == 'linear':
    return array.T
  if kind in ('bias_q', 'bias_kv'):
    return array.reshape(-1)
  return array


def layer_of(path: tuple) -> tuple[tuple, tuple[int, ...] | None]:
  """``(the params path, index)`` of a ``weight_layout`` path: a run's ``(run, j, ...)`` is
  ``[j]`` of the leaf at ``(run, ...)`` (each run's blocks are stacked over its layers), and
  an expert's ``(run, j, ..., e)`` is ``[j, e]`` of the leaf ``(run, ...)`` (the experts
  stacked too); any other path is its own leaf (index None)."""
  if len(path) > 1 and isinstance(path[1], int):
    if isinstance(path[-1], int):
      return (path[0],) + path[2:-1], (path[1], path[-1])
    return (path[0],) + path[2:], (path[1],)
  return path, None


def _set(tree: dict, path: tuple, value) -> None:
  node = tree
  for key in path[:-1]:
    node = node.setdefault(key, {})
  node[path[-1]] = value


def get_path(tree: Mapping, path: tuple):
  node = tree
  for key in path:
    node = node[key]
  return node


def params_from_hf(get_tensor: Callable[[str], np.ndarray], names: set[str],
                   config: DecoderConfig, abstract_params: Any,
                   place: Callable[[tuple, np.ndarray], Any] = lambda path, x: x) -> dict:
  """Builds params from HF tensors, checking every name and shape.

  Args:
    get_tensor: reads one HF tensor by name (lazily: one tensor in host memory at a time).
    names: the tensor names the checkpoint holds.
    config: the target architecture.
    abstract_params: ``Model.abstract_params()`` (shapes and dtypes of our params).
    place: turns a host array for one of our params (a stacked leaf: all its layers) into
      its final form (e.g. a sharded device array); identity by default.
  Raises:
    CheckpointError naming the missing, unexpected or mis-shaped tensor.
  """
  layout = list(weight_layout(config))
  expected = {name for _, name, _ in layout}
  missing = sorted(expected - names)
  if missing:
    raise CheckpointError(f'checkpoint is missing {len(missing)} tensor(s) the {config.family} '
                          f'config needs, e.g. {missing[:5]}.')
  # Tied checkpoints sometimes also store lm_head.weight (a copy); anything else is an error.
  unexpected = sorted(names - expected - ({'lm_head.weight'} if config.tie_embeddings else set())
                      - {n for n in names if n.endswith('rotary_emb.inv_freq')})
  if unexpected:
    raise CheckpointError(f'checkpoint has {len(unexpected)} tensor(s) this {config.family} '
                          f'config does not use, e.g. {unexpected[:5]}; check the config '
                          '(qkv_bias / qk_norm / tie_word_embeddings / num_experts).')
  params: dict = {}
  # A stacked leaf's layers are read one after another into one host array, placed when full.
  leaves = {}
  for path, _, _ in layout:
    leaves.setdefault(layer_of(path)[0], len(leaves))
  stacking: dict[tuple, np.ndarray] = {}
  filled: dict[tuple, int] = {}
  for path, name, kind in sorted(layout, key=lambda entry: leaves[layer_of(entry[0])[0]]):
    path, layer = layer_of(path)
    target = get_path(abstract_params, path)
    shape = tuple(target.shape)[len(layer or ()):]
    array = np.asarray(get_tensor(name))
    want = _hf_shape(kind, shape)
    if tuple(array.shape) != want:
      raise CheckpointError(f'tensor {name!r} has shape {tuple(array.shape)}; the config '
                            f'implies {want}.')
    value = _from_hf(kind, array, shape).astype(target.dtype)
    if layer is None:
      _set(params, path, place(path, value))
      continue
    stacked = stacking.setdefault(path, np.empty(target.shape, target.dtype))
    stacked[layer] = value
    filled[path] = filled.get(path, 0) + 1
    if filled[path] == math.prod(target.shape[:len(layer)]):
      _set(params, path, place(path, stacking.pop(path)))
  return params


def params_to_hf(params: Any, config: DecoderConfig) -> dict[str, np.ndarray]:
  """HF-named host arrays for every tensor of ``params`` (in their stored dtype; each layer
  of the stacked blocks its own tensor, ``model.layers.{i}.*``)."""
  host = jax.device_get(params)

  def tensor(path):
    path, layer = layer_of(path)
    value = np.asarray(get_path(host, path))
    return value if layer is None else value[layer]
  return {name: np.ascontiguousarray(_to_hf(kind, tensor(path)))
          for path, name, kind in weight_layout(config)}


# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32), 'F16': np.dtype(np.float16),
    'BF16': np.dtype(ml_dtypes.bfloat16), 'I64': np.dtype(np.int64),
    'I32': np.dtype(np.int32), 'I16': np.dtype(np.int16), 'I8': np.dtype(np.int8),
    'U8': np.dtype(np.uint8), 'BOOL': np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
  """The JSON object (``{...}``) stored in ``path`` (``config.json``, an index, ...).

  Raises:
    FileNotFoundError: there is no such file.
    CheckpointError naming the file: it is empty, not JSON, or JSON other than an object.
  """
  path = pathlib.Path(path)
  data = path.read_bytes()
  if not data.strip():
    raise CheckpointError(f'{path} is empty ({len(data)} bytes) where a JSON object belongs; the '
                          'file is truncated or was never written: download or export it again.')
  try:
    value = json.loads(data)
  except ValueError as error:  # json.JSONDecodeError, or UnicodeDecodeError for non-UTF-8 bytes.
    raise CheckpointError(f'{path} is not valid JSON ({error}); the file is corrupt or '
                          'truncated: download or export it again.') from error
  if not isinstance(value, dict):
    raise CheckpointError(f'{path} holds a JSON {_json_kind(value)}, not the JSON object '
                          '({...}) expected; check that it is the Hugging Face file of that '
                          'name.')
  return value


def _json_kind(value: Any) -> str:
  """JSON's own name for the type of a decoded value ('array', not 'list')."""
  if isinstance(value, bool):
    return 'boolean'
  if isinstance(value, (int, float)):
    return 'number'
  return {dict: 'object', list: 'array', str: 'string'}.get(type(value), 'null')


def _is_int_list(value: Any) -> bool:
  return isinstance(value, list) and all(
      isinstance(v, int) and not isinstance(v, bool) for v in value)


def _check_safetensors_entry(path: pathlib.Path, name: str, entry: Any, data_size: int) -> None:
  """Raises CheckpointError unless ``entry`` is a well-formed tensor inside the data section."""
  where = f'{path}: tensor {name!r}'
  if not isinstance(entry, dict):
    raise CheckpointError(f'{where} has the header entry {entry!r}; expected an object with '
                          '"dtype", "shape" and "data_offsets". The header is corrupt.')
  missing = [key for key in ('dtype', 'shape', 'data_offsets') if key not in entry]
  if missing:
    raise CheckpointError(f'{where} has no {", ".join(missing)} in its header entry {entry!r}; '
                          'every safetensors tensor needs "dtype", "shape" and "data_offsets". '
                          'The header is corrupt.')
  dtype, shape, offsets = entry['dtype'], entry['shape'], entry['data_offsets']
  if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
    raise CheckpointError(f'{where} has dtype {dtype!r}, not one rlax_llm reads '
                          f'({", ".join(_ST_DTYPES)}); the header is corrupt, or the checkpoint '
                          'is stored in another type (e.g. FP8) and must be converted first.')
  if not _is_int_list(shape) or any(d < 0 for d in shape):
    raise CheckpointError(f'{where} has shape {shape!r}; expected a list of non-negative '
                          'integers. The header is corrupt.')
  if not (_is_int_list(offsets) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
    raise CheckpointError(f'{where} has data_offsets {offsets!r}; expected [begin, end] with '
                          '0 <= begin <= end. The header is corrupt.')
  begin, end = offsets
  nbytes = math.prod(shape) * _ST_DTYPES[dtype].itemsize
  if end - begin != nbytes:
    raise CheckpointError(f'{where} spans {end - begin} bytes (data_offsets {offsets}) but its '
                          f'shape {tuple(shape)} and dtype {dtype} need {nbytes}; the header is '
                          'corrupt.')
  if end > data_size:
    raise CheckpointError(f'{path} is truncated: tensor {name!r} occupies bytes {begin}..{end} '
                          f'of the data section, which holds only {data_size} bytes; download '
                          'or export the file again.')


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, dict], int]:
  """Returns ``(header, data offset)`` of a .safetensors file, checked against the file.

  ``header`` maps each tensor name to its ``{'dtype', 'shape', 'data_offsets'}`` entry
  (``__metadata__`` dropped); ``data_offsets`` count from the data offset. Every entry is
  checked here, before any tensor is read: a readable dtype, a shape of non-negative ints,
  ``data_offsets`` spanning exactly shape x itemsize bytes, and ending inside the file.

  Raises:
    FileNotFoundError: there is no such file.
    CheckpointError naming the file (and tensor): the file is shorter than its declared
      header, the header is not a JSON object, an entry is malformed, or a tensor's bytes run
      past the end of the file (a truncated download).
  """
  path = pathlib.Path(path)
  size = path.stat().st_size
  if size < 8:
    raise CheckpointError(f'{path} has {size} bytes, too few for a safetensors file (it starts '
                          'with an 8-byte header length); the file is truncated or not a '
                          'safetensors file.')
  with open(path, 'rb') as f:
    length = int.from_bytes(f.read(8), 'little')
    if length > size - 8:
      raise CheckpointError(f'{path} declares a {length}-byte JSON header but only {size - 8} '
                            'bytes follow its 8-byte length prefix; the file is truncated or '
                            'not a safetensors file.')
    blob = f.read(length)
  try:
    header = json.loads(blob)
  except ValueError as error:  # json.JSONDecodeError, or UnicodeDecodeError for non-UTF-8 bytes.
    raise CheckpointError(f'{path}: the {length}-byte safetensors header is not valid JSON '
                          f'({error}); the file is corrupt or not a safetensors file.') from error
  if not isinstance(header, dict):
    raise CheckpointError(f'{path}: the safetensors header is a JSON {_json_kind(header)}, not '
                          'an object mapping tensor names to {dtype, shape, data_offsets}; the '
                          'file is corrupt.')
  header.pop('__metadata__', None)
  for name, entry in header.items():
    _check_safetensors_entry(path, name, entry, size - 8 - length)
  return header, 8 + length


class SafetensorsCheckpoint:
  """Lazy reader over one or more .safetensors files (memory-mapped, bf16 via ml_dtypes).

  Every file's header is read and checked on construction (``read_safetensors_header``), so a
  corrupt or truncated checkpoint fails here, naming the file, before any tensor is read.
  """

  def __init__(self, directory: str | pathlib.Path):
    directory = pathlib.Path(directory)
    index = directory / 'model.safetensors.index.json'
    if index.exists():
      weight_map = read_json_object(index).get('weight_map')
      if not isinstance(weight_map, dict) or not all(
          isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f'{index} has "weight_map" = {str(weight_map)[:80]}; expected an '
                              'object mapping tensor names to shard file names. The index is '
                              'corrupt: download it again.')
      files = sorted(set(weight_map.values()))
      absent = [file for file in files if not (directory / file).is_file()]
      if absent:
        raise FileNotFoundError(f'{index} lists shard(s) {absent} that are not in {directory}; '
                                'the download is incomplete.')
    else:
      files = sorted(p.name for p in directory.glob('*.safetensors'))
      if not files:
        raise FileNotFoundError(f'no *.safetensors file in {directory}.')
    self._entries: dict[str, tuple[pathlib.Path, dict, int]] = {}
    for file in files:
      header, offset = read_safetensors_header(directory / file)
      for name, entry in header.items():
        self._entries[name] = (directory / file, entry, offset)

  @property
  def names(self) -> set[str]:
    return set(self._entries)

  def get(self, name: str) -> np.ndarray:
    """The tensor ``name`` as a read-only memory map (its header entry was checked on open)."""
    path, entry, offset = self._entries[name]
    return np.memmap(path, dtype=_ST_DTYPES[entry['dtype']], mode='r',
                     offset=offset + entry['data_offsets'][0], shape=tuple(entry['shape']))


def write_safetensors(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
  """Writes ``tensors`` (name -> array) as one .safetensors file (sorted names, aligned)."""
  header: dict[str, Any] = {'__metadata__': dict(metadata or {'format': 'pt'})}
  offset = 0
  arrays = {}
  for name in sorted(tensors):
    array = np.ascontiguousarray(tensors[name])
    if array.dtype not in _ST_NAMES:
      raise CheckpointError(f'tensor {name!r} has dtype {array.dtype} that safetensors lacks.')
    arrays[name] = array
    header[name] = {'dtype': _ST_NAMES[array.dtype], 'shape': list(array.shape),
                    'data_offsets': [offset, offset + array.nbytes]}
    offset += array.nbytes
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)
  with open(path, 'wb') as f:
    f.write(len(blob).to_bytes(8, 'little'))
    f.write(blob)
    for array in arrays.values():
      f.write(array.tobytes())
