"""The verifier role: score completions with a task's scorer, never crashing or blocking the run.

A task's scorer (``task.score``) that raises, hangs past its timeout, returns something that
is not a real number, or returns a value that is not finite once converted to float32
(``1e300`` overflows to inf) gives reward 0 and a counted, logged error (docs/architecture.md
"Roles"); the controller logs the count as ``verifier/errors``. So a reward that reaches the
advantages is always a finite float32.

Scoring runs in a verifier pool: daemon threads, each completion with its own timeout (the
task's ``verifier_timeout_s`` attribute, else ``DEFAULT_TIMEOUT_S``). A thread stuck past its
timeout is abandoned (Python threads cannot be killed) and replaced, so the batch always
finishes. The domain scorers live with their tasks (docs/tasks.md lists which task uses
which) and keep their own slow work in killable subprocesses, so that an abandoned thread is
never left spinning: ``tasks.python_task.score_python`` runs code in ``rlax_llm.sandbox`` and
``tasks.math_scorer.score_math`` runs ``math-verify`` in worker processes that are killed when
an answer is late.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlax_llm.tasks.base import Prompt, Task

if TYPE_CHECKING:  # data_types imports jax; the verifier role runs without it (annotation only)
  from rlax_llm.data_types import Rollouts

DEFAULT_TIMEOUT_S = 30.0  # per completion, when the task has no `verifier_timeout_s`


def _default_workers() -> int:
  return max(4, 2 * (os.cpu_count() or 1))


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


@dataclasses.dataclass
class _Job:
  index: int
  started: float | None = None
  done: bool = False
  abandoned: bool = False
  value: object = None
  error: BaseException | None = None


def run_with_timeouts(fn: Callable[[int], object], count: int, timeout_s: float,
                      max_workers: int | None = None) -> list[tuple[str, object]]:
  """Calls ``fn(i)`` for ``i in range(count)`` on up to ``max_workers`` daemon threads.

  Each call may run ``timeout_s`` seconds from its start; a late call is abandoned (its thread
  is replaced; it ends on its own when ``fn`` returns). Returns one outcome per index:
  ``('ok', value)``, ``('error', exception)`` or ``('timeout', None)``. Never raises for
  anything ``fn`` does.
  """
  if not timeout_s > 0:
    raise ValueError(f'timeout_s must be > 0 seconds, got {timeout_s!r}.')
  jobs = [_Job(i) for i in range(count)]
  pending = list(reversed(jobs))
  cond = threading.Condition()

  def worker():
    while True:
      with cond:
        if not pending:
          return
        job = pending.pop()
        job.started = time.monotonic()
      try:
        value, error = fn(job.index), None
      except BaseException as e:  # pylint: disable=broad-except
        value, error = None, e
      with cond:
        if job.abandoned:
          return  # a replacement thread has taken this one's place
        job.value, job.error, job.done = value, error, True
        cond.notify_all()

  def spawn():
    threading.Thread(target=worker, name='verifier', daemon=True).start()

  for _ in range(min(count, max_workers or _default_workers())):
    spawn()
  with cond:
    while True:
      now = time.monotonic()
      running = [j for j in jobs if j.started is not None and not j.done and not j.abandoned]
      for job in running:
        if now - job.started >= timeout_s:
          job.abandoned = True
          spawn()
      if all(j.done or j.abandoned for j in jobs):
        break
      deadlines = [j.started + timeout_s - now for j in running if not j.abandoned]
      cond.wait(timeout=min(deadlines + [0.5]) + 1e-3)
  outcomes = []
  for job in jobs:
    if job.abandoned:
      outcomes.append(('timeout', None))
    elif job.error is not None:
      outcomes.append(('error', job.error))
    else:
      outcomes.append(('ok', job.value))
  return outcomes


def score_completions(task: Task, prompts: Sequence[Prompt], completions: Sequence[str], *,
                      timeout_s: float | None = None, max_workers: int | None = None
                      ) -> tuple[np.ndarray, int]:
  """Rewards for aligned ``prompts[i]``/``completions[i]``, scored in the verifier pool.

  timeout_s: per-completion limit; None takes ``task.verifier_timeout_s`` if the task has
    one, else ``DEFAULT_TIMEOUT_S``.
  max_workers: pool threads; None takes ``task.verifier_workers`` if set, else
    ``max(4, 2 * cpu_count)``.
  Returns ``(rewards float32 [B], number of errors)``; see the module docstring for what
  counts as an error.
  """
  if timeout_s is None:
    timeout_s = float(getattr(task, 'verifier_timeout_s', DEFAULT_TIMEOUT_S))
  if max_workers is None:
    max_workers = getattr(task, 'verifier_workers', None)
  return score_with(task.score, prompts, completions, timeout_s=timeout_s,
                    max_workers=max_workers,
                    what=f'Verifier of task {getattr(task, "name", type(task).__name__)!r}')


def score_with(score: Callable[[Prompt, str], object], prompts: Sequence[Prompt],
               completions: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
               max_workers: int | None = None, what: str = 'Scorer'
               ) -> tuple[np.ndarray, int]:
  """``score(prompts[i], completions[i])`` for every ``i`` in the verifier pool: a task's
  scorer (``score_completions``) or a reward function (``rlax_llm.rewards``).

  Each call may run ``timeout_s`` seconds; one that raises, runs late or returns something
  that is not a finite float32 gives 0 and counts one error, logged with ``what`` and the
  prompt id. Returns ``(rewards float32 [B], number of errors)``.
  """
  if len(prompts) != len(completions):
    raise ValueError(f'{len(prompts)} prompts but {len(completions)} completions; they must '
                     'be aligned one to one.')
  outcomes = run_with_timeouts(lambda i: score(prompts[i], completions[i]),
                               len(prompts), timeout_s, max_workers)
  rewards = np.zeros(len(prompts), np.float32)
  errors = 0
  for i, (kind, value) in enumerate(outcomes):
    prompt_id = getattr(prompts[i], 'prompt_id', None)
    if kind == 'timeout':
      logging.error('%s took longer than %.1f s on prompt %r; reward 0.', what, timeout_s,
                    prompt_id)
      errors += 1
      continue
    if kind == 'error':
      logging.error('%s raised on prompt %r', what, prompt_id,
                    exc_info=(type(value), value, value.__traceback__))
      errors += 1
      continue
    reward = as_reward(value)
    if reward is None:
      logging.warning('%s returned %r for prompt %r: not a finite real number in float32; '
                      'reward 0.', what, value, prompt_id)
      errors += 1
      continue
    rewards[i] = reward
  return rewards, errors


def score_rollouts(task: Task, prompts: Sequence[Prompt], rollouts: Rollouts) -> Rollouts:
  """Scores ``rollouts`` (rows of group ``g`` answer ``prompts[g]``); returns them with
  ``rewards`` (float32 ``[B]``) and ``verifier_errors`` filled in.

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
