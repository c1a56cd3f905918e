"""Rollout routing replay (R3) in the model (``rlax_llm.models.moe.replay``): the forward
records the experts it chose and can route by recorded ones, in both ``moe_impl``s, scanned
and unrolled, with and without a KV cache.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_llm.models import moe
from rlax_llm.models.decoder import MoE
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model, token_logprobs, to_weight_layout, \
    with_weight_layout
from rlax_llm.models.presets import TINY_MOE_PRESETS

CONFIG = TINY_MOE_PRESETS['tiny-qwen3-moe']
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (4, 10)), jnp.int32)
MASK = jnp.asarray(np.arange(10)[None, :] < np.array([10, 7, 4, 9])[:, None], jnp.float32)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(model, params, routes=None):
  def loss(params):
    logits, aux = model.apply(params, TOKENS, aux_loss=True, routes=routes, token_mask=MASK)
    return -jnp.mean(token_logprobs(logits[:, :-1], TOKENS[:, 1:])) + 0.01 * aux, logits
  return jax.value_and_grad(loss, has_aux=True)(params)


def _assert_close(got, want, atol):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol,
                                                       rtol=0), got, want)


@pytest.fixture(scope='module')
def recorded(model_and_params):
  model, params = model_and_params
  logits, routes = jax.jit(lambda p: model.apply(p, TOKENS, return_routes=True))(params)
  return logits, routes


def test_forward_records_its_experts_compactly(model_and_params, recorded):
  logits, routes = recorded
  assert routes.shape == (4, 10, CONFIG.num_layers, CONFIG.num_experts_per_tok)
  assert routes.dtype == jnp.int8 and np.dtype(moe.route_dtype(128)) == np.int16
  assert int(routes.min()) >= 0 and int(routes.max()) < CONFIG.num_experts
  # Each token's k experts are distinct (a top-k).
  assert np.all(np.asarray(routes[..., 0]) != np.asarray(routes[..., 1]))
  model, params = model_and_params
  np.testing.assert_array_equal(logits, jax.jit(model.apply)(params, TOKENS))


def test_replaying_its_own_routes_equals_the_plain_forward(model_and_params, recorded):
  """Values and gradients (the aux loss included), and so does a route of NO_ROUTE (the
  router's own choice: padding)."""
  model, params = model_and_params
  plain = _loss_and_grads(model, params)
  _assert_close(_loss_and_grads(model, params, recorded[1]), plain, atol=1e-6)
  unrecorded = jnp.full_like(recorded[1], moe.NO_ROUTE)
  _assert_close(_loss_and_grads(model, params, unrecorded), plain, atol=1e-6)


@pytest.mark.parametrize('impl, loop', [('dense', 'scan'), ('ragged', 'unrolled')])
def test_replay_in_each_moe_impl_and_layer_loop(model_and_params, recorded, impl, loop):
  """The dense fallback and the engine's unrolled loop replay too: their own routes give
  the plain logits, other routes the ragged scanned model's replayed logits."""
  base, params = model_and_params
  model = with_weight_layout(create_model(CONFIG.with_execution(moe_impl=impl))[0],
                             'in_out', layer_loop=loop)
  params = to_weight_layout(params, base, with_weight_layout(base, 'in_out', layer_loop=loop))
  forward = jax.jit(lambda p, r: model.apply(p, TOKENS, routes=r))
  np.testing.assert_allclose(forward(params, recorded[1]), recorded[0], atol=2e-5, rtol=0)
  other = ((recorded[1].astype(jnp.int32) + 1) % CONFIG.num_experts).astype(jnp.int8)
  want = jax.jit(lambda p: base.apply(p, TOKENS, routes=other))(model_and_params[1])
  np.testing.assert_allclose(forward(params, other), want, atol=2e-5, rtol=0)


def test_cached_decoding_records_the_full_forwards_routes(model_and_params, recorded):
  """The engine's path: a prefill then one-token steps through the KV cache, unrolled."""
  base, params = model_and_params
  model = with_weight_layout(base, 'out_in', layer_loop='unrolled')
  params = to_weight_layout(params, base, model)
  cache = model.init_cache(4, 10)
  step = jax.jit(lambda p, t, c: model.apply(p, t, cache=c, return_routes=True))
  _, cache, first = step(params, TOKENS[:, :6], cache)
  got = [first]
  for t in range(6, 10):
    _, cache, routes = step(params, TOKENS[:, t:t + 1], cache)
    got.append(routes)
  np.testing.assert_array_equal(np.concatenate(got, 1), recorded[1])


def test_replaying_other_routes_changes_the_output(model_and_params, recorded):
  model, params = model_and_params
  other = ((recorded[1].astype(jnp.int32) + 1) % CONFIG.num_experts).astype(jnp.int8)
  (_, logits), grads = _loss_and_grads(model, params, other)
  assert np.max(np.abs(np.asarray(logits - recorded[0]))) > 1e-3
  assert float(jnp.abs(grads['blocks']['moe']['router']).max()) > 0
  own, new = np.asarray(recorded[1]), np.asarray(other)
  want = [[len(set(new[b, t, l]) - set(own[b, t, l])) for l in range(CONFIG.num_layers)]
          for b in range(4) for t in range(10)]
  np.testing.assert_array_equal(moe.flipped(recorded[1], other).reshape(40, -1), want)
  np.testing.assert_array_equal(moe.flipped(recorded[1], recorded[1][..., ::-1]), 0)
  np.testing.assert_array_equal(moe.flipped(recorded[1], jnp.full_like(other, -1)), 0)


@pytest.mark.parametrize('renormalize', [True, False])
def test_replay_trains_the_router_only_through_the_gates(renormalize):
  """The replayed block is ``sum_k gate_k(router) * expert_{route_k}(x)``, the gates the
  router's softmax at the recorded experts: its gradient with respect to the router is that
  expression's, whatever the router's own top-k."""
  config = DecoderConfig(family='qwen3_moe', vocab_size=8, num_layers=1, embed_dim=8,
                         num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_mlp_dim=8, norm_topk_prob=renormalize)
  block = MoE(config, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 6, 8))
  routes = jnp.asarray([[[3, 0], [1, 2], [0, 1], [2, 3], [3, 1], [0, 2]]], jnp.int8)
  graphdef, state = nnx.split(block)
  kernels = [state[name][...] for name in ('experts_gate', 'experts_up', 'experts_down')]

  def replayed(router):
    state['router'] = nnx.Param(router)
    return jnp.sum(nnx.merge(graphdef, state)(x, routes)[0] ** 2)

  def expression(router):
    flat = x.reshape(6, 8)
    gates = jnp.take_along_axis(jax.nn.softmax(flat @ router), routes[0].astype(jnp.int32), -1)
    if renormalize:
      gates = gates / gates.sum(-1, keepdims=True)
    return jnp.sum(moe._dense_experts(flat, routes[0].astype(jnp.int32), gates, *kernels) ** 2)

  router = state['router'][...]
  both = jax.jit(lambda r: (jax.value_and_grad(replayed)(r), jax.value_and_grad(expression)(r)))
  got, want = both(router)
  _assert_close(got, want, atol=1e-5)


def test_aux_loss_counts_only_the_masked_tokens(model_and_params):
  """Padding does not enter the load-balancing loss: a row's padded tail, whatever its
  tokens, leaves it unchanged."""
  model, params = model_and_params
  aux = jax.jit(lambda p, t: model.apply(p, t, aux_loss=True, token_mask=MASK)[1])
  changed = jnp.where(MASK > 0, TOKENS, (TOKENS + 5) % CONFIG.vocab_size)
  np.testing.assert_allclose(aux(params, changed), aux(params, TOKENS), rtol=1e-6)
  unmasked = jax.jit(lambda p, t: model.apply(p, t, aux_loss=True)[1])
  assert abs(float(unmasked(params, changed)) - float(unmasked(params, TOKENS))) > 1e-6


def test_routes_on_a_dense_model_are_refused():
  dense = create_model(DecoderConfig(vocab_size=8, num_layers=1, embed_dim=8, num_heads=2,
                                     num_kv_heads=1, head_dim=4, mlp_dim=8))
  with pytest.raises(ValueError, match='route replay needs a MoE model'):
    dense[0].apply(dense[1], TOKENS % 8, return_routes=True)
