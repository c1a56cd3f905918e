"""Calculator: multiply a 3-digit by a 2-digit number (by default) with a ``calculate`` tool.

A small model cannot multiply ``a * b`` in its head, but it can learn to call the tool and copy
its result. ``reset(seed)`` draws ``a`` and ``b`` from the seed (a counter-based hash, the
same on every machine) and asks for the product. Each turn the model either calls tools in its
format (``rlax_llm.envs.tool_calls``; the results come back as tool messages, and the
observation is their text) or answers with ``\\boxed{N}`` or ``Answer: N`` (the last one in
the message counts), which ends the episode with reward 1.0 if ``N == a * b`` and 0.0
otherwise. A message with tool calls is a tool turn even if it also states an answer. A
message with neither, a malformed call, an unknown tool or a bad expression is described in
the observation and costs the turn; ``max_turns`` turns without an answer end the episode with
reward 0.

``oracle_action`` solves every episode in two turns (the supervised warm-up's
demonstrations). With ``demo_error_rate > 0`` the demonstrations are imperfect, as
``task.demo_error_rate``'s are for arithmetic: the episode of a seed is, with that
probability (a pure function of the seed), demonstrated by an oracle that calls the tool on
``a + b`` instead of ``a * b`` and answers with that (a systematic mistake: a warm-up on
these demonstrations plateaus below every problem solved).

``calculate(expression)`` evaluates non-negative integer literals with ``+ - * /`` and
parentheses exactly (``rlax_llm.tasks.countdown.arithmetic_value``: parsed, never
``eval``-ed) and returns the value (an integer, or a decimal to 10 significant digits), or
raises ValueError for anything else, which the model sees as ``error: ...``.
"""

from __future__ import annotations

import re

from rlax_llm.envs.base import EnvStep, TextEnv, check_demo_error_rate, draw_demo_error
from rlax_llm.envs.tool_calls import (
  ToolCallError,
  check_format,
  format_tool_result,
  parse_tool_calls,
  render_tool_call,
  run_tool_calls,
)
from rlax_llm.tasks._util import CounterRng, check_int
from rlax_llm.tasks.countdown import MAX_EXPRESSION_CHARS, arithmetic_value

CALCULATE_TOOL = {'type': 'function', 'function': {
    'name': 'calculate',
    'description': ('Evaluates an arithmetic expression of non-negative integers with + - * / '
                    'and parentheses, exactly.'),
    'parameters': {'type': 'object', 'properties': {'expression': {
        'type': 'string', 'description': 'The expression, e.g. "123 * 45".'}},
                   'required': ['expression']}}}
DEFAULT_INSTRUCTION = ('What is {a} * {b}? You can call the calculate tool. Give the final '
                       'answer as \\boxed{{N}}.')
# The same problems asked without the tool (``tools=False``): the model's own multiplication.
NO_TOOL_INSTRUCTION = 'What is {a} * {b}? Give the final answer as \\boxed{{N}}.'
# The final answer: the last \boxed{N} or "Answer: N" (thousands commas allowed).
_ANSWER_RE = re.compile(r'\\boxed\{\s*(-?[0-9][0-9,]{0,40})\s*\}|Answer:\s*(-?[0-9][0-9,]{0,40})')
_STREAM = 'calculator'
_DEMO_STREAM = 'calculator_demo'  # the CounterRng stream of demo_error_rate's draws


def calculate(expression: str) -> str:
  """The exact value of ``expression`` (see the module docstring) as text; raises ValueError
  naming what is allowed when ``expression`` is not such an expression."""
  found = arithmetic_value(expression)
  if found is None:
    raise ValueError(f'cannot evaluate {expression!r:.80}: use non-negative integers, + - * / '
                     f'and parentheses, at most {MAX_EXPRESSION_CHARS} characters, no division '
                     'by zero')
  value = found[0]
  return str(value.numerator) if value.denominator == 1 else f'{float(value):.10g}'


def final_answer(text: str) -> int | None:
  """The integer of the last ``\\boxed{N}`` or ``Answer: N`` in ``text``, or None."""
  last = None
  for last in _ANSWER_RE.finditer(text):
    pass
  if last is None:
    return None
  return int((last[1] or last[2]).replace(',', ''))


class CalculatorEnv(TextEnv):
  """Multiplication with a calculator tool; implements ``rlax_llm.envs.Environment``."""

  name = 'calculator'

  def __init__(self, min_a: int = 100, max_a: int = 999, min_b: int = 10, max_b: int = 99,
               max_turns: int = 4, tool_format: str = 'simple',
               instruction: str | None = None, tools: bool = True,
               demo_error_rate: float = 0.0):
    """Validates the arguments.

    Args:
      min_a, max_a, min_b, max_b: ``a`` and ``b`` are drawn uniformly from these inclusive
        ranges (non-negative ints).
      max_turns: turns (assistant messages) per episode, >= 1; the oracle needs 2.
      tool_format: how the model writes tool calls (``tool_calls.FORMATS``).
      instruction: the first user message, a ``str.format`` template over ``{a}``, ``{b}``;
        None: ``DEFAULT_INSTRUCTION`` (``NO_TOOL_INSTRUCTION`` without the tool).
      tools: False asks the same problems (the same seeds give the same ``a``, ``b``) with
        no tool shown to the model; a tool call is then an unknown tool's (``error: ...``).
        The starting point without the tool, for comparison (no oracle: it needs the tool).
      demo_error_rate: the probability, in ``[0, 1]``, that a seed's episode is demonstrated
        with ``a + b`` for ``a * b`` (module docstring); 0: every demonstration is right.
        Only ``oracle_action`` (the warm-up) reads it.
    Raises ValueError for an invalid argument.
    """
    owner = type(self).__name__
    if not isinstance(tools, bool):
      raise ValueError(f'{owner} tools={tools!r} must be True or False.')
    super().__init__(max_turns, tools=[CALCULATE_TOOL] if tools else [])
    self.functions = {'calculate': calculate} if tools else {}
    if instruction is None:
      instruction = DEFAULT_INSTRUCTION if tools else NO_TOOL_INSTRUCTION
    self.min_a = check_int(owner, 'min_a', min_a, 0)
    self.max_a = check_int(owner, 'max_a', max_a, self.min_a)
    self.min_b = check_int(owner, 'min_b', min_b, 0)
    self.max_b = check_int(owner, 'max_b', max_b, self.min_b)
    self.tool_format = check_format(tool_format)
    try:
      instruction.format(a=1, b=2)
    except (AttributeError, KeyError, IndexError, ValueError) as e:
      raise ValueError(f'{owner} instruction={instruction!r} is not a str.format template '
                       f'over {{a}}, {{b}}: {e!r}.') from None
    self.instruction = instruction
    self.demo_error_rate = check_demo_error_rate(owner, demo_error_rate,
                                                 'add instead of multiply')
    self.demo_errs = False  # whether this seed's demonstration adds instead of multiplying
    self.a = self.b = 0
    self.last_result: str | None = None

  def _reset(self, seed: int) -> str:
    rng = CounterRng(_STREAM, seed)
    self.a = rng.integers(self.min_a, self.max_a)
    self.b = rng.integers(self.min_b, self.max_b)
    self.last_result = None
    self.demo_errs = draw_demo_error(_DEMO_STREAM, seed, self.demo_error_rate)
    return self.instruction.format(a=self.a, b=self.b)

  def _step(self, action: str) -> EnvStep:
    try:
      calls = parse_tool_calls(action, self.tool_format)
    except ToolCallError as e:
      return EnvStep(f'error: {e}', 0.0, False, {'error': str(e)})
    if calls:
      contents = run_tool_calls(calls, self.functions)
      messages = [format_tool_result(content, self.tool_format, name=call.name)
                  for call, content in zip(calls, contents)]
      self.last_result = contents[-1]
      info = {'messages': messages, 'tool_calls': [c.name for c in calls]}
      errors = [c for c in contents if c.startswith('error: ')]
      if errors:
        info['error'] = errors[0]
      return EnvStep('\n'.join(contents), 0.0, False, info)
    answer = final_answer(action)
    if answer is None:
      error = ('error: no tool call and no final answer; call the calculate tool, or answer '
               'with \\boxed{N}.')
      return EnvStep(error, 0.0, False, {'error': error})
    product = self.a * self.b
    success = answer == product
    verdict = 'correct' if success else 'wrong'
    return EnvStep(f'{answer} is {verdict}.', float(success), True, {'success': success})

  def state_key(self) -> str:
    """The problem and the last tool result (None before any)."""
    return f'calculator/{self.a}*{self.b}/{self.last_result}'

  def oracle_action(self) -> str:
    """A scripted policy that solves every episode in two turns: call ``calculate`` on
    ``a * b`` (``a + b`` on the seeds ``demo_error_rate`` picks, ``demo_errs``), then answer
    with the tool's result. Raises ValueError without the tool."""
    if not self.functions:
      raise ValueError(f'{self.name}: the oracle calls the calculate tool, and tools=False '
                       'hides it; warm up with tools=True.')
    if self.last_result is None:
      op = '+' if self.demo_errs else '*'
      return render_tool_call('calculate', {'expression': f'{self.a} {op} {self.b}'},
                              self.tool_format)
    return f'The product is \\boxed{{{self.last_result}}}.'
