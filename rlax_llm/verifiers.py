"""Verifiers: score completions with a task's reward function, never crashing the run.

A verifier that raises, returns something that is not a real number, or returns a value that
is not finite once converted to float32 (``1e300`` overflows to inf) gives reward 0 and a
counted error (docs/architecture.md "Roles"); the controller logs the count as ``verifier/errors``.
So a reward that reaches the advantages is always a finite float32. Sandboxed code
execution with time and memory limits arrives with the code task.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import Sequence

import numpy as np

from rlax_llm.tasks.base import Prompt, Task


def as_reward(value: object) -> float | None:
  """``value`` as a finite float32-representable reward, or None if it is not one.

  Accepts Python and numpy real numbers (bools count as 0/1); rejects strings, None,
  complex numbers, arrays, NaN, +-inf and values that overflow float32.
  """
  if not isinstance(value, (numbers.Real, np.bool_)) or isinstance(value, np.ndarray):
    return None
  with np.errstate(over='ignore', invalid='ignore'):
    reward = np.float32(value)
  return float(reward) if np.isfinite(reward) else None


def score_completions(task: Task, prompts: Sequence[Prompt], completions: Sequence[str]
                      ) -> tuple[np.ndarray, int]:
  """Rewards for aligned ``prompts[i]``/``completions[i]``.

  Returns ``(rewards float32 [B], number of errors)``; see the module docstring for what
  counts as an error.
  """
  if len(prompts) != len(completions):
    raise ValueError(f'{len(prompts)} prompts but {len(completions)} completions; they must '
                     'be aligned one to one.')
  rewards = np.zeros(len(prompts), np.float32)
  errors = 0
  for i, (prompt, completion) in enumerate(zip(prompts, completions)):
    try:
      value = task.score(prompt, completion)
    except Exception:  # pylint: disable=broad-except
      logging.exception('Verifier of task %r raised on prompt %r', task.name, prompt.prompt_id)
      errors += 1
      continue
    reward = as_reward(value)
    if reward is None:
      logging.warning('Verifier of task %r returned %r for prompt %r: not a finite real '
                      'number in float32; reward 0.', task.name, value, prompt.prompt_id)
      errors += 1
      continue
    rewards[i] = reward
  return rewards, errors


def score_rollouts(task: Task, prompts: Sequence[Prompt], rollouts):
  """Scores ``rollouts`` (rows of group ``g`` answer ``prompts[g]``); returns them with
  ``rewards`` and ``verifier_errors`` filled in.

  Raises ValueError if a row's ``prompt_id`` is not its prompt's (the worker and the
  controller disagree about which prompt a row answers).
  """
  expanded = [prompts[g] for g in rollouts.group_ids]
  ids = np.asarray([p.prompt_id for p in expanded])
  if not np.array_equal(ids, rollouts.prompt_ids):
    raise ValueError(f'rollout prompt ids {rollouts.prompt_ids.tolist()} do not match the '
                     f'prompts of their groups {ids.tolist()}.')
  rewards, errors = score_completions(task, expanded, rollouts.completions)
  return dataclasses.replace(rollouts, rewards=rewards, verifier_errors=errors)
