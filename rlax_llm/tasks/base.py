"""What every task provides: prompts (a train stream and a held-out eval split) and a scorer.

A task is a pure, seeded description of a problem distribution. It speaks text only: prompts
are plain text or chat messages, completions are verified as decoded text, and the model's
tokenizer (``rlax_llm.tokenization``) turns them into ids. Nothing here imports model code.
The train split is an infinite, random-access stream (``train_prompt(index)``), so a run
resumes at any data position by remembering one integer; the eval split is a fixed list
disjoint from it. A class of the user's own that subclasses ``Task`` plugs in by import path
(``task.name='module.path:ClassName'``, docs/custom_tasks.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

PROMPT_FORMATS = ('plain', 'chat')


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One problem.

  prompt_id: train prompts use their stream index (>= 0); eval prompts use ids that never
    collide with train ones (``ArithmeticTask`` uses ``-1 - i``).
  text: the problem as plain text (what a plain-text model is conditioned on).
  answer: the reference answer, as text.
  messages: for chat-format tasks, the conversation the model is prompted with (the
    tokenizer renders it with the checkpoint's chat template); None for plain text.
  """

  prompt_id: int
  text: str
  answer: str
  messages: tuple[Mapping[str, Any], ...] | None = None

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe form (what a checkpoint stores for prompts in flight)."""
    return {'prompt_id': self.prompt_id, 'text': self.text, 'answer': self.answer,
            'messages': None if self.messages is None else [dict(m) for m in self.messages]}

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> 'Prompt':
    messages = data.get('messages')
    return cls(prompt_id=data['prompt_id'], text=data['text'], answer=data['answer'],
               messages=None if messages is None else tuple(dict(m) for m in messages))


def chat_messages(content: str, system_prompt: str | None) -> tuple[dict[str, str], ...]:
  """A one-turn conversation: an optional system message, then ``content`` from the user."""
  system = ({'role': 'system', 'content': system_prompt},) if system_prompt else ()
  return (*system, {'role': 'user', 'content': content})


@runtime_checkable
class Task(Protocol):
  """Prompts + formatting + scorer for one problem family."""

  name: str

  @property
  def charset(self) -> str | None:
    """Every character a plain-text prompt or a demonstration can contain, in a fixed order,
    or None. A character-level model built from scratch for the task uses it as its
    alphabet; pretrained models ignore it."""
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
