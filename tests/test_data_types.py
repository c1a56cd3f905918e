"""make_train_batch packs prompt + completion rows and aligns the per-token arrays."""

import dataclasses

import numpy as np

import pytest

from rlax_llm.data_types import FollowLatest, GenerationRequest, Rollouts, make_train_batch
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.tasks import Prompt


def test_packing_aligns_tokens_logprobs_and_versions():
  rollouts = Rollouts(
      prompt_ids=np.array([5, 5]), group_ids=np.array([0, 0], np.int32),
      prompt_tokens=np.array([[1, 7, 8, 0], [1, 9, 0, 0]], np.int32),
      prompt_lengths=np.array([3, 2], np.int32),
      completion_tokens=np.array([[4, 2, 0], [6, 6, 2]], np.int32),
      completion_mask=np.array([[1, 1, 0], [1, 1, 1]], bool),
      behaviour_logprobs=np.array([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]], np.float32),
      support_sizes=np.array([[5, 6, 0], [7, 8, 9]], np.int32),
      versions=np.array([[3, 3, -1], [3, 3, 3]], np.int32),
      finish_reasons=np.array(['stop', 'length']), completions=['4', '66'],
      sampling=SamplingSpec(), timings={}, rewards=np.array([1.0, 0.0], np.float32))
  np.testing.assert_array_equal(rollouts.finished, [True, False])
  batch = make_train_batch(rollouts, np.array([0.7, -0.7]))
  np.testing.assert_array_equal(batch.tokens, [[1, 7, 8, 4, 2, 0, 0], [1, 9, 6, 6, 2, 0, 0]])
  np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0]])
  np.testing.assert_allclose(batch.behaviour_logprobs[0], [0, 0, 0, -0.1, -0.2, 0, 0])
  np.testing.assert_allclose(batch.behaviour_logprobs[1], [0, 0, -0.3, -0.4, -0.5, 0, 0])
  np.testing.assert_array_equal(batch.versions[0], [-1, -1, -1, 3, 3, -1, -1])
  np.testing.assert_array_equal(batch.support_sizes[1], [0, 0, 7, 8, 9, 0, 0])
  np.testing.assert_allclose(batch.advantages, [0.7, -0.7])
  assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.float32


def test_versions_are_per_token_and_mixed_rows_are_found():
  """A weight swap mid-sequence leaves a row with several versions, each token its own, and
  packing keeps them token by token (the trainer's staleness is per token)."""
  versions = np.array([[3, 3, 4, 4], [4, 4, -1, -1], [2, 5, 5, -1], [-1, -1, -1, -1]],
                      np.int32)
  b = len(versions)
  rollouts = Rollouts(
      prompt_ids=np.arange(b), group_ids=np.arange(b, dtype=np.int32),
      prompt_tokens=np.ones((b, 1), np.int32), prompt_lengths=np.ones(b, np.int32),
      completion_tokens=np.ones((b, 4), np.int32), completion_mask=versions >= 0,
      behaviour_logprobs=np.zeros((b, 4), np.float32), support_sizes=np.ones((b, 4), np.int32),
      versions=versions, finish_reasons=np.array(['length', 'stop', 'stop', 'unfinished']),
      completions=[''] * b, sampling=SamplingSpec(), timings={})
  np.testing.assert_array_equal(rollouts.mixed_versions, [True, False, True, False])
  assert rollouts.oldest_version == 2
  batch = make_train_batch(rollouts.select(np.arange(b) < 3), np.zeros(3))
  np.testing.assert_array_equal(batch.versions[0], [-1, 3, 3, 4, 4])
  np.testing.assert_array_equal(batch.versions[2], [-1, 2, 5, 5, -1])


@pytest.mark.parametrize('j', [0, -1, 1.0, True])
def test_follow_latest_needs_a_reload_threshold(j):
  assert FollowLatest(3).j == 3
  with pytest.raises(ValueError, match=r'FollowLatest.j=.* must be an int >= 1'):
    FollowLatest(j)


def test_informative_groups_are_those_with_unequal_rewards():
  # Groups 7 (rewards 1, 0), 3 (0.5, 0.5) and 9 (0, 0, 1), ids unordered and interleaved.
  b = 7
  ids = np.array([7, 3, 9, 7, 9, 3, 9], np.int32)
  rollouts = Rollouts(
      prompt_ids=ids.astype(np.int64), group_ids=ids,
      prompt_tokens=np.ones((b, 2), np.int32), prompt_lengths=np.full(b, 2, np.int32),
      completion_tokens=np.ones((b, 1), np.int32), completion_mask=np.ones((b, 1), bool),
      behaviour_logprobs=np.zeros((b, 1), np.float32), support_sizes=np.ones((b, 1), np.int32),
      versions=np.zeros((b, 1), np.int32), finish_reasons=np.array(['stop'] * b),
      completions=['1'] * b, sampling=SamplingSpec(), timings={},
      rewards=np.array([1.0, 0.5, 0.0, 0.0, 0.0, 0.5, 1.0], np.float32))
  np.testing.assert_array_equal(rollouts.informative_groups, [7, 9])
  with pytest.raises(ValueError, match='needs rewards'):
    _ = dataclasses.replace(rollouts, rewards=None).informative_groups


@pytest.mark.parametrize('field', ['num_samples', 'max_new_tokens'])
@pytest.mark.parametrize('value', [0, -1, 2.0, True])
def test_generation_request_rejects_bad_counts(field, value):
  kwargs = dict(prompt=Prompt(0, '1+1=', '2'), num_samples=2, sampling=SamplingSpec(),
                max_new_tokens=4)
  with pytest.raises(ValueError, match=f'GenerationRequest.{field}='):
    GenerationRequest(**{**kwargs, field: value})
