"""The three environments: deterministic for a seed, solvable (a scripted oracle wins), bad
actions contained (an observation that costs the turn, never an exception), the turn limit,
state keys; the registry and plug-ins by import path."""

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.envs import (
  ENVS,
  CalculatorEnv,
  CountdownFeedbackEnv,
  Environment,
  EnvStep,
  GridEnv,
  make_env,
  observation_messages,
)
from rlax_llm.envs.calculator import calculate, final_answer
from rlax_llm.envs.grid import goal_distances
from rlax_llm.envs.tool_calls import FORMATS, render_tool_call
from rlax_llm.tasks.countdown import score_countdown

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / 'docs' / 'examples'
SEEDS = range(25)
# Actions every environment must take without raising: garbage, malformed calls, a megabyte.
BAD_ACTIONS = [
    '', 'hello', '<tool_call>{"name": "calculate", "arguments": ', '<tool_call>[1]</tool_call>',
    '</tool_call>', '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "__import__(\'os\')"}}'
     '</tool_call>'),
    '<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>',
    '{"name": "calculate", "parameters": {"expression": 7}}', '<|python_tag|>oops',
    '<answer>1 + </answer>', '<answer>999999 * 99999</answer>', 'sideways',
    '\\boxed{', 'x' * (1 << 20), '<tool_call>' * 50_000,
]


def make(name, **kwargs):
  return make_env({'name': name, **kwargs})


def transcript(env, seed, actions):
  """Everything the environment says for ``actions`` from ``reset(seed)``."""
  out = [env.reset(seed), env.state_key()]
  for action in actions:
    step = env.step(action)
    out.append((step, env.state_key()))
    if step.done:
      break
  return out


def oracle_episode(env, seed):
  env.reset(seed)
  total, steps = 0.0, []
  while True:
    steps.append(env.step(env.oracle_action()))
    total += steps[-1].reward
    if steps[-1].done:
      return total, steps


@pytest.mark.parametrize('name', sorted(ENVS))
def test_every_env_is_an_environment(name):
  env = make(name)
  assert isinstance(env, Environment)
  assert env.name == name and env.max_turns >= 1 and isinstance(env.tools, list)
  for tool in env.tools:
    assert tool['type'] == 'function' and tool['function']['parameters']['type'] == 'object'


@pytest.mark.parametrize('name', sorted(ENVS))
@pytest.mark.parametrize('seed', [0, 7, 2**63 + 5])
def test_one_seed_one_transcript(name, seed):
  actions = ['down', 'right', '<answer>1 + 2</answer>', BAD_ACTIONS[2], 'left', 'up']
  env = make(name, max_turns=6)
  if name != 'grid':
    actions.insert(0, make(name).oracle_action() if name == 'calculator' else 'x')
  first = transcript(make(name, max_turns=6), seed, actions)
  assert transcript(make(name, max_turns=6), seed, actions) == first
  env.reset(seed + 1)  # another episode in between changes nothing
  assert transcript(env, seed, actions) == first


@pytest.mark.parametrize('name', sorted(ENVS))
def test_seeds_give_different_problems(name):
  env = make(name)
  assert len({env.reset(seed) for seed in SEEDS}) >= 20


@pytest.mark.parametrize('name, fmt', [('calculator', f) for f in FORMATS]
                         + [('grid', None), ('countdown_feedback', None)])
def test_the_oracle_solves_every_seed(name, fmt):
  kwargs = {'tool_format': fmt} if fmt else {}
  env = make(name, max_turns=30, **kwargs)
  for seed in SEEDS:
    total, steps = oracle_episode(env, seed)
    assert steps[-1].info['success'] is True and steps[-1].reward >= 1.0
    assert total == pytest.approx(1.0)
    assert not any('error' in s.info for s in steps)


@pytest.mark.parametrize('name', sorted(ENVS))
def test_bad_actions_are_observations_that_cost_the_turn(name):
  env = make(name, max_turns=len(BAD_ACTIONS) + 1)
  env.reset(3)
  for turn, action in enumerate(BAD_ACTIONS, 1):
    key = env.state_key()
    step = env.step(action)
    assert isinstance(step, EnvStep) and isinstance(step.observation, str)
    assert env.turn == turn
    if step.done:  # a valid move into a hole, or a countdown/calculator answer
      break
    if 'error' in step.info:
      assert step.reward == 0.0 and len(step.observation) < 2000
      assert step.info['error'].startswith('error: ') or name == 'calculator'
      if name != 'calculator':
        assert env.state_key() == key  # an invalid action changes nothing but the turn


def test_calculator_tool_turn_then_answer():
  env = CalculatorEnv(tool_format='qwen')
  prompt = env.reset(11)
  a, b = env.a, env.b
  assert prompt == f'What is {a} * {b}? You can call the calculate tool. Give the final answer ' \
                   'as \\boxed{N}.'
  assert 100 <= a <= 999 and 10 <= b <= 99
  step = env.step('Let me use the tool.\n'
                  + render_tool_call('calculate', {'expression': f'{a} * {b}'}, 'qwen'))
  assert step.observation == str(a * b) and not step.done and step.reward == 0.0
  assert observation_messages(step) == [{'role': 'tool', 'content': str(a * b),
                                         'name': 'calculate'}]
  assert env.state_key() == f'calculator/{a}*{b}/{a * b}'
  step = env.step(f'So the answer is \\boxed{{{a * b + 1}}}.')
  assert step == EnvStep(f'{a * b + 1} is wrong.', 0.0, True, {'success': False})
  with pytest.raises(RuntimeError, match=r'step\(\) after the episode ended'):
    env.step('again')


def test_calculator_errors_are_reported_to_the_model():
  env = CalculatorEnv(tool_format='simple', max_turns=5)
  env.reset(0)
  bad = env.step(render_tool_call('calculate', {'expression': '1 / 0'}, 'simple'))
  assert bad.observation.startswith("error: calculate raised ValueError: cannot evaluate '1 / 0'")
  assert observation_messages(bad)[0]['role'] == 'user'  # simple: results as user messages
  assert 'error: malformed tool call' in env.step('<tool_call>{"name": 1}</tool_call>').observation
  assert 'no tool call and no final answer' in env.step('I think it is big.').observation
  step = env.step('<tool_call>{"name": "calculate", "arguments": {"x": 1}}</tool_call>')
  assert "unexpected keyword argument 'x'" in step.observation
  last = env.step('still thinking')
  assert last.done and last.info == {'error': last.info['error'], 'truncated': True,
                                     'success': False}


@pytest.mark.parametrize('expression, value', [
    ('123 * 45', '5535'), ('(2 + 3) * 4', '20'), ('7 / 2', '3.5'), ('1 / 3', '0.3333333333'),
    ('10 - 20', '-10')])
def test_calculate(expression, value):
  assert calculate(expression) == value


@pytest.mark.parametrize('expression', ['__import__("os").system("true")', '2 ** 10', '-3',
                                        '1 / 0', 'x', '', '9' * 201, '3.5 * 2'])
def test_calculate_refuses_everything_else(expression):
  with pytest.raises(ValueError, match='cannot evaluate'):
    calculate(expression)


@pytest.mark.parametrize('text, answer', [
    ('\\boxed{5535}', 5535), ('Answer: 5,535', 5535), ('\\boxed{1} then Answer: 2', 2),
    ('Answer: 3 and finally \\boxed{ -4 }', -4), ('\\boxed{x}', None), ('5535', None)])
def test_final_answer(text, answer):
  assert final_answer(text) == answer


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), size=st.integers(2, 8),
       frozen=st.floats(0.5, 1.0))
def test_every_grid_is_solvable_by_bfs(seed, size, frozen):
  env = GridEnv(size=size, frozen_fraction=frozen)
  text = env.reset(seed)
  grid = text.rsplit('\n\n', 1)[1].split('\n')
  assert len(grid) == size and all(len(row) == size for row in grid)
  assert grid[0][0] == 'P' and grid[-1][-1] == 'G'
  assert (0, 0) in goal_distances(env.desc)


def test_grid_edges_and_state_keys():
  env, other = GridEnv(size=4, frozen_fraction=1.0), GridEnv(size=4, frozen_fraction=1.0)
  assert env.reset(0).endswith('\n\nP...\n....\n....\n...G')  # all ice
  other.reset(0)
  start = env.state_key()
  assert start == f'grid/{env.grid_id}/0,0'
  edge = env.step('I will go up')
  assert edge.info['error'] == 'error: you cannot move up: the edge of the grid.'
  assert env.state_key() == start and env.turn == 1
  # Two routes to one cell give one state key (GiGPO's step groups); another map another.
  assert env.step('right').observation == 'You moved right.\n\n.P..\n....\n....\n...G'
  env.step('Down.')
  other.step('DOWN')
  other.step('then right')
  assert env.state_key() == other.state_key() == f'grid/{env.grid_id}/1,1'
  third = GridEnv(size=4)
  third.reset(1)
  assert third.grid_id != env.grid_id


def test_grid_hole_ends_the_episode_with_nothing():
  for seed in range(200):
    env = GridEnv(size=4)
    env.reset(seed)
    if env.desc[1][0] == 'H':
      step = env.step('down')
      assert step == EnvStep('You moved down into a hole.', 0.0, True, {'success': False})
      return
  pytest.fail('no map with a hole below the start in 200 seeds')


def test_grid_shaping_adds_up_to_the_distance():
  for seed in range(5):
    env = GridEnv(size=5, shaping=0.1, max_turns=40)
    env.reset(seed)
    distance = goal_distances(env.desc)[(0, 0)]
    total, steps = oracle_episode(env, seed)
    assert len(steps) == distance
    assert total == pytest.approx(1.0 + 0.1 * distance)


def test_countdown_feedback_says_how_far():
  env = CountdownFeedbackEnv()
  env.reset(5)
  a, b = env.numbers[:2]
  step = env.step(f'<answer>{a} + {b}</answer>')
  gap = a + b - env.target
  if gap:
    where = 'above' if gap > 0 else 'below'
    assert step.observation == (f'{a} + {b} = {a + b}, which is {abs(gap)} {where} the target '
                                f'{env.target}.')
    assert env.state_key() == f'countdown/{env.numbers}/{env.target}/{a + b}'
  bad = env.step(f'<answer>{a} + {a} + {a} + {a} + {a}</answer>')
  assert 'is not a valid expression over' in bad.observation and 'error' in bad.info


def test_countdown_feedback_uses_the_task_scorer():
  env = CountdownFeedbackEnv()
  env.reset(9)
  answer = env.oracle_action()
  assert score_countdown(answer, env.numbers, env.target, 'tag') == 1.0
  assert env.step(answer).reward == 1.0


def test_make_env_checks_and_tool_format():
  assert make_env({'name': 'calculator'}, tool_format='llama3').tool_format == 'llama3'
  assert make_env({'name': 'calculator', 'tool_format': 'auto'}, tool_format='qwen').tool_format \
      == 'qwen'
  assert make_env({'name': 'calculator', 'tool_format': 'qwen'}, tool_format='simple') \
      .tool_format == 'qwen'
  assert make_env({'name': 'grid'}, tool_format='qwen').name == 'grid'  # no tools: ignored
  with pytest.raises(ValueError, match=r"unknown environment name 'chess'; valid names: "):
    make_env({'name': 'chess'})
  with pytest.raises(ValueError, match=r"got unknown config fields \['colour'\]"):
    make_env({'name': 'grid', 'colour': 'red'})
  with pytest.raises(ValueError, match='GridEnv size must be in'):
    make_env({'name': 'grid', 'size': 40})
  with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
    make_env({'name': 'calculator', 'tool_format': 'xml'})


def test_a_plug_in_environment_by_import_path(monkeypatch):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  env = make_env({'name': 'my_env:GuessEnv', 'high': 10})
  assert isinstance(env, Environment)
  first = transcript(env, 4, [str(n) for n in range(1, 11)])
  assert first == transcript(make_env({'name': 'my_env:GuessEnv', 'high': 10}), 4,
                             [str(n) for n in range(1, 11)])
  assert first[-1][0].reward == 1.0
  with pytest.raises(ValueError, match=r"env.name='my_env:Nope'.*has no attribute"):
    make_env({'name': 'my_env:Nope'})
  with pytest.raises(TypeError, match='is a function, not a class'):
    make_env({'name': 'rlax_llm.envs:make_env'})
