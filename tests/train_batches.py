"""``random_train_batch``: a ``TrainBatch`` around given tokens and loss mask, with random
behaviour log-probs, support sizes and advantages; shared by the trainer tests."""

import numpy as np

from rlax_llm.data_types import TrainBatch


def random_train_batch(rng: np.random.RandomState, tokens: np.ndarray, mask: np.ndarray,
                       vocab: int, support: int | None = None, group: int = 4) -> TrainBatch:
  """``support``: draw support sizes in ``[1, support]`` (else the whole vocabulary);
  ``group``: rows per ``group_ids`` entry."""
  rows, length = tokens.shape
  sizes = (np.full((rows, length), vocab, np.int32) if support is None
           else rng.randint(1, support + 1, (rows, length)).astype(np.int32))
  return TrainBatch(
      tokens=tokens, loss_mask=mask,
      behaviour_logprobs=(np.log(rng.uniform(0.01, 0.3, (rows, length))) * mask).astype(
          np.float32),
      support_sizes=np.where(mask > 0, sizes, 0).astype(np.int32),
      advantages=rng.randn(rows).astype(np.float32),
      versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(rows // group), group).astype(np.int32))
