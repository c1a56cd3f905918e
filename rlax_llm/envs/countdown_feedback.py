"""Countdown with feedback: propose expressions, hear how far each is from the target.

The problems, the expression rules and the scorer are the countdown task's
(``rlax_llm.tasks.countdown``: ``reset(seed)`` is ``CountdownTask.train_prompt(seed)``'s
problem). Each turn the model proposes an expression in ``<answer></answer>`` tags (the last
pair counts); one that reaches the target (``score_countdown``) ends the episode with reward
1.0. Otherwise the observation says what the expression equals and how far that is from the
target (``(25 + 50) * 3 = 225, which is 25 below the target 250.``), or why it is not a valid
expression, and the turn is spent; ``max_turns`` turns end the episode with reward 0.
``state_key`` is the problem and the value of the last valid proposal.
"""

from __future__ import annotations

import json

from rlax_llm.envs.base import EnvStep, TextEnv
from rlax_llm.tasks.countdown import (
  CountdownTask,
  evaluate_expression,
  extract_expression,
  score_countdown,
)

DEFAULT_INSTRUCTION = (
    'Using the numbers {numbers}, make {target}. You may use +, -, *, / and parentheses, each '
    'number at most once. Propose an expression inside <answer></answer> tags, for example '
    '<answer>(1 + 2) * 3</answer>; I will tell you its value and how far it is from the target.')


class CountdownFeedbackEnv(TextEnv):
  """Countdown over several turns with feedback; implements ``rlax_llm.envs.Environment``."""

  name = 'countdown_feedback'

  def __init__(self, max_turns: int = 4, min_numbers: int = 3, max_numbers: int = 4,
               min_value: int = 1, max_value: int = 100, min_target: int = 10,
               max_target: int = 1000, use_all: bool = False,
               instruction: str = DEFAULT_INSTRUCTION):
    """Validates the arguments.

    Args:
      max_turns: proposals per episode, >= 1.
      min_numbers .. use_all: the problem distribution, as in ``CountdownTask``.
      instruction: the first user message, a ``str.format`` template over ``{numbers}``,
        ``{target}``.
    Raises ValueError for an invalid argument.
    """
    super().__init__(max_turns)
    self.task = CountdownTask(
        min_numbers=min_numbers, max_numbers=max_numbers, min_value=min_value,
        max_value=max_value, min_target=min_target, max_target=max_target, use_all=use_all,
        num_eval=0, format='chat', instruction=instruction)
    self.numbers: list[int] = []
    self.target = 0
    self.solution = ''
    self.last_value: str | None = None

  def _reset(self, seed: int) -> str:
    prompt = self.task.train_prompt(seed)
    problem = json.loads(prompt.answer)
    self.numbers, self.target = problem['numbers'], problem['target']
    self.solution = problem['solution']
    self.last_value = None
    return prompt.messages[-1]['content']

  def _step(self, action: str) -> EnvStep:
    if score_countdown(action, self.numbers, self.target, 'tag', self.task.use_all):
      return EnvStep(f'Correct: that makes {self.target}.', 1.0, True, {'success': True})
    text = extract_expression(action, 'tag')
    if text is None:
      error = ('error: no expression; propose one inside <answer></answer> tags, for example '
               '<answer>(1 + 2) * 3</answer>.')
      return EnvStep(error, 0.0, False, {'error': error})
    expression = text.rpartition('=')[0].strip() if '=' in text else text
    value = evaluate_expression(expression, self.numbers, self.task.use_all)
    if value is None:
      each = 'exactly once' if self.task.use_all else 'at most once'
      error = (f'error: {expression!r:.80} is not a valid expression over {self.numbers}: use '
               f'+ - * / and parentheses, each number {each}.')
      return EnvStep(error, 0.0, False, {'error': error})
    self.last_value = str(value)
    gap = value - self.target
    if not gap:  # the expression is right but the "= N" after it is not
      error = f'error: {expression} = {value}, not what you wrote after "="; drop or fix it.'
      return EnvStep(error, 0.0, False, {'error': error})
    where = 'above' if gap > 0 else 'below'
    return EnvStep(f'{expression} = {value}, which is {abs(gap)} {where} the target '
                   f'{self.target}.', 0.0, False, {})

  def state_key(self) -> str:
    """The problem and the value of the last valid proposal (None before any)."""
    return f'countdown/{self.numbers}/{self.target}/{self.last_value}'

  def oracle_action(self) -> str:
    """A scripted policy: the problem's reference solution."""
    return f'<answer>{self.solution}</answer>'
