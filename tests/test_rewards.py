"""Reward shaping: format reward, DAPO's soft overlong penalty, the weighted combination."""

import dataclasses

import ml_collections
import numpy as np
import pytest

from rlax_llm.rewards import (
    RewardComponent, format_reward, make_components, overlong_penalty, shape_rewards,
    task_reward)
from rlax_llm.tasks import CountdownTask


@dataclasses.dataclass(frozen=True)
class _Rows:
  """The fields of data_types.Rollouts that shaping reads."""

  completions: list
  completion_mask: np.ndarray
  rewards: np.ndarray | None = None


def _rows(lengths, completions=None, rewards=None, width=12):
  mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
  completions = completions or ['x'] * len(lengths)
  return _Rows(completions, mask.astype(np.float32),
               None if rewards is None else np.asarray(rewards, np.float32))


def _dapo_reference(length, max_length, cache):
  """Eq. 13 of DAPO (arXiv 2503.14476), written out case by case."""
  if length <= max_length - cache:
    return 0.0
  if length <= max_length:
    return ((max_length - cache) - length) / cache
  return -1.0


def test_overlong_penalty_matches_dapo_equation():
  lengths = np.arange(0, 13)
  got = overlong_penalty(max_length=10, cache=4)(_rows(lengths, width=13))
  want = [_dapo_reference(n, 10, 4) for n in lengths]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got[:7], 0.0)  # up to L_max - cache: no penalty
  assert got[8] == pytest.approx(-0.5) and got[10] == pytest.approx(-1.0)


@pytest.mark.parametrize('max_length, cache, message', [
    (0, 1, 'max_length must be an int >= 1'),
    (10, 0, r'cache must be an int in \[1, max_length=10\]'),
    (10, 11, r'cache must be an int in \[1, max_length=10\]'),
    (10, 2.5, 'got 2.5'),
])
def test_overlong_penalty_validates(max_length, cache, message):
  with pytest.raises(ValueError, match=message):
    overlong_penalty(max_length, cache)


def test_format_reward_by_pattern_and_by_task():
  rows = _rows([1, 1, 1, 1], ['<think>a</think> 5', 'no tags', '<think>\n</think>', None])
  np.testing.assert_array_equal(format_reward(pattern='<think>.*</think>')(rows), [1, 0, 1, 0])
  task = CountdownTask(num_eval=2, format='chat')  # expects <answer>expression</answer>
  rows = _rows([1, 1, 1], ['<answer>1 + 2</answer>', '<answer>1 +</answer>', '1 + 2'])
  np.testing.assert_array_equal(format_reward(task)(rows), [1, 0, 0])
  with pytest.raises(ValueError, match='not a valid regular expression'):
    format_reward(pattern='(')
  with pytest.raises(ValueError, match='needs a pattern or a task with format_ok'):
    format_reward(task=object())


def test_shape_rewards_weighted_sum_and_parts():
  rows = _rows([2, 12, 6], ['<a>', 'b', '<a>'], rewards=[1.0, 1.0, 0.0])
  components = [RewardComponent('task', 1.0, task_reward()),
                RewardComponent('format', 0.5, format_reward(pattern='<a>')),
                RewardComponent('overlong', 2.0, overlong_penalty(12, 8))]
  total, parts = shape_rewards(rows, components)
  np.testing.assert_array_equal(parts['task'], [1, 1, 0])
  np.testing.assert_array_equal(parts['format'], [1, 0, 1])
  np.testing.assert_allclose(parts['overlong'], [0.0, -1.0, -0.25])
  np.testing.assert_allclose(total, [1.5, 1.0 - 2.0, 0.5 - 0.5])
  assert total.dtype == np.float32 and set(parts) == {'task', 'format', 'overlong'}


def test_shape_rewards_errors():
  rows = _rows([1, 1], rewards=[1.0, 0.0])
  with pytest.raises(ValueError, match='at least one component'):
    shape_rewards(rows, [])
  with pytest.raises(ValueError, match='names must be unique'):
    shape_rewards(rows, [RewardComponent('a', 1.0, task_reward())] * 2)
  with pytest.raises(ValueError, match=r"'bad' returned shape \(3,\), expected \(2,\)"):
    shape_rewards(rows, [RewardComponent('bad', 1.0, lambda r: np.zeros(3))])
  with pytest.raises(ValueError, match="'nan' returned non-finite values"):
    shape_rewards(rows, [RewardComponent('nan', 1.0, lambda r: np.full(2, np.nan))])
  with pytest.raises(ValueError, match='overflows float32'):
    shape_rewards(rows, [RewardComponent('big', 1e39, lambda r: np.ones(2))])
  with pytest.raises(ValueError, match='call verifiers.score_rollouts before'):
    shape_rewards(_rows([1]), [RewardComponent('task', 1.0, task_reward())])
  with pytest.raises(ValueError, match="'mean' is reserved"):
    RewardComponent('mean', 1.0, task_reward())
  with pytest.raises(ValueError, match='weight must be a finite number'):
    RewardComponent('task', float('nan'), task_reward())


def test_make_components_from_config():
  config = ml_collections.ConfigDict(dict(
      task=dict(weight=1.0), format=dict(weight=0.1, pattern='<a>'),
      overlong=dict(weight=1.0, cache=4), length_soft=dict(kind='overlong', weight=0.5,
                                                             max_length=6, cache=2)))
  components = make_components(config, task=None, max_length=10)
  assert {c.name: c.weight for c in components} == {
      'task': 1.0, 'format': 0.1, 'overlong': 1.0, 'length_soft': 0.5}
  rows = _rows([6, 8], ['<a>', ''], rewards=[1.0, 1.0])
  _, parts = shape_rewards(rows, components)
  np.testing.assert_allclose(parts['overlong'], [0.0, -0.5])  # L_max 10, cache 4
  np.testing.assert_allclose(parts['length_soft'], [-1.0, -1.0])  # L_max 6, cache 2
  identity = make_components(None)
  assert [(c.name, c.weight) for c in identity] == [('task', 1.0)]
  assert [c.name for c in make_components({})] == ['task']


@pytest.mark.parametrize('config, message', [
    ({'bonus': {'weight': 1.0}}, "reward.bonus: unknown kind 'bonus'"),
    ({'format': {'weight': 1.0, 'regex': 'x'}}, r"reward.format \(format\) got unknown "
                                                r"parameter\(s\) \['regex'\]"),
    ({'overlong': {'cache': 4}}, 'reward.overlong: overlong needs max_length'),
    ({'overlong': {'cache': 0, 'max_length': 8}}, 'reward.overlong: overlong cache'),
    ({'task': 'heavy'}, 'reward.task must be a group with a weight'),
    ({'task': {'weight': float('inf')}}, 'reward.task: reward component .task. weight'),
    ({'format': {'weight': 1.0}}, 'reward.format: the format reward needs a pattern'),
])
def test_make_components_errors_name_the_key(config, message):
  with pytest.raises(ValueError, match=message):
    make_components(config, task=None, max_length=None)
