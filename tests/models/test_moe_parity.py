"""Mixture-of-experts parity with transformers: random-initialised tiny ``Qwen3MoeConfig`` and
``MixtralConfig`` models (torch CPU, float32) loaded from their safetensors give the same
logits (1e-4), gradients (1e-4 relative) and router load-balancing loss; our export loads in
transformers with the same logits; a hub id loads through the fake hub.
"""

import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from fake_hub import FakeHub, hub_environment  # noqa: E402
from rlax_llm.models.files import hf  # noqa: E402
from rlax_llm.models.files.pretrained import from_pretrained, save_pretrained  # noqa: E402
from rlax_llm.models.model import split_module, token_logprobs  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
             num_experts_per_tok=2, tie_word_embeddings=False)
FAMILIES = {
    'qwen3_moe': (transformers.Qwen3MoeConfig, dict(
        num_experts=4, moe_intermediate_size=24, intermediate_size=48, norm_topk_prob=True)),
    'qwen3_moe_unnormalised': (transformers.Qwen3MoeConfig, dict(
        num_experts=4, moe_intermediate_size=24, intermediate_size=48, norm_topk_prob=False)),
    'mixtral': (transformers.MixtralConfig, dict(num_local_experts=4, intermediate_size=24)),
}
ATOL = 1e-4


def _reference(name, directory, **changes):
  """A random transformers model of ``name`` (``changes``: to its config's fields) saved in
  ``directory``: routers drawn wide (std 0.5), so no token's top-k is a near tie that
  rounding could flip."""
  config_cls, extra = FAMILIES[name]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      config_cls(**{**SMALL, **extra, **changes})).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith('norm.weight'):
        p.add_(0.1 * torch.randn_like(p))
      elif pname.endswith('gate.weight'):
        p.copy_(0.5 * torch.randn_like(p))
  model.save_pretrained(directory)
  return model


# The routing variants' gradients and export share every code path with 'qwen3_moe': those
# tests run on one model per family.
PER_FAMILY = ('mixtral', 'qwen3_moe')


@pytest.fixture(scope='module')
def references(tmp_path_factory):
  """``get(name, **changes) -> (name, transformers model, ours, directory)`` (``changes``:
  to the config's fields, ``_reference``), each built once."""
  built = {}

  def get(name, **changes):
    key = name, repr(sorted(changes.items()))
    if key not in built:
      directory = tmp_path_factory.mktemp(name)
      model = _reference(name, directory, **changes)
      built[key] = name, model, from_pretrained(directory)[0], directory
    return built[key]
  return get


def _tokens(seed=0, batch=2, length=10):
  return np.random.RandomState(seed).randint(0, SMALL['vocab_size'], (batch, length))


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_loaded_config_and_logits_match_transformers(references, name):
  name, model, ours, _ = references(name)
  c = ours.config
  assert (c.family, c.num_experts, c.num_experts_per_tok) == (name.split('_unn')[0], 4, 2)
  assert c.norm_topk_prob == (name != 'qwen3_moe_unnormalised')
  assert c.moe_mlp_dim == 24
  tokens = _tokens()
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
  np.testing.assert_allclose(got, _torch_logits(model, tokens), atol=ATOL, rtol=0)


def _torch_grads(model, tokens):
  """Gradients of the mean next-token log-likelihood by checkpoint tensor name (the fused
  ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` split per expert; Mixtral's ``mlp``
  saved as ``block_sparse_moe`` with ``w1/w3/w2``), and the HF load-balancing loss."""
  model.zero_grad()
  ids = torch.tensor(tokens)
  out = model(ids, output_router_logits=True)
  logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
  logp.mean().backward()
  mixtral = model.config.model_type == 'mixtral'
  gate, up, down = ('w1', 'w3', 'w2') if mixtral else ('gate_proj', 'up_proj', 'down_proj')
  grads = {}
  for name, p in model.named_parameters():
    g = p.grad.numpy()
    if mixtral:
      name = name.replace('.mlp.', '.block_sparse_moe.')
    if name.endswith('experts.gate_up_proj'):
      prefix, inner = name[:-len('gate_up_proj')], g.shape[1] // 2
      for e in range(g.shape[0]):
        grads[f'{prefix}{e}.{gate}.weight'] = g[e, :inner]
        grads[f'{prefix}{e}.{up}.weight'] = g[e, inner:]
    elif name.endswith('experts.down_proj'):
      prefix = name[:-len('down_proj')]
      for e in range(g.shape[0]):
        grads[f'{prefix}{e}.{down}.weight'] = g[e]
    else:
      grads[name] = g
  return grads, out.aux_loss.item()


@pytest.mark.parametrize('name', PER_FAMILY)
def test_gradients_and_aux_loss_match_transformers(references, name):
  _, model, ours, _ = references(name)
  check_gradients_and_aux_loss(model, ours)


def check_gradients_and_aux_loss(model, ours) -> set[str]:
  """Asserts that ``ours`` (loaded from transformers' ``model``) has its gradients (1e-4
  relative, per checkpoint tensor) and aux loss; returns the tensors' names."""
  tokens = _tokens(1)
  ref_grads, ref_aux = _torch_grads(model, tokens)
  graph, params = split_module(ours)
  ids = jnp.asarray(tokens, jnp.int32)

  def objective(params):  # over the whole sequence, as HF's aux loss is
    logits, aux = graph.apply(params, ids, aux_loss=True)
    return jnp.mean(token_logprobs(logits[:, :-1], ids[:, 1:])), aux

  grads, aux = jax.grad(objective, has_aux=True)(params)
  np.testing.assert_allclose(float(aux), ref_aux, rtol=1e-5)
  ours_named = hf.params_to_hf(grads, graph.config)
  assert set(ours_named) == set(ref_grads)
  for name, g in ours_named.items():
    ref = ref_grads[name]
    error = np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-12)
    assert error < 1e-4, (name, error)
  return set(ours_named)


@pytest.mark.parametrize('name', PER_FAMILY)
def test_export_loads_in_transformers_with_same_logits(references, name, tmp_path):
  name, model, ours, directory = references(name)
  save_pretrained(ours, None, tmp_path / 'export')
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'export').eval()
  assert type(reloaded) is type(model)
  assert sorted(hf.SafetensorsCheckpoint(tmp_path / 'export').names) == sorted(
      hf.SafetensorsCheckpoint(directory).names)
  tokens = _tokens(2)
  np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(model, tokens),
                             atol=ATOL, rtol=0)


def test_hub_id_loads_through_the_fake_hub(tmp_path):
  model = _reference('qwen3_moe', tmp_path / 'repo')
  files = {str(p.relative_to(tmp_path / 'repo')): p.read_bytes()
           for p in (tmp_path / 'repo').rglob('*') if p.is_file()}
  with FakeHub() as fake:
    fake.add_commit('org/tiny-qwen3-moe', files)
    with hub_environment(fake, tmp_path / 'cache'):
      ours, _ = from_pretrained('org/tiny-qwen3-moe')
  assert ours.config.family == 'qwen3_moe'
  tokens = _tokens(4)
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens, jnp.int32))),
                             _torch_logits(model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_config_round_trip_keeps_the_moe_fields(references, name):
  _, _, ours, _ = references(name)
  assert hf.config_from_hf(hf.config_to_hf(ours.config)) == ours.config

