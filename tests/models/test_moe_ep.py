"""Expert parallelism that computes (``models.moe.expert_parallel_experts``): under a mesh
whose data axis splits the experts, each of 8 fake CPU devices dispatches its own tokens to
the experts' devices with an all-to-all; the output and every gradient equal the one-device
ragged path's. And the grouped matmul's own weight gradient (``grouped_weight_gradient``:
``jax.lax.ragged_dot_general``, and on TPU megablox ``tgmm``, here in Pallas' interpreter)
against ``jax.grad`` of the plain ``ragged_dot``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rlax_llm.models import moe
from rlax_llm.models.model import create_model, token_logprobs
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.models.quant import dequantize, quantize_experts
from rlax_llm.sharding import activation_sharding, make_mesh, param_shardings

# 37 tokens (prime: padded to each mesh's 8 token shards), 8 experts, k = 2.
TOKENS, EMBED, WIDTH, EXPERTS, K = 37, 16, 8, 8, 2
ATOL = 2e-5  # float32; the sums over a group's rows run in another order per device


def _inputs():
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (TOKENS, EMBED))
  _, gates, balanced = moe.route(jax.random.normal(keys[1], (TOKENS, EXPERTS)), K, True)
  weights = tuple(0.3 * jax.random.normal(key, shape) for key, shape in zip(
      keys[2:], ((EXPERTS, EMBED, WIDTH), (EXPERTS, EMBED, WIDTH), (EXPERTS, WIDTH, EMBED))))
  # Imbalanced: every token's slots on experts 5 and 6 (one device holds both at data 2 and
  # 4), so one device gets every row of its group.
  skewed = jnp.broadcast_to(jnp.asarray([5, 6], jnp.int32), (TOKENS, K))
  return x, gates, weights, {'balanced': balanced, 'skewed': skewed}


X, GATES, WEIGHTS, ROUTES = _inputs()
COTANGENT = jnp.cos(jnp.arange(TOKENS * EMBED, dtype=jnp.float32)).reshape(TOKENS, EMBED)


def _value_and_grads(x, experts, gates, *weights):
  """``(out, (d x, d gates, d w_gate, d w_up, d w_down))`` of ``sum(out * COTANGENT)``."""
  def loss(x, gates, *weights):
    out = moe.run_experts('ragged', x, experts, gates, *weights)
    return jnp.sum(out * COTANGENT), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
      x, gates, *weights)
  return out, grads


@pytest.fixture(scope='module')
def references():
  """The one-device ragged path's outputs and gradients for each routing."""
  step = jax.jit(lambda *args: _value_and_grads(*args))  # its own trace: no mesh
  return {name: step(X, experts, GATES, *WEIGHTS) for name, experts in ROUTES.items()}


@pytest.mark.parametrize('axes', [{'data': 2, 'fsdp': 4}, {'data': 4, 'fsdp': 2},
                                  {'data': 8}, {'data': 2, 'fsdp': 2, 'tensor': 2}],
                         ids=['ep2_fsdp4', 'ep4_fsdp2', 'ep8', 'ep2_fsdp2_tensor2'])
def test_per_device_dispatch_equals_the_one_device_ragged_path(references, axes):
  """Forward and gradients (tokens, gates, the three expert weights) for balanced and
  all-on-two-experts routing; the compiled step exchanges rows with all-to-alls (XLA:CPU's
  padded stand-in for the ragged one)."""
  mesh = make_mesh(axes)
  with activation_sharding(mesh):
    step = jax.jit(lambda *args: _value_and_grads(*args))  # traced under this mesh
    hlo = step.lower(X, ROUTES['balanced'], GATES, *WEIGHTS).compile().as_text()
    for name, experts in ROUTES.items():
      got = step(X, experts, GATES, *WEIGHTS)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL, rtol=0), got,
                   references[name])
  assert 'all-to-all' in hlo


@pytest.mark.parametrize('axes', [{'data': 4, 'fsdp': 2}, {'data': 2, 'fsdp': 2, 'tensor': 2}],
                         ids=['ep4_fsdp2', 'ep2_fsdp2_tensor2'])
def test_int8_experts_dispatch_with_their_scales_as_on_one_device(axes):
  """The engine's int8 experts (``quant.quantize_experts``: scales ``[experts, 1, out]``
  sharded with their experts and output channels) through the per-device dispatch equal the
  one-device int8 ragged path and the float path of the dequantised weights, for balanced and
  all-on-two-experts routing."""
  int8 = tuple(quantize_experts(w) for w in WEIGHTS)
  dequantised = tuple(dequantize(w, 'in_out') for w in int8)
  forward = lambda: jax.jit(lambda *args: moe.run_experts('ragged', *args))  # noqa: E731
  one = forward()  # its own trace: no mesh
  want = {name: one(X, experts, GATES, *int8) for name, experts in ROUTES.items()}
  for name, experts in ROUTES.items():
    np.testing.assert_allclose(want[name], one(X, experts, GATES, *dequantised), atol=ATOL,
                               rtol=0)
  mesh = make_mesh(axes)
  with activation_sharding(mesh):
    step = forward()  # traced under this mesh: the shard_map dispatch
    hlo = step.lower(X, ROUTES['balanced'], GATES, *int8).compile().as_text()
    for name, experts in ROUTES.items():
      got = step(X, experts, GATES, *int8)
      np.testing.assert_allclose(got, want[name], atol=ATOL, rtol=0)
  assert 'all-to-all' in hlo


def test_the_tpu_program_traces_a_ragged_all_to_all_and_the_tgmm_kernel(monkeypatch):
  """What a TPU host traces (``jax.default_backend()`` 'tpu', as launch/recipes/compile.py
  traces; devices with XLA's ragged all-to-all), traced on the CPU devices (XLA:CPU compiles
  neither): the exchange is ``ragged_all_to_all``, the weight gradient megablox's kernel."""
  monkeypatch.setattr(moe, '_PADDED_EXCHANGE', ())
  monkeypatch.setattr(jax, 'default_backend', lambda: 'tpu')
  with activation_sharding(make_mesh({'data': 4, 'fsdp': 2})):
    jaxpr = str(jax.jit(lambda *args: _value_and_grads(*args)).trace(
        X, ROUTES['balanced'], GATES, *WEIGHTS).jaxpr)
  assert jaxpr.count('ragged_all_to_all') >= 4  # there and back, and their transposes
  assert 'pallas_call' in jaxpr


# ~30 s (the tiny model's sharded step compiled twice); its CI counterparts: the dispatch tests
# above (routes given, as replay gives them) and test_moe.py's sharded model step (data 2).
@pytest.mark.slow
def test_the_sharded_model_step_with_replayed_routes_dispatches_per_device():
  """The tiny Qwen3-MoE's loss (with the router's aux loss), logits and every gradient
  under R3 replay (the recorded routes given, a third of them overridden) on data 4 x fsdp
  2 equal one device's."""
  config = TINY_MOE_PRESETS['tiny-qwen3-moe']
  model, params = create_model(config, seed=0)
  rng = np.random.RandomState(1)
  tokens = jnp.asarray(rng.randint(0, config.vocab_size, (8, 12)), jnp.int32)
  routes = jnp.asarray(rng.randint(0, config.num_experts, (8, 12, config.num_layers, 1)))
  routes = jnp.concatenate([routes, (routes + 1) % config.num_experts], axis=-1)
  routes = jnp.where(rng.rand(8, 12, 1, 1) < 0.3, moe.NO_ROUTE, routes).astype(jnp.int8)

  def loss(params, tokens, routes):
    logits, aux = model.apply(params, tokens, routes=routes, aux_loss=True)
    return -jnp.mean(token_logprobs(logits[:, :-1], tokens[:, 1:])) + 0.01 * aux, logits
  step = lambda: jax.jit(jax.value_and_grad(loss, has_aux=True))  # noqa: E731  (a trace each)
  want = step()(params, tokens, routes)
  mesh = make_mesh({'data': 4, 'fsdp': 2})
  placed = jax.device_put(params, param_shardings(model.abstract_params(),
                                                  model.logical_axes(), mesh))
  rows = NamedSharding(mesh, PartitionSpec(('data', 'fsdp')))
  with activation_sharding(mesh):
    lowered = step().lower(placed, jax.device_put(tokens, rows), jax.device_put(routes, rows))
    got = lowered.compile()(placed, jax.device_put(tokens, rows), jax.device_put(routes, rows))
  assert 'all-to-all' in lowered.as_text(dialect='hlo')
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), got, want)


def test_grouped_matmul_gradients_equal_ragged_dots():
  """``grouped_matmul``'s custom VJP (the weight gradient a grouped transposed product)
  against ``jax.grad`` of ``jax.lax.ragged_dot``: groups of 5, 0, 9 and 3 rows and 3 rows
  past them, float32, to 1e-5."""
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], (20, 6))
  w = jax.random.normal(keys[1], (4, 6, 7))
  dy = jax.random.normal(keys[2], (20, 7))
  sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)
  loss = lambda f: lambda x, w: jnp.sum(f(x, w, sizes) * dy)  # noqa: E731
  got = jax.grad(loss(moe.grouped_matmul), argnums=(0, 1))(x, w)
  want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), got, want)
  np.testing.assert_array_equal(got[0][17:], 0)  # rows past the groups take no gradient
  # each group's weight gradient is its own rows' product, an empty group's 0
  np.testing.assert_allclose(got[1][2], x[5:14].T @ dy[5:14], atol=1e-5)
  np.testing.assert_array_equal(got[1][1], 0)


def test_tpu_weight_gradient_megablox_tgmm_equals_the_ragged_one():
  """The TPU form (megablox ``tgmm``, in Pallas' interpreter) of the weight gradient: 150
  rows padded to the kernel's row tile, groups of 30, 0, 100 and 20 rows, to 1e-5."""
  keys = jax.random.split(jax.random.key(4), 2)
  x = jax.random.normal(keys[0], (150, 16))
  dy = jax.random.normal(keys[1], (150, 8))
  sizes = jnp.asarray([30, 0, 100, 20], jnp.int32)
  got = moe._tgmm_weight_gradient(x, dy, sizes, interpret=True)  # pylint: disable=protected-access
  np.testing.assert_allclose(got, moe.grouped_weight_gradient(x, dy, sizes), atol=1e-5)
  np.testing.assert_allclose(got[2], x[30:130].T @ dy[30:130], atol=1e-5)
