"""Tests for M2PO (arXiv 2510.01161): ``m2po_mask``, the candidates, and the three variants.

The mask is checked against ``np_reference.m2po_mask_loop``, a literal transcription of the
paper's Algorithm 1 (drop the current largest (log r)^2 while the mean exceeds tau), and by
properties; the variants against their NumPy references and by the on-policy limit.
"""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import np_reference as ref
from loss_api import call

from rlax_llm.losses import m2po_mask, m2po_trust_region_candidates
from rlax_llm.losses.policy import M2PO_VARIANTS

jit_mask = jax.jit(m2po_mask)


@functools.cache
def jitted_m2po(variant, tau=0.04):
  return jax.jit(functools.partial(call, 'm2po', m2po_variant=variant, m2po_tau=tau))


# ---------------------------------------------------------------------------------------------
# m2po_mask.


def test_mask_hand_case():
  # (log r)^2 = .09, .01, .04, .0025; mean .035625. tau = .02: drop .09 -> .0525 / 3 = .0175
  # <= .02, stop. tau = .04: keep all. tau = .005: drop .09, .04 (-> .00625), .01 -> .0025.
  log_r = jnp.array([0.3, 0.1, -0.2, 0.05])
  mask = jnp.ones(4, bool)
  np.testing.assert_array_equal(jit_mask(log_r, mask, 0.02), [False, True, True, True])
  np.testing.assert_array_equal(jit_mask(log_r, mask, 0.04), [True, True, True, True])
  np.testing.assert_array_equal(jit_mask(log_r, mask, 0.005), [False, False, False, True])
  np.testing.assert_array_equal(jit_mask(log_r, mask, 1e-4), [False, False, False, False])
  # Non-candidates are never kept and do not count: without token 0, .0525 / 3 <= .02.
  np.testing.assert_array_equal(jit_mask(log_r, jnp.array([0, 1, 1, 1]), 0.02),
                                [False, True, True, True])
  # The default tau is 0.04.
  np.testing.assert_array_equal(m2po_mask(log_r, mask), [True, True, True, True])


def test_mask_pools_the_whole_batch_and_breaks_ties_by_position():
  # 2-D input is one pool: the two 0.5s in different rows compete. Squares: .25, .25, 0, 0 with
  # tau = .1: keeping one .25 gives mean .25 / 3 = .083 <= .1; keeping both 0.5 / 4 > .1.
  # Ties: the earlier token is kept.
  log_r = jnp.array([[0.0, 0.5], [-0.5, 0.0]])
  kept = jit_mask(log_r, jnp.ones((2, 2)), 0.1)
  np.testing.assert_array_equal(kept, [[True, True], [False, True]])
  np.testing.assert_array_equal(kept, ref.m2po_mask_loop(log_r, np.ones((2, 2)), 0.1))


@pytest.mark.parametrize('tau', [0.005, 0.04, 0.2])
@pytest.mark.parametrize('seed', range(4))
def test_mask_matches_literal_loop_on_random_inputs(seed, tau):
  rng = np.random.RandomState(seed)
  log_r = rng.normal(0.0, 0.3, (6, 9)).astype(np.float32)
  mask = rng.rand(6, 9) < 0.7
  kept = np.asarray(jit_mask(log_r, mask, tau))
  want = ref.m2po_mask_loop(log_r, mask, tau)
  np.testing.assert_array_equal(kept, want)
  if tau < 0.2:
    assert (mask & ~want).any()  # something is dropped


# Log-ratios on a grid of sixteenths: squares and their sums are exact in float32, and the
# thresholds are dyadic (or 0.04, which no mean of k / 256 over <= 24 tokens equals), so the
# library's float32 and the loop's float64 comparisons agree exactly, ties with tau included.
_grid = st.integers(-12, 12).map(lambda k: k / 16.0)
_taus = st.sampled_from([1 / 64, 1 / 32, 1 / 16, 1 / 4, 0.04])
_grid_case = st.tuples(st.lists(_grid, min_size=24, max_size=24),
                       st.lists(st.booleans(), min_size=24, max_size=24), _taus)


@settings(max_examples=50, deadline=None)
@given(_grid_case)
def test_mask_properties_on_exact_grid(case):
  values, candidates, tau = case
  log_r = np.array(values, np.float32).reshape(3, 8)
  mask = np.array(candidates).reshape(3, 8)
  kept = np.asarray(jit_mask(log_r, mask, tau))
  m2 = np.square(log_r.astype(np.float64))
  # Literal Algorithm 1.
  np.testing.assert_array_equal(kept, ref.m2po_mask_loop(log_r, mask, tau))
  # Never outside the candidates.
  assert not (kept & ~mask).any()
  # The kept set is within the budget (or empty) ...
  assert not kept.any() or m2[kept].mean() <= tau
  dropped = mask & ~kept
  if dropped.any():
    # ... only the largest values are dropped ...
    assert not kept.any() or m2[dropped].min() >= m2[kept].max()
    # ... and no more than needed: keeping the smallest dropped one would exceed tau.
    smallest = m2[dropped].min()
    assert (m2[kept].sum() + smallest) / (kept.sum() + 1) > tau


_floats = st.floats(-2.0, 2.0, allow_nan=False, allow_subnormal=False, width=32)


@settings(max_examples=50, deadline=None)
@given(st.lists(_floats, min_size=24, max_size=24),
       st.lists(st.booleans(), min_size=24, max_size=24),
       st.floats(1e-4, 0.5, allow_nan=False))
def test_mask_properties_on_arbitrary_floats(values, candidates, tau):
  log_r = np.array(values, np.float32).reshape(4, 6)
  mask = np.array(candidates).reshape(4, 6)
  kept = np.asarray(jit_mask(log_r, mask, tau))
  assert not (kept & ~mask).any()
  m2 = np.square(log_r.astype(np.float64))
  if kept.any():  # float32 sums: a relative 1e-5 slack
    assert m2[kept].mean() <= tau * (1 + 1e-5) + 1e-12
  dropped = mask & ~kept
  if dropped.any() and kept.any():
    # The order is the library's own float32 square; ties may go either way by position.
    m2_32 = np.square(log_r)
    assert m2_32[dropped].min() >= m2_32[kept].max()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=24, max_size=24), _taus)
def test_mask_keeps_every_candidate_when_log_ratios_are_zero(candidates, tau):
  mask = np.array(candidates).reshape(3, 8)
  np.testing.assert_array_equal(jit_mask(np.zeros((3, 8), np.float32), mask, tau), mask)


@settings(max_examples=25, deadline=None)
@given(_grid_case, _taus)
def test_larger_tau_keeps_a_superset(case, tau2):
  values, candidates, tau1 = case
  log_r = np.array(values, np.float32).reshape(3, 8)
  mask = np.array(candidates).reshape(3, 8)
  lo, hi = sorted((tau1, tau2))
  kept_lo = np.asarray(jit_mask(log_r, mask, lo))
  kept_hi = np.asarray(jit_mask(log_r, mask, hi))
  assert not (kept_lo & ~kept_hi).any()


def test_mask_has_no_gradient_path():
  g = jax.grad(lambda lr: jnp.sum(m2po_mask(lr, jnp.ones(3), 0.01) * lr))(jnp.array(
      [0.3, 0.01, -0.02]))
  # Only the product's own factor lr flows: the mask itself is a constant.
  np.testing.assert_array_equal(g, [0.0, 1.0, 1.0])


def test_trust_region_candidates():
  # (A > 0 and log r > 0) or (A < 0 and log r < 0), on loss tokens only.
  log_r = jnp.array([[0.1, -0.1, 0.1, -0.1, 0.0, 0.2]])
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0]])
  mask = jnp.array([[1, 1, 1, 1, 1, 0]])
  np.testing.assert_array_equal(m2po_trust_region_candidates(log_r, adv, mask),
                                [[True, False, False, True, False, False]])


# ---------------------------------------------------------------------------------------------
# The variants.

# One row, A = 1, log r = .3, .1, -.2, .05, tau = .02 (r = e^.3, e^.1, e^-.2, e^.05):
# paper: candidates are the log r > 0 tokens 0, 1, 3 (m2 .09, .01, .0025, mean .0342 > .02);
#   dropping .09 leaves .00625. Loss -(e^.1 + e^-.2 + e^.05) / 4 (all 4 loss tokens count).
# areal: all 4 are candidates (mean .035625); dropping .09 leaves .0175 <= .02. Loss
#   -(e^.1 + e^-.2 + e^.05) / 3 (the kept tokens).
# adaptive_clip: same kept set, delta = .2; token 0's ratio e^.3 is clipped to e^.2.
#   Loss -(e^.2 + e^.1 + e^-.2 + e^.05) / 4.
_S = np.exp(0.1) + np.exp(-0.2) + np.exp(0.05)
HAND = {
    'paper': (-_S / 4, 0.25, 3 / 4, (0.09 + 0.01 + 0.0025) / 3, (0.01 + 0.0025) / 2),
    'areal': (-_S / 3, 0.25, 1.0, 0.1425 / 4, 0.0525 / 3),
    'adaptive_clip': (-(np.exp(0.2) + _S) / 4, 0.25, 1.0, 0.1425 / 4, 0.0525 / 3),
}


@pytest.mark.parametrize('variant', M2PO_VARIANTS)
def test_variants_hand_case(variant):
  log_r = np.array([[0.3, 0.1, -0.2, 0.05]])
  logp = np.full((1, 4), -1.0)
  loss, d = jitted_m2po(variant, 0.02)(logp, logp - log_r, np.ones(1), np.ones((1, 4)))
  want_loss, masked, candidates, m2_before, m2_after = HAND[variant]
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(d['m2po/masked_fraction'], masked, rtol=1e-6)
  np.testing.assert_allclose(d['m2po/candidate_fraction'], candidates, rtol=1e-6)
  np.testing.assert_allclose(d['m2po/m2_before'], m2_before, rtol=1e-5)
  np.testing.assert_allclose(d['m2po/m2_after'], m2_after, rtol=1e-5)
  # The reference agrees with the hand arithmetic.
  np.testing.assert_allclose(ref.M2PO_LOSSES[variant](logp, logp - log_r, np.ones(1),
                                                      np.ones((1, 4)), tau=0.02), want_loss,
                             rtol=1e-6)


@pytest.mark.parametrize('tau', [0.01, 0.04, 0.3])
@pytest.mark.parametrize('variant', M2PO_VARIANTS)
def test_variants_match_numpy_reference(variant, tau):
  for seed in (30, 31):
    x = ref.make_inputs(seed, batch=8, length=9, zero_row=2, per_token_adv=True)
    loss, d = jitted_m2po(variant, tau)(x['logp'], x['behaviour'], x['adv'], x['mask'])
    want = ref.M2PO_LOSSES[variant](x['logp'], x['behaviour'], x['adv'], x['mask'], tau=tau)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    # masked_fraction: dropped candidates (paper, areal) or clipped tokens (adaptive_clip).
    m = x['mask'] > 0
    log_r = ref.f64(x['logp']) - x['behaviour']
    adv = np.broadcast_to(ref.f64(x['adv'])[:, None] if x['adv'].ndim == 1 else x['adv'],
                          m.shape)
    if variant == 'adaptive_clip':
      delta = ref.m2po_adaptive_delta(x['logp'], x['behaviour'], m, tau)
      removed = ((adv > 0) & (log_r > delta)) | ((adv < 0) & (log_r < -delta))
    else:
      cand = (ref.m2po_paper_candidates(x['logp'], x['behaviour'], x['adv'], m)
              if variant == 'paper' else m)
      removed = cand & ~ref.m2po_mask_loop(log_r, cand, tau)
    np.testing.assert_allclose(d['m2po/masked_fraction'], removed[m].mean(), rtol=1e-6)


@pytest.mark.parametrize('variant', ['paper', 'areal'])
def test_masking_variants_analytic_gradient(variant):
  # d loss / d logp = -r A / N on kept (paper: and non-candidate) tokens, 0 on dropped ones;
  # N = loss tokens (paper) or kept tokens (areal).
  x = ref.make_inputs(32, zero_row=0, per_token_adv=True)
  fn = lambda lp: jitted_m2po(variant)(lp, x['behaviour'], x['adv'], x['mask'])[0]
  grad = np.asarray(jax.jit(jax.grad(fn))(x['logp']))
  m = x['mask'] > 0
  log_r = ref.f64(x['logp']) - x['behaviour']
  if variant == 'paper':
    cand = ref.m2po_paper_candidates(x['logp'], x['behaviour'], x['adv'], m)
    contributes = m & ~(cand & ~ref.m2po_mask_loop(log_r, cand, 0.04))
    n = m.sum()
  else:
    contributes = ref.m2po_mask_loop(log_r, m, 0.04)
    n = contributes.sum()
  assert (m & ~contributes).any()
  want = np.where(contributes, -np.exp(log_r) * x['adv'] / n, 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_adaptive_clip_gradient_of_the_token_that_sets_delta():
  # Two tokens, tau large (nothing dropped): delta = max |log r| = 0.1, bounds [e^-.1, e^.1].
  # Neither ratio is outside the bounds, so both keep their PPO gradient -r A / 2:
  # (-e^.1 / 2, -e^-.05 / 2). The library gives token 0 (r = e^.1 = the bound) 0.75 of it.
  logp = jnp.array([[-1.0, -2.0]])
  behaviour = logp - jnp.array([[0.1, -0.05]])
  fn = lambda lp: jitted_m2po('adaptive_clip', 1.0)(lp, behaviour, jnp.ones(1),
                                                    jnp.ones((1, 2)))[0]
  grad = jax.grad(fn)(logp)
  np.testing.assert_allclose(grad, [[-np.exp(0.1) / 2, -np.exp(-0.05) / 2]], rtol=1e-5)


def test_adaptive_clip_analytic_gradient_on_random_inputs():
  # PPO gradient with the (detached) bounds [e^-delta, e^delta]: -r A / N unless the ratio is
  # outside the bounds on the side where the clip bites.
  x = ref.make_inputs(33, zero_row=0, per_token_adv=True)
  fn = lambda lp: jitted_m2po('adaptive_clip')(lp, x['behaviour'], x['adv'], x['mask'])[0]
  grad = np.asarray(jax.jit(jax.grad(fn))(x['logp']))
  m = x['mask'] > 0
  log_r = ref.f64(x['logp']) - x['behaviour']
  delta = ref.m2po_adaptive_delta(x['logp'], x['behaviour'], m)
  adv = ref.f64(x['adv'])
  clipped = ((adv > 0) & (log_r > delta)) | ((adv < 0) & (log_r < -delta))
  assert (clipped & m).any()
  want = np.where(m & ~clipped, -np.exp(log_r) * adv / m.sum(), 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# On-policy data: r == 1, so M2PO must be the plain token-mean policy gradient.


def _on_policy_case(seed):
  rng = np.random.RandomState(seed)
  logp = -rng.uniform(0.05, 3.0, (5, 7)).astype(np.float32)
  adv = rng.normal(size=(5, 7)).astype(np.float32)
  mask = (rng.rand(5, 7) < 0.6).astype(np.float32)
  mask[1] = 0.0
  return logp, adv, mask


@pytest.mark.parametrize('variant', M2PO_VARIANTS)
def test_on_policy_value_equals_token_mean_advantage_and_masks_nothing(variant):
  for seed in (40, 41):
    logp, adv, mask = _on_policy_case(seed)
    loss, d = jitted_m2po(variant)(logp, logp, adv, mask)
    np.testing.assert_allclose(loss, -ref.token_mean(adv, mask), rtol=1e-5, atol=1e-7)
    assert float(d['m2po/masked_fraction']) == 0.0
    assert float(d['clip_fraction']) == 0.0
    assert float(d['m2po/m2_after']) == 0.0


@pytest.mark.parametrize('variant', M2PO_VARIANTS)
def test_on_policy_gradient_equals_token_mean_policy_gradient(variant):
  # d/dlogp of -token-mean(A * logp) = -A / N on loss tokens.
  logp, adv, mask = _on_policy_case(42)
  fn = lambda lp: jitted_m2po(variant)(lp, jax.lax.stop_gradient(lp), adv, mask)[0]
  grad = np.asarray(jax.jit(jax.grad(fn))(logp))
  want = np.where(mask > 0, -adv / mask.sum(), 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)
  # The same as the gradient of the plain token-mean surrogate, taken by JAX.
  pg = jax.grad(lambda lp: -jnp.sum(adv * lp * mask) / jnp.sum(mask))(jnp.asarray(logp))
  np.testing.assert_allclose(grad, pg, rtol=1e-5, atol=1e-8)
