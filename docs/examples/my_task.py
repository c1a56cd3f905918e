"""A task and a reward function of your own, plugged into rlax_llm by import path.

docs/custom_tasks.md walks through this module; tests/tasks/test_plugins.py runs it through
``python -m rlax_llm.launch`` with this directory on ``PYTHONPATH``:

    PYTHONPATH=docs/examples python -m rlax_llm.launch --config=configs/default.py:smoke \\
        --config.task.name=my_task:ReverseTask --workdir=/tmp/reverse
    PYTHONPATH=docs/examples python -m rlax_llm.launch --config=docs/examples/my_config.py \\
        --workdir=/tmp/reverse_shaped

The task: reverse a short word over the letters a-f (``"abc>"`` -> ``"cba"``).
"""

from __future__ import annotations

import itertools
import random
import zlib

from rlax_llm.tasks import Prompt, Task

LETTERS = 'abcdef'


class ReverseTask(Task):
  """Reverse a word of ``min_length..max_length`` letters from ``LETTERS``.

  The fields of ``config.task`` other than ``name`` are this constructor's keyword
  arguments; ``seed`` is ``config.seed``.
  """

  name = 'reverse'  # the task's name in logs

  def __init__(self, seed: int = 0, min_length: int = 2, max_length: int = 4,
               num_eval: int = 16, eval_percent: int = 10):
    if not 1 <= min_length <= max_length:
      raise ValueError(f'ReverseTask needs 1 <= min_length <= max_length, got {min_length}, '
                       f'{max_length}.')
    if not 0 < eval_percent < 50:
      raise ValueError(f'ReverseTask eval_percent must be in (0, 50), got {eval_percent}.')
    self.seed, self.min_length, self.max_length = seed, min_length, max_length
    self.eval_percent = eval_percent
    words = sorted(self._held_out_words(), key=lambda w: self._hash('order', w))
    if len(words) < num_eval:
      raise ValueError(f'ReverseTask holds out {len(words)} words, fewer than num_eval='
                       f'{num_eval}; lower num_eval or raise eval_percent.')
    self._eval = [self._prompt(-1 - i, w) for i, w in enumerate(words[:num_eval])]

  @property
  def charset(self) -> str:
    """Every character of a prompt or a demonstration: a tiny model's alphabet."""
    return LETTERS + '>'

  def train_prompt(self, index: int) -> Prompt:
    """A pure function of (seed, index): never a held-out word."""
    rng = random.Random(f'{self.seed}:{index}')
    while True:
      word = self._draw(rng)
      if not self._is_held_out(word):
        return self._prompt(index, word)

  def eval_prompts(self) -> list[Prompt]:
    return list(self._eval)

  def score(self, prompt: Prompt, completion: str) -> float:
    """1.0 for the reversed word (surrounding blanks ignored), else 0.0; never raises."""
    return 1.0 if isinstance(completion, str) and completion.strip() == prompt.answer else 0.0

  def sft_example(self, index: int) -> tuple[str, str]:
    """(prompt, target) demonstrations for the supervised warm-up."""
    prompt = self.train_prompt(index)
    return prompt.text, prompt.answer

  def format_ok(self, completion: str) -> bool:
    """Letters only (the ``format`` reward's check)."""
    return bool(completion.strip()) and set(completion.strip()) <= set(LETTERS)

  def _prompt(self, prompt_id: int, word: str) -> Prompt:
    return Prompt(prompt_id=prompt_id, text=f'{word}>', answer=word[::-1])

  def _draw(self, rng: random.Random) -> str:
    length = rng.randint(self.min_length, self.max_length)
    return ''.join(rng.choice(LETTERS) for _ in range(length))

  def _hash(self, purpose: str, word: str) -> int:
    return zlib.crc32(f'{purpose}:{self.seed}:{word}'.encode())

  def _is_held_out(self, word: str) -> bool:
    return self._hash('split', word) % 100 < self.eval_percent

  def _held_out_words(self) -> list[str]:
    every = (''.join(letters) for n in range(self.min_length, self.max_length + 1)
             for letters in itertools.product(LETTERS, repeat=n))
    return [w for w in every if self._is_held_out(w)]


def same_length(prompt: Prompt, completion: str) -> float:
  """A shaping reward: 1.0 when the completion is as long as the answer, else 0.0."""
  return 1.0 if len(completion.strip()) == len(prompt.answer) else 0.0
