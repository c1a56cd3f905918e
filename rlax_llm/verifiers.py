"""Verifiers: score completions with a task's reward function, never crashing the run.

A verifier that raises gives reward 0 and a counted error (DESIGN.md "Verifiers"); the
controller logs the count as ``verifier/errors``. Sandboxed code execution with time and
memory limits arrives with the code task.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from rlax_llm.tasks import Prompt, Task


def score_completions(task: Task, prompts: Sequence[Prompt], completions: Sequence[str]
                      ) -> tuple[np.ndarray, int]:
  """Rewards for aligned ``prompts[i]``/``completions[i]``.

  Returns ``(rewards float32 [B], number of errors)``. A score that raises, or that is not a
  finite number, counts as an error and gives 0.
  """
  if len(prompts) != len(completions):
    raise ValueError(f'{len(prompts)} prompts but {len(completions)} completions; they must '
                     'be aligned one to one.')
  rewards = np.zeros(len(prompts), np.float32)
  errors = 0
  for i, (prompt, completion) in enumerate(zip(prompts, completions)):
    try:
      value = float(task.score(prompt, completion))
    except Exception:  # pylint: disable=broad-except
      logging.exception('Verifier of task %r raised on prompt %r', task.name, prompt.prompt_id)
      errors += 1
      continue
    if not math.isfinite(value):
      errors += 1
      continue
    rewards[i] = value
  return rewards, errors
