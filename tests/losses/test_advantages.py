"""Tests for rlax_llm.losses.advantages (GRPO group-normalised advantages)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.losses.advantages import grpo_advantages

# One compiled program per shape keeps the randomised tests fast (eager dispatch recompiles
# jnp.unique and the segment sums op by op).
jit_advantages = jax.jit(grpo_advantages)
HYP_BATCH = 10


def np_grpo_advantages(rewards, group_ids, eps=1e-6):
  """Reference from the formula: per group (r - mean) / (unbiased std + eps); 0 if |g| == 1."""
  rewards = np.asarray(rewards, np.float64)
  group_ids = np.asarray(group_ids)
  out = np.zeros_like(rewards)
  for g in set(group_ids.tolist()):
    idx = np.flatnonzero(group_ids == g)
    if len(idx) < 2:
      continue
    r = rewards[idx]
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
    out[idx] = (r - mean) / (std + eps)
  return out


def test_hand_computed_values():
  # group 7 -> indices 0, 2, 5 with rewards 1, 0, 5: mean 2, deviations -1, -2, 3,
  #   sum of squares 14, unbiased var 14 / 2 = 7.
  # group 3 -> indices 1, 4 with rewards 0, 4: mean 2, deviations -2, 2, var 8 / 1 = 8.
  # group 100 -> index 3 alone: 0.
  rewards = jnp.array([1.0, 0.0, 0.0, 2.0, 4.0, 5.0])
  group_ids = jnp.array([7, 3, 7, 100, 3, 7])
  s7 = math.sqrt(7.0) + 1e-6
  s3 = math.sqrt(8.0) + 1e-6
  expected = [-1 / s7, -2 / s3, -2 / s7, 0.0, 2 / s3, 3 / s7]
  adv = jit_advantages(rewards, group_ids)
  assert adv.dtype == jnp.float32 and adv.shape == (6,)
  np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-7)


def test_eps_is_added_to_std():
  # rewards 0, 2: mean 1, unbiased std sqrt(2); with eps = 1 the advantages are +-1/(sqrt2+1).
  adv = jit_advantages(jnp.array([0.0, 2.0]), jnp.array([5, 5]), eps=1.0)
  np.testing.assert_allclose(adv, [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)], rtol=1e-6)


def test_integer_rewards_are_accepted():
  adv = jit_advantages(jnp.array([0, 1, 1, 0]), jnp.array([0, 0, 1, 1]))
  assert adv.dtype == jnp.float32
  np.testing.assert_allclose(adv, np_grpo_advantages([0, 1, 1, 0], [0, 0, 1, 1]), rtol=1e-6)


def test_random_unequal_groups_with_arbitrary_ids():
  rng = np.random.RandomState(0)
  ids_pool = np.array([7, 3, 100, -5, 0, 2**30])
  batch = 16
  for _ in range(5):
    group_ids = ids_pool[rng.randint(0, len(ids_pool), batch)]
    rewards = rng.normal(size=batch).astype(np.float32)
    adv = jit_advantages(jnp.asarray(rewards), jnp.asarray(group_ids, jnp.int32))
    np.testing.assert_allclose(adv, np_grpo_advantages(rewards, group_ids), rtol=1e-4,
                               atol=1e-5)
  # The example from the docstring-style id set [7, 3, 7, 100, 3].
  rewards = np.array([0.3, -1.2, 2.5, 4.0, 0.7], np.float32)
  group_ids = np.array([7, 3, 7, 100, 3])
  np.testing.assert_allclose(jit_advantages(jnp.asarray(rewards), jnp.asarray(group_ids)),
                             np_grpo_advantages(rewards, group_ids), rtol=1e-5, atol=1e-6)


# Rewards on a grid of quarter-integers are exact in float32, so group means are exact and the
# float64 reference is comparable at float32 precision.
_rewards = st.integers(-8, 8).map(lambda k: k * 0.25)
_ids = st.sampled_from([7, 3, 100, -5, 0, 2**30, -(2**31)])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(_rewards, _ids), min_size=HYP_BATCH, max_size=HYP_BATCH))
def test_matches_reference_on_random_groups(pairs):
  rewards = np.array([p[0] for p in pairs], np.float32)
  group_ids = np.array([p[1] for p in pairs], np.int32)
  adv = np.asarray(jit_advantages(jnp.asarray(rewards), jnp.asarray(group_ids)))
  assert np.all(np.isfinite(adv))
  np.testing.assert_allclose(adv, np_grpo_advantages(rewards, group_ids), rtol=1e-5,
                             atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(_rewards, _ids), min_size=HYP_BATCH, max_size=HYP_BATCH).flatmap(
    lambda pairs: st.tuples(st.just(pairs), st.permutations(range(len(pairs))))))
def test_permuting_samples_permutes_advantages(pairs_and_perm):
  pairs, perm = pairs_and_perm
  perm = np.array(perm)
  rewards = jnp.array([p[0] for p in pairs], jnp.float32)
  group_ids = jnp.array([p[1] for p in pairs], jnp.int32)
  adv = np.asarray(jit_advantages(rewards, group_ids))
  adv_perm = np.asarray(jit_advantages(rewards[perm], group_ids[perm]))
  np.testing.assert_allclose(adv_perm, adv[perm], rtol=1e-6, atol=1e-7)


def test_singleton_groups_are_zero_and_finite():
  adv = jit_advantages(jnp.array([5.0, 1.0, 2.0]), jnp.array([1, 2, 2]))
  # Group 2 = rewards 1, 2: mean 1.5, deviations -+0.5, unbiased var 0.5.
  s2 = math.sqrt(0.5) + 1e-6
  np.testing.assert_allclose(adv, [0.0, -0.5 / s2, 0.5 / s2], rtol=1e-6)
  # Every sample alone (incl. a batch of one): all zero, no NaN even with eps = 0.
  for eps in (1e-6, 0.0):
    for rewards, ids in (([3.0, -1.0, 7.0], [0, 1, 2]), ([4.0], [9])):
      adv = np.asarray(jit_advantages(jnp.array(rewards), jnp.array(ids), eps=eps))
      assert np.all(np.isfinite(adv))
      np.testing.assert_array_equal(adv, np.zeros(len(rewards)))


def test_all_equal_group_is_zero():
  # Values exactly representable in float32 (the usual 0/1 verifier rewards).
  rewards = jnp.array([0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
  group_ids = jnp.array([1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3])
  adv = np.asarray(jit_advantages(rewards, group_ids))
  assert np.all(np.isfinite(adv))
  np.testing.assert_array_equal(adv[:4], 0.0)
  np.testing.assert_array_equal(adv[6:], 0.0)
  # Group 2 = rewards 1, 0: mean 0.5, deviations +-0.5, unbiased var 0.5.
  s2 = math.sqrt(0.5) + 1e-6
  np.testing.assert_allclose(adv[4:6], [0.5 / s2, -0.5 / s2], rtol=1e-6)


@pytest.mark.parametrize('value,size', [(0.1, 8), (0.9, 16)])
def test_all_equal_group_is_zero_for_inexact_rewards(value, size):
  adv = jit_advantages(jnp.full((size,), value, jnp.float32), jnp.zeros((size,), jnp.int32))
  np.testing.assert_allclose(adv, np.zeros(size), atol=1e-4)


def test_jit_gives_same_result():
  rewards = jnp.array([0.3, -1.2, 2.5, 4.0, 0.7, 1.1, -0.4])
  group_ids = jnp.array([7, 3, 7, 100, 3, 3, -2])
  eager = grpo_advantages(rewards, group_ids)
  jitted = jax.jit(grpo_advantages)(rewards, group_ids)  # a fresh trace, not the cached one
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jitted, np_grpo_advantages(rewards, group_ids), rtol=1e-5,
                             atol=1e-6)


def test_mismatched_shapes_raise():
  with pytest.raises(AssertionError):
    grpo_advantages(jnp.ones(3), jnp.zeros(4, jnp.int32))
  with pytest.raises(AssertionError):
    grpo_advantages(jnp.ones((2, 3)), jnp.zeros((2, 3), jnp.int32))
