"""What every task provides: prompts (a train stream and a held-out eval split) and a verifier.

A task is a pure, seeded description of a problem distribution. The train split is an
infinite, random-access stream (``train_prompt(index)``), so a run resumes at any data
position by remembering one integer; the eval split is a fixed list disjoint from it.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from rlax_llm.models.tokenizer import CharTokenizer


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One problem.

  prompt_id: train prompts use their stream index (>= 0); eval prompts use ids that never
    collide with train ones (``ArithmeticTask`` uses ``-1 - i``).
  text: what the policy is conditioned on.
  answer: the reference answer, as text.
  """

  prompt_id: int
  text: str
  answer: str


@runtime_checkable
class Task(Protocol):
  """Prompts + formatting + verifier for one problem family."""

  name: str

  @property
  def tokenizer(self) -> CharTokenizer:
    """The tokenizer whose alphabet covers every prompt and answer of the task."""
    ...

  def train_prompt(self, index: int) -> Prompt:
    """The train-split prompt at stream position ``index >= 0``.

    A pure function of (task seed, index): O(1), no precomputed list, and never a prompt of
    the eval split.
    """
    ...

  def eval_prompts(self) -> list[Prompt]:
    """The held-out split, fixed for the task seed."""
    ...

  def score(self, prompt: Prompt, completion: str) -> float:
    """Reward of ``completion`` (decoded text, without eos) for ``prompt``.

    Never raises: anything malformed scores 0.0.
    """
    ...

  def sft_example(self, index: int) -> tuple[str, str]:
    """(prompt text, target completion text) for train position ``index``; deterministic."""
    ...
