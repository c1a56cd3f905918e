"""The mixture-of-experts block (``rlax_llm.models.moe``) on tiny random models: the grouped
matmul equals the dense fallback, the scanned stack the unrolled one, an expert x fsdp sharded
forward and gradient the one-device ones, the engine's decoding the trainer's forward; the
MoE fields' checks.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.model_spec import Architecture
from rlax_llm.models import moe
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model, token_logprobs, to_weight_layout, \
    with_weight_layout
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.sharding import activation_sharding, make_mesh, param_shardings

CONFIG = TINY_MOE_PRESETS['tiny-qwen3-moe']
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (8, 12)), jnp.int32)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def _loss_and_grads(model, params, tokens=TOKENS):
  def loss(params):
    logits, aux = model.apply(params, tokens, aux_loss=True)
    return -jnp.mean(token_logprobs(logits[:, :-1], tokens[:, 1:])) + 0.01 * aux, logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.fixture(scope='module')
def reference(model_and_params):
  """``((loss, logits), grads)`` of the ragged, scanned, one-device model."""
  return _loss_and_grads(*model_and_params)


def _assert_close(got, want, atol):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol,
                                                       rtol=0), got, want)


def test_ragged_equals_dense(model_and_params, reference):
  """The loss (with the router's aux loss), logits and every gradient."""
  model, params = model_and_params
  dense = create_model(model.config.with_execution(moe_impl='dense'))[0]
  _assert_close(_loss_and_grads(dense, params), reference, atol=2e-5)


def test_routing_is_dropless_and_gates_renormalise():
  """Every token gets its k experts whatever the load: all tokens on one expert still
  compute it (the grouped matmul has no capacity)."""
  logits = jnp.asarray([[5.0, 1.0, 0.0, -1.0]] * 6)
  probs, gates, experts = moe.route(logits, 2, renormalize=True)
  np.testing.assert_array_equal(experts, [[0, 1]] * 6)
  np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
  _, raw, _ = moe.route(logits, 2, renormalize=False)
  np.testing.assert_allclose(raw, probs[:, :2], rtol=1e-6)
  x = jax.random.normal(jax.random.key(0), (6, 8))
  w = [jax.random.normal(jax.random.key(i), shape) for i, shape in
       enumerate(((4, 8, 5), (4, 8, 5), (4, 5, 8)), 1)]
  np.testing.assert_allclose(moe._ragged_experts(x, experts, gates, *w),
                             moe._dense_experts(x, experts, gates, *w), atol=1e-4)
  stats = moe.router_stats(probs, experts)
  np.testing.assert_array_equal(stats[0], [6, 6, 0, 0])
  # Perfectly balanced top-1 routing gives the Switch loss its minimum, 1.
  balanced = moe.router_stats(jnp.eye(4), jnp.arange(4)[:, None])
  np.testing.assert_allclose(moe.load_balancing_loss(balanced, 1), 1.0, rtol=1e-6)


def test_scan_equals_unrolled(model_and_params, reference):
  model, params = model_and_params
  unrolled = with_weight_layout(model, 'in_out', layer_loop='unrolled')
  logits = jax.jit(unrolled.apply)(to_weight_layout(params, model, unrolled), TOKENS)
  np.testing.assert_allclose(logits, reference[0][1], atol=1e-5, rtol=0)


def test_expert_by_fsdp_sharded_step_equals_one_device(model_and_params, reference):
  model, params = model_and_params
  mesh = make_mesh({'data': 2, 'fsdp': 4})  # experts over data, their matrices over fsdp
  shardings = param_shardings(model.abstract_params(), model.logical_axes(), mesh)
  placed = jax.device_put(params, shardings)
  experts = placed['blocks']['moe']['experts_gate']
  assert experts.sharding.spec == jax.sharding.PartitionSpec(None, 'data', 'fsdp', None)
  assert experts.addressable_shards[0].data.shape == (CONFIG.num_layers, 4, 8, 16)
  tokens = jax.device_put(TOKENS, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(('data', 'fsdp'))))
  with activation_sharding(mesh):
    got = _loss_and_grads(model, placed, tokens)
  _assert_close(got, reference, atol=1e-5)


def test_cached_decoding_equals_the_full_forward(model_and_params, reference):
  """A prefill then one-token steps through the KV cache (what the engine runs) give the
  trainer forward's logits: routing is per token, so batching and caching change nothing."""
  model, params = model_and_params
  tokens = TOKENS[:2]
  cache = model.init_cache(2, 12)
  step = jax.jit(lambda params, tokens, cache: model.apply(params, tokens, cache=cache))
  logits, cache = step(params, tokens[:, :5], cache)
  got = [logits]
  for t in range(5, 12):
    logits, cache = step(params, tokens[:, t:t + 1], cache)
    got.append(logits)
  np.testing.assert_allclose(np.concatenate(got, 1), reference[0][1][:2], atol=1e-5, rtol=0)


@pytest.mark.slow  # the engine's programs: ~30 s; test_cached_decoding_... is its CI check
def test_engine_decoding_equals_the_trainer_forward(model_and_params):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / 'rollout'))
  from test_engine_layer_loop import OBSERVATIONS, PROMPTS, conversation, make
  model, raw = model_and_params
  turns = conversation(make(model, 'unrolled'), raw)
  for i, prompt in enumerate(PROMPTS):
    (tokens1, logp1), (tokens2, logp2) = turns[0][i], turns[1][i]
    whole = prompt + tuple(tokens1) + OBSERVATIONS[i] + tuple(tokens2)
    ids = jnp.asarray([whole], jnp.int32)
    logp = np.asarray(token_logprobs(model.apply(raw, ids[:, :-1]), ids[:, 1:]))[0]
    start2 = len(prompt) + len(tokens1) + len(OBSERVATIONS[i])
    np.testing.assert_allclose(logp1, logp[len(prompt) - 1:len(prompt) - 1 + len(tokens1)],
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(logp2, logp[start2 - 1:start2 - 1 + len(tokens2)],
                               atol=1e-5, rtol=0)


MOE = dict(vocab_size=8, family='qwen3_moe', num_experts=4, num_experts_per_tok=2,
           moe_mlp_dim=8)


@pytest.mark.parametrize('changes, message', [
    (dict(family='llama'), r"num_experts=4 makes a mixture of experts, but family='llama'"),
    (dict(num_experts=0), r"family='qwen3_moe' is a mixture of experts but num_experts=0"),
    (dict(num_experts_per_tok=5), r'num_experts_per_tok=5 must be in \[1, num_experts=4\]'),
    (dict(moe_mlp_dim=0), r'moe_mlp_dim=0 must be positive'),
    (dict(family='mixtral'), r"norm_topk_prob=False, but family='mixtral'"),
    (dict(decoder_sparse_step=0), r'decoder_sparse_step=0 must be >= 1'),
    (dict(mlp_only_layers=(2,)), r'mlp_only_layers=\(2,\) must be a tuple of distinct layer '
                                 r'indices in \[0, num_layers=2\)'),
    (dict(mlp_only_layers=[0]), r'mlp_only_layers=\[0\] must be a tuple'),
    (dict(mlp_only_layers=(0, 1)), r'leave none of the 2 layers MoE'),
    (dict(decoder_sparse_step=3), r'leave none of the 2 layers MoE'),
    (dict(family='mixtral', norm_topk_prob=True, decoder_sparse_step=2),
     r'which Mixtral does not'),
    (dict(router_aux_loss_coef=-1.0), r'router_aux_loss_coef=-1.0 must be a float >= 0'),
])
def test_moe_fields_are_checked(changes, message):
  with pytest.raises(ValueError, match=message):
    Architecture(**{**MOE, **changes})


def test_moe_execution_and_aux_loss_misuse_are_refused(model_and_params):
  with pytest.raises(ValueError,
                     match=r"moe_impl='grouped'; choose one of \('ragged', 'dense', 'blocked'\)"):
    CONFIG.with_execution(moe_impl='grouped')
  with pytest.raises(ValueError, match='num_experts=8 with Execution.batch_invariant=True'):
    CONFIG.with_execution(batch_invariant=True)
  dense = create_model(DecoderConfig(vocab_size=8, num_layers=1, embed_dim=8, num_heads=2,
                                     num_kv_heads=1, head_dim=4, mlp_dim=8))
  with pytest.raises(ValueError, match='but num_experts=0'):
    dense[0].apply(dense[1], TOKENS % 8, aux_loss=True)


def test_lora_adapts_the_attention_of_a_mixture_of_experts_and_refuses_its_mlp():
  from flax import nnx
  from rlax_llm.errors import ConfigError
  from rlax_llm.models import lora
  from rlax_llm.models.decoder import Decoder
  decoder = Decoder(CONFIG, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match=r"lora.targets includes \['down', 'gate', 'up'\]"):
    lora.add_adapters(decoder, lora.LoRAConfig(rank=2, alpha=4.0), nnx.Rngs(1))
  lora.add_adapters(decoder, lora.LoRAConfig(rank=2, alpha=4.0, targets=('q', 'o')), nnx.Rngs(1))
  assert decoder.blocks.attn.wq_lora.a[...].shape[:2] == (CONFIG.num_layers, CONFIG.embed_dim)
