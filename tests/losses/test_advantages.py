"""Tests for rlax_llm.losses.advantages: every estimator in ESTIMATORS against NumPy loops."""

import functools
import math
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

from rlax_llm.losses.advantages import (
  BASELINE_FREE,
  ESTIMATORS,
  batch_normalize,
  group_advantages,
)

# One compiled program per (estimator, shape) keeps the randomised tests fast (eager dispatch
# recompiles jnp.unique and the segment sums op by op).
jit_advantages = jax.jit(group_advantages, static_argnames='estimator')
jit_grpo = jax.jit(functools.partial(group_advantages, estimator='grpo'))
GROUP_RELATIVE = ('grpo', 'drgrpo', 'rloo', 'median', 'gdpo', 'reinforce_pp')
HYP_BATCH = 10


def test_estimators_are_the_documented_ones():
  assert set(ESTIMATORS) == set(ref.ESTIMATORS)


def advantages(rewards, group_ids, estimator, **kwargs):
  return np.asarray(jit_advantages(jnp.asarray(rewards), jnp.asarray(group_ids),
                                   estimator=estimator, **kwargs))


def expected(rewards, group_ids, estimator, valid=None, eps=1e-6, reward_weights=None):
  fn = ref.ESTIMATORS[estimator]
  if estimator in ('drgrpo', 'rloo', 'reinforce', 'w_reinforce'):
    return fn(rewards, group_ids, valid)
  if estimator == 'gdpo':
    return fn(rewards, group_ids, reward_weights, valid, eps)
  return fn(rewards, group_ids, valid, eps)


# ---------------------------------------------------------------------------------------------
# Hand-computed values.

# group 7 -> indices 0, 2, 5 with rewards 1, 0, 5: mean 2, median 1, deviations -1, -2, 3,
#   sum of squares 14, unbiased var 7. group 3 -> indices 1, 4 with rewards 0, 4: mean 2,
#   median 2, deviations -2, 2, var 8. group 100 -> index 3 alone: 0 for every group-relative
#   estimator.
HAND_REWARDS = np.array([1.0, 0.0, 0.0, 2.0, 4.0, 5.0], np.float32)
HAND_IDS = np.array([7, 3, 7, 100, 3, 7])
_S7 = math.sqrt(7.0) + 1e-6
_S3 = math.sqrt(8.0) + 1e-6
# reinforce_pp: r - mean = -1, -2, -2, 0, 2, 3 (batch mean 0, sum of squares 22, var 22 / 5).
_SB = math.sqrt(22 / 5) + 1e-6
HAND_EXPECTED = {
    'grpo': [-1 / _S7, -2 / _S3, -2 / _S7, 0.0, 2 / _S3, 3 / _S7],
    'drgrpo': [-1.0, -2.0, -2.0, 0.0, 2.0, 3.0],
    # r_i - mean of the others: 1 - (0 + 5) / 2, 0 - 4, 0 - (1 + 5) / 2, -, 4 - 0, 5 - (1 + 0) / 2.
    'rloo': [-1.5, -4.0, -3.0, 0.0, 4.0, 4.5],
    'median': [0.0, -2 / _S3, -1 / _S7, 0.0, 2 / _S3, 4 / _S7],
    'reinforce': [1.0, 0.0, 0.0, 2.0, 4.0, 5.0],
    'reinforce_pp': [-1 / _SB, -2 / _SB, -2 / _SB, 0.0, 2 / _SB, 3 / _SB],
    # 0.1 r - (1 - r) = 1.1 r - 1.
    'w_reinforce': [0.1, -1.0, -1.0, 1.2, 3.4, 4.5],
}


@pytest.mark.parametrize('estimator', sorted(HAND_EXPECTED))
def test_hand_computed_values(estimator):
  adv = jit_advantages(jnp.asarray(HAND_REWARDS), jnp.asarray(HAND_IDS), estimator=estimator)
  assert adv.dtype == jnp.float32 and adv.shape == (6,)
  np.testing.assert_allclose(adv, HAND_EXPECTED[estimator], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(expected(HAND_REWARDS, HAND_IDS, estimator),
                             HAND_EXPECTED[estimator], rtol=1e-12, atol=1e-12)


def test_gdpo_hand_case():
  # Two groups of two, reward columns (1, 0, 1, 1) and (0, 1, 1, 0), weights (1, 2).
  # Column 0: group 0 -> +-0.5 / sqrt(0.5) = +-a (a = sqrt(0.5)), group 1 constant -> 0.
  # Column 1: group 0 -> -a, +a; group 1 -> +a, -a. Weighted sum: -a, a, 2a, -2a; batch mean 0,
  # unbiased var 10 a^2 / 3 = 5 / 3, so the advantages are sqrt(0.3) * (-1, 1, 2, -2).
  rewards = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]], np.float32)
  adv = advantages(rewards, [0, 0, 1, 1], 'gdpo', reward_weights=jnp.array([1.0, 2.0]))
  np.testing.assert_allclose(adv, math.sqrt(0.3) * np.array([-1, 1, 2, -2]), rtol=1e-5)
  np.testing.assert_allclose(
      ref.gdpo_advantages(rewards, [0, 0, 1, 1], [1.0, 2.0]),
      math.sqrt(0.3) * np.array([-1, 1, 2, -2]), rtol=1e-5)
  # Default weights (1, 1): sums 0, 0, a, -a; batch var 2 a^2 / 3 = 1 / 3, so (0, 0, 1, -1)
  # * sqrt(1.5).
  adv = advantages(rewards, [0, 0, 1, 1], 'gdpo')
  np.testing.assert_allclose(adv, math.sqrt(1.5) * np.array([0, 0, 1, -1]), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(ref.gdpo_advantages(rewards, [0, 0, 1, 1]),
                             math.sqrt(1.5) * np.array([0, 0, 1, -1]), rtol=1e-5, atol=1e-6)


def test_median_of_odd_group_gets_exactly_zero():
  adv = advantages(np.array([3.0, 10.0, -1.0, 0.25, 0.5], np.float32), [1, 1, 1, 2, 2],
                   'median')
  assert adv[0] == 0.0  # the median of 3, 10, -1
  np.testing.assert_allclose(adv, ref.median_advantages([3.0, 10.0, -1.0, 0.25, 0.5],
                                                        [1, 1, 1, 2, 2]), rtol=1e-6)


def test_eps_is_added_to_std():
  # rewards 0, 2: mean 1, unbiased std sqrt(2); with eps = 1 the advantages are +-1/(sqrt2+1).
  adv = jit_grpo(jnp.array([0.0, 2.0]), jnp.array([5, 5]), eps=1.0)
  np.testing.assert_allclose(adv, [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)], rtol=1e-6)
  adv = advantages(np.array([0.0, 2.0, 0.0]), [5, 5, 5], 'median', eps=1.0)
  # median 0, std sqrt(4/3): (0, 2, 0) / (sqrt(4/3) + 1).
  np.testing.assert_allclose(adv, [0.0, 2 / (math.sqrt(4 / 3) + 1), 0.0], rtol=1e-6)


def test_integer_rewards_are_accepted():
  for estimator in ('grpo', 'rloo', 'median', 'reinforce_pp'):
    adv = advantages(np.array([0, 1, 1, 0]), [0, 0, 1, 1], estimator)
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, expected([0, 1, 1, 0], [0, 0, 1, 1], estimator),
                               rtol=1e-6, err_msg=estimator)


def test_grpo_advantages_eager_and_jit_give_same_result():
  rewards = jnp.array([0.3, -1.2, 2.5, 4.0, 0.7, 1.1, -0.4])
  group_ids = jnp.array([7, 3, 7, 100, 3, 3, -2])
  eager = group_advantages(rewards, group_ids, 'grpo')
  jitted = jax.jit(group_advantages, static_argnames='estimator')(  # a fresh trace
      rewards, group_ids, estimator='grpo')
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jitted, ref.grpo_advantages(rewards, group_ids), rtol=1e-5,
                             atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Random inputs.


@pytest.mark.parametrize('estimator', [e for e in ESTIMATORS if e != 'gdpo'])
def test_random_unequal_groups_with_arbitrary_ids(estimator):
  rng = np.random.RandomState(0)
  ids_pool = np.array([7, 3, 100, -5, 0, 2**30])
  for _ in range(4):
    group_ids = ids_pool[rng.randint(0, len(ids_pool), 16)].astype(np.int32)
    rewards = rng.normal(size=16).astype(np.float32)
    valid = rng.rand(16) < 0.8
    np.testing.assert_allclose(advantages(rewards, group_ids, estimator),
                               expected(rewards, group_ids, estimator), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(advantages(rewards, group_ids, estimator, valid=valid),
                               expected(rewards, group_ids, estimator, valid=valid),
                               rtol=1e-4, atol=1e-5)


def test_gdpo_random():
  rng = np.random.RandomState(1)
  for _ in range(4):
    group_ids = rng.randint(0, 4, 16).astype(np.int32)
    rewards = rng.normal(size=(16, 3)).astype(np.float32)
    weights = rng.uniform(0.1, 2.0, 3).astype(np.float32)
    valid = rng.rand(16) < 0.8
    np.testing.assert_allclose(
        advantages(rewards, group_ids, 'gdpo', reward_weights=weights, valid=valid),
        ref.gdpo_advantages(rewards, group_ids, weights, valid), rtol=1e-4, atol=1e-5)


# Rewards on a grid of quarter-integers are exact in float32, so group means are nearly exact
# and the float64 reference is comparable at float32 precision.
_rewards = st.integers(-8, 8).map(lambda k: k * 0.25)
_ids = st.sampled_from([7, 3, 100, -5, 0, 2**30, -(2**31)])
_rows = st.lists(st.tuples(_rewards, _ids, st.booleans()), min_size=HYP_BATCH,
                 max_size=HYP_BATCH)


@settings(max_examples=40, deadline=None)
@given(_rows, st.sampled_from([e for e in ESTIMATORS if e != 'gdpo']), st.booleans())
def test_matches_reference_on_random_groups(rows, estimator, use_valid):
  rewards = np.array([r[0] for r in rows], np.float32)
  group_ids = np.array([r[1] for r in rows], np.int32)
  valid = np.array([r[2] for r in rows]) if use_valid else None
  adv = advantages(rewards, group_ids, estimator, valid=valid)
  assert np.all(np.isfinite(adv))
  np.testing.assert_allclose(adv, expected(rewards, group_ids, estimator, valid=valid),
                             rtol=1e-5, atol=1e-5)
  if valid is not None:
    np.testing.assert_array_equal(adv[~valid], 0.0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(_rewards, _rewards, st.sampled_from([0, 1, 2, 3])),
                min_size=HYP_BATCH, max_size=HYP_BATCH))
def test_gdpo_matches_reference_on_random_groups(rows):
  # Continuous weights keep the weighted column sum away from an exact all-equal batch (see
  # test_gdpo_complementary_rewards_give_zero).
  rewards = np.array([[r[0], r[1]] for r in rows], np.float32)
  group_ids = np.array([r[2] for r in rows], np.int32)
  weights = np.array([1.0, 0.37], np.float32)
  adv = advantages(rewards, group_ids, 'gdpo', reward_weights=weights)
  want = ref.gdpo_advantages(rewards, group_ids, weights)
  assert np.all(np.isfinite(adv))
  np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(_rewards, _ids, _rewards), min_size=HYP_BATCH, max_size=HYP_BATCH)
       .flatmap(lambda rows: st.tuples(st.just(rows), st.permutations(range(len(rows))))),
       st.sampled_from(ESTIMATORS))
def test_permuting_samples_permutes_advantages(rows_and_perm, estimator):
  rows, perm = rows_and_perm
  perm = np.array(perm)
  if estimator == 'gdpo':
    rewards = np.array([[r[0], r[2]] for r in rows], np.float32)
  else:
    rewards = np.array([r[0] for r in rows], np.float32)
  group_ids = np.array([r[1] for r in rows], np.int32)
  adv = advantages(rewards, group_ids, estimator)
  adv_perm = advantages(rewards[perm], group_ids[perm], estimator)
  np.testing.assert_allclose(adv_perm, adv[perm], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Edge cases: singletons, equal rewards, invalid rows.


@pytest.mark.parametrize('eps', [1e-6, 0.0])
@pytest.mark.parametrize('estimator', GROUP_RELATIVE)
def test_group_of_one_gets_zero_and_never_nan(estimator, eps):
  # Index 0 and index 3 are alone in their groups; the others form groups of 2 and 3.
  rewards = np.array([5.0, 1.0, 2.0, -3.0, 0.5, 4.0, 1.5], np.float32)
  ids = [10, 20, 20, 30, 40, 40, 40]
  if estimator == 'gdpo':
    rewards = np.stack([rewards, rewards[::-1] * 0.5], axis=1)
  adv = advantages(rewards, ids, estimator, eps=eps)
  assert np.all(np.isfinite(adv))
  np.testing.assert_allclose(adv[[0, 3]], 0.0, atol=1e-6)
  np.testing.assert_allclose(adv, expected(rewards, ids, estimator, eps=eps), rtol=1e-5,
                             atol=1e-6)
  # Every sample alone, including a batch of one: all exactly zero.
  for r, i in (([3.0, -1.0, 7.0], [0, 1, 2]), ([4.0], [9])):
    r = np.asarray(r, np.float32)
    if estimator == 'gdpo':
      r = np.stack([r, -r], axis=1)
    adv = advantages(r, i, estimator, eps=eps)
    np.testing.assert_array_equal(adv, np.zeros(len(i)))


@pytest.mark.parametrize('estimator', GROUP_RELATIVE)
def test_all_equal_group_is_zero(estimator):
  # Values exactly representable in float32 (the usual 0/1 verifier rewards).
  rewards = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 1.0, 1.0, 1.0], np.float32)
  ids = np.array([1, 1, 1, 1, 2, 2, 3, 3, 3])
  if estimator == 'gdpo':
    rewards = np.stack([rewards, rewards], axis=1)
  adv = advantages(rewards, ids, estimator)
  assert np.all(np.isfinite(adv))
  np.testing.assert_allclose(adv[:4], 0.0, atol=1e-7)
  np.testing.assert_allclose(adv[6:], 0.0, atol=1e-7)
  assert adv[4] > 0 > adv[5]


@pytest.mark.parametrize('estimator', ['grpo', 'median', 'rloo', 'drgrpo'])
@pytest.mark.parametrize('value,size', [(0.1, 8), (0.9, 16), (1 / 3, 5)])
def test_all_equal_group_is_zero_for_inexact_rewards(estimator, value, size):
  adv = advantages(np.full((size,), value, np.float32), np.zeros((size,), np.int32), estimator)
  np.testing.assert_array_equal(adv, np.zeros(size))


def test_gdpo_complementary_rewards_give_zero():
  # Two groups of three; column 1 = 1 - column 0. Per group the GRPO advantages of the two
  # columns are exact negatives, so the per-sample sum is 0 for every sample: an all-equal
  # batch, documented to give 0.
  col = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], np.float32)
  rewards = np.stack([col, 1.0 - col], axis=1)
  adv = advantages(rewards, [0, 0, 0, 1, 1, 1], 'gdpo')
  np.testing.assert_allclose(ref.gdpo_advantages(rewards, [0, 0, 0, 1, 1, 1]), 0.0, atol=1e-9)
  np.testing.assert_allclose(adv, 0.0, atol=1e-4)


def test_invalid_rows_are_ignored_and_get_zero():
  # Group 0 = rewards 1, 3 and an invalid 100: the 100 changes nothing.
  rewards = np.array([1.0, 3.0, 100.0, 2.0, 2.5], np.float32)
  ids = [0, 0, 0, 1, 1]
  valid = np.array([True, True, False, True, True])
  for estimator in ESTIMATORS:
    r = np.stack([rewards, rewards], 1) if estimator == 'gdpo' else rewards
    r_valid = np.stack([rewards[valid]] * 2, 1) if estimator == 'gdpo' else rewards[valid]
    adv = advantages(r, ids, estimator, valid=valid)
    assert adv[2] == 0.0, estimator
    np.testing.assert_allclose(adv[valid], expected(r_valid, [0, 0, 1, 1], estimator),
                               rtol=1e-5, atol=1e-6, err_msg=estimator)


def test_w_reinforce_trains_groups_whose_rewards_are_all_equal():
  # An all-wrong group is pushed down by 1 per sample, an all-right one up by lambda: unlike
  # every group-relative estimator, neither is zero (so dynamic sampling must keep them).
  rewards = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
  ids = [0, 0, 0, 1, 1, 1, 2, 2]
  np.testing.assert_allclose(advantages(rewards, ids, 'w_reinforce'),
                             [-1, -1, -1, 0.1, 0.1, 0.1, 0.1, -1], rtol=1e-6)
  np.testing.assert_allclose(advantages(rewards, ids, 'w_reinforce', positive_weight=0.5),
                             [-1, -1, -1, 0.5, 0.5, 0.5, 0.5, -1], rtol=1e-6)
  for estimator in GROUP_RELATIVE:
    if estimator != 'gdpo':
      assert np.all(advantages(rewards[:6], ids[:6], estimator) == 0.0), estimator
  assert set(BASELINE_FREE) == set(ESTIMATORS) - set(GROUP_RELATIVE)


def test_batch_normalize():
  # (x - mean) / (std + eps) with Bessel std over the valid entries; 0 elsewhere and when all
  # equal. x = 1, 2, 3 (valid), 50 (invalid): mean 2, std 1.
  x = jnp.array([1.0, 2.0, 3.0, 50.0])
  valid = jnp.array([True, True, True, False])
  np.testing.assert_allclose(batch_normalize(x, valid), [-1 / (1 + 1e-6), 0, 1 / (1 + 1e-6), 0],
                             rtol=1e-6)
  np.testing.assert_allclose(batch_normalize(x), ref.batch_normalize(x), rtol=1e-6)
  np.testing.assert_array_equal(batch_normalize(jnp.full(5, 0.1)), 0.0)
  np.testing.assert_array_equal(batch_normalize(jnp.array([3.0])), 0.0)


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_mismatched_shapes_raise():
  with pytest.raises(ValueError, match=r'group_ids must have shape \[batch\] = \(3,\), got '
                                       r'\(4,\)'):
    group_advantages(jnp.ones(3), jnp.zeros(4, jnp.int32))
  with pytest.raises(ValueError, match=r"estimator 'grpo' needs rewards of shape \[batch\], "
                                       r'got shape \(2, 3\)'):
    group_advantages(jnp.ones((2, 3)), jnp.zeros(2, jnp.int32), 'grpo')
  with pytest.raises(ValueError, match=r"estimator 'gdpo' needs rewards of shape "
                                       r'\[batch, num_rewards\], got shape \(4,\)'):
    group_advantages(jnp.ones(4), jnp.zeros(4, jnp.int32), 'gdpo')
  with pytest.raises(ValueError, match=r'valid must have shape \[batch\] = \(4,\), got \(3,\)'):
    group_advantages(jnp.ones(4), jnp.zeros(4, jnp.int32), 'rloo', valid=jnp.ones(3, bool))
  with pytest.raises(ValueError, match='group_ids must be integers, got dtype float32'):
    group_advantages(jnp.ones(4), jnp.zeros(4, jnp.float32))


def test_unknown_estimator_lists_the_valid_ones():
  with pytest.raises(ValueError, match="Unknown advantage estimator 'ppo'") as e:
    group_advantages(jnp.ones(4), jnp.zeros(4, jnp.int32), 'ppo')
  assert all(repr(name) in str(e.value) for name in ESTIMATORS)
