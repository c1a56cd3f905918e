"""Tests for rlax_llm.losses.policy: every named loss and the shared options, against NumPy.

Expected values come from ``np_reference`` (float64, written from each paper's formula) or from
hand arithmetic in comments; the library is never used to compute them. M2PO-specific tests
(the mask, its variants' properties) are in ``test_m2po.py``; diagnostics in
``test_diagnostics.py``.
"""

import dataclasses
import functools
import pathlib
import re
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

from rlax_llm.losses import components
from rlax_llm.losses.kl import kl_penalty
from rlax_llm.losses import LossConfig, MismatchConfig, policy_loss
from rlax_llm.losses.policy import LOSSES, M2PO_VARIANTS

# Every named loss, the three M2PO variants separately: key -> (name, static options).
CONFIGS = {name: (name, ()) for name in LOSSES if name != 'm2po'}
CONFIGS.update({f'm2po-{v}': ('m2po', (('m2po_variant', v),)) for v in M2PO_VARIANTS})
ALL = sorted(CONFIGS)
# LossConfig refuses old_logprobs='recompute' with M2PO (its M2 would be identically 0), so
# the recomputed proximal policy (old_logp) and the mismatch correction apply to the others.
RECOMPUTE = [key for key in ALL if CONFIGS[key][0] != 'm2po']
PG_LIKE = ('cispo', 'reinforce', 'rloo')  # sg[coefficient] * A * logp objectives


def test_configs_cover_every_named_loss():
  assert set(LOSSES) == {'ppo', 'grpo', 'dapo', 'drgrpo', 'gspo', 'cispo', 'reinforce', 'rloo',
                         'reinforce_pp', 'm2po'}
  assert set(M2PO_VARIANTS) == {'paper', 'areal', 'adaptive_clip'}
  assert {name for name, _ in CONFIGS.values()} == set(LOSSES)


@functools.cache
def jitted(name, static):
  opts = dict(static)
  return jax.jit(lambda logp, behaviour, adv, mask, **arrays: call(
      name, logp, behaviour, adv, mask, **arrays, **opts))


def run(key, logp, behaviour, adv, mask, static=(), **arrays):
  name, base = CONFIGS[key]
  return jitted(name, base + tuple(static))(logp, behaviour, adv, mask, **arrays)


_REF_KWARGS = {'m2po_variant': 'variant', 'm2po_tau': 'tau', 'max_length': 'max_length',
               'kl_beta': 'kl_beta', 'kl_estimator': 'kl_estimator'}


def expected(key, logp, behaviour, adv, mask, static=(), old_logp=None, ref_logp=None):
  name, base = CONFIGS[key]
  kwargs = {}
  for k, v in base + tuple(static):
    if k == 'mismatch':
      kwargs['mismatch'] = dataclasses.asdict(v)
    else:
      kwargs[_REF_KWARGS[k]] = v
  return ref.policy_loss(name, logp, behaviour, adv, mask, old_logp=old_logp, ref_logp=ref_logp,
                         **kwargs)


def args(x):
  return x['logp'], x['behaviour'], x['adv'], x['mask']


@pytest.fixture
def x64():
  """float64 inside the test only; the global flag is restored afterwards."""
  with jax.enable_x64(True):
    yield


# ---------------------------------------------------------------------------------------------
# Hand-computed cases.

# Ratios r = exp(logp) against behaviour 0; row 0 A = 1, row 1 A = -2, row 2 A = 0.5.
HAND_RATIOS = np.array([[1.5, 0.5, 1.0, 9.0], [0.9, 1.3, 7.0, 0.1], [1.1, 0.7, 1.25, 0.95]])
HAND_MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
HAND_ADV = np.array([1.0, -2.0, 0.5], np.float32)

# Per-token min(rA, clip(r, 0.8, 1.2) A) on loss tokens:
#   row 0: 1.5 -> 1.2, 0.5 -> 0.5, 1.0 -> 1.0                      sum  2.7 (1 of 3 clipped)
#   row 1: 0.9 -> min(-1.8, -1.8) = -1.8, 1.3 -> min(-2.6, -2.4) = -2.6     sum -4.4
#   row 2: 1.1 -> .55, .7 -> min(.35, .4) = .35, 1.25 -> .6, .95 -> .475    sum 1.975
# token-mean (9 tokens) 0.275 / 9; seq-mean-token-mean (0.9 - 2.2 + 0.49375) / 3 = -0.26875;
# Dr. GRPO 0.275 / (3 * 4). DAPO (clip 0.8 .. 1.28): row 0 1.5 -> 1.28 (sum 2.78), row 1
# unchanged (-4.4), row 2 1.25 -> .625 (sum 2.0): 0.38 / 9.
HAND_EXPECTED = {
    'ppo': -0.275 / 9,
    'reinforce_pp': -0.275 / 9,
    'grpo': 0.26875,
    'drgrpo': -0.275 / 12,
    'dapo': -0.38 / 9,
}


@pytest.mark.parametrize('key', sorted(HAND_EXPECTED))
def test_ppo_family_hand_case(key):
  logp = np.log(HAND_RATIOS).astype(np.float32)
  behaviour = np.zeros_like(logp)
  loss, _ = run(key, logp, behaviour, HAND_ADV, HAND_MASK)
  assert loss.shape == () and loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, HAND_EXPECTED[key], rtol=1e-5, atol=1e-7)
  # The NumPy reference agrees with the hand arithmetic.
  np.testing.assert_allclose(expected(key, logp, behaviour, HAND_ADV, HAND_MASK),
                             HAND_EXPECTED[key], rtol=1e-6)


def test_grpo_hand_case():
  # One sequence, two loss tokens, A = 1, eps = 0.2.
  # token 0: r = 1.5 -> min(1.5, 1.2) = 1.2 (clipped); token 1: r = 0.5 -> min(0.5, 0.8) = 0.5.
  # loss = -(1.2 + 0.5) / 2 = -0.85; clip_fraction = 1/2. The third token is masked out.
  logp = jnp.log(jnp.array([[1.5, 0.5, 9.0]]))
  behaviour = jnp.zeros((1, 3))
  loss, diags = call('grpo', logp, behaviour, jnp.array([1.0]), jnp.array([[1, 1, 0]]),
                     eps_low=0.2, eps_high=0.2)
  np.testing.assert_allclose(loss, -0.85, rtol=1e-6)
  np.testing.assert_allclose(diags['clip_fraction'], 0.5)
  np.testing.assert_allclose(diags['is/ratio_max'], 1.5, rtol=1e-6)
  # eps is honoured: with eps = 0.6 nothing is clipped, -(1.5 + 0.5) / 2.
  loss, _ = call('grpo', logp, behaviour, jnp.array([1.0]), jnp.array([[1, 1, 0]]),
                 eps_low=0.6, eps_high=0.6)
  np.testing.assert_allclose(loss, -1.0, rtol=1e-6)


def test_gspo_hand_case():
  # Sequence ratios s = exp(mean log r), trust region [1 - 3e-4, 1 + 4e-4]:
  #   row 0: log r = +-0.002 -> s = 1 (inside), A = 2 -> 2;
  #   row 1: log r = 0.01, 0.03 -> s = e^0.02 > 1.0004, A = 1 -> clipped to 1.0004;
  #   row 2: log r = -0.01 (one token) -> s = e^-0.01 < 0.9997, A = -1 -> min(-s, -0.9997)
  #          = -0.9997 (the clip acts when it makes the objective smaller).
  # loss = -(2 + 1.0004 - 0.9997) / 3.
  log_r = np.array([[0.002, -0.002], [0.01, 0.03], [-0.01, 5.0]])
  mask = np.array([[1, 1], [1, 1], [1, 0]], np.float32)
  logp = np.full((3, 2), -1.0)
  loss, diags = run('gspo', logp, logp - log_r, np.array([2.0, 1.0, -1.0]), mask)
  np.testing.assert_allclose(loss, -(2.0 + 1.0004 - 0.9997) / 3, rtol=1e-5)
  # Every token of rows 1 and 2 is clipped: 3 of the 5 loss tokens.
  np.testing.assert_allclose(diags['clip_fraction'], 3 / 5, rtol=1e-6)


def test_cispo_hand_case_and_gradient():
  # logp = -1, -2 with r = 1.5, 0.5 and A = 1: weights clip(r, 0, 1.28) = 1.28, 0.5.
  # loss = -(1.28 * -1 + 0.5 * -2) / 2 = 1.14; d loss / d logp = -(1.28, 0.5) / 2: the weight
  # is a constant, so the clipped token keeps its gradient (unlike PPO).
  logp = jnp.array([[-1.0, -2.0]])
  behaviour = logp - jnp.log(jnp.array([[1.5, 0.5]]))
  fn = lambda lp: call('cispo', lp, behaviour, jnp.array([1.0]), jnp.ones((1, 2)))
  (loss, diags), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)
  np.testing.assert_allclose(loss, 1.14, rtol=1e-6)
  np.testing.assert_allclose(grad, [[-0.64, -0.25]], rtol=1e-6)
  np.testing.assert_allclose(diags['clip_fraction'], 0.5)


def test_reinforce_and_rloo_hand_case():
  # sg[r] A logp summed per sequence, averaged over the 2 non-empty sequences (row 2 is empty):
  #   row 0: r = 1, 2 (A = 1): 1 * -1 + 2 * -0.5 = -2;  row 1: r = 1 (A = -3): -3 * -2 = 6.
  # loss = -(-2 + 6) / 2 = -2.
  logp = np.array([[-1.0, -0.5], [-2.0, -7.0], [-1.0, -1.0]], np.float32)
  behaviour = logp - np.log([[1.0, 2.0], [1.0, 5.0], [1.0, 1.0]]).astype(np.float32)
  mask = np.array([[1, 1], [1, 0], [0, 0]], np.float32)
  for name in ('reinforce', 'rloo'):
    loss, _ = run(name, logp, behaviour, np.array([1.0, -3.0, 9.0]), mask)
    np.testing.assert_allclose(loss, -2.0, rtol=1e-6, err_msg=name)


def test_m2po_jitted_matches_the_reference_for_every_variant():
  x = ref.make_inputs(40)
  for variant in M2PO_VARIANTS:
    loss, _ = jax.jit(functools.partial(call, 'm2po', m2po_tau=0.05, m2po_variant=variant))(
        *args(x))
    np.testing.assert_allclose(
        loss, ref.policy_loss('m2po', *args(x), tau=0.05, variant=variant), rtol=1e-5,
        atol=1e-6, err_msg=variant)


# ---------------------------------------------------------------------------------------------
# Every named loss against its NumPy reference.


@pytest.mark.parametrize('per_token_adv', [False, True])
@pytest.mark.parametrize('key', ALL)
def test_matches_numpy_reference(key, per_token_adv):
  for seed in (0, 1, 2):
    x = ref.make_inputs(seed, zero_row=2, per_token_adv=per_token_adv)
    loss, diags = run(key, *args(x))
    assert loss.shape == () and loss.dtype == jnp.float32
    assert all(v.shape == () and v.dtype == jnp.float32 for v in diags.values())
    np.testing.assert_allclose(loss, expected(key, *args(x)), rtol=1e-5, atol=1e-6,
                               err_msg=f'seed {seed}')


@settings(max_examples=40, deadline=None)
@given(key=st.sampled_from(ALL), seed=st.integers(0, 2**31 - 1),
       density=st.sampled_from([0.2, 0.5, 0.9]))
def test_matches_numpy_reference_on_random_masks(key, seed, density):
  x = ref.make_inputs(seed % 1000)
  rng = np.random.RandomState(seed)
  mask = (rng.rand(*x['mask'].shape) < density).astype(np.float32)
  x['mask'] = mask
  loss, _ = run(key, *args(x))
  np.testing.assert_allclose(loss, expected(key, *args(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('key', ['ppo', 'grpo', 'dapo', 'drgrpo', 'gspo', 'cispo'])
def test_eps_overrides(key):
  x = ref.make_inputs(3)
  static = (('eps_low', 0.1), ('eps_high', 0.5))
  loss, _ = run(key, *args(x), static=static)
  logp, behaviour, adv, mask = args(x)
  fn = {'ppo': ref.dapo_loss, 'grpo': None, 'dapo': ref.dapo_loss, 'drgrpo': None,
        'gspo': ref.gspo_loss, 'cispo': ref.cispo_loss}[key]
  if key == 'grpo':
    ratio = np.exp(ref.f64(logp) - behaviour)
    want = -ref.seq_mean_token_mean(ref.ppo_clip(ratio, ref.f64(adv)[:, None], 0.1, 0.5), mask)
  elif key == 'drgrpo':
    ratio = np.exp(ref.f64(logp) - behaviour)
    want = -ref.seq_mean_token_sum_norm(
        ref.ppo_clip(ratio, ref.f64(adv)[:, None], 0.1, 0.5), mask)
  else:
    want = fn(logp, behaviour, adv, mask, eps_low=0.1, eps_high=0.5)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('aggregation', sorted(ref.AGGREGATIONS))
def test_aggregation_override(aggregation):
  # PPO's per-token surrogate under each aggregation.
  x = ref.make_inputs(4, zero_row=0)
  logp, behaviour, adv, mask = args(x)
  loss, _ = run('ppo', *args(x), static=(('aggregation', aggregation),))
  per_token = ref.ppo_clip(np.exp(ref.f64(logp) - behaviour), ref.f64(adv)[:, None], 0.2, 0.2)
  want = -ref.AGGREGATIONS[aggregation](per_token, mask)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)


def test_drgrpo_normaliser_is_padded_width_or_max_length():
  x = ref.make_inputs(5)
  t = x['mask'].shape[1]
  loss_default, _ = run('drgrpo', *args(x))
  loss_long, _ = run('drgrpo', *args(x), static=(('max_length', 4 * t),))
  np.testing.assert_allclose(loss_long, loss_default / 4, rtol=1e-5)
  np.testing.assert_allclose(loss_long, ref.drgrpo_loss(*args(x), max_length=4 * t),
                             rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Options: KL penalty, old_logp, mismatch correction.


# Every estimator with two aggregations; one estimator each for the other losses.
KL_CASES = ([('grpo', e) for e in ('k1', 'k2', 'k3')] + [('drgrpo', e) for e in ('k1', 'k2', 'k3')]
            + [('dapo', 'k2'), ('gspo', 'k1'), ('cispo', 'k3'), ('reinforce', 'k1'),
               ('rloo', 'k2'), ('reinforce_pp', 'k3'), ('m2po-paper', 'k3'),
               ('m2po-areal', 'k1'), ('m2po-adaptive_clip', 'k2'), ('ppo', 'k1')])


@pytest.mark.parametrize('key,estimator', KL_CASES)
def test_kl_penalty_option(key, estimator):
  x = ref.make_inputs(6, zero_row=3)
  static = (('kl_beta', 0.1), ('kl_estimator', estimator))
  loss, diags = run(key, *args(x), static=static, ref_logp=x['ref'])
  np.testing.assert_allclose(loss, expected(key, *args(x), static=static, ref_logp=x['ref']),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(diags['kl'], ref.token_mean(
      ref.kl(x['logp'], x['ref'], estimator), x['mask']), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('key', ['ppo', 'reinforce_pp'])
def test_default_kl_estimator(key):
  # REINFORCE++ uses k2 by default, the others k3.
  x = ref.make_inputs(7)
  loss, _ = run(key, *args(x), static=(('kl_beta', 0.2),), ref_logp=x['ref'])
  estimator = 'k2' if key == 'reinforce_pp' else 'k3'
  want = ref.ppo_loss(*args(x)) + 0.2 * ref.token_mean(ref.kl(x['logp'], x['ref'], estimator),
                                                       x['mask'])
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('key', RECOMPUTE)
def test_old_logp_replaces_behaviour_in_the_ratio(key):
  # old_logp is the proximal policy; behaviour_logp (far off here) only feeds the mismatch
  # diagnostics.
  x = ref.make_inputs(8)
  loss, diags = run(key, x['logp'], x['rollout'], x['adv'], x['mask'], old_logp=x['behaviour'])
  np.testing.assert_allclose(loss, expected(key, *args(x)), rtol=1e-5, atol=1e-6)
  # The ratio statistics come from old_logp too.
  log_r = (ref.f64(x['logp']) - x['behaviour'])[x['mask'] > 0]
  np.testing.assert_allclose(diags['is/m2'], np.mean(log_r ** 2), rtol=1e-5)


MISMATCHES = [
    MismatchConfig('token', 'truncate', 1.5),
    MismatchConfig('token', 'mask', 1.2),
    MismatchConfig('sequence', 'truncate', 2.0),
    MismatchConfig('sequence', 'mask', 1.2),
    MismatchConfig('token', 'truncate', 2.0, veto_threshold=0.6),
    MismatchConfig('sequence', 'mask', 5.0, veto_threshold=0.5),
]


# Every correction with GRPO; one correction each for the other losses.
MISMATCH_CASES = [('grpo', m) for m in MISMATCHES] + [
    (key, MISMATCHES[i % len(MISMATCHES)])
    for i, key in enumerate(k for k in RECOMPUTE if k != 'grpo')]


@pytest.mark.parametrize('key,mismatch', MISMATCH_CASES, ids=str)
def test_mismatch_correction(key, mismatch):
  x = ref.make_inputs(9, zero_row=5)
  logp, rollout, adv, mask = x['logp'], x['rollout'], x['adv'], x['mask']
  static = (('mismatch', mismatch),)
  loss, diags = run(key, logp, rollout, adv, mask, static=static, old_logp=x['behaviour'])
  want = expected(key, logp, rollout, adv, mask, static=static, old_logp=x['behaviour'])
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  w = ref.mismatch_weights(x['behaviour'], rollout, mask, **dataclasses.asdict(mismatch))
  np.testing.assert_allclose(diags['mismatch/weight_mean'], ref.token_mean(w, mask),
                             rtol=1e-5, atol=1e-6)
  # Kept: every loss token for TIS, w <= threshold for MIS, minus vetoed rows.
  if mismatch.mode == 'truncate':
    kept = (w > 0) | (mask == 0)
  else:
    kept = w > 0
  np.testing.assert_allclose(diags['mismatch/kept_fraction'], ref.token_mean(kept, mask),
                             rtol=1e-6)


def test_mismatch_cases_are_not_trivial():
  # The inputs above make each correction do something: some weights clipped or zeroed,
  # some rows vetoed.
  x = ref.make_inputs(9, zero_row=5)
  m = x['mask'] > 0
  raw = np.exp(ref.f64(x['behaviour']) - x['rollout'])[m]
  assert (raw > 1.5).any() and (raw < 1.5).any()
  assert (raw < 0.6).any()
  w = ref.mismatch_weights(x['behaviour'], x['rollout'], x['mask'], level='sequence',
                           mode='mask', threshold=1.2)
  assert (w[m] == 0).any() and (w[m] > 0).any()


def test_mismatch_hand_case():
  # Token TIS, threshold 2: old - rollout = log 3, log 0.5 -> weights 2 (truncated), 0.5.
  # r = 1 (logp == old), A = 1, dapo token-mean: loss = -(2 * 1 + 0.5 * 1) / 2 = -1.25.
  # With veto 0.6, the 0.5 token vetoes the whole sequence: loss 0.
  logp = np.array([[-1.0, -2.0]], np.float32)
  rollout = logp - np.log([[3.0, 0.5]]).astype(np.float32)
  mismatch = MismatchConfig('token', 'truncate', 2.0)
  dapo = lambda m: run('dapo', logp, rollout, np.ones(1), np.ones((1, 2)),
                       static=(('mismatch', m),), old_logp=logp)
  loss, d = dapo(mismatch)
  np.testing.assert_allclose(loss, -1.25, rtol=1e-6)
  np.testing.assert_allclose(d['mismatch/weight_mean'], 1.25, rtol=1e-6)
  loss, d = dapo(dataclasses.replace(mismatch, veto_threshold=0.6))
  assert float(loss) == 0.0 and float(d['mismatch/kept_fraction']) == 0.0
  # Sequence MIS, threshold 2: weight 3 * 0.5 = 1.5 for both tokens -> -1.5.
  loss, _ = dapo(MismatchConfig('sequence', 'mask', 2.0))
  np.testing.assert_allclose(loss, -1.5, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Invariances.

# Every option on at once (one compiled program per loss and shape, shared by several tests).
# Dr. GRPO's normaliser is the padded width by design, so max_length is fixed.
FULL_OPTIONS = (('kl_beta', 0.1), ('max_length', 16),
                ('mismatch', MismatchConfig('sequence', 'mask', 2.0, veto_threshold=0.5)))


def full_options(key, z):
  """``(static, arrays)``: every option, with ``old_logp`` where the loss accepts a
  recomputed proximal policy; M2PO gets the options without the mismatch correction."""
  if key in RECOMPUTE:
    return FULL_OPTIONS, {'ref_logp': z['ref'], 'old_logp': z['behaviour']}
  return tuple(o for o in FULL_OPTIONS if o[0] != 'mismatch'), {'ref_logp': z['ref']}


@pytest.mark.parametrize('key', ALL)
def test_padding_invariance(key):
  """Masked-out columns with arbitrary values change neither the loss nor the diagnostics."""
  x = ref.make_inputs(10, zero_row=1, per_token_adv=True)
  b = x['mask'].shape[0]
  extra = 4
  rng = np.random.RandomState(11)
  pad = lambda a: np.concatenate(
      [a, (30.0 * rng.normal(size=(b, extra))).astype(np.float32)], axis=1)
  padded = {k: pad(v) for k, v in x.items() if k != 'mask'}
  padded['mask'] = np.concatenate([x['mask'], np.zeros((b, extra), np.float32)], axis=1)
  outs = [run(key, z['logp'], z['rollout'], z['adv'], z['mask'], static=full_options(key, z)[0],
              **full_options(key, z)[1]) for z in (x, padded)]
  (loss, diags), (loss_p, diags_p) = outs
  np.testing.assert_allclose(loss_p, loss, rtol=1e-6, atol=1e-7)
  assert set(diags) == set(diags_p)
  for k in diags:
    np.testing.assert_allclose(diags_p[k], diags[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize('key', ALL)
def test_padding_invariance_with_per_sample_advantages(key):
  x = ref.make_inputs(10, zero_row=1)
  b, t = x['mask'].shape
  rng = np.random.RandomState(12)
  pad = lambda a: np.concatenate([a, (30.0 * rng.normal(size=(b, 3))).astype(np.float32)], 1)
  mask_p = np.concatenate([x['mask'], np.zeros((b, 3), np.float32)], axis=1)
  static = (('max_length', t),) if key == 'drgrpo' else ()
  loss, _ = run(key, *args(x))
  loss_p, _ = run(key, pad(x['logp']), pad(x['behaviour']), x['adv'], mask_p, static=static)
  np.testing.assert_allclose(loss_p, loss, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('key', ALL)
def test_row_permutation_invariance(key):
  x = ref.make_inputs(12, zero_row=4, per_token_adv=True)
  perm = np.random.RandomState(13).permutation(x['mask'].shape[0])
  permuted = {k: v[perm] for k, v in x.items()}
  (loss, diags), (loss_p, diags_p) = [
      run(key, z['logp'], z['rollout'], z['adv'], z['mask'], static=full_options(key, z)[0],
          **full_options(key, z)[1]) for z in (x, permuted)]
  np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-7)
  for k in diags:
    np.testing.assert_allclose(diags_p[k], diags[k], rtol=1e-5, atol=1e-7, err_msg=k)


# ---------------------------------------------------------------------------------------------
# Gradients.


@pytest.mark.parametrize('key', ALL)
def test_no_gradient_through_stop_gradient_inputs(key):
  """behaviour_logp, old_logp, ref_logp and advantages are detached inputs."""
  x = ref.make_inputs(14, per_token_adv=True)
  name, base = CONFIGS[key]
  opts = dict(base, kl_beta=0.1)
  if key in RECOMPUTE:
    opts['mismatch'] = MismatchConfig('token', 'truncate', 1.5)

  def loss_fn(logp, behaviour, adv, old, ref_logp):
    return call(name, logp, behaviour, adv, x['mask'], ref_logp=ref_logp, **opts,
                old_logp=old if key in RECOMPUTE else None)[0]

  grads = jax.jit(jax.grad(loss_fn, argnums=(0, 1, 2, 3, 4)))(
      x['logp'], x['rollout'], x['adv'], x['behaviour'], x['ref'])
  assert np.abs(np.asarray(grads[0])).max() > 0
  for arg, g in zip(('behaviour_logp', 'advantages', 'old_logp', 'ref_logp'), grads[1:]):
    np.testing.assert_array_equal(g, np.zeros_like(g), err_msg=arg)
  # Tokens outside the loss mask get exactly zero gradient.
  np.testing.assert_array_equal(np.asarray(grads[0])[x['mask'] == 0], 0.0)


@pytest.mark.parametrize('key', PG_LIKE)
def test_pg_gradient_is_detached_coefficient_times_advantage(key):
  # d loss / d logp_it = -c_it A_it / normaliser with c = clip(r, 0, 1.28) for CISPO
  # (token-mean: N loss tokens) and c = r for REINFORCE/RLOO (seq-mean-token-sum: G' rows).
  x = ref.make_inputs(15, zero_row=0)
  logp, behaviour, adv, mask = args(x)
  grad = jax.jit(jax.grad(lambda lp: call(key, lp, behaviour, adv, mask)[0]))(logp)
  m = mask > 0
  if key == 'cispo':
    coeff = ref.cispo_coefficient(logp, behaviour)
    assert (np.exp(ref.f64(logp) - behaviour)[m] > 1.28).any()  # some weights are clipped
    normaliser = m.sum()
  else:
    coeff = np.exp(ref.f64(logp) - behaviour)
    normaliser = m.any(axis=1).sum()
  want = np.where(m, -coeff * ref.f64(adv)[:, None] / normaliser, 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


_PPO_NORMALISER = {'ppo': 'token', 'dapo': 'token', 'reinforce_pp': 'token', 'grpo': 'seq',
                   'drgrpo': 'const'}


@pytest.mark.parametrize('key', sorted(_PPO_NORMALISER))
def test_ppo_family_analytic_gradient(key):
  # d/dlogp of -agg(min(rA, clip(r)A)) = -w_it A r (0 where the clip removes the gradient),
  # with w the aggregation weight of the token; plus beta * w * (1 - e^(ref - logp)) for k3.
  x = ref.make_inputs(16, zero_row=2)
  logp, behaviour, adv, mask = args(x)
  fn = lambda lp: call(key, lp, behaviour, adv, mask, kl_beta=0.1, ref_logp=x['ref'])[0]
  grad = np.asarray(jax.jit(jax.grad(fn))(logp))
  m = mask > 0
  ratio = np.exp(ref.f64(logp) - behaviour)
  a = ref.f64(adv)[:, None]
  hi = 1.28 if key == 'dapo' else 1.2
  clipped = ((a > 0) & (ratio > hi)) | ((a < 0) & (ratio < 0.8))
  assert clipped[m].any() and not clipped[m].all()
  kind = _PPO_NORMALISER[key]
  if kind == 'token':
    w = m / m.sum()
  elif kind == 'seq':
    w = m / np.maximum(m.sum(1), 1)[:, None] / m.any(1).sum()
  else:
    w = m / m.size
  estimator = 'k2' if key == 'reinforce_pp' else 'k3'
  d_kl = {'k3': 1.0 - np.exp(ref.f64(x['ref']) - logp), 'k2': ref.f64(logp) - x['ref']}
  want = w * (np.where(clipped, 0.0, -a * ratio) + 0.1 * d_kl[estimator])
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


FD_STEP = 2.0 ** -20  # ~1e-6; float64 evaluation


def fd_inputs(tiny_rows):
  """float64 inputs, rows >= 6 tokens long (row 3 empty, a masked token in rows 0, 2, 4).

  Only GSPO needs the near-zero rows (to be inside its trust region); for M2PO they would put
  log-ratios within a step of 0, where the paper variant's candidate set changes.
  """
  x = {k: np.asarray(v, np.float64)
       for k, v in ref.make_inputs(18, zero_row=3, tiny_rows=tiny_rows).items()}
  x['mask'] = np.ones_like(x['mask'])
  x['mask'][3] = 0.0
  x['mask'][::2, -1] = 0.0
  return x


def m2po_decisions_are_stable(x, h, tau=0.04):
  """True if no single-token step of +-h changes an M2PO candidate set or kept set."""
  mask = x['mask'] > 0

  def decisions(logp):
    candidates = ref.m2po_paper_candidates(logp, x['behaviour'], x['adv'], mask)
    log_r = logp - x['behaviour']
    kept_all = ref.m2po_mask_loop(log_r, mask, tau)
    # adaptive_clip: which token sets delta, and which tokens its clip acts on.
    delta = ref.m2po_adaptive_delta(logp, x['behaviour'], mask, tau)
    arg_delta = np.argmax(np.where(kept_all, np.abs(log_r), -1.0))
    adv = ref.f64(x['adv'])[:, None]
    clipped = ((adv > 0) & (log_r > delta)) | ((adv < 0) & (log_r < -delta))
    clipped &= ~kept_all
    return (candidates.tobytes(), ref.m2po_mask_loop(log_r, candidates, tau).tobytes(),
            kept_all.tobytes(), arg_delta, clipped.tobytes())

  base = decisions(x['logp'])
  for idx in np.ndindex(mask.shape):
    for sign in (1.0, -1.0):
      logp = x['logp'].copy()
      logp[idx] += sign * h
      if decisions(logp) != base:
        return False
  return True


@pytest.mark.parametrize('key', ALL)
def test_grad_matches_central_finite_differences(x64, key):
  """jax.grad vs central differences, one token at a time (vmapped), with float64 inputs.

  The library computes float64 inputs in float64 (``components.as_float``), so the check runs
  at float64 precision: h = 2^-20, tolerances 1e-6. The inputs keep every ratio
  >= 0.04 (in log space) from a clip edge; rows are >= 6 tokens long, so one step moves a GSPO
  sequence log-ratio by <= 1.7e-4, less than its 2e-4 margin to the trust-region edge; M2PO
  decisions do not change under the step (checked). For the sg[c] A logp objectives (CISPO,
  REINFORCE, RLOO), the value depends on logp through the detached coefficient too, so the
  difference quotient moves behaviour_logp along with logp (the ratio, hence the coefficient,
  stays fixed): the gradient of a detached-coefficient loss.
  """
  x = fd_inputs(tiny_rows=key == 'gspo')
  name, base = CONFIGS[key]
  if name == 'm2po':
    assert m2po_decisions_are_stable(x, FD_STEP)
  opts = dict(base, kl_beta=0.05)
  logp0 = x['logp']
  hold_ratio = key in PG_LIKE

  def loss_fn(lp):
    behaviour = x['behaviour'] + (lp - logp0) if hold_ratio else x['behaviour']
    return call(name, lp, behaviour, x['adv'], x['mask'], ref_logp=x['ref'], **opts)[0]

  grad = np.asarray(jax.jit(jax.grad(loss_fn))(jnp.asarray(logp0)))
  assert grad.dtype == np.float64
  h = FD_STEP
  b, t = logp0.shape
  eye = np.eye(b * t).reshape(b * t, b, t)
  f = jax.jit(jax.vmap(loss_fn))
  fd = (np.asarray(f(logp0[None] + h * eye), np.float64)
        - np.asarray(f(logp0[None] - h * eye), np.float64)) / (2 * h)
  fd = fd.reshape(b, t)
  if key == 'm2po-adaptive_clip':
    # delta = max |log r| over the kept tokens is a detached statistic: moving the token that
    # sets it moves the clip bounds in the value but not in the gradient, by design. Its own
    # gradient is checked in test_m2po.py.
    log_r = logp0 - x['behaviour']
    kept = ref.m2po_mask_loop(log_r, x['mask'] > 0, 0.04)
    sets_delta = np.unravel_index(np.argmax(np.where(kept, np.abs(log_r), -1.0)), (b, t))
    fd[sets_delta] = grad[sets_delta]
  np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)
  assert np.abs(grad).max() > 1e-2
  np.testing.assert_array_equal(grad[x['mask'] == 0], 0.0)


def test_float64_inputs_are_computed_in_float64(x64):
  # Documented (components.as_float): values are computed in at least float32, so float64
  # inputs give a float64 loss that agrees with the float32 computation to float32 accuracy.
  x32 = ref.make_inputs(17)
  x = {k: np.asarray(v, np.float64) for k, v in x32.items()}
  loss, diags = run('grpo', *args(x))
  loss32, _ = run('grpo', *args({k: np.asarray(v, np.float32) for k, v in x32.items()}))
  assert loss.dtype == jnp.float64
  np.testing.assert_allclose(loss, loss32, rtol=1e-5, atol=1e-7)
  assert all(jnp.issubdtype(v.dtype, jnp.floating) and v.dtype.itemsize >= 4
             for v in diags.values())


# ---------------------------------------------------------------------------------------------
# dtypes, degenerate inputs.


@pytest.mark.parametrize('key', ALL)
def test_bf16_inputs_under_jit(key):
  x = ref.make_inputs(18, zero_row=0)
  bf = {k: jnp.asarray(v, jnp.bfloat16) for k, v in x.items() if k != 'mask'}
  mask = x['mask'].astype(bool)
  static = (('kl_beta', 0.05),)
  loss, diags = run(key, bf['logp'], bf['behaviour'], bf['adv'], mask, static=static,
                    ref_logp=bf['ref'])
  assert loss.dtype == jnp.float32
  assert np.isfinite(float(loss)) and all(np.isfinite(v) for v in jax.tree.leaves(diags))
  # The loss casts to float32 before subtracting, so it is exact on the bf16-rounded values.
  r = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in bf.items()}
  want = expected(key, r['logp'], r['behaviour'], r['adv'], mask, static=static,
                  ref_logp=r['ref'])
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('key', ALL)
def test_all_masked_batch_gives_zero_loss_and_finite_diagnostics(key):
  x = ref.make_inputs(19, per_token_adv=True)
  zero = np.zeros_like(x['mask'])
  static, arrays = full_options(key, x)
  loss, diags = run(key, x['logp'], x['rollout'], x['adv'], zero, static=static, **arrays)
  assert float(loss) == 0.0
  for k, v in diags.items():
    assert np.isfinite(float(v)), k


@pytest.mark.parametrize('key', ALL)
def test_extreme_log_ratios_stay_finite(key):
  # A token 100 nats more likely than under the behaviour policy: exp is capped at e^20.
  logp = np.array([[-0.1, -50.0, -1.0]], np.float32)
  behaviour = np.array([[-100.1, -0.1, -1.0]], np.float32)
  loss, diags = run(key, logp, behaviour, np.array([1.0], np.float32), np.ones((1, 3)))
  assert np.isfinite(float(loss))
  assert all(np.isfinite(v) for v in jax.tree.leaves(diags))


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_mismatched_shapes_raise_clear_errors():
  x = ref.make_inputs(20)
  logp, behaviour, adv, mask = args(x)
  with pytest.raises(ValueError, match=r'behaviour_logp has shape \(6, 6\) but logp has shape '
                                       r'\(6, 7\)'):
    call('grpo', logp, behaviour[:, :-1], adv, mask)
  with pytest.raises(ValueError, match=r'loss_mask has shape \(5, 7\)'):
    call('ppo', logp, behaviour, adv, mask[:-1])
  with pytest.raises(ValueError, match=r'old_logp has shape \(6, 8\)'):
    call('ppo', logp, behaviour, adv, mask, old_logp=np.zeros((6, 8), np.float32))
  with pytest.raises(ValueError, match=r'ref_logp has shape \(7,\)'):
    call('ppo', logp, behaviour, adv, mask, kl_beta=0.1,
                ref_logp=np.zeros((7,), np.float32))
  with pytest.raises(ValueError, match=r'advantages must be \[batch\] = \(6,\) or '
                                       r'\[batch, tokens\] = \(6, 7\), got \(5,\)'):
    call('grpo', logp, behaviour, adv[:-1], mask)
  with pytest.raises(ValueError, match=r'logp must be \[batch, tokens\], got shape \(7,\)'):
    call('grpo', logp[0], behaviour[0], adv[:1], mask[0])


@pytest.mark.parametrize('knobs, message, valid', [
    (dict(loss='nope'), "loss='nope' is not valid", sorted(LOSSES)),
    (dict(loss='m2po', m2po_variant='bogus'), "m2po_variant='bogus' is not valid", M2PO_VARIANTS),
    (dict(aggregation='sum'), "aggregation='sum' is not valid", components.AGGREGATIONS),
    (dict(kl_estimator='k9'), "kl_estimator='k9' is not valid", ('k1', 'k2', 'k3')),
    (dict(advantage_estimator='ppo'), "advantage_estimator='ppo' is not valid", ('grpo',)),
    (dict(old_logprobs='fresh'), "old_logprobs='fresh' is not valid", ('behaviour', 'recompute')),
])
def test_loss_config_rejects_unknown_names_listing_the_valid_ones(knobs, message, valid):
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    LossConfig(**knobs)
  assert all(repr(v) in str(e.value) for v in valid)


@pytest.mark.parametrize('knobs, message', [
    (dict(eps_low=-0.1), 'eps_low=-0.1 must be a finite number >= 0'),
    (dict(eps_high=float('nan')), 'eps_high=nan must be a finite number >= 0'),
    (dict(kl_beta=float('inf')), 'kl_beta=inf must be a finite number >= 0'),
    (dict(kl_beta=-1.0), 'kl_beta=-1.0'),
    (dict(loss='m2po', m2po_tau=0.0), 'm2po_tau=0.0 must be a finite number > 0'),
    (dict(mismatch=MismatchConfig()), "needs old_logprobs='recompute'"),
    (dict(loss='m2po', old_logprobs='recompute'), 'M2 would be identically 0'),
])
def test_loss_config_rejects_bad_values_naming_the_field(knobs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    LossConfig(**knobs)


@pytest.mark.parametrize('knobs, message', [
    (dict(level='row'), "mismatch.level='row' is not valid; choose one of ('token', 'sequence')"),
    (dict(mode='clip'), "mismatch.mode='clip' is not valid; choose one of ('truncate', 'mask')"),
    (dict(threshold=0), 'mismatch.threshold=0 must be > 0'),
    (dict(veto_threshold=-1.0), 'mismatch.veto_threshold=-1.0'),
])
def test_mismatch_config_rejects_bad_values(knobs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    MismatchConfig(**knobs)


def test_loss_config_resolves_the_named_defaults():
  resolved = LossConfig(loss='gspo').resolve()
  assert (resolved.eps_low, resolved.eps_high) == (3e-4, 4e-4)
  assert resolved.aggregation == 'seq-mean-token-mean' and resolved.kl_estimator == 'k3'
  assert LossConfig(loss='drgrpo').estimator == 'drgrpo'
  assert LossConfig(loss='drgrpo', advantage_estimator='rloo').estimator == 'rloo'
  assert LossConfig(loss='dapo', eps_high=0.3).resolve().eps_high == 0.3
  with pytest.raises(TypeError, match='takes a LossConfig first'):
    policy_loss('grpo', *args(ref.make_inputs(21)))


def test_aggregate_rejects_unknown_names():
  with pytest.raises(ValueError, match="Unknown aggregation 'sum'"):
    components.aggregate(jnp.ones((2, 2)), jnp.ones((2, 2)), 'sum')


def test_missing_inputs_raise():
  x = ref.make_inputs(22)
  with pytest.raises(ValueError, match='kl_beta=0.1 > 0 needs ref_logp'):
    call('grpo', *args(x), kl_beta=0.1)
  with pytest.raises(ValueError, match="old_logprobs='recompute' but old_logp was not given"):
    policy_loss(LossConfig(loss='dapo', old_logprobs='recompute'), *args(x))
  with pytest.raises(ValueError, match="old_logprobs='behaviour' but old_logp was given"):
    policy_loss(LossConfig(loss='dapo'), *args(x), old_logp=x['behaviour'])


# ---------------------------------------------------------------------------------------------
# The shared parts.


def test_ppo_clip_objective_and_token_ratio():
  log_r = components.token_log_ratio(jnp.log(jnp.array([[0.5, 0.9, 1.5, 1.5, 0.5]])),
                                     jnp.zeros((1, 5)))
  ratio = components.safe_exp(log_r)
  np.testing.assert_allclose(ratio, [[0.5, 0.9, 1.5, 1.5, 0.5]], rtol=1e-6)
  adv = jnp.array([[1.0, 1.0, 1.0, -1.0, -1.0]])
  obj, clipped = components.ppo_clip_objective(ratio, adv, 0.2, 0.3)
  # min(rA, clip(r, 0.8, 1.3) A) per token.
  np.testing.assert_allclose(obj, [[0.5, 0.9, 1.3, -1.5, -0.8]], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[False, False, True, False, True]])
  # safe_exp caps the exponent at +-20; token_log_ratio detaches old_logp.
  np.testing.assert_allclose(components.safe_exp(jnp.array([100.0, -100.0])),
                             [np.exp(20.0), np.exp(-20.0)], rtol=1e-6)
  g = jax.grad(lambda o: components.token_log_ratio(jnp.ones(3), o).sum())(jnp.zeros(3))
  np.testing.assert_array_equal(g, 0.0)


def test_aggregations_hand_case():
  # Row 0 has 1 loss token (value 4), row 1 has 3 (values 1, 2, 3), row 2 has none.
  # seq-mean-token-mean: (4 + 2) / 2 = 3; token-mean: (4 + 6) / 4 = 2.5;
  # seq-mean-token-sum: (4 + 6) / 2 = 5; seq-mean-token-sum-norm: 10 / (3 * 3), or 10 / (3 * 5).
  x = jnp.array([[4.0, 100.0, 100.0], [1.0, 2.0, 3.0], [7.0, 7.0, 7.0]])
  mask = jnp.array([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
  agg = components.aggregate
  np.testing.assert_allclose(agg(x, mask, 'seq-mean-token-mean'), 3.0, rtol=1e-6)
  np.testing.assert_allclose(agg(x, mask, 'token-mean'), 2.5, rtol=1e-6)
  np.testing.assert_allclose(components.masked_token_mean(x, mask), 2.5, rtol=1e-6)
  np.testing.assert_allclose(agg(x, mask, 'seq-mean-token-sum'), 5.0, rtol=1e-6)
  np.testing.assert_allclose(agg(x, mask, 'seq-mean-token-sum-norm'), 10 / 9, rtol=1e-6)
  np.testing.assert_allclose(agg(x, mask, 'seq-mean-token-sum-norm', 5), 10 / 15, rtol=1e-6)
  for mode in components.AGGREGATIONS:
    assert float(agg(x, jnp.zeros_like(mask), mode)) == 0.0
    np.testing.assert_allclose(agg(x, mask, mode), ref.AGGREGATIONS[mode](x, mask), rtol=1e-6)


def test_sequence_log_ratio():
  # Mean of the masked log-ratios per row; 0 for an empty row.
  log_r = jnp.array([[0.3, -0.1, 9.0], [1.0, 1.0, 1.0]])
  out = components.sequence_log_ratio(log_r, jnp.array([[1, 1, 0], [0, 0, 0]]))
  np.testing.assert_allclose(out, [0.1, 0.0], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# kl_penalty.


def test_kl_estimators_match_formulas():
  rng = np.random.RandomState(12)
  logp = -rng.uniform(0.01, 4.0, (3, 6)).astype(np.float32)
  ref_logp = -rng.uniform(0.01, 4.0, (3, 6)).astype(np.float32)
  for name in ('k1', 'k2', 'k3'):
    out = kl_penalty(jnp.asarray(logp), jnp.asarray(ref_logp), name)
    assert out.dtype == jnp.float32 and out.shape == (3, 6)
    np.testing.assert_allclose(out, ref.kl(logp, ref_logp, name), rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # k3 is the default, and all three are 0 when the policies agree.
  np.testing.assert_allclose(kl_penalty(jnp.asarray(logp), jnp.asarray(ref_logp)),
                             ref.kl(logp, ref_logp, 'k3'), rtol=1e-5, atol=1e-6)
  for name in ('k1', 'k2', 'k3'):
    np.testing.assert_array_equal(kl_penalty(jnp.asarray(logp), jnp.asarray(logp), name), 0.0)


def test_kl_k3_far_reference_is_finite():
  # Past log_ratio = 20, exp is continued linearly: a reference 100 nats more likely gives
  # exp(20) * (1 + 80) - 1 - 100, finite.
  out = kl_penalty(jnp.array([[-100.0]]), jnp.array([[0.0]]), 'k3')
  np.testing.assert_allclose(out, [[np.exp(20.0) * 81.0 - 101.0]], rtol=1e-6)


def test_kl_k3_gradient_matches_formula():
  # d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - exp(ref - logp).
  logp = jnp.array([[-3.0, -1.0, -0.5, -8.0, -0.1]])
  ref_logp = jnp.array([[-1.0, -1.0, -2.0, -0.5, -7.0]])
  grad = jax.grad(lambda lp: kl_penalty(lp, ref_logp, 'k3').sum())(logp)
  np.testing.assert_allclose(grad, 1.0 - np.exp(np.asarray(ref_logp) - np.asarray(logp)),
                             rtol=1e-5)


def test_kl_k3_pulls_towards_reference_beyond_clamp():
  logp = jnp.array([[-21.0, -25.0, -40.0]])
  grad = jax.grad(lambda lp: kl_penalty(lp, jnp.zeros_like(lp), 'k3').sum())(logp)
  assert np.all(np.asarray(grad) < 0), grad


def test_kl_unknown_estimator_raises():
  with pytest.raises(ValueError, match=r"k4.*\('k1', 'k2', 'k3'\)"):
    kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), 'k4')


_logps = st.floats(-15.0, 0.0, allow_nan=False, width=32)
jit_kl = jax.jit(kl_penalty, static_argnums=2)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(_logps, _logps), min_size=8, max_size=8))
def test_kl_k3_is_nonnegative_and_matches_reference(pairs):
  logp = np.array([[p[0] for p in pairs]], np.float32)
  ref_logp = np.array([[p[1] for p in pairs]], np.float32)
  k3 = np.asarray(jit_kl(logp, ref_logp, 'k3'))
  assert np.all(k3 >= 0.0), k3
  np.testing.assert_allclose(k3, ref.kl(logp, ref_logp, 'k3'), rtol=1e-5, atol=2e-7)
  far = np.abs(ref_logp.astype(np.float64) - logp) >= 1e-2  # rounding cannot flip the sign
  assert np.all(k3[far] > 0)


def test_kl_k3_is_exactly_nonnegative_for_small_log_ratios():
  x = np.linspace(-3e-4, 3e-4, 1001).astype(np.float32)[None]
  k3 = np.asarray(kl_penalty(jnp.zeros_like(x), jnp.asarray(x), 'k3'))
  assert np.all(k3 >= 0.0)
