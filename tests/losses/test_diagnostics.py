"""Tests for rlax_llm.losses.diagnostics and the diagnostics every policy loss reports."""

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

from rlax_llm.losses import diagnostics as D
from rlax_llm.losses import mismatch_diagnostics, ratio_diagnostics
from rlax_llm.losses.policy import LOSSES, M2PO_VARIANTS

CONFIGS = {name: (name, ()) for name in LOSSES if name != 'm2po'}
CONFIGS.update({f'm2po-{v}': ('m2po', (('m2po_variant', v),)) for v in M2PO_VARIANTS})


@functools.cache
def jitted(key, **kwargs):
  name, static = CONFIGS[key]
  return jax.jit(functools.partial(call, name, **dict(static), **kwargs))


def np_clipped(key, logp, old_logp, adv, mask, tau=0.04):
  """Tokens whose gradient (or, for CISPO, weight) the algorithm's clip or mask removes."""
  logp, old_logp, mask = ref.f64(logp), ref.f64(old_logp), mask > 0
  adv = np.broadcast_to(ref.f64(adv)[:, None] if np.ndim(adv) == 1 else adv, logp.shape)
  log_r = logp - old_logp
  ratio = np.exp(log_r)
  pushes_up, pushes_down = adv > 0, adv < 0
  if key in ('ppo', 'grpo', 'drgrpo', 'reinforce_pp', 'dapo'):
    hi = 1.28 if key == 'dapo' else 1.2
    return (pushes_up & (ratio > hi)) | (pushes_down & (ratio < 0.8))
  if key == 'gspo':
    s = ref.gspo_sequence_ratio(logp, old_logp, mask)[:, None]
    return (pushes_up & (s > 1 + 4e-4)) | (pushes_down & (s < 1 - 3e-4))
  if key == 'cispo':
    return ratio > 1.28
  if key in ('reinforce', 'rloo'):
    return np.zeros(logp.shape, bool)
  if key == 'm2po-adaptive_clip':
    delta = ref.m2po_adaptive_delta(logp, old_logp, mask, tau)
    return (pushes_up & (log_r > delta)) | (pushes_down & (log_r < -delta))
  cand = (ref.m2po_paper_candidates(logp, old_logp, adv, mask) if key == 'm2po-paper' else mask)
  return cand & ~ref.m2po_mask_loop(log_r, cand, tau)


# M2PO refuses a recomputed proximal policy (old_logprobs='recompute'; see LossConfig).
CASES = [(key, with_old) for key in sorted(CONFIGS) for with_old in (False, True)
         if not (with_old and key.startswith('m2po'))]


@pytest.mark.parametrize('key, with_old_logp', CASES)
def test_policy_loss_diagnostics_match_numpy(key, with_old_logp):
  x = ref.make_inputs(50, batch=8, length=9, zero_row=3)
  m = x['mask'] > 0
  # behaviour_logp is the rollout engine's; the ratio's proximal policy is old_logp if given.
  if with_old_logp:
    _, d = jitted(key)(x['logp'], x['rollout'], x['adv'], x['mask'], old_logp=x['behaviour'])
    proximal, trainer = x['behaviour'], x['behaviour']
  else:
    _, d = jitted(key)(x['logp'], x['rollout'], x['adv'], x['mask'])
    proximal, trainer = x['rollout'], x['logp']
  log_r = (ref.f64(x['logp']) - proximal)[m]
  want = {
      'is/ratio_mean': np.exp(log_r).mean(),
      'is/ratio_max': np.exp(log_r).max(),
      'is/ratio_min': np.exp(log_r).min(),
      'is/m2': np.mean(log_r ** 2),
      'advantage/mean': np.broadcast_to(x['adv'][:, None], m.shape)[m].mean(),
      'clip_fraction': np_clipped(key, x['logp'], proximal, x['adv'], x['mask'])[m].mean(),
  }
  d_logp = np.abs(ref.f64(trainer) - x['rollout'])[m]
  want.update({
      'mismatch/max_abs_dlogp': d_logp.max(),
      'mismatch/p95_abs_dlogp': ref.nearest_rank_quantile(d_logp, 0.95),
      'mismatch/logp_corr': np.corrcoef(ref.f64(trainer)[m], x['rollout'][m])[0, 1],
      'mismatch/kl': ref.mismatch_kl(trainer, x['rollout'], x['mask']),
      'mismatch/ess_fraction': ess_fraction(ref.f64(trainer)[m] - x['rollout'][m]),
  })
  if key.startswith('m2po'):
    log_r_all = ref.f64(x['logp']) - proximal
    cand = (ref.m2po_paper_candidates(x['logp'], proximal, x['adv'], m) if key == 'm2po-paper'
            else m)
    kept = ref.m2po_mask_loop(log_r_all, cand, 0.04)
    want['m2po/m2_before'] = np.mean(log_r_all[cand] ** 2)
    want['m2po/m2_after'] = np.mean(log_r_all[kept] ** 2)
    want['m2po/candidate_fraction'] = cand[m].mean()
    assert d['m2po/m2_after'] <= 0.04
    assert want['m2po/m2_before'] > 0.04  # the mask had work to do
  for k, v in want.items():
    np.testing.assert_allclose(d[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  assert 0.0 < want['mismatch/logp_corr'] < 1.0
  if key not in ('reinforce', 'rloo'):
    assert 0.0 < want['clip_fraction'] < 1.0, 'the inputs make the clip act on some tokens'
  # Nothing else is reported silently without a test.
  extra = set(d) - set(want) - {'m2po/masked_fraction'}
  assert not extra, extra


def test_diagnostics_carry_no_gradient():
  x = ref.make_inputs(51)
  for key in ('grpo', 'm2po-paper'):
    fn = jitted(key)
    grads = jax.grad(lambda lp, fn=fn: sum(fn(lp, x['behaviour'], x['adv'], x['mask'])[1]
                                           .values()))(x['logp'])
    np.testing.assert_array_equal(grads, 0.0)


@pytest.mark.parametrize('key', sorted(CONFIGS))
def test_diagnostics_are_finite_and_zero_with_an_all_zero_mask(key):
  x = ref.make_inputs(52)
  zero = np.zeros_like(x['mask'])
  old = None if key.startswith('m2po') else x['behaviour']
  loss, d = jitted(key)(x['logp'], x['rollout'], x['adv'], zero, old_logp=old)
  assert float(loss) == 0.0
  for k, v in d.items():
    assert float(v) == 0.0, k


# ---------------------------------------------------------------------------------------------
# The masked statistics themselves.

jit_quantile = jax.jit(D.masked_quantile, static_argnums=2)


@pytest.mark.parametrize('q', [0.05, 0.5, 0.95, 0.99, 1.0])
def test_masked_quantile_is_nearest_rank(q):
  rng = np.random.RandomState(53)
  for n in (1, 2, 3, 7, 19, 20, 21, 40, 60, 100):
    x = rng.normal(size=(10, 12)).astype(np.float32)
    mask = np.zeros(120, bool)
    mask[rng.choice(120, n, replace=False)] = True
    mask = mask.reshape(10, 12)
    got = jit_quantile(x, mask, q)
    np.testing.assert_allclose(got, np.quantile(x[mask], q, method='inverted_cdf'), rtol=1e-6,
                               err_msg=f'n={n}')


def test_masked_quantile_hand_case():
  # Sorted 1..20: the 0.95 nearest-rank quantile is the ceil(0.95 * 20) = 19th value, 19;
  # with 10 values, the ceil(9.5) = 10th, i.e. the max.
  x = jnp.arange(20.0, 0.0, -1.0)
  np.testing.assert_allclose(D.masked_quantile(x, jnp.ones(20), 0.95), 19.0)
  np.testing.assert_allclose(D.masked_quantile(x, jnp.arange(20) < 10, 0.95), 20.0)
  assert float(D.masked_quantile(x, jnp.zeros(20), 0.95)) == 0.0


@settings(max_examples=30, deadline=None)
# No subnormals: XLA on CPU flushes them to zero.
@given(st.lists(st.tuples(st.floats(-100, 100, allow_nan=False, allow_subnormal=False,
                                    width=32), st.booleans()),
                min_size=16, max_size=16), st.sampled_from([0.1, 0.5, 0.9, 0.95]))
def test_masked_quantile_matches_numpy_on_random_values(pairs, q):
  x = np.array([p[0] for p in pairs], np.float32)
  mask = np.array([p[1] for p in pairs])
  got = float(jit_quantile(x, mask, q))
  want = np.quantile(x[mask], q, method='inverted_cdf') if mask.any() else 0.0
  assert got == want


def test_masked_correlation_and_extrema():
  rng = np.random.RandomState(54)
  x = rng.normal(size=(4, 9)).astype(np.float32)
  y = (0.6 * x + 0.8 * rng.normal(size=(4, 9))).astype(np.float32)
  mask = rng.rand(4, 9) < 0.7
  np.testing.assert_allclose(D.masked_correlation(x, y, mask),
                             np.corrcoef(x[mask], y[mask])[0, 1], rtol=1e-5)
  np.testing.assert_allclose(D.masked_max(x, mask), x[mask].max())
  np.testing.assert_allclose(D.masked_min(x, mask), x[mask].min())
  # A constant side, a single token and an empty mask all give 0, never NaN.
  assert float(D.masked_correlation(x, jnp.ones_like(x), mask)) == 0.0
  one = np.zeros_like(mask)
  one[0, 0] = True
  assert float(D.masked_correlation(x, y, one)) == 0.0
  empty = np.zeros_like(mask)
  for fn in (D.masked_max, D.masked_min):
    assert float(fn(x, empty)) == 0.0


def ess_fraction(log_w):
  """Kong's effective sample size of weights ``exp(log_w)``, over their number."""
  w = np.exp(np.asarray(log_w, np.float64))
  return w.sum() ** 2 / (w.size * np.sum(w ** 2))


def test_ratio_and_mismatch_diagnostics_functions():
  x = ref.make_inputs(55, zero_row=1)
  m = x['mask'] > 0
  log_r = ref.f64(x['logp']) - x['behaviour']
  d = ratio_diagnostics(jnp.asarray(log_r, jnp.float32), m, prefix='p')
  np.testing.assert_allclose(d['p/ratio_mean'], np.exp(log_r[m]).mean(), rtol=1e-5)
  np.testing.assert_allclose(d['p/m2'], np.mean(log_r[m] ** 2), rtol=1e-5)
  d = mismatch_diagnostics(x['logp'], x['rollout'], m)
  # KL(rollout || trainer) by k3 on rollout samples: mean of e^(t - r) - 1 - (t - r) >= 0.
  t, r = ref.f64(x['logp'])[m], ref.f64(x['rollout'])[m]
  np.testing.assert_allclose(d['mismatch/kl'], np.mean(np.exp(t - r) - 1 - (t - r)),
                             rtol=1e-5)
  assert float(d['mismatch/kl']) > 0
  np.testing.assert_allclose(d['mismatch/ess_fraction'], ess_fraction(t - r), rtol=1e-5)
  assert 0 < float(d['mismatch/ess_fraction']) < 1
  # By hand: weights 1 and 3 on the two masked tokens: (1 + 3)^2 / (2 * (1 + 9)) = 0.8; the
  # unmasked token's weight (e^5) is left out.
  hand = mismatch_diagnostics(jnp.log(jnp.array([[1.0, 3.0, 148.0]])), jnp.zeros((1, 3)),
                              jnp.array([[True, True, False]]))
  np.testing.assert_allclose(hand['mismatch/ess_fraction'], 0.8, rtol=1e-6)
  # Identical log-probs: no mismatch, correlation 1, every token counts fully.
  d = mismatch_diagnostics(x['logp'], x['logp'], m)
  np.testing.assert_allclose(d['mismatch/ess_fraction'], 1.0, rtol=1e-6)
  assert float(d['mismatch/kl']) == 0.0 and float(d['mismatch/max_abs_dlogp']) == 0.0
  np.testing.assert_allclose(d['mismatch/logp_corr'], 1.0, rtol=1e-5)
  # With no masked token every statistic is 0.
  for v in {**mismatch_diagnostics(x['logp'], x['rollout'], np.zeros_like(m)),
            **ratio_diagnostics(jnp.asarray(log_r), np.zeros_like(m))}.values():
    assert float(v) == 0.0


def test_log_ratio_histogram_matches_numpy_and_clips_into_the_end_bins():
  rng = np.random.default_rng(0)
  log_ratio = rng.normal(0.0, 0.6, size=(4, 32)).astype(np.float32)
  log_ratio[0, :3] = [-5.0, 7.0, 1.0]  # beyond the range, and the top edge itself
  mask = rng.random((4, 32)) < 0.7
  mask[0, :3] = True
  got = np.asarray(D.log_ratio_histogram(jnp.asarray(log_ratio), jnp.asarray(mask)))
  edges = np.asarray(D.LOG_RATIO_BIN_EDGES)
  counts, _ = np.histogram(np.clip(log_ratio[mask], edges[0], edges[-1]), bins=edges)
  np.testing.assert_allclose(got, counts / mask.sum(), rtol=1e-6)
  assert got.shape == (40,) and got.sum() == pytest.approx(1.0)
  n = mask.sum()
  assert got[0] * n >= 1 and got[-1] * n >= 2  # -5 in the first bin; 7 and 1 in the last
  empty = D.log_ratio_histogram(jnp.asarray(log_ratio), jnp.zeros((4, 32), bool))
  assert not np.any(np.asarray(empty))
