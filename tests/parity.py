"""The trainer's side of a sampler/trainer parity check (imported by the engine tests)."""

import numpy as np


def trainer_logprobs(score, params, prompt, sample, width: int) -> np.ndarray:
  """The trainer's recompute of ``sample``'s log-probs: ``score`` (a jitted
  ``Policy.sequence_log_probs``) of the prompt plus the sample's tokens, right-padded with
  zeros to ``width``, with the sample's support sizes. Returns float32 ``[len(tokens)]``."""
  n = len(prompt) + len(sample.tokens)
  tokens = np.zeros((1, width), np.int32)
  sizes = np.zeros((1, width), np.int32)
  tokens[0, :n] = list(prompt) + list(sample.tokens)
  sizes[0, len(prompt):n] = sample.supports
  return np.asarray(score(params, tokens, sizes).logp)[0, len(prompt) - 1:n - 1]
