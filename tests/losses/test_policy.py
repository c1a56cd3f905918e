"""Tests for rlax_llm.losses.policy (GRPO loss and its parts) and rlax_llm.losses.kl."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.losses.kl import kl_penalty
from rlax_llm.losses.policy import (grpo_loss, importance_ratio, masked_token_mean,
                                    policy_loss, ppo_clip_objective, sequence_mean_aggregate)

B, T = 5, 7
CLIP = 0.2


# ---------------------------------------------------------------------------------------------
# NumPy references, written from the formulas (float64).


def np_k3(logp, ref_logp):
  log_ratio = np.asarray(ref_logp, np.float64) - np.asarray(logp, np.float64)
  return np.exp(log_ratio) - 1.0 - log_ratio


def np_grpo(logp, behaviour_logp, advantages, mask, clip_eps=CLIP, kl_beta=0.0, ref_logp=None):
  """DeepSeekMath eq. (3), returned as a loss to minimise, plus the clip fraction and KL."""
  logp = np.asarray(logp, np.float64)
  behaviour_logp = np.asarray(behaviour_logp, np.float64)
  mask = np.asarray(mask, bool)
  adv = np.asarray(advantages, np.float64)
  if adv.ndim == 1:
    adv = adv[:, None]
  adv = np.broadcast_to(adv, logp.shape)
  ratio = np.exp(logp - behaviour_logp)
  surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
  per_token = -surrogate
  kl = None
  if kl_beta > 0:
    kl = np_k3(logp, ref_logp)
    per_token = per_token + kl_beta * kl

  def seq_mean(x):
    rows = [x[b][mask[b]].mean() for b in range(x.shape[0]) if mask[b].any()]
    return float(np.mean(rows)) if rows else 0.0

  # A token's gradient is removed by the clip iff r > 1+eps with A > 0, or r < 1-eps with A < 0.
  clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
  clip_fraction = clipped[mask].mean() if mask.any() else 0.0
  return seq_mean(per_token), {
      'clip_fraction': clip_fraction,
      'kl': None if kl is None else seq_mean(kl),
      'ratio/mean': ratio[mask].mean(),
      'ratio/max': ratio[mask].max(),
      'advantage/mean': adv[mask].mean(),
      'mismatch/abs_dlogp': np.abs(logp - behaviour_logp)[mask].mean(),
  }


def np_grpo_grad_logp(logp, behaviour_logp, advantages, mask, clip_eps=CLIP, kl_beta=0.0,
                      ref_logp=None):
  """Analytic d loss / d logp of ``np_grpo``."""
  logp = np.asarray(logp, np.float64)
  mask = np.asarray(mask, bool)
  adv = np.asarray(advantages, np.float64)
  adv = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
  ratio = np.exp(logp - np.asarray(behaviour_logp, np.float64))
  clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
  d_token = np.where(clipped, 0.0, -adv * ratio)  # d(-min(rA, clip(r)A))/dlogp
  if kl_beta > 0:
    d_token = d_token + kl_beta * (1.0 - np.exp(np.asarray(ref_logp, np.float64) - logp))
  lengths = mask.sum(1)
  num_seqs = (lengths > 0).sum()
  weight = mask / np.maximum(lengths, 1)[:, None] / max(num_seqs, 1)
  return d_token * weight


def make_inputs(seed, batch=B, length=T, zero_row=2, per_token_adv=False):
  """Random log-probs whose ratios stay >= 0.05 away from the clip edges 0.8 and 1.2.

  Row ``zero_row`` has an all-zero mask; every other row has at least one loss token.
  """
  rng = np.random.RandomState(seed)
  logp = -rng.uniform(0.05, 3.0, (batch, length))
  bands = np.array([[-0.6, -0.3], [-0.15, 0.12], [0.25, 0.6]])  # log-ratio bands
  band = bands[rng.randint(0, 3, (batch, length))]
  log_ratio = band[..., 0] + rng.rand(batch, length) * (band[..., 1] - band[..., 0])
  behaviour = logp - log_ratio
  ref = logp + rng.normal(0.0, 0.4, (batch, length))
  adv_shape = (batch, length) if per_token_adv else (batch,)
  adv = rng.normal(size=adv_shape)
  mask = rng.rand(batch, length) < 0.6
  mask[:, 0] = True
  if zero_row is not None:
    mask[zero_row] = False
  f32 = lambda x: x.astype(np.float32)
  return f32(logp), f32(behaviour), f32(adv), mask.astype(np.float32), f32(ref)


@functools.lru_cache(maxsize=None)
def jitted_grpo(kl_beta=0.0, clip_eps=CLIP, kl_estimator='k3'):
  fn = functools.partial(grpo_loss, clip_eps=clip_eps, kl_beta=kl_beta,
                         kl_estimator=kl_estimator)
  if kl_beta > 0:
    return jax.jit(lambda lp, bl, a, m, ref: fn(lp, bl, a, m, ref_logp=ref))
  return jax.jit(lambda lp, bl, a, m, ref: fn(lp, bl, a, m))


@pytest.fixture
def x64():
  """float64 inside the test only; the global flag is restored afterwards."""
  with jax.enable_x64(True):
    yield


# ---------------------------------------------------------------------------------------------
# grpo_loss values.


@pytest.mark.parametrize('kl_beta', [0.0, 0.05])
@pytest.mark.parametrize('per_token_adv', [False, True])
@pytest.mark.parametrize('seed', [0, 1])
def test_grpo_loss_matches_numpy_reference(seed, per_token_adv, kl_beta):
  logp, behaviour, adv, mask, ref = make_inputs(seed, per_token_adv=per_token_adv)
  loss, diags = jitted_grpo(kl_beta)(logp, behaviour, adv, mask, ref)
  expected, expected_diags = np_grpo(logp, behaviour, adv, mask, kl_beta=kl_beta, ref_logp=ref)
  assert loss.shape == () and loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)
  # The inputs make the clip bite on some tokens, so clip_fraction is a real check.
  assert 0.0 < expected_diags['clip_fraction'] < 1.0
  for key in ('clip_fraction', 'ratio/mean', 'ratio/max', 'advantage/mean',
              'mismatch/abs_dlogp'):
    np.testing.assert_allclose(diags[key], expected_diags[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)
  if kl_beta > 0:
    np.testing.assert_allclose(diags['kl'], expected_diags['kl'], rtol=1e-5, atol=1e-6)
  else:
    assert 'kl' not in diags


def test_grpo_loss_hand_case():
  # One sequence, two loss tokens, A = 1, eps = 0.2.
  # token 0: r = 1.5 -> min(1.5, 1.2) = 1.2 (clipped); token 1: r = 0.5 -> min(0.5, 0.8) = 0.5.
  # loss = -(1.2 + 0.5) / 2 = -0.85; clip_fraction = 1/2. The third token is masked out.
  logp = jnp.log(jnp.array([[1.5, 0.5, 9.0]]))
  behaviour = jnp.zeros((1, 3))
  loss, diags = grpo_loss(logp, behaviour, jnp.array([1.0]), jnp.array([[1, 1, 0]]),
                          clip_eps=0.2)
  np.testing.assert_allclose(loss, -0.85, rtol=1e-6)
  np.testing.assert_allclose(diags['clip_fraction'], 0.5)
  np.testing.assert_allclose(diags['ratio/max'], 1.5, rtol=1e-6)


def test_sequence_mean_weights_sequences_equally():
  # Row 0 has 1 loss token (value 4), row 1 has 3 (values 1, 2, 3), row 2 has none.
  # Per-sequence means 4 and 2 -> 3; a token mean would give (4 + 6) / 4 = 2.5.
  x = jnp.array([[4.0, 100.0, 100.0], [1.0, 2.0, 3.0], [7.0, 7.0, 7.0]])
  mask = jnp.array([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
  np.testing.assert_allclose(sequence_mean_aggregate(x, mask), 3.0, rtol=1e-6)
  np.testing.assert_allclose(masked_token_mean(x, mask), 2.5, rtol=1e-6)
  assert float(sequence_mean_aggregate(x, jnp.zeros_like(mask))) == 0.0
  assert float(masked_token_mean(x, jnp.zeros_like(mask))) == 0.0


def test_ppo_clip_objective_and_importance_ratio():
  ratio = importance_ratio(jnp.log(jnp.array([[0.5, 0.9, 1.5, 1.5, 0.5]])), jnp.zeros((1, 5)))
  np.testing.assert_allclose(ratio, [[0.5, 0.9, 1.5, 1.5, 0.5]], rtol=1e-6)
  adv = jnp.array([[1.0, 1.0, 1.0, -1.0, -1.0]])
  obj, clipped = ppo_clip_objective(ratio, adv, 0.2, 0.3)
  # min(rA, clip(r, 0.8, 1.3) A) per token.
  np.testing.assert_allclose(obj, [[0.5, 0.9, 1.3, -1.5, -0.8]], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[False, False, True, False, True]])


def test_all_masked_batch_gives_zero_loss():
  logp, behaviour, adv, mask, ref = make_inputs(3)
  loss, diags = jitted_grpo(0.1)(logp, behaviour, adv, np.zeros_like(mask), ref)
  assert float(loss) == 0.0
  assert all(np.isfinite(v) for v in jax.tree.leaves(diags))


def test_padding_invariance():
  """Appending masked-out columns with arbitrary values changes neither loss nor diagnostics."""
  logp, behaviour, adv, mask, ref = make_inputs(4)
  rng = np.random.RandomState(5)
  extra = 4
  pad = lambda x, scale: np.concatenate(
      [x, (scale * rng.normal(size=(B, extra))).astype(np.float32)], axis=1)
  padded = (pad(logp, 30.0), pad(behaviour, 30.0), adv,
            np.concatenate([mask, np.zeros((B, extra), np.float32)], axis=1), pad(ref, 30.0))
  loss, diags = jitted_grpo(0.1)(logp, behaviour, adv, mask, ref)
  loss_p, diags_p = jitted_grpo(0.1)(*padded)
  np.testing.assert_allclose(loss_p, loss, rtol=1e-6, atol=1e-7)
  for key in diags:
    np.testing.assert_allclose(diags_p[key], diags[key], rtol=1e-6, atol=1e-7, err_msg=key)
  # Same with per-token advantages padded with junk.
  adv_t = np.broadcast_to(adv[:, None], (B, T)).copy()
  loss_t, _ = jitted_grpo(0.1)(logp, behaviour, adv_t, mask, ref)
  padded_t = padded[:2] + (pad(adv_t, 30.0),) + padded[3:]
  loss_tp, _ = jitted_grpo(0.1)(*padded_t)
  np.testing.assert_allclose(loss_t, loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(loss_tp, loss, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Gradients.


@pytest.mark.parametrize('kl_beta', [0.0, 0.1])
def test_grad_wrt_logp_matches_finite_differences_and_analytic(x64, kl_beta):
  logp, behaviour, adv, mask, ref = (np.asarray(a, np.float64) for a in make_inputs(6))

  def loss_fn(lp):
    kwargs = dict(kl_beta=kl_beta, ref_logp=jnp.asarray(ref)) if kl_beta else {}
    return grpo_loss(lp, jnp.asarray(behaviour), jnp.asarray(adv), jnp.asarray(mask),
                     clip_eps=CLIP, **kwargs)[0]

  loss_jit = jax.jit(loss_fn)
  grad = np.asarray(jax.jit(jax.grad(loss_fn))(jnp.asarray(logp)))
  assert grad.shape == (B, T)

  # Central finite differences, one token at a time, batched through vmap.
  h = 1e-3
  eye = np.eye(B * T).reshape(B * T, B, T)
  plus = jax.vmap(loss_jit)(jnp.asarray(logp[None] + h * eye))
  minus = jax.vmap(loss_jit)(jnp.asarray(logp[None] - h * eye))
  fd = (np.asarray(plus) - np.asarray(minus)).reshape(B, T) / (2 * h)
  np.testing.assert_allclose(grad, fd, atol=5e-4)

  analytic = np_grpo_grad_logp(logp, behaviour, adv, mask, kl_beta=kl_beta, ref_logp=ref)
  np.testing.assert_allclose(grad, analytic, rtol=1e-5, atol=1e-7)
  # Masked tokens (incl. the all-zero row) get exactly zero gradient.
  np.testing.assert_array_equal(grad[mask == 0], 0.0)
  if kl_beta == 0:
    ratio = np.exp(logp - behaviour)
    a = adv[:, None]
    clipped = ((a > 0) & (ratio > 1 + CLIP)) | ((a < 0) & (ratio < 1 - CLIP))
    assert clipped[mask > 0].any()
    np.testing.assert_array_equal(grad[clipped], 0.0)


def test_no_gradient_through_behaviour_ref_or_advantages():
  logp, behaviour, adv, mask, ref = make_inputs(7)

  def loss_fn(lp, bl, a, r):
    return grpo_loss(lp, bl, a, mask, clip_eps=CLIP, kl_beta=0.1, ref_logp=r)[0]

  grads = jax.jit(jax.grad(loss_fn, argnums=(0, 1, 2, 3)))(logp, behaviour, adv, ref)
  assert np.abs(np.asarray(grads[0])).max() > 0
  for g in grads[1:]:
    np.testing.assert_array_equal(g, np.zeros_like(g))


# ---------------------------------------------------------------------------------------------
# Errors, dispatch, dtypes.


def test_kl_beta_without_ref_logp_raises():
  logp, behaviour, adv, mask, _ = make_inputs(8)
  with pytest.raises(ValueError, match='ref_logp'):
    grpo_loss(logp, behaviour, adv, mask, kl_beta=0.1)


def test_policy_loss_dispatch():
  logp, behaviour, adv, mask, ref = make_inputs(9)
  with pytest.raises(ValueError, match=r"nope.*\['grpo'\]"):
    policy_loss('nope', logp, behaviour, adv, mask)
  loss, _ = policy_loss('grpo', logp, behaviour, adv, mask, clip_eps=CLIP, kl_beta=0.05,
                        ref_logp=ref)
  expected, _ = np_grpo(logp, behaviour, adv, mask, kl_beta=0.05, ref_logp=ref)
  np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)


def test_shape_mismatch_raises():
  logp, behaviour, adv, mask, _ = make_inputs(10)
  with pytest.raises(AssertionError):
    grpo_loss(logp, behaviour[:, :-1], adv, mask)
  with pytest.raises(AssertionError):
    grpo_loss(logp, behaviour, adv[:-1], mask)


def test_bf16_inputs_under_jit():
  logp, behaviour, adv, mask, ref = make_inputs(11)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  args = (bf(logp), bf(behaviour), bf(adv), mask.astype(bool), bf(ref))
  loss, diags = jitted_grpo(0.05)(*args)
  assert loss.dtype == jnp.float32
  assert np.isfinite(float(loss)) and all(np.isfinite(v) for v in jax.tree.leaves(diags))
  # The loss casts to float32 before subtracting, so it is exact on the bf16-rounded values.
  as64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  expected, expected_diags = np_grpo(as64(args[0]), as64(args[1]), as64(args[2]), mask,
                                     kl_beta=0.05, ref_logp=as64(args[4]))
  np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(diags['clip_fraction'], expected_diags['clip_fraction'])


# ---------------------------------------------------------------------------------------------
# kl_penalty.


def test_kl_estimators_match_formulas():
  rng = np.random.RandomState(12)
  logp = -rng.uniform(0.01, 4.0, (3, 6)).astype(np.float32)
  ref = -rng.uniform(0.01, 4.0, (3, 6)).astype(np.float32)
  log_ratio = ref.astype(np.float64) - logp
  expected = {'k1': -log_ratio, 'k2': 0.5 * log_ratio ** 2,
              'k3': np.exp(log_ratio) - 1 - log_ratio}
  for name, value in expected.items():
    out = kl_penalty(jnp.asarray(logp), jnp.asarray(ref), name)
    assert out.dtype == jnp.float32 and out.shape == (3, 6)
    np.testing.assert_allclose(out, value, rtol=1e-5, atol=1e-6, err_msg=name)
  # k3 is the default, and all three are 0 when the policies agree.
  np.testing.assert_allclose(kl_penalty(jnp.asarray(logp), jnp.asarray(ref)), expected['k3'],
                             rtol=1e-5, atol=1e-6)
  for name in expected:
    np.testing.assert_array_equal(kl_penalty(jnp.asarray(logp), jnp.asarray(logp), name), 0.0)


def test_kl_k3_far_reference_is_finite():
  # Past log_ratio = 20, exp is continued linearly: a reference 100 nats more likely gives
  # exp(20) * (1 + 80) - 1 - 100, finite.
  out = kl_penalty(jnp.array([[-100.0]]), jnp.array([[0.0]]), 'k3')
  np.testing.assert_allclose(out, [[np.exp(20.0) * 81.0 - 101.0]], rtol=1e-6)


def test_kl_k3_gradient_matches_formula():
  # d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - exp(ref - logp).
  logp = jnp.array([[-3.0, -1.0, -0.5, -8.0, -0.1]])
  ref = jnp.array([[-1.0, -1.0, -2.0, -0.5, -7.0]])
  grad = jax.grad(lambda lp: kl_penalty(lp, ref, 'k3').sum())(logp)
  np.testing.assert_allclose(grad, 1.0 - np.exp(np.asarray(ref) - np.asarray(logp)), rtol=1e-5)


def test_kl_k3_pulls_towards_reference_beyond_clamp():
  logp = jnp.array([[-21.0, -25.0, -40.0]])
  grad = jax.grad(lambda lp: kl_penalty(lp, jnp.zeros_like(lp), 'k3').sum())(logp)
  assert np.all(np.asarray(grad) < 0), grad


def test_kl_unknown_estimator_raises():
  with pytest.raises(ValueError, match=r"k4.*\('k1', 'k2', 'k3'\)"):
    kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), 'k4')


_logps = st.floats(-15.0, 0.0, allow_nan=False, width=32)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(_logps, _logps), min_size=8, max_size=8))
def test_kl_k3_is_nonnegative_and_matches_reference(pairs):
  logp = np.array([[p[0] for p in pairs]], np.float32)
  ref = np.array([[p[1] for p in pairs]], np.float32)
  k3 = np.asarray(jax.jit(kl_penalty, static_argnums=2)(logp, ref, 'k3'))
  assert np.all(k3 >= 0.0), k3
  np.testing.assert_allclose(k3, np_k3(logp, ref), rtol=1e-5, atol=2e-7)
  far = np.abs(ref.astype(np.float64) - logp) >= 1e-2  # rounding cannot flip the sign here
  assert np.all(k3[far] > 0)


def test_kl_k3_is_exactly_nonnegative_for_small_log_ratios():
  x = np.linspace(-3e-4, 3e-4, 1001).astype(np.float32)[None]
  k3 = np.asarray(kl_penalty(jnp.zeros_like(x), jnp.asarray(x), 'k3'))
  assert np.all(k3 >= 0.0)
