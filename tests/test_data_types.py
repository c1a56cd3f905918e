"""make_train_batch packs prompt + completion rows and aligns the per-token arrays."""

import numpy as np

from rlax_llm.types import Rollouts, make_train_batch


def test_packing_aligns_tokens_logprobs_and_versions():
  rollouts = Rollouts(
      prompt_ids=np.array([5, 5]), group_ids=np.array([0, 0], np.int32),
      prompt_tokens=np.array([[1, 7, 8, 0], [1, 9, 0, 0]], np.int32),
      prompt_lengths=np.array([3, 2], np.int32),
      completion_tokens=np.array([[4, 2, 0], [6, 6, 2]], np.int32),
      completion_mask=np.array([[1, 1, 0], [1, 1, 1]], bool),
      behaviour_logprobs=np.array([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]], np.float32),
      versions=np.array([[3, 3, -1], [3, 3, 3]], np.int32),
      finished=np.array([True, True]), completions=['4', '66'],
      rewards=np.array([1.0, 0.0], np.float32))
  batch = make_train_batch(rollouts, np.array([0.7, -0.7]))
  np.testing.assert_array_equal(batch.tokens, [[1, 7, 8, 4, 2, 0, 0], [1, 9, 6, 6, 2, 0, 0]])
  np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0]])
  np.testing.assert_allclose(batch.behaviour_logprobs[0], [0, 0, 0, -0.1, -0.2, 0, 0])
  np.testing.assert_allclose(batch.behaviour_logprobs[1], [0, 0, -0.3, -0.4, -0.5, 0, 0])
  np.testing.assert_array_equal(batch.versions[0], [-1, -1, -1, 3, 3, -1, -1])
  np.testing.assert_allclose(batch.advantages, [0.7, -0.7])
  assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.float32
