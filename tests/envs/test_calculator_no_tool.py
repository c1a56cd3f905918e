"""The calculator without its tool (``tools=False``): the same problems, no tool shown."""

import pytest

from rlax_llm.envs import CalculatorEnv
from rlax_llm.envs.calculator import NO_TOOL_INSTRUCTION
from rlax_llm.envs.tool_calls import render_tool_call


def test_the_same_seeds_ask_the_same_problems_without_the_tool():
  for seed in (0, 7, 2**40 + 3):
    with_tool, without = CalculatorEnv(), CalculatorEnv(tools=False)
    first = without.reset(seed)
    with_tool.reset(seed)
    assert (with_tool.a, with_tool.b) == (without.a, without.b)
    assert first == NO_TOOL_INSTRUCTION.format(a=without.a, b=without.b)
    assert 'calculate' not in first and without.tools == [] and with_tool.tools


def test_without_the_tool_a_call_costs_the_turn_and_the_answer_is_checked():
  env = CalculatorEnv(tools=False)
  env.reset(5)
  call = env.step(render_tool_call('calculate', {'expression': f'{env.a} * {env.b}'}, 'simple'))
  assert not call.done and call.reward == 0.0 and 'unknown tool' in call.info['error']
  wrong = CalculatorEnv(tools=False)
  wrong.reset(5)
  assert wrong.step(f'\\boxed{{{env.a * env.b + 1}}}').reward == 0.0
  right = env.step(f'Answer: {env.a * env.b}')
  assert right.done and right.reward == 1.0 and right.info['success']
  with pytest.raises(ValueError, match='tools=False hides it'):
    env.oracle_action()
  with pytest.raises(ValueError, match='tools=.* must be True or False'):
    CalculatorEnv(tools='no')
