"""``SamplingSpec``: the policy's sampling transform as a value (temperature, top-k, top-p).

A leaf module (numpy only): the config boundary validates it, requests and rollouts carry it
between roles, and ``rlax_llm.policy`` defines what it does to logits. Greedy (temperature 0)
is for evaluation only; ``check_for_rollouts`` refuses it for RL.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """The sampling transform of the policy. ``temperature == 0`` is greedy (evaluation only).

  Attributes:
    temperature: finite, 0 (greedy) or at least float32's smallest normal; logits are divided
      by it (``transform_logits``).
    top_k: int >= 0; keep the ``top_k`` largest logits (0 keeps all).
    top_p: in (0, 1]; keep the smallest set of most probable tokens whose mass reaches
      ``top_p`` (the token that crosses it is kept; 1.0 keeps all).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    # Python or numpy numbers (np.float32(0.7) is a number too); never bools.
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))
    t = self.temperature
    if not real(t) or not math.isfinite(t) or t < 0:
      raise ValueError(f'temperature={t!r} must be a finite number >= 0 (0 is greedy).')
    if 0 < t < np.finfo(np.float32).tiny:
      raise ValueError(f'temperature={t!r} is below float32\'s smallest normal number '
                       f'({np.finfo(np.float32).tiny:.3g}); use 0 (greedy).')
    k = self.top_k
    if not real(k) or not isinstance(k, numbers.Integral) or k < 0:
      raise ValueError(f'top_k={k!r} must be an int >= 0 (0 disables it).')
    p = self.top_p
    if not real(p) or not 0.0 < p <= 1.0:
      raise ValueError(f'top_p={p!r} must be in (0, 1] (1.0 disables it).')
    object.__setattr__(self, 'temperature', float(t))
    object.__setattr__(self, 'top_k', int(k))
    object.__setattr__(self, 'top_p', float(p))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def truncates(self) -> bool:
    """Whether top-k or top-p removes tokens from the support."""
    return self.top_k > 0 or self.top_p < 1.0

  def check_for_rollouts(self) -> 'SamplingSpec':
    """Returns ``self``; raises ValueError for greedy decoding, which RL cannot learn from."""
    if self.greedy:
      raise ValueError(
          'temperature=0 (greedy) is not valid for RL rollouts: every sample of a group would '
          'be identical, every group-relative advantage 0, and RL would learn nothing. Use a '
          'temperature > 0 for rollouts (greedy stays valid for evaluation).')
    return self


GREEDY = SamplingSpec(temperature=0.0)
