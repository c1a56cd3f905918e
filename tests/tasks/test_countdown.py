"""Countdown: the expression parser (never eval), the scorer, the generator and the split."""

import fractions
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.data import prompt_dataset
from rlax_llm.tasks import CountdownTask, Task, make_task
from rlax_llm.tasks.countdown import evaluate_expression, extract_expression, score_countdown

NUMBERS = [25, 50, 3, 7, 3]


@pytest.fixture(scope='module')
def task():
  return CountdownTask(seed=3, num_eval=50)


@pytest.mark.parametrize('expression, value', [
    ('25 + 50', 75),
    ('(25 + 50) * 3', 225),
    ('50 / 3', fractions.Fraction(50, 3)),  # exact rationals, no float rounding
    ('(50 - 25) / (7 - 3 - 3)', 25),
    ('3 * 3 * 7', 63),  # 3 is given twice
    ('  7\t+ 3 ', 10),
    ('7', 7),
    ('(' * 90 + '3' + ')' * 90, 3),  # deep nesting within the length cap parses
])
def test_valid_expressions_evaluate_exactly(expression, value):
  assert evaluate_expression(expression, NUMBERS) == value


@pytest.mark.parametrize('expression', [
    '3 * 3 * 3',  # 3 used three times, given twice
    '25 + 4',  # 4 is not given
    '-3 + 7', '--3', '+7',  # unary operators
    '7 ** 3', '9**9**9', '50 // 3', '50 % 3',  # operators outside + - * /
    '0x19', '1_0', '25.0', '2e1', '07',  # other literal spellings
    '__import__("os").system("true")', 'abs(3)', 'x + 3', '[3]', '3, 7',
    '3 3', '(3', '3 +', '', '   ', '7 / (3 - 3)',  # syntax errors, division by zero
    '(' * 150 + '3' + ')' * 150,  # longer than MAX_EXPRESSION_CHARS
    '٣ + ٧',  # Arabic-Indic digits
    None, 37, b'3 + 7',
])
def test_invalid_expressions_are_rejected_without_evaluation(expression):
  assert evaluate_expression(expression, NUMBERS) is None


def test_use_all_requires_every_number_exactly_once():
  assert evaluate_expression('25 + 50 + 3 + 7 + 3', NUMBERS, use_all=True) == 88
  assert evaluate_expression('25 + 50', NUMBERS, use_all=True) is None


@pytest.mark.parametrize('completion, answer_format, reward', [
    ('(25 + 50) * 3', 'expression', 1.0),
    ('(25 + 50) * 3 = 225', 'expression', 1.0),
    ('(25 + 50) * 3 = 224', 'expression', 0.0),  # a stated result must be the target
    ('(25 + 50) * 3.', 'expression', 1.0),
    ('25 * 3 * 3', 'expression', 1.0),
    ('225', 'expression', 0.0),  # 225 is not a given number
    ('think... <answer>3 * (50 + 25)</answer>', 'tag', 1.0),
    ('<answer>1</answer> then <answer>3 * (50 + 25)</answer>', 'tag', 1.0),
    ('<answer>3 * (50 + 25)', 'tag', 0.0),  # unclosed tag
    ('3 * (50 + 25)', 'tag', 0.0),
    ('working\n\n(25 + 50) * 3\n', 'last_line', 1.0),
    ('(25 + 50) * 3\nso that is it', 'last_line', 0.0),
    ('__import__("os").system("true")', 'expression', 0.0),
    ('9' * 10_000, 'expression', 0.0),
    ('(25 + 50) * 3 = ' + '9' * 5000, 'expression', 0.0),
    ('(25 + 50) * 3 = 1e400', 'expression', 0.0),
    ('(25 + 50) * 3 = nan', 'expression', 0.0),
    ('\ud800', 'expression', 0.0),
    (None, 'expression', 0.0),
    ('(25 + 50) * 3', 'no such format', 0.0),
])
def test_score_countdown_truth_table(completion, answer_format, reward):
  assert score_countdown(completion, NUMBERS, 225, answer_format) == reward


@settings(max_examples=300, deadline=None)
@given(completion=st.one_of(st.text(max_size=80),
                            st.text(alphabet='0123456789+-*/() =<>answer', max_size=80)))
def test_fuzz_score_countdown_never_raises(completion):
  assert score_countdown(completion, NUMBERS, 225, 'tag') in (0.0, 1.0)
  assert score_countdown(completion, NUMBERS, 225, 'expression') in (0.0, 1.0)


def test_every_generated_problem_is_solved_by_its_reference(task):
  assert isinstance(task, Task)
  for prompt in itertools.chain(task.eval_prompts(), map(task.train_prompt, range(300))):
    spec = json.loads(prompt.answer)
    numbers, target = spec['numbers'], spec['target']
    assert task.min_numbers <= len(numbers) <= task.max_numbers
    assert all(task.min_value <= n <= task.max_value for n in numbers)
    assert task.min_target <= target <= task.max_target
    assert str(numbers)[1:-1] in prompt.text and str(target) in prompt.text
    # An independent check of the reference: Python's own arithmetic on the trusted string.
    assert eval(spec['solution']) == pytest.approx(target)  # pylint: disable=eval-used
    assert task.score(prompt, spec['solution']) == 1.0
    assert task.score(prompt, spec['solution'] + ' + 1') == 0.0


def test_split_is_disjoint_deterministic_and_random_access(task):
  evals = task.eval_prompts()
  assert len(evals) == 50 and [p.prompt_id for p in evals] == [-1 - i for i in range(50)]
  keys = {(tuple(sorted(json.loads(p.answer)['numbers'])), json.loads(p.answer)['target'])
          for p in evals}
  assert len(keys) == 50
  for prompt in evals:
    spec = json.loads(prompt.answer)
    assert task.is_eval_problem(spec['numbers'], spec['target'])
  for i in range(500):
    spec = json.loads(task.train_prompt(i).answer)
    assert not task.is_eval_problem(spec['numbers'], spec['target'])
  again = CountdownTask(seed=3, num_eval=50)
  assert again.eval_prompts() == evals
  assert again.train_prompt(12345) == task.train_prompt(12345)
  assert task.train_prompt(7).prompt_id == 7
  assert CountdownTask(seed=4, num_eval=50).eval_prompts() != evals


def test_grain_position_resumes_the_stream(task):
  it = iter(prompt_dataset(task, 2).to_iter_dataset())
  next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(3)]
  resumed = iter(prompt_dataset(CountdownTask(seed=3, num_eval=50), 2).to_iter_dataset())
  resumed.set_state(state)
  assert [next(resumed) for _ in range(3)] == expected
  assert expected[0] == [task.train_prompt(2), task.train_prompt(3)]


def test_chat_format_with_system_prompt_and_tag_answers():
  chat = CountdownTask(num_eval=4, format='chat', system_prompt='Be brief.')
  prompt = chat.train_prompt(0)
  assert prompt.messages[0] == {'role': 'system', 'content': 'Be brief.'}
  assert prompt.messages[1]['role'] == 'user' and '<answer>' in prompt.messages[1]['content']
  assert chat.answer_format == 'tag'
  text, demonstration = chat.sft_example(0)
  assert text == prompt.text and demonstration.startswith('<answer>')
  assert chat.score(prompt, demonstration) == 1.0
  assert chat.format_ok(demonstration) and not chat.format_ok('no tags')
  assert CountdownTask(num_eval=4).train_prompt(0).messages is None


def test_use_all_problems_use_every_number():
  strict = CountdownTask(num_eval=4, use_all=True, min_numbers=3, max_numbers=3)
  for i in range(50):
    spec = json.loads(strict.train_prompt(i).answer)
    assert evaluate_expression(spec['solution'], spec['numbers'], use_all=True) == spec['target']


def test_extract_expression():
  assert extract_expression(' 1 + 2. ', 'expression') == '1 + 2'
  assert extract_expression('a\n1 + 2\n\n', 'last_line') == '1 + 2'
  assert extract_expression('<answer> </answer>', 'tag') is None


@pytest.mark.parametrize('kwargs, message', [
    (dict(min_numbers=1), 'min_numbers must be in'),
    (dict(min_numbers=4, max_numbers=3), 'max_numbers must be in'),
    (dict(eval_fraction=0.9), 'eval_fraction must be in'),
    (dict(format='xml'), "format='xml'"),
    (dict(answer_format='json'), "answer_format='json'"),
    (dict(text_template='{nums}'), 'text_template'),
    (dict(use_all=1), 'use_all must be a bool'),
    (dict(min_target=5000, max_target=6000, max_value=2, min_numbers=2, max_numbers=2), 'widen'),
])
def test_invalid_arguments(kwargs, message):
  with pytest.raises((ValueError, RuntimeError), match=message):
    CountdownTask(num_eval=2, **kwargs)


def test_repr_is_the_constructor_call():
  task = CountdownTask(seed=2, max_numbers=3, num_eval=3, format='chat')
  assert repr(task) == ('CountdownTask(seed=2, min_numbers=3, max_numbers=3, min_value=1, '
                        'max_value=100, min_target=10, max_target=1000, use_all=False, '
                        "num_eval=3, eval_fraction=0.05, format='chat', answer_format='tag')")
  rebuilt = eval(repr(task), {'CountdownTask': CountdownTask})  # pylint: disable=eval-used
  assert rebuilt.eval_prompts() == task.eval_prompts()


def test_make_task_selects_countdown():
  task = make_task({'name': 'countdown', 'seed': 1, 'num_eval': 3, 'max_numbers': 3})
  assert isinstance(task, CountdownTask) and len(task.eval_prompts()) == 3
  with pytest.raises(ValueError, match="unknown config fields \\['numbers'\\]"):
    make_task({'name': 'countdown', 'numbers': 3})
