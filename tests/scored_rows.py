"""``Rows``: a stand-in for ``data_types.Rollouts`` holding only the fields that
``verifiers.score_rollouts`` reads (no jax import), shared by the verifier and evaluation
tests."""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rows:
  prompt_ids: np.ndarray
  group_ids: np.ndarray
  completions: list
  rewards: np.ndarray | None = None
  verifier_errors: int = 0
