"""The head-to-head's one reward: 2-digit addition answered in the strict format.

Plain Python (``re`` only: no rlax_llm, JAX or torch), so that rlax_llm's verifier, TRL's
``GRPOTrainer`` and Tunix's GRPO learner, each in its own virtual environment, call the same
function on the same decoded text, and the evaluator grades every side's checkpoints with it.
It restates ``rlax_llm.tasks.arithmetic.ArithmeticTask.score`` with ``answer_format='strict'``
(configs/smollm2.py's task); tests/test_benchmark_peers.py checks that the two agree.

The strict format: the stripped completion is the integer alone (``125``), or the problem
restated then ``=`` and the integer (``57 + 68 = 125``; a restated problem must be the one
asked), with an optional final period. 1.0 iff that integer is the right sum, else 0.0.
"""

from __future__ import annotations

import re

# rlax_llm/tasks/arithmetic.py's patterns and caps, restated.
_STRICT_RE = re.compile(r'(?:([0-9]+)\s*([+\-*])\s*([0-9]+)\s*=\s*)?(-?[0-9]+)\.?')
_INTEGER_RE = re.compile(r'-?[0-9]+')
_MAX_ANSWER_CHARS = 64


def stated_answer(completion: object, problem: tuple[int, str, int]) -> int | None:
  """The integer ``completion`` states in the strict format for ``problem = (a, op, b)``,
  or None (not a string, too long, another format, or a different problem restated)."""
  if not isinstance(completion, str) or len(completion) > 4 * _MAX_ANSWER_CHARS:
    return None
  match = _STRICT_RE.fullmatch(completion.strip())
  if match is None:
    return None
  if match[1] is not None and (int(match[1]), match[2], int(match[3])) != tuple(problem):
    return None
  text = match[4]
  if len(text) > _MAX_ANSWER_CHARS or _INTEGER_RE.fullmatch(text) is None:
    return None
  return int(text)


def reward(completion: object, a: int, op: str, b: int, answer: str) -> float:
  """1.0 iff ``completion`` states ``answer`` (the exact result of ``a op b``, as text) in
  the strict format, else 0.0. Never raises on a completion; ``a``, ``op``, ``b`` and
  ``answer`` are a job row's fields (benchmarks/peers/job.py)."""
  stated = stated_answer(completion, (int(a), op, int(b)))
  expected = answer.strip() if isinstance(answer, str) else ''
  if stated is None or _INTEGER_RE.fullmatch(expected) is None:
    return 0.0
  return 1.0 if stated == int(expected) else 0.0
