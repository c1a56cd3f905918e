"""Countdown: reach a target number from given numbers with ``+ - * /`` (each number at most once).

The numbers game of the Countdown TV show, the RL testbed of TinyZero and of many R1-style
reproductions (e.g. Pan et al., 2025; reasoning-gym's ``countdown``). A problem is a list of
numbers and a target; a completion states an arithmetic expression, and it scores 1.0 when
the expression is well formed, uses only the given numbers (each at most as often as it is
given; with ``use_all`` every one exactly so), and equals the target in exact rational
arithmetic.

Expressions are parsed, never evaluated as Python: the text must consist of ASCII digits,
``+ - * /``, parentheses and spaces (at most ``MAX_EXPRESSION_CHARS``), and its ``ast`` may hold
only integer literals and the four binary operators; values are ``fractions.Fraction``. So
``9**9**9``, ``2 // 1``, unary minus (``-3``, ``--3``), ``0x19``, ``1_0`` and function calls are
rejected before any arithmetic, and a division by zero makes the expression invalid.

Problems are generated (not taken from reasoning-gym, whose install pulls matplotlib, pillow
and a dozen other packages, and whose generator draws from one stateful RNG per dataset): a
counter-based hash draw (``CounterRng``) picks the numbers, then combines a random subset of
them pairwise with random operators, keeping every intermediate value a positive integer, and
the result is the target, so every problem has a solution. The train / eval split is decided
per problem (the sorted numbers and the target) by a seeded hash: a problem is held out iff
its hash falls in the lowest ``eval_fraction``; train draws redraw held-out problems.
"""

from __future__ import annotations

import ast
import collections
import fractions
import json
import re
from collections.abc import Sequence

from rlax_llm.tasks._util import CounterRng, check_format, check_int, stable_hash, task_repr
from rlax_llm.tasks.base import Prompt, chat_messages

MAX_EXPRESSION_CHARS = 200
ANSWER_FORMATS = ('expression', 'tag', 'last_line')
DEFAULT_TEXT = ('Using the numbers {numbers}, make {target}. Use + - * / and parentheses, each '
                'number at most once.\nExpression: ')
DEFAULT_INSTRUCTION = (
    'Using the numbers {numbers}, create an arithmetic expression that equals {target}. You '
    'may use +, -, *, / and parentheses, and each number at most once. Think it through, then '
    'give the expression inside <answer></answer> tags, for example <answer>(1 + 2) * 3'
    '</answer>.')

_ALLOWED_RE = re.compile(r'[0-9+\-*/() \t]*')
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}
_OP_SYMBOLS = '+-*/'
_TRAIN_STREAM, _EVAL_STREAM, _SPLIT_STREAM = 'countdown/train', 'countdown/eval', 'countdown/split'
_MAX_ATTEMPTS = 1000


class _Invalid(Exception):
  """The expression is not a valid countdown expression."""


def arithmetic_value(expression: object) -> tuple[fractions.Fraction, list[int]] | None:
  """Exact value of an arithmetic expression and its integer literals in order, or None if it
  is invalid (``evaluate_expression``'s rules without the ones on ``numbers``): the one safe
  evaluator of the countdown task and the calculator tool (``rlax_llm.envs.calculator``).
  Never raises, never evaluates Python."""
  if (not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS
      or not expression.strip() or _ALLOWED_RE.fullmatch(expression) is None):
    return None
  try:
    tree = ast.parse(expression.strip(), mode='eval')
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None
  used: list[int] = []

  def value(node: ast.AST) -> fractions.Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # pylint: disable=unidiomatic-typecheck
      used.append(node.value)
      return fractions.Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      left, right = value(node.left), value(node.right)
      if isinstance(node.op, ast.Div) and right == 0:
        raise _Invalid('division by zero')
      return _OPS[type(node.op)](left, right)
    raise _Invalid(f'{type(node).__name__} is not allowed')

  try:
    result = value(tree.body)
  except (_Invalid, RecursionError):
    return None
  return result, used


def evaluate_expression(expression: object, numbers: Sequence[int],
                        use_all: bool = False) -> fractions.Fraction | None:
  """Exact value of a countdown expression over ``numbers``, or None if it is invalid.

  Invalid: not a str, longer than ``MAX_EXPRESSION_CHARS``, a character other than ASCII digits,
  ``+ - * /``, parentheses and blanks, a syntax error, any node besides integer literals and
  binary ``+ - * /`` (unary operators, ``**``, ``//``, calls, names), a literal not among
  ``numbers`` or used more often than given (with ``use_all``: not exactly the numbers), or a
  division by zero. Never raises, never evaluates Python.
  """
  found = arithmetic_value(expression)
  if found is None:
    return None
  result, used = found
  given, counts = collections.Counter(numbers), collections.Counter(used)
  if use_all and counts != given:
    return None
  if any(counts[n] > given[n] for n in counts):
    return None
  return result


def extract_expression(completion: object, answer_format: str) -> str | None:
  """The expression a completion states under ``answer_format``, or None. Never raises.

  * ``'expression'``: the whole completion; ``'tag'``: the last ``<answer>...</answer>``;
    ``'last_line'``: the last non-empty line.
  The result may end in ``= N`` (``(1 + 2) * 3 = 9``), which ``score_countdown`` checks.
  """
  if not isinstance(completion, str):
    return None
  if answer_format == 'tag':  # the last <answer>...</answer>, found in linear time
    end = completion.rfind('</answer>')
    start = completion.rfind('<answer>', 0, end) if end >= 0 else -1
    text = completion[start + len('<answer>'):end] if start >= 0 else None
  elif answer_format == 'last_line':
    stripped = completion.rstrip()
    text = stripped[stripped.rfind('\n') + 1:]
  elif answer_format == 'expression':
    text = completion
  else:
    return None
  if text is None or len(text) > 4 * MAX_EXPRESSION_CHARS:
    return None
  text = text.strip().rstrip('.').strip()
  return text or None


def _split_equals(text: str) -> tuple[str, str | None]:
  """``'expr = 9'`` -> ``('expr', '9')``; ``'expr'`` -> ``('expr', None)``."""
  if '=' not in text:
    return text, None
  left, _, right = text.rpartition('=')
  return left.strip(), right.strip()


def score_countdown(completion: object, numbers: Sequence[int], target: int,
                    answer_format: str = 'expression', use_all: bool = False) -> float:
  """1.0 if the completion's expression (``extract_expression``) is valid over ``numbers`` and
  equals ``target``; an ``= N`` suffix must state the target. Else 0.0; never raises."""
  try:
    text = extract_expression(completion, answer_format)
    if text is None:
      return 0.0
    expression, stated = _split_equals(text)
    if stated is not None and (re.fullmatch(r'-?[0-9]{1,12}', stated) is None
                               or int(stated) != target):
      return 0.0
    result = evaluate_expression(expression, numbers, use_all)
    return 1.0 if result is not None and result == target else 0.0
  except Exception:  # pylint: disable=broad-except
    return 0.0


class CountdownTask:
  """Countdown problems; implements the ``rlax_llm.tasks.Task`` protocol.

  Prompt text is ``text_template`` over ``{numbers}`` (e.g. ``[25, 50, 3, 7]``) and
  ``{target}``; with ``format='chat'`` the user turn is ``instruction`` (same fields plus
  ``{text}``). ``Prompt.answer`` is JSON: ``{"numbers": [...], "target": T, "solution": "..."}``
  (one reference expression; any valid expression scores). Train prompts have ``prompt_id ==
  index``; eval prompts ``-1 - i``.
  """

  name = 'countdown'
  verifier_timeout_s = 10.0

  def __init__(self, seed: int = 0, min_numbers: int = 3, max_numbers: int = 4,
               min_value: int = 1, max_value: int = 100, min_target: int = 10,
               max_target: int = 1000, use_all: bool = False, num_eval: int = 200,
               eval_fraction: float = 0.05, format: str = 'plain',  # pylint: disable=redefined-builtin
               system_prompt: str | None = None, instruction: str = DEFAULT_INSTRUCTION,
               text_template: str = DEFAULT_TEXT, answer_format: str | None = None):
    """Validates the arguments and builds the eval split.

    Args:
      seed: int in ``[0, 2**64)``: fixes the split, the train stream and the eval prompts.
      min_numbers, max_numbers: how many numbers a problem gives, ``2 <= min <= max <= 8``.
      min_value, max_value: the numbers are drawn from ``[min_value, max_value]`` (>= 1).
      min_target, max_target: the target range (>= 1).
      use_all: a solution must use every number exactly once (else: each at most once).
      num_eval: int >= 0, held-out prompts ``eval_prompts`` returns.
      eval_fraction: the share of the problem space held out, in ``(0, 0.5]``.
      format: ``'plain'`` (prompt = ``text``) or ``'chat'`` (prompt = ``messages``).
      system_prompt: optional system turn of chat prompts.
      instruction: the user turn of chat prompts, a template over ``numbers``, ``target``,
        ``text``.
      text_template: the plain-text prompt, a template over ``numbers``, ``target``.
      answer_format: where the completion states its expression (``ANSWER_FORMATS``); None
        picks ``'tag'`` for chat (the default instruction asks for tags) and ``'expression'``
        for plain text.
    Raises ValueError for an invalid argument.
    """
    owner = 'CountdownTask'
    self.seed = check_int(owner, 'seed', seed, 0, (1 << 64) - 1)
    self.min_numbers = check_int(owner, 'min_numbers', min_numbers, 2, 8)
    self.max_numbers = check_int(owner, 'max_numbers', max_numbers, self.min_numbers, 8)
    self.min_value = check_int(owner, 'min_value', min_value, 1)
    self.max_value = check_int(owner, 'max_value', max_value, self.min_value, 10**6)
    self.min_target = check_int(owner, 'min_target', min_target, 1)
    self.max_target = check_int(owner, 'max_target', max_target, self.min_target, 10**9)
    self.num_eval = check_int(owner, 'num_eval', num_eval, 0)
    if not isinstance(use_all, bool):
      raise ValueError(f'{owner} use_all must be a bool, got {use_all!r}.')
    self.use_all = use_all
    if (isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float))
        or not 0 < eval_fraction <= 0.5):
      raise ValueError(f'{owner} eval_fraction must be in (0, 0.5], got {eval_fraction!r}.')
    self.eval_fraction = float(eval_fraction)
    check_format(owner, format, system_prompt, instruction, numbers='[1, 2]', target=3,
                 text='...')
    try:
      text_template.format(numbers='[1, 2]', target=3)
    except (AttributeError, KeyError, IndexError, ValueError) as e:
      raise ValueError(f'{owner} text_template={text_template!r} is not a str.format template '
                       f'over {{numbers}}, {{target}}: {e!r}.') from None
    if answer_format is None:
      answer_format = 'tag' if format == 'chat' else 'expression'
    if answer_format not in ANSWER_FORMATS:
      raise ValueError(f'{owner} answer_format={answer_format!r}; choose one of '
                       f'{ANSWER_FORMATS}.')
    self.format, self.system_prompt, self.instruction = format, system_prompt, instruction
    self.text_template, self.answer_format = text_template, answer_format
    self._threshold = int(self.eval_fraction * (1 << 64))
    self._eval = self._build_eval()

  def __repr__(self) -> str:
    return task_repr(self, 'seed', 'min_numbers', 'max_numbers', 'min_value', 'max_value',
                     'min_target', 'max_target', 'use_all', 'num_eval', 'eval_fraction',
                     'format', 'answer_format')

  @property
  def charset(self) -> str:
    """Every character of a plain-text prompt or a demonstration."""
    fixed = self.text_template.replace('{numbers}', '').replace('{target}', '')
    chars = set(fixed) | set('0123456789[], +-*/()')
    if self.answer_format == 'tag':
      chars |= set('<answer>/')
    return ''.join(sorted(chars))

  def is_eval_problem(self, numbers: Sequence[int], target: int) -> bool:
    """Whether the problem belongs to the held-out pool (order of ``numbers`` ignored)."""
    key = ','.join(map(str, sorted(numbers)))
    return stable_hash(_SPLIT_STREAM, self.seed, key, int(target)) < self._threshold

  def train_prompt(self, index: int) -> Prompt:
    """The train prompt at stream position ``index >= 0`` (O(1), pure in seed and index)."""
    index = check_int('CountdownTask', 'index', index, 0, (1 << 64) - 1)
    for attempt in range(_MAX_ATTEMPTS):
      numbers, target, solution = self._generate(CounterRng(_TRAIN_STREAM, self.seed, index,
                                                            attempt))
      if not self.is_eval_problem(numbers, target):
        return self._make_prompt(index, numbers, target, solution)
    raise RuntimeError(f'{self!r}: no train problem in {_MAX_ATTEMPTS} draws at index {index}; '
                       'widen the number or target ranges.')

  def eval_prompts(self) -> list[Prompt]:
    """The ``num_eval`` held-out prompts, distinct and fixed for the seed, ids ``-1 - i``."""
    return [self._make_prompt(-1 - i, *problem) for i, problem in enumerate(self._eval)]

  def score(self, prompt: Prompt, completion: str) -> float:
    """1.0 iff the completion's expression is valid and equals the target; never raises."""
    try:
      spec = json.loads(prompt.answer)
      numbers, target = [int(n) for n in spec['numbers']], int(spec['target'])
    except Exception:  # pylint: disable=broad-except
      return 0.0
    return score_countdown(completion, numbers, target, self.answer_format, self.use_all)

  def format_ok(self, completion: object) -> bool:
    """Whether the completion states an expression where ``answer_format`` expects it and the
    expression parses (whatever its value)."""
    text = extract_expression(completion, self.answer_format)
    if text is None:
      return False
    expression = _split_equals(text)[0]
    if len(expression) > MAX_EXPRESSION_CHARS or _ALLOWED_RE.fullmatch(expression) is None:
      return False
    try:
      ast.parse(expression, mode='eval')
    except (SyntaxError, ValueError, RecursionError, MemoryError):
      return False
    return True

  def sft_example(self, index: int) -> tuple[str, str]:
    """(prompt text, the reference solution of ``train_prompt(index)``)."""
    prompt = self.train_prompt(index)
    solution = json.loads(prompt.answer)['solution']
    if self.answer_format == 'tag':
      solution = f'<answer>{solution}</answer>'
    return prompt.text, solution

  def _generate(self, rng: CounterRng) -> tuple[list[int], int, str]:
    """One solvable problem: (numbers, target, a solution expression)."""
    for _ in range(_MAX_ATTEMPTS):
      count = rng.integers(self.min_numbers, self.max_numbers)
      numbers = [rng.integers(self.min_value, self.max_value) for _ in range(count)]
      used = count if self.use_all else rng.integers(2, count)
      order = list(range(count))
      for i in range(count - 1, 0, -1):  # Fisher-Yates with the counter RNG
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
      items = [(numbers[k], str(numbers[k])) for k in order[:used]]
      while len(items) > 1:
        i = rng.below(len(items))
        a = items.pop(i)
        b = items.pop(rng.below(len(items)))
        combined = None
        start = rng.below(4)
        for step in range(4):
          combined = _combine(a, b, _OP_SYMBOLS[(start + step) % 4])
          if combined is not None:
            break
        if combined is None:
          break
        items.append(combined)
      if len(items) == 1:
        target, expression = items[0]
        if self.min_target <= target <= self.max_target:
          return numbers, target, expression[1:-1] if expression.startswith('(') else expression
    raise RuntimeError(f'{self!r}: no problem with a target in [{self.min_target}, '
                       f'{self.max_target}] after {_MAX_ATTEMPTS} attempts; widen the ranges.')

  def _build_eval(self) -> list[tuple[list[int], int, str]]:
    """The first ``num_eval`` distinct held-out problems of the seeded eval stream."""
    found: dict[tuple[tuple[int, ...], int], tuple[list[int], int, str]] = {}
    max_draws = 1 + int(16 * self.num_eval / self.eval_fraction)
    for j in range(max_draws):
      if len(found) >= self.num_eval:
        break
      numbers, target, solution = self._generate(CounterRng(_EVAL_STREAM, self.seed, j))
      if self.is_eval_problem(numbers, target):
        found.setdefault((tuple(sorted(numbers)), target), (numbers, target, solution))
    if len(found) < self.num_eval:
      raise ValueError(f'{self!r}: found only {len(found)} distinct held-out problems in '
                       f'{max_draws} draws; lower num_eval or widen the ranges.')
    return list(found.values())

  def _make_prompt(self, prompt_id: int, numbers: list[int], target: int,
                   solution: str) -> Prompt:
    shown = '[' + ', '.join(map(str, numbers)) + ']'
    text = self.text_template.format(numbers=shown, target=target)
    messages = None
    if self.format == 'chat':
      content = self.instruction.format(numbers=shown, target=target, text=text)
      messages = chat_messages(content, self.system_prompt)
    answer = json.dumps({'numbers': numbers, 'target': target, 'solution': solution})
    return Prompt(prompt_id=prompt_id, text=text, answer=answer, messages=messages)


def _combine(a: tuple[int, str], b: tuple[int, str], op: str) -> tuple[int, str] | None:
  """``a op b`` if it keeps the values positive integers (and avoids ``x * 1``, ``x / 1``),
  else None; larger operand first for ``-`` and ``/``."""
  (x, ex), (y, ey) = a, b
  if op in '-/' and x < y:
    (x, ex), (y, ey) = (y, ey), (x, ex)
  if op == '+':
    value = x + y
  elif op == '-':
    value = x - y
  elif op == '*':
    value = x * y if x != 1 and y != 1 else 0
  else:
    value = x // y if y > 1 and x % y == 0 else 0
  if value <= 0:
    return None
  return value, f'({ex} {op} {ey})'
