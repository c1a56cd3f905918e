"""Helpers shared by the tasks: a stable hash, a counter-based generator, argument checks,
text cleaning."""

from __future__ import annotations

import hashlib
import numbers
import re
import struct

from rlax_llm.tasks.base import PROMPT_FORMATS

MASK64 = (1 << 64) - 1
_SURROGATE_RE = re.compile('[\ud800-\udfff]')


def stable_hash(*parts: int | str) -> int:
  """A 64-bit hash of ints and strings, the same in every process and on every platform
  (BLAKE2b; unlike ``hash()`` it ignores ``PYTHONHASHSEED``)."""
  h = hashlib.blake2b(digest_size=8)
  for part in parts:
    kind = b'i' if isinstance(part, int) else b's'
    data = str(part).encode('utf-8', 'surrogatepass')
    h.update(kind + struct.pack('<Q', len(data)) + data)
  return int.from_bytes(h.digest(), 'little')


class CounterRng:
  """Draws that are a pure function of ``(key..., draw number)``: ``train_prompt(index)`` is
  O(1) and identical across processes, Python and numpy versions."""

  def __init__(self, *key: int | str):
    self.key = key
    self.count = 0

  def below(self, n: int) -> int:
    """Uniform in ``[0, n)`` (bias below ``n / 2**64``)."""
    self.count += 1
    return stable_hash(*self.key, self.count) % n

  def integers(self, low: int, high: int) -> int:
    """Uniform in ``[low, high]``."""
    return low + self.below(high - low + 1)

  def uniform(self) -> float:
    """Uniform in ``[0, 1)``."""
    self.count += 1
    return stable_hash(*self.key, self.count) / float(1 << 64)


def check_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> int:
  """``value`` as a Python int; ValueError naming ``owner.name`` unless it is an int (Python
  or numpy; not a bool) in ``[low, high]`` (``high=None``: no upper bound)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f'{owner} {name} must be an int, got {type(value).__name__}: {value!r}.')
  if value < low or (high is not None and value > high):
    bound = f'>= {low}' if high is None else f'in [{low}, {high}]'
    raise ValueError(f'{owner} {name} must be {bound}, got {value}.')
  return int(value)


def task_repr(task: object, *names: str) -> str:
  """``Name(a=..., b=...)``: the task's class name and the reprs of its attributes ``names``
  (the settings that fix its prompts and scores), as a constructor call would read."""
  fields = ', '.join(f'{name}={getattr(task, name)!r}' for name in names)
  return f'{type(task).__name__}({fields})'


def check_positive_float(owner: str, name: str, value: object) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    raise ValueError(f'{owner} {name} must be a number > 0, got {value!r}.')
  return float(value)


def check_format(owner: str, format: str, system_prompt: object,  # pylint: disable=redefined-builtin
                 instruction: object, **fields: object) -> None:
  """Validates the ``format``/``system_prompt``/``instruction`` trio of a task; ``fields`` are
  example values of the instruction's ``str.format`` fields."""
  if format not in PROMPT_FORMATS:
    raise ValueError(f'{owner} format={format!r}; choose one of {PROMPT_FORMATS}.')
  if system_prompt is not None and not isinstance(system_prompt, str):
    raise ValueError(f'{owner} system_prompt must be a str or None, got {system_prompt!r}.')
  try:
    if not isinstance(instruction, str):
      raise AttributeError('not a str')
    instruction.format(**fields)
  except (AttributeError, KeyError, IndexError, ValueError) as e:
    names = ', '.join('{' + k + '}' for k in fields)
    raise ValueError(f'{owner} instruction={instruction!r} is not a str.format template over '
                     f'{names}: {e!r}.') from None


def clean_text(text: object) -> str | None:
  """``text`` as valid UTF-8-encodable str (lone surrogates become U+FFFD), or None if it is
  not a str."""
  if not isinstance(text, str):
    return None
  try:
    text.encode('utf-8')
    return text
  except UnicodeEncodeError:
    return _SURROGATE_RE.sub('\ufffd', text)
