"""Parity with transformers for every family; export/import round trips; loader errors.

Reference models are transformers' own classes with random initialisation (torch CPU).
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from rlax_llm.errors import CheckpointError  # noqa: E402
from rlax_llm.models.files import hf  # noqa: E402
from rlax_llm.models.decoder_config import DecoderConfig  # noqa: E402
from rlax_llm.models.kv_cache import KVCache  # noqa: E402
from rlax_llm.models.model import create_model  # noqa: E402
from rlax_llm.models.files.pretrained import from_pretrained, save_pretrained  # noqa: E402
from rlax_llm.sharding import make_mesh  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=128)

FAMILIES = {
    'llama3_scaled': (transformers.LlamaConfig, dict(
        rope_parameters={'rope_type': 'llama3', 'rope_theta': 500_000.0, 'factor': 8.0,
                         'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                         'original_max_position_embeddings': 64},
        tie_word_embeddings=False)),
    'smollm2_tied': (transformers.LlamaConfig, dict(
        rope_parameters={'rope_type': 'default', 'rope_theta': 100_000.0},
        tie_word_embeddings=True)),
    'qwen2_bias': (transformers.Qwen2Config, dict(
        rope_parameters={'rope_type': 'default', 'rope_theta': 1_000_000.0},
        tie_word_embeddings=False)),
    'qwen3_qknorm': (transformers.Qwen3Config, dict(
        rope_parameters={'rope_type': 'default', 'rope_theta': 1_000_000.0},
        tie_word_embeddings=True)),
}


def _reference(name, tmp_path_factory):
  config_cls, extra = FAMILIES[name]
  torch.manual_seed(0)
  config = config_cls(**SMALL, **extra)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():  # random, non-trivial norms and biases
    for pname, p in model.named_parameters():
      if pname.endswith('norm.weight') or pname.endswith('.bias'):
        p.add_(0.1 * torch.randn_like(p))
  directory = tmp_path_factory.mktemp(name)
  model.save_pretrained(directory)
  return model, directory


@pytest.fixture(scope='module', params=sorted(FAMILIES))
def reference(request, tmp_path_factory):
  return request.param, *_reference(request.param, tmp_path_factory)


def _tokens(seed=0, batch=2, length=12):
  return np.random.RandomState(seed).randint(0, SMALL['vocab_size'], (batch, length))


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def test_prefill_logits_match_transformers(reference):
  _, model, directory = reference
  ours, _ = from_pretrained(directory)
  tokens = _tokens()
  ref = _torch_logits(model, tokens)
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
  assert got.shape == ref.shape
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_loader_options_reach_the_config(reference):
  """``from_pretrained``'s numerics options land in the model's config (the SmolLM2 engine
  tests build their batch-invariant models from that config) and keep the weights."""
  _, model, directory = reference
  ours, _ = from_pretrained(directory, batch_invariant=True, invariant_rows='floor',
                            remat='full', max_seq_len=96)
  config = ours.config
  run = config.execution
  assert (run.batch_invariant, run.invariant_rows, run.remat, config.max_seq_len) == (
      True, 'floor', 'full', 96)
  tokens = _tokens(3)
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens, jnp.int32))),
                             _torch_logits(model, tokens), atol=1e-4, rtol=0)


def test_cached_decoding_equals_full_forward(reference):
  _, _, directory = reference
  ours, _ = from_pretrained(directory)
  tokens = jnp.asarray(_tokens(1, batch=2, length=10), jnp.int32)
  full = np.asarray(ours(tokens))
  cache = KVCache.init(ours.config, 2, 10)
  logits, cache = ours(tokens[:, :4], cache=cache)
  np.testing.assert_allclose(logits, full[:, :4], atol=1e-5)
  for t in range(4, 10):
    step, cache = ours(tokens[:, t:t + 1], cache=cache)
    np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-5)


def test_export_loads_in_transformers_with_same_logits(reference, tmp_path):
  name, _, directory = reference
  ours, _ = from_pretrained(directory)
  save_pretrained(ours, None, tmp_path / 'export')
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'export').eval()
  assert type(reloaded).__name__ == json.loads(
      (directory / 'config.json').read_text())['architectures'][0]
  tokens = _tokens(2)
  np.testing.assert_allclose(_torch_logits(reloaded, tokens),
                             np.asarray(ours(jnp.asarray(tokens, jnp.int32))), atol=1e-4)


def test_load_export_load_is_bit_identical(reference, tmp_path):
  _, _, directory = reference
  first, _ = from_pretrained(directory)
  save_pretrained(first, None, tmp_path / 'a')
  second, _ = from_pretrained(tmp_path / 'a')
  save_pretrained(second, None, tmp_path / 'b')
  a = hf.SafetensorsCheckpoint(tmp_path / 'a')
  b = hf.SafetensorsCheckpoint(tmp_path / 'b')
  assert a.names == b.names
  for name in a.names:
    np.testing.assert_array_equal(np.asarray(a.get(name)), np.asarray(b.get(name)))
  assert (tmp_path / 'a' / 'model.safetensors').read_bytes() == (
      tmp_path / 'b' / 'model.safetensors').read_bytes()


def test_our_random_model_exports_to_transformers(tmp_path):
  config = DecoderConfig(vocab_size=96, num_layers=2, embed_dim=32, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp_dim=48, qk_norm=True,
                         tie_embeddings=False, family='qwen3', max_seq_len=64)
  model, params = create_model(config, seed=1)
  from flax import nnx
  module = nnx.merge(model.graphdef, params)
  save_pretrained(module, None, tmp_path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  tokens = np.random.RandomState(3).randint(0, 96, (2, 9))
  np.testing.assert_allclose(_torch_logits(ref, tokens),
                             np.asarray(module(jnp.asarray(tokens, jnp.int32))), atol=1e-4)


def test_sharded_forward_on_fsdp_tensor_mesh_matches_one_device(tmp_path_factory):
  _, directory = _reference('qwen2_bias', tmp_path_factory)
  single, _ = from_pretrained(directory)
  mesh = make_mesh({'fsdp': 4, 'tensor': 2})
  sharded, _ = from_pretrained(directory, mesh=mesh)
  wq = sharded.blocks.attn.wq[...]  # stacked over the layers: never sharded
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', 'tensor', None)
  assert wq.addressable_shards[0].data.shape == (wq.shape[0], 64 // 4, 4 // 2, 16)
  tokens = jnp.asarray(_tokens(4, batch=8), jnp.int32)

  from flax import nnx
  from rlax_llm.sharding import activation_sharding
  graphdef, state = nnx.split(sharded)

  @jax.jit
  def forward(state, tokens):
    return nnx.merge(graphdef, state)(tokens)

  with activation_sharding(mesh):
    got = forward(state, jax.device_put(tokens, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(('data', 'fsdp')))))
  np.testing.assert_allclose(np.asarray(got), np.asarray(single(tokens)), atol=1e-5)


# ----------------------------------------------------------------------------- errors


def _tiny_checkpoint(tmp_path_factory):
  return _reference('smollm2_tied', tmp_path_factory)[1]


def _rewrite(directory, dst, *, drop=None, config_edit=None):
  dst.mkdir()
  ckpt = hf.SafetensorsCheckpoint(directory)
  tensors = {n: np.array(ckpt.get(n)) for n in ckpt.names if n != drop}
  hf.write_safetensors(dst / 'model.safetensors', tensors)
  config = json.loads((directory / 'config.json').read_text())
  if config_edit:
    config.update(config_edit)
  (dst / 'config.json').write_text(json.dumps(config))
  return dst


def test_missing_tensor_is_named(tmp_path_factory, tmp_path):
  src = _tiny_checkpoint(tmp_path_factory)
  bad = _rewrite(src, tmp_path / 'bad', drop='model.layers.1.mlp.up_proj.weight')
  with pytest.raises(CheckpointError, match=r'missing 1 tensor.*layers\.1\.mlp\.up_proj'):
    from_pretrained(bad)


def test_shape_mismatch_is_named(tmp_path_factory, tmp_path):
  src = _tiny_checkpoint(tmp_path_factory)
  bad = _rewrite(src, tmp_path / 'bad', config_edit={'intermediate_size': 100})
  with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has "
                                               r"shape \(96, 64\); the config implies \(100, 64\)"):
    from_pretrained(bad)


def test_unknown_architecture_is_named(tmp_path_factory, tmp_path):
  src = _tiny_checkpoint(tmp_path_factory)
  bad = _rewrite(src, tmp_path / 'bad', config_edit={'architectures': ['MambaForCausalLM'],
                                                     'model_type': 'mamba'})
  with pytest.raises(CheckpointError, match=r'"architectures".*MambaForCausalLM'):
    from_pretrained(bad)


def test_unused_tensor_is_an_error(tmp_path_factory, tmp_path):
  src = _tiny_checkpoint(tmp_path_factory)
  bad = _rewrite(src, tmp_path / 'bad')
  ckpt = hf.SafetensorsCheckpoint(bad)
  tensors = {n: np.array(ckpt.get(n)) for n in ckpt.names}  # copies: the file is rewritten
  del ckpt
  tensors['model.layers.0.self_attn.q_proj.bias'] = np.zeros(64, np.float32)
  hf.write_safetensors(bad / 'model.safetensors', tensors)
  with pytest.raises(CheckpointError, match=r'does not use.*q_proj\.bias'):
    from_pretrained(bad)


def test_missing_directory_files():
  with pytest.raises(FileNotFoundError, match='config.json'):
    from_pretrained('/nonexistent/dir')


def test_bf16_compute_with_fp32_master_weights(tmp_path_factory):
  _, directory = _reference('qwen3_qknorm', tmp_path_factory)
  fp32, _ = from_pretrained(directory)
  bf16, _ = from_pretrained(directory, dtype=jnp.bfloat16)
  assert bf16.blocks.attn.wq[...].dtype == jnp.float32  # storage stays fp32
  tokens = jnp.asarray(_tokens(5), jnp.int32)
  low = np.asarray(bf16(tokens))
  assert low.dtype == np.float32 and np.isfinite(low).all()
  high = np.asarray(fp32(tokens))
  assert 0 < np.abs(low - high).max() < 0.1  # bf16 rounding, not a different model
  stored, _ = from_pretrained(directory, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  assert stored.blocks.attn.wq[...].dtype == jnp.bfloat16
