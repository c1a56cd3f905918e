"""Tests for rlax_llm.tasks (ArithmeticTask, make_task)."""

import collections
import operator
import re

import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.tasks import TASKS, ArithmeticTask, Prompt, Task, make_task
from rlax_llm.tasks.arithmetic import extract_answer, no_carry_answer

OPS = {'+': operator.add, '-': operator.sub, '*': operator.mul}
PROBLEM_RE = re.compile(r'([0-9]+)([+\-*])([0-9]+)=')


def parse(text):
  """Independent parser: 'a+b=' -> (a, op, b)."""
  match = PROBLEM_RE.fullmatch(text)
  assert match is not None, text
  return int(match[1]), match[2], int(match[3])


def check_prompt(prompt, max_operand, operations):
  a, op, b = parse(prompt.text)
  assert 0 <= a <= max_operand and 0 <= b <= max_operand
  assert op in operations
  assert prompt.answer == str(OPS[op](a, b))


@pytest.fixture(scope='module')
def task():
  return ArithmeticTask(seed=0, max_operand=99, operations='+-*', num_eval=200)


def test_implements_task_protocol(task):
  assert isinstance(task, Task)
  assert task.name == 'arithmetic'


def test_train_prompts_are_correct_and_cover_the_space(task):
  prompts = [task.train_prompt(i) for i in range(3000)]
  for i, prompt in enumerate(prompts):
    assert prompt.prompt_id == i
    check_prompt(prompt, 99, '+-*')
  ops = collections.Counter(parse(p.text)[1] for p in prompts)
  assert all(850 < ops[op] < 1150 for op in '+-*'), ops
  operands = {parse(p.text)[0] for p in prompts}
  assert operands == set(range(100))
  assert any(p.answer.startswith('-') for p in prompts)


def test_train_prompt_is_deterministic_and_random_access(task):
  again = ArithmeticTask(seed=0, max_operand=99, operations='+-*', num_eval=200)
  assert [task.train_prompt(i) for i in range(50)] == [again.train_prompt(i) for i in range(50)]
  assert task.train_prompt(10**12) == again.train_prompt(10**12)
  other = ArithmeticTask(seed=1, max_operand=99, operations='+-*', num_eval=200)
  same = sum(task.train_prompt(i) == other.train_prompt(i) for i in range(50))
  assert same < 5


def test_train_and_eval_are_disjoint(task):
  eval_texts = {p.text for p in task.eval_prompts()}
  for i in range(5000):
    prompt = task.train_prompt(i)
    assert prompt.text not in eval_texts
    assert not task.is_eval_problem(*parse(prompt.text))


def test_eval_prompts_size_uniqueness_ids_and_determinism(task):
  prompts = task.eval_prompts()
  assert len(prompts) == 200
  assert len({p.text for p in prompts}) == 200
  assert [p.prompt_id for p in prompts] == [-1 - i for i in range(200)]
  for prompt in prompts:
    check_prompt(prompt, 99, '+-*')
    assert task.is_eval_problem(*parse(prompt.text))
  assert ArithmeticTask(seed=0, max_operand=99, operations='+-*').eval_prompts() == prompts
  other = ArithmeticTask(seed=1, max_operand=99, operations='+-*').eval_prompts()
  assert len({p.text for p in other} & {p.text for p in prompts}) < 40


def test_eval_pool_size_is_about_five_percent():
  task = ArithmeticTask(seed=3, max_operand=99, operations='+', num_eval=100)
  pool = sum(task.is_eval_problem(a, '+', b) for a in range(100) for b in range(100))
  assert 400 < pool < 600  # target max(2 * 100, 5% of 10000) = 500


def test_tiny_space_split_is_exact():
  task = ArithmeticTask(seed=0, max_operand=9, operations='+', num_eval=10)
  pool = {(a, '+', b) for a in range(10) for b in range(10) if task.is_eval_problem(a, '+', b)}
  assert {parse(p.text) for p in task.eval_prompts()} <= pool
  train = {parse(task.train_prompt(i).text) for i in range(400)}
  assert not train & pool
  assert len(train) > 60  # nearly all of the ~80 train problems are reached


def test_large_space_uses_sampled_eval_split():
  task = ArithmeticTask(seed=5, max_operand=1100, operations='+-', num_eval=50)
  prompts = task.eval_prompts()
  assert len({p.text for p in prompts}) == 50
  for prompt in prompts:
    check_prompt(prompt, 1100, '+-')
    assert task.is_eval_problem(*parse(prompt.text))
  for i in range(300):
    assert not task.is_eval_problem(*parse(task.train_prompt(i).text))
  assert ArithmeticTask(seed=5, max_operand=1100, operations='+-', num_eval=50).eval_prompts() \
      == prompts


def test_sft_example_matches_train_prompt(task):
  for i in (0, 7, 123):
    prompt = task.train_prompt(i)
    assert task.sft_example(i) == (prompt.text, prompt.answer)


def test_charset_covers_prompts_and_answers(task):
  for prompt in task.eval_prompts()[:50] + [task.train_prompt(i) for i in range(50)]:
    assert set(prompt.text + prompt.answer) <= set(task.charset)
  demo = ArithmeticTask(demo_error_rate=1.0)
  assert all(set(''.join(demo.sft_example(i))) <= set(demo.charset) for i in range(50))


def test_chat_format_carries_messages_with_the_instruction():
  task = ArithmeticTask(format='chat', system_prompt='Be brief.',
                        instruction='Compute {a}{op}{b}.')
  prompt = task.train_prompt(3)
  a, op, b = parse(prompt.text)
  assert prompt.messages == ({'role': 'system', 'content': 'Be brief.'},
                             {'role': 'user', 'content': f'Compute {a}{op}{b}.'})
  assert ArithmeticTask(format='chat').train_prompt(3).messages[0]['role'] == 'user'
  assert ArithmeticTask().train_prompt(3).messages is None


@pytest.mark.parametrize('completion, reward', [
    ('125', 1.0), (' 125.\n', 1.0), ('57+68=125', 1.0), ('57 + 68 = 125.', 1.0),
    ('57+68 = 124', 0.0), ('12+68=125', 0.0), ('The answer is 125', 0.0), ('125 apples', 0.0),
    ('125\n125', 0.0), ('=125', 0.0),
])
def test_strict_answer_format(completion, reward):
  task = ArithmeticTask(answer_format='strict')
  assert task.score(Prompt(prompt_id=0, text='57+68=', answer='125'), completion) == reward


def test_last_integer_answer_format():
  task = ArithmeticTask(answer_format='last_integer')
  prompt = Prompt(prompt_id=0, text='57+68=', answer='125')
  assert task.score(prompt, 'Adding 57 and 68 gives 125.') == 1.0
  assert task.score(prompt, 'It is 125, or maybe 124') == 0.0
  assert task.score(prompt, 'no digits') == 0.0


@pytest.mark.parametrize('kwargs, message', [
    (dict(format='markdown'), "format='markdown'"),
    (dict(answer_format='fuzzy'), "answer_format='fuzzy'"),
    (dict(instruction='{x}'), 'not a str.format template'),
])
def test_formatting_arguments_are_validated(kwargs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    ArithmeticTask(**kwargs)


def test_importing_tasks_loads_no_model_code():
  """Tasks speak text: importing them must not load flax, jinja2 or rlax_llm.models."""
  import subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  code = ('import sys, rlax_llm.tasks, rlax_llm.verifiers; '
          'print(sorted(m for m in sys.modules if m.split(".")[0] in '
          '("flax", "jinja2", "jax", "tokenizers", "gguf") or m.startswith("rlax_llm.models")))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]', out.stdout


def test_score_correct_and_wrong():
  task = ArithmeticTask()
  prompt = Prompt(prompt_id=0, text='37-82=', answer='-45')
  assert task.score(prompt, '-45') == 1.0
  assert task.score(prompt, ' -45\n') == 1.0
  assert task.score(prompt, '-045') == 1.0
  assert task.score(prompt, '45') == 0.0
  assert task.score(prompt, '-46') == 0.0


@pytest.mark.parametrize('completion', [
    '', ' ', '-', '--45', '+95', '95=', '9 5', '95.0', '1e2', '95+0', 'abc',
    '\u0669\u0665',  # Arabic-Indic digits: int() accepts them, the strict regex must not.
    '9' * 100_000, None, 95, 95.0, b'95', ['95'],
])
def test_score_malformed_is_zero(completion):
  task = ArithmeticTask()
  prompt = Prompt(prompt_id=0, text='69+26=', answer='95')
  assert task.score(prompt, completion) == 0.0


def test_score_malformed_prompt_is_zero():
  task = ArithmeticTask()
  assert task.score(None, '95') == 0.0
  assert task.score(Prompt(prompt_id=0, text='1+1=', answer='two'), '2') == 0.0


SCORE_TASK = ArithmeticTask()


@settings(max_examples=60, deadline=None)
@given(completion=st.one_of(st.text(max_size=30),
                            st.text(alphabet='0123456789+-*= \n', max_size=12)))
def test_score_never_raises_and_matches_reference(completion):
  prompt = Prompt(prompt_id=0, text='69+26=', answer='95')
  reward = SCORE_TASK.score(prompt, completion)
  expected = 1.0 if re.fullmatch(r'0*95', completion.strip()) else 0.0
  assert reward == expected


@settings(max_examples=50, deadline=None)
@given(value=st.integers(min_value=-(10**30), max_value=10**30))
def test_extract_answer_round_trips_integers(value):
  assert extract_answer(str(value)) == value
  assert extract_answer(f'  {value}\n') == value


def test_extract_answer_rejects_non_integers():
  for bad in ('', '1 2', '0x10', '1_000', '\uff11', None, 12):
    assert extract_answer(bad) is None


@pytest.mark.parametrize('kwargs, message', [
    (dict(operations=''), 'non-empty'),
    (dict(operations='+/'), r"unsupported '/'"),
    (dict(operations='++'), 'repeats'),
    (dict(operations=None), 'non-empty string'),
    (dict(max_operand=-1), r'max_operand must be >= 0, got -1'),
    (dict(seed=-3), r'seed must be in \[0, '),
    (dict(seed=1.5), 'seed must be an int, got float'),
    (dict(num_eval=True), 'num_eval must be an int, got bool'),
    (dict(max_operand=5, num_eval=100), r'36 distinct problems, too few .*lower num_eval'),
])
def test_invalid_constructor_args(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ArithmeticTask(**kwargs)


def test_repr_is_the_constructor_call_and_numpy_ints_are_accepted():
  task = ArithmeticTask(seed=np.uint64(3), max_operand=np.int32(20), operations='+-',
                        num_eval=10, format='chat')
  assert (type(task.seed), type(task.max_operand)) == (int, int)
  assert repr(task) == ("ArithmeticTask(seed=3, max_operand=20, operations='+-', num_eval=10, "
                        "demo_error_rate=0.0, format='chat', answer_format='exact')")
  rebuilt = eval(repr(task), {'ArithmeticTask': ArithmeticTask})  # pylint: disable=eval-used
  assert rebuilt.eval_prompts() == task.eval_prompts()


def test_negative_index_raises(task):
  with pytest.raises(ValueError, match='index must be in'):
    task.train_prompt(-1)


def test_make_task_builds_from_config_dict():
  config = ml_collections.ConfigDict(
      dict(name='arithmetic', seed=4, max_operand=20, operations='*', num_eval=10))
  task = make_task(config)
  assert isinstance(task, ArithmeticTask)
  assert (task.seed, task.max_operand, task.operations, task.num_eval) == (4, 20, '*', 10)
  assert task.eval_prompts() == ArithmeticTask(4, 20, '*', 10).eval_prompts()
  assert set(TASKS) == {'arithmetic', 'countdown', 'math', 'python'}


def test_make_task_unknown_name_lists_valid_names():
  with pytest.raises(ValueError, match=r"unknown task name 'gsm9k'; valid names: "
                     r"\['arithmetic', 'countdown', 'math', 'python'\]"):
    make_task(ml_collections.ConfigDict(dict(name='gsm9k')))


def test_make_task_unknown_field_and_missing_name():
  with pytest.raises(ValueError, match=r"unknown config fields \['max_opernd'\]"):
    make_task(dict(name='arithmetic', max_opernd=9))
  with pytest.raises(ValueError, match='no "name" field'):
    make_task(dict(seed=0))


# --- Imperfect demonstrations (demo_error_rate) -------------------------------------------


def _no_carry_reference(a, op, b):
  """Column arithmetic on zero-padded digit strings, dropping carries/borrows."""
  if op == '-' and a < b:
    return -_no_carry_reference(b, op, a)
  width = max(len(str(a)), len(str(b)))
  da, db = str(a).zfill(width), str(b).zfill(width)
  cols = [(int(x) + int(y)) % 10 if op == '+' else (int(x) - int(y)) % 10
          for x, y in zip(da, db)]
  return int(''.join(map(str, cols)))


@pytest.mark.parametrize('a, op, b, expected', [
    (57, '+', 68, 15), (52, '-', 38, 24), (38, '-', 52, -24), (12, '+', 34, 46),
    (5, '+', 99, 94), (0, '+', 0, 0), (90, '-', 90, 0),
])
def test_no_carry_answer_examples(a, op, b, expected):
  assert no_carry_answer(a, op, b) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from('+-'), st.integers(0, 10**6))
def test_no_carry_answer_matches_column_reference(a, op, b):
  assert no_carry_answer(a, op, b) == _no_carry_reference(a, op, b)


def test_demonstrations_are_exact_without_errors():
  task = ArithmeticTask(seed=3, demo_error_rate=0.0)
  for i in range(300):
    text, answer = task.sft_example(i)
    assert (text, answer) == (task.train_prompt(i).text, task.train_prompt(i).answer)


def test_demonstration_error_rate():
  task = ArithmeticTask(seed=3, demo_error_rate=0.6)
  n, wrong, carry = 4000, 0, 0
  for i in range(n):
    prompt = task.train_prompt(i)
    text, answer = task.sft_example(i)
    assert text == prompt.text
    a, b = (int(x) for x in prompt.text[:-1].split('+'))
    if _no_carry_reference(a, '+', b) != a + b:
      carry += 1
    if answer != prompt.answer:
      wrong += 1
      assert int(answer) == _no_carry_reference(a, '+', b)
  assert abs(wrong / carry - 0.6) < 0.04  # errors only where a carry exists, at the rate
  assert task.sft_example(17) == task.sft_example(17)  # deterministic
  # The verifier always judges against the exact answer.
  prompt = task.train_prompt(0)
  assert task.score(prompt, prompt.answer) == 1.0


@pytest.mark.parametrize('kwargs, message', [
    (dict(demo_error_rate=1.5), r'demo_error_rate must be a float in \[0, 1\]'),
    (dict(demo_error_rate=-0.1), r'demo_error_rate must be a float in \[0, 1\]'),
    (dict(demo_error_rate=0.2, operations='+*'), "defined for '\\+' and '-' only"),
])
def test_demo_error_rate_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ArithmeticTask(**kwargs)
