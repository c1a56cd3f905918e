"""Data that flows between roles (DESIGN.md "Data that flows").

``Rollouts`` is struct-of-arrays (one row per sampled completion), which is what the
sampler produces and what batching needs; ``TrainBatch`` is the padded ``[B, T]`` view the
trainer consumes. ``WeightSnapshot`` lives with the parameter server
(``rlax_llm.paramserver``).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np


@dataclasses.dataclass
class Rollouts:
  """A batch of scored completions, host numpy arrays. ``B`` rows, ``P``/``N`` widths.

  Rows of one prompt share a ``group_id`` and are contiguous.
  """

  prompt_ids: np.ndarray  # int64 [B]
  group_ids: np.ndarray  # int32 [B]
  prompt_tokens: np.ndarray  # int32 [B, P], right-padded
  prompt_lengths: np.ndarray  # int32 [B]
  completion_tokens: np.ndarray  # int32 [B, N], pad after the end
  completion_mask: np.ndarray  # bool [B, N]
  behaviour_logprobs: np.ndarray  # float32 [B, N]
  versions: np.ndarray  # int32 [B, N], policy version per token, -1 on padding
  finished: np.ndarray  # bool [B]: True = stopped at eos, False = hit the length cap
  completions: list[str]  # decoded text
  rewards: np.ndarray  # float32 [B]
  verifier_errors: int = 0

  def __len__(self) -> int:
    return len(self.prompt_ids)

  @property
  def finish_reasons(self) -> list[str]:
    return ['eos' if f else 'length' for f in self.finished]


@flax.struct.dataclass
class TrainBatch:
  """Padded training arrays; position ``t`` refers to token ``t`` (predicted from ``< t``)."""

  tokens: jax.Array  # int32 [B, T]: prompt then completion, right-padded
  loss_mask: jax.Array  # float32 [B, T]: 1 on completion tokens
  behaviour_logprobs: jax.Array  # float32 [B, T]: 0 off the loss mask
  advantages: jax.Array  # float32 [B]
  versions: jax.Array  # int32 [B, T]: -1 off the loss mask
  group_ids: jax.Array  # int32 [B]


def make_train_batch(rollouts: Rollouts, advantages: np.ndarray) -> TrainBatch:
  """Packs each prompt with its completion into a right-padded ``[B, P + N]`` row."""
  b, p = rollouts.prompt_tokens.shape
  n = rollouts.completion_tokens.shape[1]
  length = p + n
  tokens = np.zeros((b, length), np.int32)
  loss_mask = np.zeros((b, length), np.float32)
  logps = np.zeros((b, length), np.float32)
  versions = np.full((b, length), -1, np.int32)
  comp_len = rollouts.completion_mask.sum(axis=1)
  for i in range(b):
    lp, lc = int(rollouts.prompt_lengths[i]), int(comp_len[i])
    tokens[i, :lp] = rollouts.prompt_tokens[i, :lp]
    tokens[i, lp:lp + lc] = rollouts.completion_tokens[i, :lc]
    loss_mask[i, lp:lp + lc] = 1.0
    logps[i, lp:lp + lc] = rollouts.behaviour_logprobs[i, :lc]
    versions[i, lp:lp + lc] = rollouts.versions[i, :lc]
  return TrainBatch(tokens=tokens, loss_mask=loss_mask, behaviour_logprobs=logps,
                    advantages=np.asarray(advantages, np.float32), versions=versions,
                    group_ids=np.asarray(rollouts.group_ids, np.int32))
