"""The credit an environment run's episodes get (``controller.episodes.Episodes``): an episode
cut by its wall-clock deadline is no failure to learn from, and the credit metrics say what
a batch's advantages hold."""

import pathlib

import numpy as np
import pytest

from rlax_llm import losses
from rlax_llm.cli import load_config_file
from rlax_llm.config import run_spec
from rlax_llm.controller.episodes import Episodes
from rlax_llm.data_types import Trajectory

ROOT = pathlib.Path(__file__).resolve().parents[2]


def trajectory(group, ret, termination='done', turns=2, episode=0):
  """An episode of ``turns`` turns (2 model tokens and 1 observation token each), returning
  ``ret`` at its last turn, each turn acting in the state ``turn`` of its group's map."""
  tokens, mask, turn_of, starts, ends = [1], [False], [-1], [], []
  for t in range(turns):
    starts.append(len(tokens))
    tokens += [2, 3]
    mask += [True, True]
    turn_of += [t, t]
    ends.append(len(tokens))
    tokens.append(4)
    mask.append(False)
    turn_of.append(-1)
  n = len(tokens)
  rewards = np.zeros(turns, np.float32)
  rewards[-1] = ret
  ok = np.full(turns, termination != 'timeout')
  if termination == 'timeout':  # cut inside its last turn: the earlier ones completed
    ok[:-1] = True
  return Trajectory(
      episode_id=episode, group_id=group, prompt_id=group, tokens=np.asarray(tokens, np.int32),
      loss_mask=np.asarray(mask), behaviour_logprobs=np.zeros(n, np.float32),
      support_sizes=np.zeros(n, np.int32), versions=np.zeros(n, np.int32),
      token_turn=np.asarray(turn_of, np.int32), turn_starts=np.asarray(starts, np.int32),
      turn_ends=np.asarray(ends, np.int32), turn_rewards=rewards, turn_mask=ok,
      state_ids=np.arange(turns, dtype=np.int64) + 100 * group, episode_return=float(ret),
      termination=termination, success=ret > 0)


def episodes(estimator):
  config = load_config_file(f'{ROOT}/configs/agent.py:smoke')
  config.rl.advantage_estimator = estimator
  return Episodes(run_spec(config).controller)


# Group 0: a success, two failures and an episode the deadline cut (its return 0 is the
# load's doing); group 1: two failures (no signal).
BATCH = [trajectory(0, 1.0, episode=0), trajectory(0, 0.0, episode=1),
         trajectory(0, 0.0, 'timeout', episode=2), trajectory(0, 0.0, episode=3),
         trajectory(1, 0.0, episode=4), trajectory(1, 0.0, episode=5)]


@pytest.mark.parametrize('estimator', ['grpo', 'trajectory_grpo', 'gigpo'])
def test_a_timed_out_episode_gets_no_credit_and_joins_no_group(estimator):
  train, credit = episodes(estimator)._train_batch(BATCH)
  advantages = np.asarray(train.advantages)
  row = advantages[2] if advantages.ndim == 1 else advantages[2][train.loss_mask[2] > 0]
  assert np.all(row == 0)
  # The other three of group 0 are normalised among themselves: 1, 0, 0.
  expected = np.asarray(losses.group_advantages(np.array([1.0, 0.0, 0.0]), np.zeros(3, int)))
  first_token = [np.flatnonzero(train.loss_mask[i])[0] for i in (0, 1, 3)]
  got = (advantages[[0, 1, 3]] if advantages.ndim == 1
         else advantages[[0, 1, 3], first_token])
  # GiGPO: A^E plus A^S of the first turn's step group, the same three turns (their
  # discounted returns 0.95 * (1, 0, 0) normalise to A^E's values).
  np.testing.assert_allclose(got, expected * (2 if estimator == 'gigpo' else 1), rtol=1e-4)
  assert credit['credit/flat_groups'] == 0.5


def test_credit_metrics_count_what_has_no_signal():
  adv = np.array([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], bool)
  steps = np.array([[0, 1, -1], [0, 2, 3], [4, -1, -1], [4, 5, -1]])
  out = losses.credit_metrics(adv, mask, np.array([0, 0, 1, 1]), np.array([1.0, 0, 0, 0]),
                              steps)
  assert out['credit/zero_fraction'] == pytest.approx(3 / 8)
  assert out['credit/abs_mean'] == pytest.approx(5 / 8)
  assert out['credit/flat_groups'] == 0.5  # group 1 returned 0 twice
  assert out['credit/turn0_mean'] == 0.0 and out['credit/turn0_zero'] == 0.5
  assert out['credit/turn2_mean'] == -1.0 and 'credit/turn3_mean' not in out
  assert out['credit/step_groups'] == 6 and out['credit/step_group_size'] == pytest.approx(8 / 6)
  assert out['credit/singleton_turns'] == pytest.approx(4 / 8)  # steps 1, 2, 3, 5


def test_a_trajectory_without_a_turn_is_no_member_of_its_group():
  """A^E of the others is their own group's: a row whose every turn is masked (cut before its
  first step completed) neither counts in the mean nor gets credit."""
  returns = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
  mask = np.array([[1, 1], [1, 0], [1, 1], [0, 0]], bool)
  adv = np.asarray(losses.trajectory_advantages(returns, np.zeros(4, np.int32), mask))
  alone = np.asarray(losses.group_advantages(returns[:3], np.zeros(3, np.int32)))
  np.testing.assert_allclose(adv[:3][mask[:3]], np.repeat(alone, mask[:3].sum(1)), rtol=1e-6)
  assert np.all(adv[3] == 0)
