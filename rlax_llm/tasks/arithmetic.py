"""Integer arithmetic: prompts ``"a+b="``, answers ``str(a + b)``, reward 1.0 for exact match.

The problem space is every ``(a, op, b)`` with ``a, b`` in ``[0, max_operand]`` and ``op`` in
``operations``. The train / eval split is decided per problem by a seeded 64-bit hash
(SplitMix64 over ``(seed, a, ord(op), b)``, independent of ``PYTHONHASHSEED``): a problem is
held out iff its hash falls below a threshold sized so that the eval pool holds roughly
``max(2 * num_eval, 5% of all problems)``. Train prompts are drawn by a counter-based generator
(the same hash over ``(seed, index, attempt)``) that redraws held-out problems, so
``train_prompt(index)`` is O(1), random-access, and never an eval problem.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from rlax_llm.tasks._util import MASK64, check_format, check_int, task_repr
from rlax_llm.tasks.base import Prompt, chat_messages

ALPHABET = '0123456789+-*='
SUPPORTED_OPERATIONS = '+-*'

# Completions longer than this cannot be an answer of this task (|a * b| < 10**40 for any
# operand range worth training on); the cap also keeps int() away from huge digit strings.
_MAX_ANSWER_CHARS = 64
_ANSWER_RE = re.compile(r'-?[0-9]+')
# 'strict': just the number, or the expression then '=' and the number; optional final period.
_STRICT_RE = re.compile(r'(?:([0-9]+)\s*([+\-*])\s*([0-9]+)\s*=\s*)?(-?[0-9]+)\.?')
_INTEGER_RE = re.compile(r'-?[0-9]+')

ANSWER_FORMATS = ('exact', 'strict', 'last_integer')
DEFAULT_INSTRUCTION = 'What is {a} {op} {b}? Reply with just the number.'

# Problem spaces up to this size are enumerated exactly (pool size checked, eval chosen as
# the pool members with the smallest hashes); larger ones are sampled (see _sample_eval).
_ENUMERATE_LIMIT = 1 << 20
_SAMPLE_BLOCK = 4096

_GOLDEN64 = 0x9E3779B97F4A7C15
# Stream tags keep the split hash, the train stream and the eval sampler independent.
_SPLIT_STREAM = 0x5B117
_TRAIN_STREAM = 0x7AA1
_DEMO_STREAM = 0xDE30
_EVAL_STREAM = 0xE7A1


def _mix64(z):
  """SplitMix64 finalizer (Steele et al., 2014) on a Python int or a uint64 array."""
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
  return z ^ (z >> 31)


def _hash_words(*words):
  """64-bit hash of a sequence of words in ``[0, 2**64)``.

  Each word is a Python int or a uint64 array (arrays broadcast); the result is a Python int
  when all words are ints, else a uint64 array. Both paths compute the same values.
  """
  h = 0
  for word in words:
    h = _mix64(((h ^ word) + _GOLDEN64) & MASK64)
  return h


def _apply(a: int, op: str, b: int) -> int:
  """The exact integer result of ``a op b``."""
  if op == '+':
    return a + b
  if op == '-':
    return a - b
  return a * b


def no_carry_answer(a: int, op: str, b: int) -> int:
  """``a op b`` worked digit by digit with every carry (``+``) or borrow (``-``) forgotten.

  ``57 + 68``: 7+8 -> 5, 5+6 -> 1, giving 15 (exact: 125). ``52 - 38``: 2-8 -> 4, 5-3 -> 2,
  giving 24 (exact: 14). For ``a < b``, ``a - b = -(b - a)`` is worked the same way.
  Problems without carries/borrows get their exact answer.
  """
  if op == '-' and a < b:
    return -no_carry_answer(b, '-', a)
  if op not in '+-':
    raise ValueError(f"no_carry_answer is defined for '+' and '-', got {op!r}.")
  result, place = 0, 1
  while a or b:
    da, db = a % 10, b % 10
    digit = (da + db) % 10 if op == '+' else (da - db) % 10
    result += digit * place
    a, b, place = a // 10, b // 10, place * 10
  return result


def _parse_prompt(text: str) -> tuple[int, str, int]:
  """Inverse of the prompt format ``f'{a}{op}{b}='`` (operands are non-negative)."""
  body = text[:-1]
  for i in range(1, len(body)):
    if body[i] in SUPPORTED_OPERATIONS:
      return int(body[:i]), body[i], int(body[i + 1:])
  raise ValueError(f'not an arithmetic prompt: {text!r}')


def extract_answer(completion: object, answer_format: str = 'exact',
                   problem: tuple[int, str, int] | None = None) -> int | None:
  """The integer a completion states under ``answer_format``, or None. Never raises.

  ASCII digits only; at most 64 characters of answer.

  * ``'exact'``: the completion, stripped of surrounding whitespace, is exactly one integer
    (``-?[0-9]+``).
  * ``'strict'``: the stripped completion is the integer alone, or the expression followed by
    ``=`` and the integer (``57 + 68 = 125``), with an optional final period. With
    ``problem=(a, op, b)`` a stated expression must be that problem.
  * ``'last_integer'``: the last integer anywhere in the completion (a lenient reading of
    free-form replies).
  """
  if not isinstance(completion, str) or len(completion) > 4 * _MAX_ANSWER_CHARS:
    return None
  text = completion.strip()
  if answer_format == 'last_integer':
    found = _INTEGER_RE.findall(text)
    text = found[-1] if found else ''
  elif answer_format == 'strict':
    match = _STRICT_RE.fullmatch(text)
    if match is None:
      return None
    if match[1] is not None and problem is not None and (
        (int(match[1]), match[2], int(match[3])) != tuple(problem)):
      return None
    text = match[4]
  elif answer_format != 'exact':
    return None
  if len(text) > _MAX_ANSWER_CHARS or _ANSWER_RE.fullmatch(text) is None:
    return None
  return int(text)


class ArithmeticTask:
  """``a OP b`` with ``a, b`` uniform in ``[0, max_operand]``, OP uniform in ``operations``.

  Implements the ``rlax_llm.tasks.Task`` protocol. Prompt text is exactly ``f'{a}{op}{b}='``
  and the answer ``str(a op b)`` (negative for some ``'-'`` problems). Train prompts have
  ``prompt_id == index``; eval prompts have ``prompt_id == -1 - i``. With ``format='chat'``
  each prompt also carries ``messages``: the ``instruction`` as a user turn (after an optional
  system prompt), for chat models.
  """

  name = 'arithmetic'

  def __init__(self, seed: int = 0, max_operand: int = 99, operations: str = '+',
               num_eval: int = 200, demo_error_rate: float = 0.0, format: str = 'plain',
               system_prompt: str | None = None, instruction: str = DEFAULT_INSTRUCTION,
               answer_format: str = 'exact'):  # pylint: disable=redefined-builtin
    """Validates the arguments and builds the eval split.

    Args:
      seed: int in ``[0, 2**64)``; fixes the split, the train stream and the eval prompts.
      max_operand: int >= 0; operands are drawn from ``[0, max_operand]``.
      operations: non-empty string of distinct characters from ``'+-*'``.
      num_eval: int >= 0, number of held-out prompts ``eval_prompts`` returns.
      demo_error_rate: float in ``[0, 1]``: the probability that a warm-up demonstration
        (``sft_example``) shows the answer worked without carries/borrows
        (``no_carry_answer``), the classic systematic error of a student. Only the
        demonstrations change; prompts, answers and ``score`` are always exact. A warm-up on
        such imperfect demonstrations leaves a model that is right on carry-free problems and
        torn between two answers on the others: partial competence that RL with the exact
        verifier can repair. Needs ``operations`` without ``'*'`` when > 0.
      format: ``'plain'`` (prompt = ``text``) or ``'chat'`` (prompt = ``messages``).
      system_prompt: optional system turn of chat prompts.
      instruction: the user turn of chat prompts, a ``str.format`` template over ``a``,
        ``op``, ``b`` and ``text``.
      answer_format: how a completion states its answer (``ANSWER_FORMATS``, see
        ``extract_answer``).
    Raises ValueError when an argument is invalid or the problem space is too small to hold
    an eval pool of ``max(2 * num_eval, 5%)`` problems in at most half of it.
    """
    owner = 'ArithmeticTask'
    self.seed = check_int(owner, 'seed', seed, 0, MASK64)
    self.max_operand = check_int(owner, 'max_operand', max_operand, 0)
    self.num_eval = check_int(owner, 'num_eval', num_eval, 0)
    self.operations = _check_operations(operations)
    if (isinstance(demo_error_rate, bool) or not isinstance(demo_error_rate, (int, float))
        or not 0.0 <= demo_error_rate <= 1.0):
      raise ValueError(f'demo_error_rate must be a float in [0, 1], got {demo_error_rate!r}.')
    if demo_error_rate > 0 and '*' in self.operations:
      raise ValueError("demo_error_rate > 0 (no-carry demonstrations) is defined for '+' and "
                       f"'-' only; got operations={self.operations!r}.")
    self.demo_error_rate = float(demo_error_rate)
    check_format(owner, format, system_prompt, instruction, a=1, op='+', b=2, text='1+2=')
    if answer_format not in ANSWER_FORMATS:
      raise ValueError(f'{owner} answer_format={answer_format!r}; choose one of '
                       f'{ANSWER_FORMATS}.')
    self.format = format
    self.system_prompt = system_prompt
    self.instruction = instruction
    self.answer_format = answer_format

    self.num_problems = (self.max_operand + 1) ** 2 * len(self.operations)
    # Expected held-out pool size; a problem is held out iff its split hash < threshold,
    # i.e. with probability pool_target / num_problems.
    self._pool_target = max(2 * self.num_eval, -(-self.num_problems // 20))
    if 2 * self._pool_target > self.num_problems:
      raise ValueError(
          f'ArithmeticTask(max_operand={max_operand}, operations={operations!r}) has '
          f'{self.num_problems} distinct problems, too few for an eval pool of '
          f'{self._pool_target} (max(2 * num_eval, 5%) with num_eval={num_eval}) that leaves '
          'at least half for training; lower num_eval or raise max_operand / add operations.')
    self._threshold = (self._pool_target << 64) // self.num_problems
    if self.num_problems <= _ENUMERATE_LIMIT:
      self._eval_problems = self._enumerate_eval()
    else:
      self._eval_problems = self._sample_eval()

  def __repr__(self) -> str:
    return task_repr(self, 'seed', 'max_operand', 'operations', 'num_eval', 'demo_error_rate',
                     'format', 'answer_format')

  @property
  def charset(self) -> str:
    """``'0123456789+-*='``: every character of a prompt text or a demonstration."""
    return ALPHABET

  def is_eval_problem(self, a: int, op: str, b: int) -> bool:
    """Whether problem ``a op b`` belongs to the held-out pool (a superset of eval_prompts)."""
    return _hash_words(_SPLIT_STREAM, self.seed, int(a), ord(op), int(b)) < self._threshold

  def train_prompt(self, index: int) -> Prompt:
    """The train prompt at stream position ``index >= 0`` (O(1), pure in seed and index)."""
    index = check_int('ArithmeticTask', 'index', index, 0, MASK64)
    n_operand = self.max_operand + 1
    for attempt in itertools.count():
      a = _hash_words(_TRAIN_STREAM, self.seed, index, attempt, 0) % n_operand
      op_index = _hash_words(_TRAIN_STREAM, self.seed, index, attempt, 1) % len(self.operations)
      b = _hash_words(_TRAIN_STREAM, self.seed, index, attempt, 2) % n_operand
      op = self.operations[op_index]
      # Held out with probability <= 1/2 (in expectation over the split), so < 2 draws on
      # average; `%` of a 64-bit hash is uniform up to a bias below n / 2**64.
      if not self.is_eval_problem(a, op, b):
        return self._make_prompt(index, a, op, b)

  def eval_prompts(self) -> list[Prompt]:
    """The ``num_eval`` held-out prompts, distinct and fixed for the seed, ids ``-1 - i``."""
    return [self._make_prompt(-1 - i, a, op, b)
            for i, (a, op, b) in enumerate(self._eval_problems)]

  def score(self, prompt: Prompt, completion: str) -> float:
    """1.0 iff the answer the completion states (``extract_answer`` with the task's
    ``answer_format``) equals the prompt's answer, else 0.0; never raises."""
    problem = None
    if self.answer_format == 'strict':
      try:
        problem = _parse_prompt(prompt.text)
      except (AttributeError, TypeError, ValueError):
        return 0.0
    stated = extract_answer(completion, self.answer_format, problem)
    expected = extract_answer(getattr(prompt, 'answer', None))
    if stated is None or expected is None:
      return 0.0
    return 1.0 if stated == expected else 0.0

  def format_ok(self, completion: object) -> bool:
    """Whether the completion states an integer the way ``answer_format`` asks (right or
    wrong; with ``'strict'`` an expression stated must have the ``a op b = n`` form)."""
    return extract_answer(completion, self.answer_format) is not None

  def sft_example(self, index: int) -> tuple[str, str]:
    """(prompt text, demonstrated answer) of ``train_prompt(index)``.

    The demonstration is the exact answer, except with probability ``demo_error_rate``
    (deterministic in seed and index) the no-carry answer.
    """
    prompt = self.train_prompt(index)
    if self.demo_error_rate > 0:
      draw = _hash_words(_DEMO_STREAM, self.seed, index, 0, 0) / float(1 << 64)
      if draw < self.demo_error_rate:
        a, op, b = _parse_prompt(prompt.text)
        return prompt.text, str(no_carry_answer(a, op, b))
    return prompt.text, prompt.answer

  def _make_prompt(self, prompt_id: int, a: int, op: str, b: int) -> Prompt:
    """Prompt with text ``f'{a}{op}{b}='``, the exact result as answer, and chat messages
    when the format is ``'chat'``."""
    text = f'{a}{op}{b}='
    messages = None
    if self.format == 'chat':
      content = self.instruction.format(a=a, op=op, b=b, text=text)
      messages = chat_messages(content, self.system_prompt)
    return Prompt(prompt_id=prompt_id, text=text, answer=str(_apply(a, op, b)),
                  messages=messages)

  def _enumerate_eval(self) -> list[tuple[int, str, int]]:
    """Exact split: the eval prompts are the ``num_eval`` pool problems with smallest hash.

    Sorting a uniform hash is a seeded permutation, so the choice is uniform over the pool.
    """
    grid = np.arange(self.max_operand + 1, dtype=np.uint64)
    a_grid, b_grid = np.meshgrid(grid, grid, indexing='ij')
    hashes, problems = [], []
    pool_size = 0
    for op in self.operations:
      h = _hash_words(_SPLIT_STREAM, self.seed, a_grid, ord(op), b_grid).ravel()
      held = np.flatnonzero(h < np.uint64(self._threshold))
      pool_size += held.size
      hashes.append(h[held])
      problems.extend((int(a_grid.flat[k]), op, int(b_grid.flat[k])) for k in held)
    if pool_size < self.num_eval:
      raise ValueError(
          f'{self!r}: the held-out pool drew only {pool_size} problems but num_eval='
          f'{self.num_eval}; lower num_eval or raise max_operand.')
    if pool_size == self.num_problems:
      raise ValueError(f'{self!r}: every one of the {self.num_problems} problems fell in the '
                       'held-out pool, leaving none to train on; use another seed or raise '
                       'max_operand.')
    order = np.argsort(np.concatenate(hashes), kind='stable')[:self.num_eval]
    return [problems[k] for k in order]

  def _sample_eval(self) -> list[tuple[int, str, int]]:
    """Sampled split for large problem spaces: the first ``num_eval`` distinct pool problems
    hit by the seeded counter-based draw ``j = 0, 1, ...``.

    The pool holds ~5% (at least 2 * num_eval) of > 2**20 problems, so about
    ``num_eval / P(held out)`` draws suffice; the 8x bound below is never reached in practice.
    """
    n_operand = self.max_operand + 1
    found: dict[tuple[int, str, int], None] = {}
    expected_draws = self.num_eval * self.num_problems // self._pool_target
    max_blocks = 1 + 8 * expected_draws // _SAMPLE_BLOCK
    for block in range(max_blocks):
      if len(found) >= self.num_eval:
        break
      j = np.arange(block * _SAMPLE_BLOCK, (block + 1) * _SAMPLE_BLOCK, dtype=np.uint64)
      a = _hash_words(_EVAL_STREAM, self.seed, j, 0) % np.uint64(n_operand)
      op_index = _hash_words(_EVAL_STREAM, self.seed, j, 1) % np.uint64(len(self.operations))
      b = _hash_words(_EVAL_STREAM, self.seed, j, 2) % np.uint64(n_operand)
      op_code = np.asarray([ord(op) for op in self.operations], dtype=np.uint64)[op_index]
      held = _hash_words(_SPLIT_STREAM, self.seed, a, op_code, b) < np.uint64(self._threshold)
      for k in np.flatnonzero(held):
        found.setdefault((int(a[k]), self.operations[int(op_index[k])], int(b[k])), None)
    if len(found) < self.num_eval:
      raise ValueError(f'{self!r}: found only {len(found)} distinct held-out problems; '
                       'lower num_eval.')
    return list(found)[:self.num_eval]


def _check_operations(operations: object) -> str:
  """Returns ``operations``; ValueError unless it is a non-empty str of distinct '+-*'."""
  if not isinstance(operations, str) or not operations:
    raise ValueError(f'ArithmeticTask operations must be a non-empty string of characters '
                     f'from {SUPPORTED_OPERATIONS!r}, got {operations!r}.')
  unknown = sorted(set(operations) - set(SUPPORTED_OPERATIONS))
  if unknown:
    raise ValueError(f'ArithmeticTask operations={operations!r} contains unsupported '
                     f'{"".join(unknown)!r}; use only characters from '
                     f'{SUPPORTED_OPERATIONS!r}.')
  if len(set(operations)) != len(operations):
    raise ValueError(f'ArithmeticTask operations={operations!r} repeats a character; list each '
                     'operation once (they are drawn uniformly).')
  return operations
