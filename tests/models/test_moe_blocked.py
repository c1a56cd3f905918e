"""``Execution.moe_impl='blocked'`` (``moe._blocked_experts``): the (token, slot) pairs in
blocks of one expert each, about the routed FLOPs on any backend. Its block rule and layout,
and the same function as the 'dense' path (every expert on every token): forward to float32
rounding and gradients (of the tokens, gates, router and experts) to 1e-5 relative, on
random tiny shapes, with an expert that gets no row and one that gets every row, int8
experts, and in the model (train step and decode step).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models import moe
from rlax_llm.models.model import create_model, token_logprobs
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.models.quant import quantize_experts, quantize_params

CONFIG = TINY_MOE_PRESETS['tiny-qwen3-moe']


def _weights(key, experts, embed, mlp):
  """Random ``(w_gate, w_up, w_down)`` scaled as ``decoder.MoE`` initialises them."""
  k1, k2, k3 = jax.random.split(key, 3)
  return (jax.random.normal(k1, (experts, embed, mlp)) * embed ** -0.5,
          jax.random.normal(k2, (experts, embed, mlp)) * embed ** -0.5,
          jax.random.normal(k3, (experts, mlp, embed)) * mlp ** -0.5)


def _assert_relative(got, want, rtol):
  """Each leaf of ``got`` within ``rtol`` of ``want``'s largest magnitude."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.abs(b).max()), 1e-30)
    assert float(np.abs(a - b).max()) / scale <= rtol, (a.shape, np.abs(a - b).max(), scale)


@pytest.mark.parametrize('rows,experts,block', [
    (2032, 16, 64),  # benchmarks/moe_speed.py's train step: 127 rows per expert
    (16, 16, 1),  # its decode step: one row per expert
    (5, 16, 1),  # fewer rows than experts
    (10 ** 6, 4, 128),  # capped
    (3, 1, 2),
])
def test_block_rows_is_the_power_of_two_under_the_mean_rows_per_expert(rows, experts, block):
  assert moe.block_rows(rows, experts) == block


def test_block_rows_refuses_no_rows():
  with pytest.raises(ValueError, match=r'rows >= 1 and num_experts >= 1, got rows=0'):
    moe.block_rows(0, 4)


def test_the_layout_puts_every_pair_once_in_a_block_of_its_expert():
  """Blocks of one expert each; every (token, slot) pair in exactly one valid row of a block
  of its expert; an expert with no pair owns no block; padding (an id past the experts) is
  placed nowhere."""
  experts = jnp.asarray([[2, 0], [2, 3], [2, 0], [2, 3], [2, 0], [4, 2]], jnp.int32)
  block = 2
  block_experts, token, valid, position = moe._block_layout(experts, 4, block)
  assert block_experts.shape == ((12 + 4 * (block - 1)) // block,)
  expert_of_row = np.repeat(np.asarray(block_experts), block)
  token, valid, position = np.asarray(token), np.asarray(valid), np.asarray(position)
  assert 1 not in set(expert_of_row[valid])  # expert 1: no pair, no block
  placed = 0
  for t in range(6):
    for s in range(2):
      p = position[t * 2 + s]
      if experts[t, s] >= 4:
        assert p == block_experts.shape[0] * block  # nowhere
        continue
      placed += 1
      assert valid[p] and token[p] == t and expert_of_row[p] == experts[t, s]
  assert valid.sum() == placed == 11
  # Each used block's rows are one expert's; its valid rows come first.
  for b in range(block_experts.shape[0]):
    rows = valid[b * block:(b + 1) * block]
    assert list(rows) == sorted(rows, reverse=True)


_SHAPES = [
    # tokens, experts, k, embed, mlp, routing
    (7, 4, 2, 8, 6, 'random'),
    (40, 8, 2, 16, 12, 'random'),
    (3, 16, 1, 8, 8, 'random'),  # fewer rows than experts: blocks of one row
    (64, 4, 4, 8, 8, 'random'),  # every expert on every token
    (24, 6, 2, 8, 8, 'one_takes_all'),  # expert 3 in every token's slot 0; 0 gets no row
    (20, 4, 1, 8, 4, 'single'),  # k = 1, every row on expert 1
]


def _case(tokens, experts, k, embed, mlp, routing):
  key = jax.random.key(tokens * 100 + experts)
  kx, kr, kw = jax.random.split(key, 3)
  x = jax.random.normal(kx, (tokens, embed))
  router = jax.random.normal(kr, (embed, experts)) * embed ** -0.5
  chosen = None
  if routing == 'one_takes_all':
    other = 1 + (jnp.arange(tokens) % (experts - 1))
    other = jnp.where(other == 3, experts - 1, other)
    chosen = jnp.stack([jnp.full((tokens,), 3), other], 1).astype(jnp.int32)
  elif routing == 'single':
    chosen = jnp.ones((tokens, 1), jnp.int32)
  return x, router, chosen, _weights(kw, experts, embed, mlp)


@pytest.mark.parametrize('shape', _SHAPES)
def test_blocked_equals_dense_forward_and_gradients(shape):
  """The output to float32 rounding; the gradients of the tokens, the gates (``gate_shift``,
  zeros added to them), the router (through the gates) and the three expert weights to 1e-5
  of their largest value."""
  x, router, chosen, weights = _case(*shape)
  k = shape[2]

  def loss(impl, x, router, gate_shift, *weights):
    # k = 1 renormalised: every gate is 1 and the router has no gradient to compare.
    _, gates, experts = moe.route(x @ router, k, renormalize=k > 1)
    if chosen is not None:
      experts = chosen
    out = moe.EXPERT_IMPLS[impl](x, experts, gates + gate_shift, *weights)
    return jnp.sum(jnp.sin(3.0 * out)), out

  grads = {impl: jax.jit(jax.value_and_grad(lambda *a, impl=impl: loss(impl, *a),
                                            argnums=(0, 1, 2, 3, 4, 5), has_aux=True))(
                                                x, router, jnp.zeros((x.shape[0], k)), *weights)
           for impl in ('blocked', 'dense')}
  (_, got_out), got = grads['blocked']
  (_, want_out), want = grads['dense']
  np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-6)
  _assert_relative(got, want, 1e-5)


def test_an_expert_with_every_row_and_experts_with_none():
  """All tokens on expert 2 (k = 1): one expert's group is every row, the others' empty."""
  x, _, _, weights = _case(33, 4, 1, 8, 8, 'random')
  experts = jnp.full((33, 1), 2, jnp.int32)
  gates = jnp.ones((33, 1))
  got = moe._blocked_experts(x, experts, gates, *weights)
  want = jax.nn.silu(x @ weights[0][2]) * (x @ weights[1][2]) @ weights[2][2]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_int8_experts_blocked_equals_dense():
  """``Int8Weight`` experts (the engine's int8 copy): blocked and dense compute the same
  ``(x @ q) * scale`` products, forward and the tokens' gradient."""
  x, router, _, weights = _case(40, 8, 2, 16, 12, 'random')
  quantised = [quantize_experts(w) for w in weights]
  _, gates, experts = moe.route(x @ router, 2, renormalize=True)

  def run(impl):
    f = lambda x: moe.EXPERT_IMPLS[impl](x, experts, gates, *quantised)  # noqa: E731
    return f(x), jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)

  (out, grad), (want_out, want_grad) = run('blocked'), run('dense')
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  _assert_relative(grad, want_grad, 1e-5)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def test_the_blocked_model_equals_the_dense_one(model_and_params):
  """The tiny Qwen3-MoE's train loss (with the router's aux loss) and every gradient, and a
  decode-shaped forward (one token per row) with int8 experts, 'blocked' against 'dense'."""
  _, params = model_and_params
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (8, 12)),
                       jnp.int32)

  def loss_and_grads(impl):
    model = create_model(CONFIG.with_execution(moe_impl=impl))[0]

    def loss(params):
      logits, aux = model.apply(params, tokens, aux_loss=True)
      return -jnp.mean(token_logprobs(logits[:, :-1], tokens[:, 1:])) + 0.01 * aux
    return model, jax.jit(jax.value_and_grad(loss))(params)

  (blocked, got), (dense, want) = loss_and_grads('blocked'), loss_and_grads('dense')
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  _assert_relative(got[1], want[1], 1e-5)
  one_each = tokens[:, :1]
  np.testing.assert_allclose(
      jax.jit(blocked.apply)(quantize_params(params, blocked), one_each),
      jax.jit(dense.apply)(quantize_params(params, dense), one_each), rtol=1e-5, atol=1e-5)
