"""Tests for rlax_llm.losses.multi_turn: credit over turns (trajectory GRPO, discounted
per-turn GRPO, GiGPO) against hand-worked numbers and the NumPy loops in np_reference."""

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

from rlax_llm.losses import (
  TURN_ESTIMATORS,
  LossConfig,
  broadcast_turn_advantages,
  discounted_turn_returns,
  gigpo_advantages,
  group_advantages,
  policy_loss,
  step_group_ids,
  trajectory_advantages,
  turn_advantages,
  turn_grpo_advantages,
)

jit_gigpo = jax.jit(gigpo_advantages, static_argnames='norm')
jit_returns = jax.jit(discounted_turn_returns)

# ---------------------------------------------------------------------------------------------
# The hand-worked example: 2 groups x 3 trajectories x up to 3 turns, gamma = 0.5, omega = 1.
#
# Group 10 (every trajectory starts in state 100):
#   traj 0: states 100, 101, 102; rewards 0, 0, 1           episode return 1
#   traj 1: states 100, 101, (999); rewards 0, 0, (5)       episode return 0 (ends after 2 turns)
#   traj 2: states 100, 103, 101; rewards 0, 0, 1           episode return 1 (101 at turn 2)
# Group 20 (also state 100 first: equal state ids in other groups are other step groups):
#   traj 3: states 100, (7), (7); rewards 1, (9), (9)       episode return 1 (one turn)
#   traj 4: states 100, 201, (0); rewards 0, 0.5, (0)       episode return 0.5
#   traj 5: states 100, 201, 202; rewards 0, 0, 0           episode return 0
# Parenthesised turns are masked: they must change nothing.
HAND_GROUPS = np.array([10, 10, 10, 20, 20, 20], np.int32)
HAND_STATES = np.array([[100, 101, 102], [100, 101, 999], [100, 103, 101],
                        [100, 7, 7], [100, 201, 0], [100, 201, 202]], np.int32)
HAND_REWARDS = np.array([[0, 0, 1], [0, 0, 5], [0, 0, 1], [1, 9, 9], [0, 0.5, 0], [0, 0, 0]],
                        np.float32)
HAND_MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], bool)
HAND_EPISODE = np.array([1, 0, 1, 1, 0.5, 0], np.float32)
# Discounted returns, R_t = r_t + 0.5 R_{t+1}: traj 0 and 2: 0 + 0.5 (0 + 0.5 * 1) = 0.25, 0.5,
# 1; traj 4: 0 + 0.5 * 0.5 = 0.25, 0.5; traj 3: 1; the others 0. Masked turns: 0.
HAND_RETURNS = [[0.25, 0.5, 1], [0, 0, 0], [0.25, 0.5, 1], [1, 0, 0], [0.25, 0.5, 0], [0, 0, 0]]
# Step groups, numbered by (group, state): (10, 100) = 0: traj 0-2 turn 0, returns 0.25, 0, 0.25;
# (10, 101) = 1: traj 0 turn 1, traj 1 turn 1, traj 2 turn 2, returns 0.5, 0, 1; (10, 102) = 2
# and (10, 103) = 3 are singletons; (20, 100) = 4: returns 1, 0.25, 0; (20, 201) = 5: returns
# 0.5, 0; (20, 202) = 6 a singleton.
HAND_STEP_GROUPS = [[0, 1, 2], [0, 1, -1], [0, 3, 1], [4, -1, -1], [4, 5, -1], [4, 5, 6]]
# norm='mean' (F_norm = 1), everything in twelfths:
#   A^E: group 10 returns 1, 0, 1, mean 2/3 -> 4, -8, 4; group 20: 1, 0.5, 0, mean 0.5 -> 6, 0, -6.
#   A^S: (10, 100) mean 1/6 -> 1, -2, 1; (10, 101) mean 0.5 -> 0, -6, 6; (20, 100) mean 5/12 ->
#   7, -2, -5; (20, 201) mean 0.25 -> 3, -3; singletons 0.
#   A = A^E + A^S per turn.
HAND_MEAN_TWELFTHS = [[4 + 1, 4 + 0, 4 + 0],
                      [-8 - 2, -8 - 6, 0],
                      [4 + 1, 4 + 0, 4 + 6],
                      [6 + 7, 0, 0],
                      [0 - 2, 0 + 3, 0],
                      [-6 - 5, -6 - 3, -6 + 0]]
# norm='std' (Bessel std, + 1e-6):
#   A^E: group 10 deviations 1/3, -2/3, 1/3, var (1 + 4 + 1) / 9 / 2 = 1/3 -> sqrt3 * dev;
#   group 20 deviations 0.5, 0, -0.5, std 0.5 -> 1, 0, -1.
#   A^S: (10, 100) deviations 1/12, -2/12, 1/12, var 6/144 / 2 = 1/48 -> 4 sqrt3 * dev, which is
#   sqrt3/3, -2 sqrt3/3, sqrt3/3; (10, 101) deviations 0, -0.5, 0.5, std 0.5 -> 0, -1, 1;
#   (20, 100) deviations 7/12, -2/12, -5/12, var 78/144 / 2 = 39/144 -> (7, -2, -5) / sqrt39;
#   (20, 201) deviations +-0.25, std sqrt(0.125) -> +-1/sqrt2.
_S3, _S39, _S2 = math.sqrt(3), math.sqrt(39), math.sqrt(2)
HAND_STD = [[_S3 / 3 + _S3 / 3, _S3 / 3 + 0, _S3 / 3 + 0],
            [-2 * _S3 / 3 - 2 * _S3 / 3, -2 * _S3 / 3 - 1, 0],
            [_S3 / 3 + _S3 / 3, _S3 / 3 + 0, _S3 / 3 + 1],
            [1 + 7 / _S39, 0, 0],
            [0 - 2 / _S39, 0 + 1 / _S2, 0],
            [-1 - 5 / _S39, -1 - 1 / _S2, -1 + 0]]


def hand_gigpo(norm, fn=jit_gigpo, omega=1.0):
  return np.asarray(fn(jnp.asarray(HAND_EPISODE), jnp.asarray(HAND_GROUPS),
                       jnp.asarray(HAND_REWARDS), jnp.asarray(HAND_MASK),
                       jnp.asarray(HAND_STATES), 0.5, omega, norm=norm))


def test_hand_worked_step_groups_and_returns():
  np.testing.assert_array_equal(step_group_ids(HAND_GROUPS, HAND_STATES, HAND_MASK),
                                HAND_STEP_GROUPS)
  np.testing.assert_allclose(jit_returns(HAND_REWARDS, HAND_MASK, 0.5), HAND_RETURNS, rtol=0)
  np.testing.assert_allclose(ref.discounted_turn_returns(HAND_REWARDS, HAND_MASK, 0.5),
                             HAND_RETURNS, rtol=0)


def test_hand_worked_gigpo():
  adv = hand_gigpo('mean')
  assert adv.dtype == np.float32 and adv.shape == (6, 3)
  np.testing.assert_allclose(adv, np.array(HAND_MEAN_TWELFTHS) / 12, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(hand_gigpo('std'), HAND_STD, rtol=1e-5, atol=1e-6)
  for norm, want in (('mean', np.array(HAND_MEAN_TWELFTHS) / 12), ('std', HAND_STD)):
    np.testing.assert_allclose(
        ref.gigpo_advantages(HAND_EPISODE, HAND_GROUPS, HAND_REWARDS, HAND_MASK, HAND_STATES,
                             0.5, 1.0, norm), want, rtol=1e-5, atol=1e-6)
  # omega scales only the step part: with omega = 0, GiGPO is trajectory-level GRPO.
  np.testing.assert_allclose(hand_gigpo('std', omega=0.0),
                             trajectory_advantages(HAND_EPISODE, HAND_GROUPS, HAND_MASK, 'std'),
                             rtol=1e-6)


def test_jit_equals_eager():
  eager = hand_gigpo('std', fn=gigpo_advantages)
  # A fresh trace (not the cached jit_gigpo), with gamma and omega traced.
  fresh = jax.jit(lambda *a: gigpo_advantages(*a, norm='std'))
  jitted = np.asarray(fresh(jnp.asarray(HAND_EPISODE), jnp.asarray(HAND_GROUPS),
                            jnp.asarray(HAND_REWARDS), jnp.asarray(HAND_MASK),
                            jnp.asarray(HAND_STATES), jnp.float32(0.5), jnp.float32(1.0)))
  np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(jax.jit(step_group_ids)(HAND_GROUPS, HAND_STATES, HAND_MASK),
                                HAND_STEP_GROUPS)


def test_singleton_step_groups_get_no_step_advantage():
  # Hand case: the singleton turns (step groups 2, 3, 6) carry A^E only.
  step = hand_gigpo('std') - np.asarray(
      trajectory_advantages(HAND_EPISODE, HAND_GROUPS, HAND_MASK, 'std'))
  ids = np.array(HAND_STEP_GROUPS)
  np.testing.assert_array_equal(step[np.isin(ids, [2, 3, 6])], 0.0)
  # Every state distinct: every step group is a singleton, so GiGPO = trajectory GRPO, for any
  # omega, in both normalisations.
  distinct = np.arange(18, dtype=np.int32).reshape(6, 3)
  for norm in ('std', 'mean'):
    adv = jit_gigpo(HAND_EPISODE, HAND_GROUPS, HAND_REWARDS, HAND_MASK, distinct, 0.5, 3.0,
                    norm=norm)
    np.testing.assert_array_equal(adv, trajectory_advantages(HAND_EPISODE, HAND_GROUPS,
                                                             HAND_MASK, norm))


def test_masked_turns_contribute_nothing():
  base = hand_gigpo('std')
  np.testing.assert_array_equal(base[~HAND_MASK], 0.0)
  # Other rewards and states on the masked turns (one masked state equal to a real one of its
  # group) change nothing.
  rewards = np.where(HAND_MASK, HAND_REWARDS, -40.0).astype(np.float32)
  states = np.where(HAND_MASK, HAND_STATES, 101).astype(np.int32)
  adv = jit_gigpo(HAND_EPISODE, HAND_GROUPS, rewards, HAND_MASK, states, 0.5, 1.0, norm='std')
  np.testing.assert_array_equal(adv, base)
  np.testing.assert_array_equal(jit_returns(rewards, HAND_MASK, 0.5), HAND_RETURNS)
  # A trajectory whose turns are all masked gets 0 everywhere.
  mask = HAND_MASK.copy()
  mask[5] = False
  adv = jit_gigpo(HAND_EPISODE, HAND_GROUPS, HAND_REWARDS, mask, HAND_STATES, 0.5, 1.0,
                  norm='std')
  np.testing.assert_array_equal(np.asarray(adv)[5], 0.0)


def test_discounted_returns_against_a_python_loop():
  rng = np.random.RandomState(0)
  for gamma in (0.0, 0.5, 0.95, 1.0):
    rewards = rng.normal(size=(5, 7)).astype(np.float32)
    mask = rng.rand(5, 7) < 0.7  # holes inside trajectories too
    mask[0] = False
    got = np.asarray(jit_returns(rewards, mask, gamma))
    want = np.zeros((5, 7))
    for i in range(5):
      running = 0.0
      for t in reversed(range(7)):
        if mask[i, t]:
          running = float(rewards[i, t]) + gamma * running
          want[i, t] = running
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, ref.discounted_turn_returns(rewards, mask, gamma),
                               rtol=1e-5, atol=1e-6)
  # Integer rewards and a float mask are accepted; the returns are float32.
  got = discounted_turn_returns(jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3)), 0.5)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got, [[1.75, 1.5, 1.0]] * 2)


# Quarter-integer rewards are exact in float32, so the float64 reference compares closely.
_reward = st.integers(-4, 4).map(lambda k: k * 0.25)
_turn = st.tuples(_reward, st.integers(0, 3), st.booleans())  # reward, state, happened
_trajectory = st.tuples(_reward, st.lists(_turn, min_size=3, max_size=3))
_batch = st.lists(_trajectory, min_size=6, max_size=6)


def _arrays(batch):
  episode = np.array([t[0] for t in batch], np.float32)
  rewards = np.array([[turn[0] for turn in t[1]] for t in batch], np.float32)
  states = np.array([[turn[1] for turn in t[1]] for t in batch], np.int32)
  mask = np.array([[turn[2] for turn in t[1]] for t in batch], bool)
  return episode, rewards, states, mask


@settings(max_examples=30, deadline=None)
@given(_batch, st.permutations(range(6)), st.sampled_from(['std', 'mean']))
def test_permuting_trajectories_permutes_advantages(batch, perm, norm):
  # Groups 0 (rows 0-2) and 1 (rows 3-5); the permutation moves trajectories within and
  # across positions, so only the group membership of each trajectory stays.
  episode, rewards, states, mask = _arrays(batch)
  groups = np.array([0, 0, 0, 1, 1, 1], np.int32)
  perm = np.array(perm)
  adv = np.asarray(jit_gigpo(episode, groups, rewards, mask, states, 0.75, 1.0, norm=norm))
  assert np.all(np.isfinite(adv))
  np.testing.assert_allclose(
      adv, ref.gigpo_advantages(episode, groups, rewards, mask, states, 0.75, 1.0, norm),
      rtol=1e-4, atol=1e-5)
  adv_perm = jit_gigpo(episode[perm], groups[perm], rewards[perm], mask[perm], states[perm],
                       0.75, 1.0, norm=norm)
  np.testing.assert_allclose(adv_perm, adv[perm], rtol=1e-5, atol=1e-6)


def test_one_turn_trajectories_reduce_to_grpo():
  # A single-turn rollout is a one-turn trajectory from the task's one start state: its step
  # group is its task group and R_0 = r, so A^S = A^E and GiGPO = (1 + omega) GRPO; the two
  # other estimators are GRPO itself.
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.25, 2.0], np.float32)
  groups = np.array([3, 3, 3, 8, 8, 8, 9], np.int32)
  grpo = np.asarray(group_advantages(rewards, groups, 'grpo'))[:, None]
  turns = {'episode_returns': rewards, 'group_ids': groups, 'turn_rewards': rewards[:, None],
           'turn_mask': np.ones((7, 1), bool), 'state_ids': np.zeros((7, 1), np.int32),
           'gamma': 0.9, 'omega': 0.5}
  np.testing.assert_allclose(turn_advantages('gigpo', **turns), 1.5 * grpo, rtol=1e-6)
  for name in ('trajectory_grpo', 'turn_grpo'):
    np.testing.assert_allclose(turn_advantages(name, **turns), grpo, rtol=1e-6)


def test_turn_grpo_is_gigpo_step_level_with_one_state_per_group():
  # Discounted per-turn returns normalised over every turn of the group: GiGPO's A^S when all
  # of a group's turns share one state. Hand case, norm='mean', group 10's returns 0.25, 0.5,
  # 1, 0, 0, 0.25, 0.5, 1 (mean 0.4375).
  adv = np.asarray(turn_grpo_advantages(HAND_GROUPS, HAND_REWARDS, HAND_MASK, 0.5, 'mean'))
  np.testing.assert_allclose(adv[0], np.array([0.25, 0.5, 1]) - 0.4375, rtol=1e-6)
  one_state = np.zeros_like(HAND_STATES)
  for norm in ('std', 'mean'):
    _, step = ref.gigpo_parts(HAND_EPISODE, HAND_GROUPS, HAND_REWARDS, HAND_MASK, one_state,
                              0.5, norm)
    np.testing.assert_allclose(turn_grpo_advantages(HAND_GROUPS, HAND_REWARDS, HAND_MASK, 0.5,
                                                    norm), step, rtol=1e-5, atol=1e-6)


def test_registry_dispatch():
  turns = {'episode_returns': HAND_EPISODE, 'group_ids': HAND_GROUPS,
           'turn_rewards': HAND_REWARDS, 'turn_mask': HAND_MASK, 'state_ids': HAND_STATES,
           'gamma': 0.5, 'omega': 1.0, 'norm': 'mean'}
  assert set(TURN_ESTIMATORS) == {'trajectory_grpo', 'turn_grpo', 'gigpo'}
  np.testing.assert_allclose(turn_advantages('gigpo', **turns),
                             np.array(HAND_MEAN_TWELFTHS) / 12, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(turn_advantages('trajectory_grpo', **turns),
                                trajectory_advantages(HAND_EPISODE, HAND_GROUPS, HAND_MASK,
                                                      'mean'))
  np.testing.assert_array_equal(turn_advantages('turn_grpo', **turns),
                                turn_grpo_advantages(HAND_GROUPS, HAND_REWARDS, HAND_MASK, 0.5,
                                                     'mean'))
  with pytest.raises(ValueError, match=r"Unknown multi-turn advantage estimator 'grpo'.*"
                                       r"'trajectory_grpo', 'turn_grpo', 'gigpo'"):
    turn_advantages('grpo', **turns)
  # Selectable by name where the loss's estimator is chosen.
  assert LossConfig(advantage_estimator='gigpo').estimator == 'gigpo'


def test_broadcast_to_tokens():
  # Row 0: prompt (2 tokens), turn 0 (2), tool output (1), turn 1 (1), padding; row 1: turn 0,
  # then environment tokens, then a token naming a turn that does not exist (-> 0).
  turn_adv = jnp.array([[0.5, -2.0], [3.0, 7.0]])
  token_turn = jnp.array([[-1, -1, 0, 0, -1, 1, -1], [0, 0, 0, -1, -1, 1, 2]])
  got = broadcast_turn_advantages(turn_adv, token_turn)
  np.testing.assert_array_equal(got, [[0, 0, 0.5, 0.5, 0, -2.0, 0], [3, 3, 3, 0, 0, 7, 0]])
  assert got.dtype == jnp.float32


def test_gradient_of_a_loss_on_turn_advantages_is_finite():
  # 6 trajectories of 10 tokens; token_turn follows the hand case's turns (masked turns have no
  # tokens); environment tokens between turns are -1 and out of the loss mask.
  token_turn = np.full((6, 10), -1, np.int32)
  for i in range(6):
    for t in range(3):
      if HAND_MASK[i, t]:
        token_turn[i, 1 + 3 * t:3 + 3 * t] = t
  loss_mask = token_turn >= 0
  rng = np.random.RandomState(0)
  behaviour = jnp.asarray(-rng.uniform(0.1, 2.0, (6, 10)), jnp.float32)
  logp = behaviour + 0.05 * jnp.asarray(rng.normal(size=(6, 10)), jnp.float32)
  adv = broadcast_turn_advantages(hand_gigpo('std'), token_turn)

  def loss(lp):
    return policy_loss(LossConfig(loss='grpo'), lp, behaviour, adv, loss_mask)[0]

  value, grad = jax.jit(jax.value_and_grad(loss))(logp)
  assert np.isfinite(value) and np.all(np.isfinite(grad))
  assert np.all(np.asarray(grad)[~loss_mask] == 0.0)
  assert np.any(np.asarray(grad)[loss_mask] != 0.0)


def test_groups_of_one_and_equal_returns_are_zero_not_nan():
  # One trajectory per task, and a group whose returns (and states) are all equal.
  episode = np.array([1.0, 2.0, 1.0, 1.0], np.float32)
  groups = np.array([0, 1, 2, 2], np.int32)
  rewards = np.array([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
  states = np.array([[0, 1], [0, 1], [0, 1], [0, 1]], np.int32)
  mask = np.ones((4, 2), bool)
  for norm in ('std', 'mean'):
    adv = jit_gigpo(episode, groups, rewards, mask, states, 0.95, 1.0, norm=norm, eps=0.0)
    np.testing.assert_array_equal(adv, 0.0)


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match=r"norm='whiten' is not valid; choose one of \['std', "
                                       r"'mean'\]"):
    gigpo_advantages(HAND_EPISODE, HAND_GROUPS, HAND_REWARDS, HAND_MASK, HAND_STATES,
                     norm='whiten')
  with pytest.raises(ValueError, match=r'state_ids must have the shape of turn_mask \[B, N\] = '
                                       r'\(6, 3\), got \(6, 2\)'):
    gigpo_advantages(HAND_EPISODE, HAND_GROUPS, HAND_REWARDS, HAND_MASK, HAND_STATES[:, :2])
  with pytest.raises(AssertionError):  # float group ids (chex)
    gigpo_advantages(HAND_EPISODE, HAND_GROUPS.astype(np.float32), HAND_REWARDS, HAND_MASK,
                     HAND_STATES)
  with pytest.raises(AssertionError):  # episode returns per turn instead of per trajectory
    trajectory_advantages(HAND_REWARDS, HAND_GROUPS, HAND_MASK)
