"""File-backed tasks: the JSONL/Parquet loader, the split, and the math and python tasks."""

import gzip
import json
import time

import numpy as np
import pytest

from rlax_llm.data import prompt_dataset
from rlax_llm.tasks import MathTask, PythonTask, Task, make_task
from rlax_llm.tasks.files import FileSplit, load_records
from rlax_llm.verifiers import score_completions


def _write_jsonl(path, rows):
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return path


GSM = [{'question': f'What is {i} plus {i}?', 'answer': f'{i} + {i} = {2 * i}\n#### {2 * i}'}
       for i in range(1, 21)]


# ------------------------------------------------------------------------------ loader


def test_jsonl_gzip_and_parquet_give_the_same_records(tmp_path):
  pq = pytest.importorskip('pyarrow.parquet')
  import pyarrow  # pylint: disable=import-outside-toplevel
  _write_jsonl(tmp_path / 'a.jsonl', GSM[:10])
  with gzip.open(tmp_path / 'b.jsonl.gz', 'wt') as f:
    f.write('\n'.join(json.dumps(r) for r in GSM[10:15]) + '\n\n')
  pq.write_table(pyarrow.Table.from_pylist(GSM[15:]), tmp_path / 'c.parquet')
  records = load_records([tmp_path / 'a.jsonl', str(tmp_path / 'b.jsonl.gz'),
                          str(tmp_path / 'c.parquet')], required=('question', 'answer'))
  assert records == GSM
  assert load_records(str(tmp_path / '*.jsonl*')) == GSM[:15]  # a glob, sorted


def test_loader_errors_name_the_file_line_and_fix(tmp_path):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"question": "q", "answer": "1"}\n{"question": \n')
  with pytest.raises(ValueError, match=r'bad.jsonl:2: not valid JSON'):
    load_records(bad)
  bad.write_text('[1, 2]\n')
  with pytest.raises(ValueError, match=r'bad.jsonl:1: a line must be a JSON object, got list'):
    load_records(bad)
  bad.write_text('{"problem": "q"}\n')
  with pytest.raises(ValueError, match=r"lacks field\(s\) \['question'\]; it has \['problem'\]"):
    load_records(bad, required=('question',))
  with pytest.raises(ValueError, match='does not exist'):
    load_records(tmp_path / 'missing.jsonl')
  with pytest.raises(ValueError, match='matches no file'):
    load_records(str(tmp_path / 'nothing*.jsonl'))
  (tmp_path / 'x.csv').write_text('a,b\n')
  with pytest.raises(ValueError, match='unknown data file type'):
    load_records(tmp_path / 'x.csv')


def test_split_holds_out_by_hash_drops_duplicates_and_is_order_independent():
  records = GSM + [GSM[0], GSM[1]]  # duplicates of two problems
  key = lambda r: r['question']
  split = FileSplit(records, key, seed=0, num_eval=5)
  eval_keys = {key(r) for r in split.eval}
  assert len(split.eval) == 5 and len(eval_keys) == 5
  assert not eval_keys & {key(r) for r in split.train}
  assert len(split.train) + sum(key(r) in eval_keys for r in records) == len(records)
  shuffled = FileSplit(list(reversed(records)), key, seed=0, num_eval=5)
  assert {key(r) for r in shuffled.eval} == eval_keys
  assert {key(r) for r in FileSplit(records, key, seed=1, num_eval=5).eval} != eval_keys
  # Each epoch visits every train record once, in a seeded order.
  n = len(split.train)
  for epoch in range(2):
    seen = [key(split.train_record(epoch * n + i)) for i in range(n)]
    assert sorted(seen) == sorted(key(r) for r in split.train)
  with pytest.raises(ValueError, match='holds only 20 distinct problems'):
    FileSplit(records, key, seed=0, num_eval=21)


# -------------------------------------------------------------------------------- math


@pytest.fixture(scope='module')
def math_task():
  return MathTask(num_eval=4)


def test_math_task_bundled_sample(math_task):
  assert isinstance(math_task, Task)
  evals = math_task.eval_prompts()
  assert [p.prompt_id for p in evals] == [-1, -2, -3, -4]
  assert all(p.text.startswith('Question: ') and p.text.endswith('\nAnswer:') for p in evals)
  questions = {p.text for p in evals}
  assert not questions & {math_task.train_prompt(i).text for i in range(40)}
  # The reference solutions score 1 under the verifier (GSM8K '####' and MATH '\boxed{}').
  for i in range(10):
    prompt = math_task.train_prompt(i)
    text, demonstration = math_task.sft_example(i)
    assert text == prompt.text
    assert math_task.score(prompt, demonstration) == 1.0
    assert math_task.format_ok(demonstration)
    assert math_task.score(prompt, '#### 123456789') == 0.0


def test_math_task_gsm8k_style_file_and_chat_format(tmp_path):
  path = _write_jsonl(tmp_path / 'gsm.jsonl', GSM)
  task = MathTask(path=str(path), num_eval=3, format='chat', system_prompt='You are careful.')
  prompt = task.train_prompt(0)
  number = int(prompt.text.split()[3])  # "Question: What is N plus N?"
  assert prompt.answer == str(2 * number)
  assert prompt.messages[0] == {'role': 'system', 'content': 'You are careful.'}
  assert prompt.messages[1]['content'].endswith('put your final answer within \\boxed{}.')
  assert task.score(prompt, f'so \\boxed{{{2 * number}}}') == 1.0
  assert task.score(prompt, f'#### {2 * number + 1}') == 0.0
  assert task.format_ok('\\boxed{3}') and not task.format_ok('3')


def test_math_task_custom_fields_and_separate_eval_file(tmp_path):
  rows = [{'problem': f'Simplify ${i}/{2 * i}$.', 'solution': 'It is $\\boxed{\\frac{1}{2}}$.'}
          for i in range(1, 8)]
  train = _write_jsonl(tmp_path / 'train.jsonl', rows[:5])
  test = _write_jsonl(tmp_path / 'test.jsonl', rows[4:])
  task = MathTask(path=str(train), eval_path=str(test), num_eval=2,
                  question_field='problem', answer_field='solution')
  assert {p.text for p in task.eval_prompts()} <= {f'Question: {r["problem"]}\nAnswer:'
                                                    for r in rows[4:]}
  assert task.eval_prompts()[0].answer == '\\frac{1}{2}'
  assert task.score(task.eval_prompts()[0], '#### 0.5') == 1.0
  # A train record that is also an eval record is dropped (no leak).
  assert all(task.split.train_record(i)['problem'] not in {p['problem'] for p in task.split.eval}
             for i in range(10))


def test_math_task_rejects_bad_records_with_the_record_and_fix(tmp_path):
  path = _write_jsonl(tmp_path / 'bad.jsonl', [{'question': 'q', 'answer': 'no marker here'}])
  MathTask(path=str(path), num_eval=0)  # a bare answer is a final answer
  path = _write_jsonl(tmp_path / 'bad.jsonl', [{'question': 'q', 'answer': '\\boxed{1'}])
  with pytest.raises(ValueError, match='record 0 of path=.*has no final answer'):
    MathTask(path=str(path), num_eval=0)
  with pytest.raises(ValueError, match="lacks field\\(s\\) \\['problem'\\]"):
    MathTask(question_field='problem')
  with pytest.raises(ValueError, match='math_timeout_s must be a number > 0'):
    MathTask(math_timeout_s=0)


def test_math_task_scorer_choice(tmp_path):
  rows = [{'question': 'Reverse "abc".', 'answer': 'cba'},
          {'question': 'Which day follows Sunday?', 'answer': '\\boxed{\\text{Monday}}'},
          {'question': 'Half of 3?', 'answer': '#### 1.5'}]
  path = _write_jsonl(tmp_path / 'words.jsonl', rows)
  prompts = {}
  for scorer in ('math', 'normalised', 'exact'):
    task = MathTask(path=str(path), num_eval=0, scorer=scorer)
    prompts = {task.train_prompt(i).answer: task.train_prompt(i) for i in range(3)}
    assert task.score(prompts['cba'], '\\boxed{abc}') == 0.0  # not a product of letters
    assert task.score(prompts['cba'], '\\boxed{cba}') == 1.0
    assert task.score(prompts['\\text{Monday}'], '\\boxed{monday}') == (
        0.0 if scorer == 'exact' else 1.0)
    assert task.score(prompts['1.5'], '\\boxed{\\frac{3}{2}}') == (
        1.0 if scorer == 'math' else 0.0)
  with pytest.raises(ValueError, match=r"scorer='fuzzy'; choose one of \['exact', 'math', "
                     r"'normalised'\]"):
    MathTask(scorer='fuzzy')


@pytest.mark.parametrize('task_cls, record', [
    (MathTask, {'question': '  ', 'answer': '1'}),
    (PythonTask, {'prompt': 7, 'tests': ['assert True']}),
])
def test_file_tasks_reject_a_record_without_a_question(tmp_path, task_cls, record):
  """The question check FileTask gives both tasks, with their own question field."""
  path = _write_jsonl(tmp_path / 'bad.jsonl', [record])
  field = 'question' if task_cls is MathTask else 'prompt'
  with pytest.raises(ValueError, match=f"record 0 of path=.*field '{field}' must be a "
                     'non-empty str'):
    task_cls(path=str(path), num_eval=0)


def test_file_task_grain_position_resumes(math_task):
  it = iter(prompt_dataset(math_task, 3).to_iter_dataset())
  next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]  # crosses an epoch boundary (10 train records)
  resumed = iter(prompt_dataset(MathTask(num_eval=4), 3).to_iter_dataset())
  resumed.set_state(state)
  assert [next(resumed) for _ in range(4)] == expected


# ------------------------------------------------------------------------------ python


@pytest.fixture(scope='module')
def python_task():
  return PythonTask(timeout_s=3.0)


def test_python_task_reference_solutions_pass(python_task):
  assert isinstance(python_task, Task)
  prompt = python_task.train_prompt(0)
  spec = json.loads(prompt.answer)
  assert spec['tests'] and spec['tests'][0] in prompt.text
  assert prompt.messages is not None and '```python' in prompt.messages[-1]['content']
  for i in range(3):
    prompt = python_task.train_prompt(i)
    _, demonstration = python_task.sft_example(i)
    assert python_task.format_ok(demonstration)
    assert python_task.score(prompt, demonstration) == 1.0
    assert python_task.score(prompt, '```python\npass\n```') == 0.0


def test_python_task_partial_credit_and_setup(tmp_path):
  rows = [{'prompt': 'Write pi_times(x).', 'tests': ['assert pi_times(0) == 0',
                                                      'assert pi_times(1) == math.pi'],
           'setup': 'import math'}] * 1 + [
      {'prompt': f'Write f{i}().', 'tests': [f'assert f{i}() == {i}']} for i in range(3)]
  path = _write_jsonl(tmp_path / 'code.jsonl', rows)
  task = PythonTask(path=str(path), num_eval=0, timeout_s=2.0, format='plain')
  prompt = next(task.train_prompt(i) for i in range(8) if 'pi_times' in task.train_prompt(i).text)
  assert prompt.messages is None and prompt.text.startswith('"""Write pi_times(x).')
  assert task.score(prompt, 'def pi_times(x):\n  return 0') == pytest.approx(0.5)
  assert task.score(prompt, 'def pi_times(x):\n  return x * math.pi') == 1.0
  strict = PythonTask(path=str(path), num_eval=0, timeout_s=2.0, partial_credit=False)
  assert strict.score(prompt, 'def pi_times(x):\n  return 0') == 0.0
  with pytest.raises(ValueError, match='has no .solution. field'):
    task.sft_example(0)
  bad = _write_jsonl(tmp_path / 'bad.jsonl', [{'prompt': 'p', 'tests': 'assert True'}])
  with pytest.raises(ValueError, match='must be a non-empty list of Python statements'):
    PythonTask(path=str(bad), num_eval=0)


def test_many_python_completions_in_the_pool_in_parallel(python_task):
  prompt = python_task.train_prompt(0)
  good = python_task.sft_example(0)[1]
  completions = [good, 'while True: pass', good, 'import os\nos._exit(0)'] * 2
  start = time.monotonic()
  rewards, errors = score_completions(python_task, [prompt] * len(completions), completions)
  assert time.monotonic() - start < 10.0
  np.testing.assert_array_equal(rewards, [1, 0, 1, 0] * 2)
  assert errors == 0  # a failing program is a reward of 0, not a verifier error


def test_make_task_selects_file_tasks():
  assert isinstance(make_task({'name': 'math', 'num_eval': 2}), MathTask)
  assert isinstance(make_task({'name': 'python', 'num_eval': 1}), PythonTask)
  with pytest.raises(ValueError, match="unknown task name 'gsm8k'; valid names: "
                     "\\['arithmetic', 'countdown', 'math', 'python'\\]"):
    make_task({'name': 'gsm8k'})
