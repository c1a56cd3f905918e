"""Tests for rlax_llm.losses.distill against float64 NumPy references written from the papers
(GKD, Agarwal et al. 2024, eq. 1, with TRL's convention at the ends; Thinking Machines 2025's
per-token reverse KL), and DistillConfig's validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.losses import (DistillConfig, LossConfig, generalized_jsd, gkd_loss,
                             mix_advantages, policy_loss, reverse_kl_advantages)
from rlax_llm.losses.distill import TAIL_FLOOR, with_tail


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_kl(logp, logq):
  """KL(P || Q) over the last axis, from log P and log Q."""
  return (np.exp(logp) * (logp - logq)).sum(-1)


def np_jsd(student_logp, teacher_logp, beta):
  """GKD's JSD(beta) after renormalising both on the support: beta KL(T || M) + (1 - beta)
  KL(S || M), M = beta T + (1 - beta) S; the ends KL(T || S) (beta 0), KL(S || T) (beta 1)."""
  s, t = np_log_softmax(student_logp), np_log_softmax(teacher_logp)
  if beta == 0:
    return np_kl(t, s)
  if beta == 1:
    return np_kl(s, t)
  m = np.log(beta * np.exp(t) + (1 - beta) * np.exp(s))
  return beta * np_kl(t, m) + (1 - beta) * np_kl(s, m)


# JAX computes in float32 here (x64 off): compare with float32 tolerances.
TOL = dict(rtol=2e-5, atol=1e-6)


def _logits(seed, shape):
  return np.random.default_rng(seed).normal(size=shape) * 2.0


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), beta=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
       k=st.sampled_from([1, 5]))
def test_generalized_jsd_matches_numpy(seed, beta, k):
  s, t = _logits(seed, (2, 3, k)), _logits(seed + 1, (2, 3, k))
  got = generalized_jsd(jnp.asarray(s), jnp.asarray(t), beta)
  np.testing.assert_allclose(got, np_jsd(s, t, beta), **TOL)


def test_jsd_ends_are_the_two_kls_and_interior_approaches_them():
  s, t = _logits(0, (2, 4, 7)), _logits(1, (2, 4, 7))
  ls, lt = np_log_softmax(s), np_log_softmax(t)
  np.testing.assert_allclose(generalized_jsd(s, t, 0.0), np_kl(lt, ls), **TOL)
  np.testing.assert_allclose(generalized_jsd(s, t, 1.0), np_kl(ls, lt), **TOL)
  # Equal distributions: 0 for every beta; the interior is symmetric under swapping the roles
  # with beta -> 1 - beta.
  for beta in (0.0, 0.3, 1.0):
    np.testing.assert_allclose(generalized_jsd(s, s, beta), 0.0, atol=1e-6)
  np.testing.assert_allclose(generalized_jsd(s, t, 0.3), generalized_jsd(t, s, 0.7), **TOL)


def test_jsd_renormalises_on_the_support():
  # Log-probs of a top-k subset (mass < 1) give the divergence of the renormalised ones.
  full_s, full_t = np_log_softmax(_logits(2, (1, 2, 9))), np_log_softmax(_logits(3, (1, 2, 9)))
  top = np.argsort(-full_t, axis=-1)[..., :4]
  sub_s = np.take_along_axis(full_s, top, -1)
  sub_t = np.take_along_axis(full_t, top, -1)
  np.testing.assert_allclose(generalized_jsd(sub_s, sub_t, 0.5), np_jsd(sub_s, sub_t, 0.5),
                             **TOL)
  np.testing.assert_allclose(generalized_jsd(sub_s - 3.0, sub_t + 1.0, 0.5),
                             generalized_jsd(sub_s, sub_t, 0.5), **TOL)


def np_with_tail(logp):
  """The support's full-vocabulary log-probs and log(1 - their mass), in float64 (the
  masses here are far above ``TAIL_FLOOR``)."""
  logp = np.asarray(logp, np.float64)
  return np.concatenate([logp, np.log1p(-np.exp(logp).sum(-1, keepdims=True))], -1)


@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
def test_tail_compares_the_support_and_the_mass_outside_it(beta):
  full_s, full_t = np_log_softmax(_logits(6, (2, 3, 9))), np_log_softmax(_logits(7, (2, 3, 9)))
  top = np.argsort(-full_t, axis=-1)[..., :4]
  sub_s, sub_t = (np.take_along_axis(x, top, -1) for x in (full_s, full_t))
  got = generalized_jsd(jnp.asarray(sub_s), jnp.asarray(sub_t), beta, tail=True)
  np.testing.assert_allclose(got, np_jsd(np_with_tail(sub_s), np_with_tail(sub_t), beta),
                             **TOL)


def test_tail_sees_the_mass_the_student_moves_off_the_support():
  # The student's support shape is the teacher's, but it holds half its mass elsewhere:
  # renormalised, the two are equal (0); with the tail they are not, and the gradient moves
  # the student's mass back onto the support (raises every support log-prob).
  teacher = np.log(np.array([[[0.6, 0.3, 0.05]]]))  # 0.05 outside
  student = teacher + np.log(0.5 / 0.95)  # the same shape, 0.5 outside
  np.testing.assert_allclose(generalized_jsd(student, teacher, 0.5), 0.0, atol=1e-6)
  with_t = generalized_jsd(jnp.asarray(student), jnp.asarray(teacher), 0.5, tail=True)
  assert float(with_t[0, 0]) > 0.05
  grad = jax.grad(lambda s: gkd_loss(s, jnp.asarray(teacher), np.ones((1, 1)), 0.5,
                                     tail=True))(jnp.asarray(student))
  assert np.all(np.asarray(grad) < 0)


def test_a_tail_below_the_floor_is_held_there_without_gradient():
  # The whole vocabulary as the support: float32 leaves a tail of about 1e-7, rounding.
  logp = jnp.asarray(np_log_softmax(_logits(8, (1, 2, 5))))
  out = with_tail(logp)
  np.testing.assert_allclose(out[..., :5], logp)
  np.testing.assert_allclose(out[..., 5], np.log(TAIL_FLOOR), rtol=1e-6)
  grad = jax.grad(lambda s: with_tail(s)[..., 5].sum())(logp)
  np.testing.assert_array_equal(grad, 0.0)
  student = jax.nn.log_softmax(logp + jnp.asarray(_logits(9, (1, 2, 5))) * 0.1)
  np.testing.assert_allclose(generalized_jsd(student, logp, 0.5, tail=True),
                             generalized_jsd(student, logp, 0.5), rtol=1e-3, atol=1e-6)


def test_jsd_refuses_beta_outside_unit_interval():
  with pytest.raises(ValueError, match=r'beta=1.5 must be in \[0, 1\]'):
    generalized_jsd(jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 2)), 1.5)


def test_gkd_loss_is_masked_token_mean_and_teacher_gets_no_gradient():
  s, t = _logits(4, (2, 3, 5)), _logits(5, (2, 3, 5))
  mask = np.array([[1, 1, 0], [0, 1, 0]], np.float32)
  per_token = np_jsd(s, t, 0.5)
  want = per_token[mask > 0].mean()
  np.testing.assert_allclose(gkd_loss(s, t, mask, 0.5), want, **TOL)
  # Masked positions do not matter: changing them leaves the loss unchanged.
  s2 = s.copy()
  s2[0, 2] += 10.0
  np.testing.assert_allclose(gkd_loss(s2, t, mask, 0.5), want, **TOL)
  grad_t = jax.grad(lambda tt: gkd_loss(jnp.asarray(s), tt, mask, 0.5))(jnp.asarray(t))
  np.testing.assert_array_equal(grad_t, 0.0)
  grad_s = jax.grad(lambda ss: gkd_loss(ss, jnp.asarray(t), mask, 0.5))(jnp.asarray(s))
  assert np.all(grad_s[0, 2] == 0) and np.any(grad_s[0, 0] != 0)


def test_reverse_kl_advantages_and_mix():
  teacher = np.log(np.array([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]]))
  student = np.log(np.array([[0.25, 0.25, 0.3], [0.2, 0.1, 0.3]]))
  mask = np.array([[1, 1, 0], [0, 1, 1]], np.float32)
  adv = reverse_kl_advantages(teacher, student, mask)
  want = np.where(mask > 0, np.log(np.array([[2.0, 1.0, 3.0], [0.5, 2.0, 1.0]])), 0.0)
  np.testing.assert_allclose(adv, want, **TOL)
  task = np.array([1.0, -0.5])
  np.testing.assert_allclose(mix_advantages(task, adv, mask, 0.5),
                             np.where(mask > 0, task[:, None] + 0.5 * want, 0.0), **TOL)
  np.testing.assert_allclose(mix_advantages(None, adv, mask, 2.0), 2.0 * want, **TOL)
  per_token_task = np.arange(6.0).reshape(2, 3)
  np.testing.assert_allclose(mix_advantages(per_token_task, adv, mask, 1.0),
                             np.where(mask > 0, per_token_task + want, 0.0), **TOL)
  with pytest.raises(ValueError, match=r'task_advantages must be \[B\]'):
    mix_advantages(np.zeros(3), adv, mask, 1.0)


def test_reverse_kl_advantage_through_policy_loss_is_the_reverse_kl_gradient():
  # On-policy (ratio 1), REINFORCE with A_t = log pt - log ps summed over the tokens has the
  # gradient of -KL(ps || pt) estimated on the samples: d/dtheta sum_t A_t logp_t. With
  # the same logp as behaviour, the loss's gradient wrt logp is -A_t / (token count).
  teacher = np.log(np.array([[0.5, 0.2]]))
  student = np.log(np.array([[0.25, 0.4]]))
  mask = np.ones((1, 2), np.float32)
  adv = reverse_kl_advantages(teacher, student, mask)
  loss_fn = lambda lp: policy_loss(LossConfig(loss='ppo'), lp, jnp.asarray(student), adv,
                                   mask)[0]
  grad = jax.grad(loss_fn)(jnp.asarray(student))
  np.testing.assert_allclose(grad, -np.log([[2.0, 0.5]]) / 2, **TOL)


def test_reverse_kl_advantages_lower_the_kl_by_gradient_descent():
  # A categorical student over 6 tokens samples 64 tokens a step; the policy loss with the
  # reverse-KL advantages (behaviour = the sampling student, on-policy) is descended. The
  # exact KL(student || teacher) falls: the signal is the reverse KL's gradient.
  teacher = jnp.log(jnp.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]))
  mask = jnp.ones((1, 64))

  @jax.jit
  def step(theta, key):
    logp_all = jax.nn.log_softmax(theta)
    tokens = jax.random.categorical(key, theta, shape=(1, 64))
    behaviour = logp_all[tokens]
    adv = reverse_kl_advantages(teacher[tokens], behaviour, mask)
    loss = lambda th: policy_loss(LossConfig(loss='ppo'), jax.nn.log_softmax(th)[tokens],
                                  behaviour, adv, mask)[0]
    return theta - 1.0 * jax.grad(loss)(theta)

  kl = lambda th: float(np.sum(np.exp(jax.nn.log_softmax(th)) * (jax.nn.log_softmax(th)
                                                                 - teacher)))
  theta = jnp.array([0.0, 0.0, 0.0, 0.0, 3.0, 3.0])
  before = kl(theta)
  for key in jax.random.split(jax.random.key(0), 60):
    theta = step(theta, key)
  assert before > 2.0 and kl(theta) < 0.1 * before, (before, kl(theta))


def test_reverse_kl_advantages_refuse_mismatched_shapes():
  with pytest.raises(AssertionError):
    reverse_kl_advantages(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))


@pytest.mark.parametrize('fields, message', [
    (dict(kind='kl'), r"distill.kind='kl' is not valid"),
    (dict(beta=1.5), r'distill.beta=1.5 must be a number in \[0, 1\]'),
    (dict(weight=-1.0), r'distill.weight=-1.0 must be a finite number >= 0'),
    (dict(kind='gkd', top_k=0), r"distill.top_k=0 with distill.kind='gkd'"),
    (dict(top_k=-2), r'distill.top_k=-2 must be an int >= 0'),
    (dict(kind='reverse_kl', weight=0.0, with_reward=False), r'trains on nothing'),
    (dict(kind='gkd', top_k=4, tail=1), r'distill.tail=1 must be True or False'),
    (dict(kind='reverse_kl', tail=True), r"distill.tail=True with distill.kind='reverse_kl'"),
])
def test_distill_config_refuses(fields, message):
  with pytest.raises(ValueError, match=message):
    DistillConfig(**fields)


def test_distill_config_defaults_off():
  assert not DistillConfig().enabled
  assert DistillConfig(kind='gkd', top_k=20, beta=0.0).enabled
