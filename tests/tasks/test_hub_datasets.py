"""Hub datasets (hf://datasets/ORG/NAME) read by the file tasks: from a hub cache laid out as
huggingface_hub lays it out (offline), and downloaded from a fake hub on loopback (only the
split's files); layouts, the Parquet-conversion fallback, errors, and a resumed stream."""

import json
import os
import pathlib
import subprocess
import sys

import hub_cache  # tests/hub_cache.py
import pytest
from fake_hub import FakeHub, hub_environment  # tests/fake_hub.py
from hub_cache import cache_dataset, card_bytes, gsm8k_rows, parquet_bytes

from rlax_llm.data import prompt_dataset
from rlax_llm.tasks import MathTask, PythonTask, make_task
from rlax_llm.tasks.hub_datasets import HubDataset, conventional_layout

GSM8K = 'hf://datasets/openai/gsm8k'
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def offline(tmp_path):
  """An empty hub cache that huggingface_hub reads offline."""
  with hub_environment(None, tmp_path, offline=True):
    yield tmp_path


@pytest.fixture
def shipped(offline):
  """openai/gsm8k and HuggingFaceH4/MATH-500 stand-ins in a hub cache, offline."""
  hub_cache.cache_shipped_datasets(offline)
  return offline


def test_gsm8k_from_the_cache_offline_takes_its_test_split_for_eval(shipped):
  task = MathTask(path=GSM8K, hf_config='main', num_eval=5)
  assert task.eval_split == 'test' and task.hf_config == 'main'
  assert len(task.split.train) == 40 and len(task.split.eval) == 5
  train_questions = {r['question'] for r in gsm8k_rows(40)}
  test_questions = {r['question'] for r in gsm8k_rows(200, start=100)}
  assert {r['question'] for r in task.split.eval} <= test_questions
  for i in range(5):
    prompt = task.train_prompt(i)
    record = task.split.train_record(i)
    assert record['question'] in train_questions
    assert prompt.answer == record['answer'].split('#### ')[1]  # GSM8K's final answer
    assert task.score(prompt, task.sft_example(i)[1]) == 1.0
    assert task.score(prompt, f'\\boxed{{{int(prompt.answer) + 1}}}') == 0.0
  assert "hf_config='main', split='train', eval_split='test'" in repr(task)
  # eval_split='' holds out of the train split; another config reads its own files.
  held_out = MathTask(path=GSM8K, hf_config='main', eval_split='', num_eval=5)
  assert len(held_out.split.train) == 35
  assert {r['question'] for r in held_out.split.eval} <= train_questions
  socratic = MathTask(path=GSM8K, hf_config='socratic', num_eval=1)
  assert len(socratic.split.train) == 3


def test_math500_root_jsonl_and_make_task(shipped):
  task = make_task({'name': 'math', 'path': 'hf://datasets/HuggingFaceH4/MATH-500',
                    'split': 'test', 'eval_split': '', 'num_eval': 10,
                    'question_field': 'problem', 'answer_field': 'solution'})
  assert task.hf_config == 'default' and len(task.split.train) == 110
  prompt = task.train_prompt(0)
  assert prompt.answer.startswith('\\frac{') and prompt.text.startswith('Question: Compute')
  assert task.score(prompt, task.sft_example(0)[1]) == 1.0
  # Only the task's fields are kept in memory.
  assert set(task.split.train_record(0)) == {'problem', 'solution'}


def test_layouts_without_a_card_and_the_parquet_conversion(offline):
  rows = gsm8k_rows(12)
  cache_dataset(offline, 'org/data-dir', {
      'data/train-00000-of-00002.parquet': parquet_bytes(rows[:6]),
      'data/train-00001-of-00002.parquet': parquet_bytes(rows[6:]),
      'data/validation-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(3, start=50)),
      '.gitattributes': b'*.parquet filter=lfs\n', 'README.md': b'# no card data\n'})
  task = MathTask(path='hf://datasets/org/data-dir', num_eval=2)
  assert task.eval_split == '' and len(task.split.train) == 10  # no test split: held out
  task = MathTask(path='hf://datasets/org/data-dir', eval_split='validation', num_eval=3)
  assert len(task.split.train) == 12 and len(task.split.eval) == 3
  # CSV and a loading script only: the hub's Parquet conversion (refs/convert/parquet).
  cache_dataset(offline, 'org/csv', {'train.csv': b'question,answer\nq,1\n',
                                      'csv.py': b'# a loading script\n'})
  cache_dataset(offline, 'org/csv', {
      'default/train/0000.parquet': parquet_bytes(rows[:7]),
      'default/train/0001.parquet': parquet_bytes(rows[7:]),
      'default/partial-test/0000.parquet': parquet_bytes(gsm8k_rows(4, start=50))},
      revision='refs/convert/parquet')
  task = MathTask(path='hf://datasets/org/csv', num_eval=2)
  assert task.dataset.revision == 'refs/convert/parquet' and task.eval_split == 'test'
  assert len(task.split.train) == 12 and len(task.split.eval) == 2
  # The conventional names, as a table.
  assert conventional_layout(
      ['train.jsonl', 'test.jsonl.gz', 'main/train-00000-of-00001.parquet',
       'main/test/0000.parquet', 'data/train_sft-00000-of-00003.parquet', 'notes.txt',
       'a/b/c/d.parquet'], ('.jsonl', '.jsonl.gz', '.parquet')) == {
           'default': {'train': ['train.jsonl'], 'test': ['test.jsonl.gz'],
                       'train_sft': ['data/train_sft-00000-of-00003.parquet']},
           'main': {'train': ['main/train-00000-of-00001.parquet'],
                    'test': ['main/test/0000.parquet']}}


def test_python_task_reads_an_mbpp_shaped_hub_dataset(offline):
  rows = [{'task_id': i, 'text': f'Write f{i}() returning {i}.', 'code': f'def f{i}():\n  '
           f'return {i}', 'test_list': [f'assert f{i}() == {i}'], 'test_setup_code': ''}
          for i in range(6)]
  cache_dataset(offline, 'org/mbpp', {
      'README.md': card_bytes({'full': {'train': 'full/train-*', 'test': 'full/test-*'},
                               'sanitized': {'train': 'sanitized/train-*'}}),
      'full/train-00000-of-00001.parquet': parquet_bytes(rows[:4]),
      'full/test-00000-of-00001.parquet': parquet_bytes(rows[4:])})
  task = PythonTask(path='hf://datasets/org/mbpp', hf_config='full', num_eval=2,
                    question_field='text', tests_field='test_list',
                    setup_field='test_setup_code', solution_field='code', timeout_s=3.0)
  assert len(task.split.train) == 4 and task.eval_split == 'test'
  prompt = task.train_prompt(0)
  assert task.score(prompt, task.sft_example(0)[1]) == 1.0


def test_errors_name_what_exists(shipped):
  with pytest.raises(ValueError, match=r"has several configs and no default: \['main', "
                     r"'socratic'\]; set hf_config"):
    MathTask(path=GSM8K)
  with pytest.raises(ValueError, match=r"has no config 'mian'; its configs: \['main', "
                     r"'socratic'\]"):
    MathTask(path=GSM8K, hf_config='mian')
  with pytest.raises(ValueError, match=r"\(config 'main'\) has no split 'validation'; its "
                     r"splits: \['test', 'train'\]"):
    MathTask(path=GSM8K, hf_config='main', split='validation')
  with pytest.raises(ValueError, match=r"lacks column\(s\) \['problem'\]; it has "
                     r"\['question', 'answer'\]"):
    MathTask(path=GSM8K, hf_config='main', question_field='problem')
  with pytest.raises(ValueError, match=r"openai/gsm9k is not in the hub cache .* and "
                     'HF_HUB_OFFLINE is set; run once online'):
    MathTask(path='hf://datasets/openai/gsm9k')
  with pytest.raises(ValueError, match=r"names a hub model, not a dataset; write "
                     r'hf://datasets/ORG/NAME'):
    MathTask(path='hf://openai/gsm8k')
  with pytest.raises(ValueError, match='names a file or folder inside the dataset'):
    MathTask(path=GSM8K + '/main/train-00000-of-00001.parquet')
  with pytest.raises(ValueError, match=r"choose the parts of a hub dataset .* but "
                     r"path='math_sample.jsonl' names files"):
    MathTask(hf_config='main')
  local = shipped / 'eval.jsonl'
  local.write_bytes(hub_cache.jsonl_bytes(gsm8k_rows(3, start=500)))
  with pytest.raises(ValueError, match='both name the held-out records; give one'):
    MathTask(path=GSM8K, hf_config='main', eval_path=str(local), eval_split='test')
  task = MathTask(path=GSM8K, hf_config='main', eval_path=str(local), num_eval=3)
  assert {r['question'] for r in task.split.eval} == {r['question']
                                                      for r in gsm8k_rows(3, start=500)}


def test_a_split_missing_from_the_cache_offline(offline):
  """Only the train files were downloaded: the test split is named, not silently dropped."""
  cache_dataset(offline, 'org/half', {
      'README.md': card_bytes({'default': {'train': 'train-*', 'test': 'test-*'}}),
      'train-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(8))})
  with pytest.raises(ValueError, match=r"split 'test' is not in the hub cache"):
    MathTask(path='hf://datasets/org/half', eval_split='test')


def test_resumed_mid_dataset_the_stream_continues_with_the_same_prompts(shipped):
  """The controller's data position (the grain iterator's state, stored as JSON in a
  checkpoint) resumes the stream, in a new process that reads the dataset from the cache
  again, at the same prompts, across an epoch boundary of the hub split."""
  args = {'path': GSM8K, 'hf_config': 'main', 'num_eval': 8, 'format': 'chat'}
  it = iter(prompt_dataset(MathTask(**args), 1).to_iter_dataset())  # as the controller's
  for _ in range(37):  # 37 of the 40 train records
    next(it)
  state = json.dumps(dict(it.get_state()))
  expected = [p.to_dict() for batch in (next(it) for _ in range(6)) for p in batch]
  code = ('import json, sys\n'
          'from rlax_llm.data import prompt_dataset\n'
          'from rlax_llm.tasks import MathTask\n'
          'it = iter(prompt_dataset(MathTask(**json.loads(sys.argv[2])), 1).to_iter_dataset())\n'
          'it.set_state(json.loads(sys.argv[1]))\n'
          'print(json.dumps([p.to_dict() for _ in range(6) for p in next(it)]))\n')
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  result = subprocess.run([sys.executable, '-c', code, state, json.dumps(args)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  got = json.loads(result.stdout.splitlines()[-1])
  assert got == expected
  assert [p['prompt_id'] for p in got] == list(range(37, 43))  # into the second epoch


def test_download_from_the_hub_fetches_only_the_split_files(tmp_path):
  files = {'README.md': card_bytes({'main': {'train': 'main/train-*', 'test': 'main/test-*'},
                                    'socratic': {'train': 'socratic/train-*'}}),
           'main/train-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(10)),
           'main/test-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(5, start=50)),
           'socratic/train-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(10, start=90))}
  with FakeHub(token='hf_secret') as hub:
    hub.add_commit('openai/gsm8k', files, repo_type='dataset')
    hub.add_commit('org/gated', files, repo_type='dataset', gated=True)
    with hub_environment(hub, tmp_path):
      task = MathTask(path=GSM8K, hf_config='main', num_eval=2)
    assert len(task.split.train) == 10 and task.eval_split == 'test'
    assert sorted(hub.downloads) == [
        ('datasets/openai/gsm8k', p) for p in ('README.md', 'main/test-00000-of-00001.parquet',
                                               'main/train-00000-of-00001.parquet')]
    # Then offline, from the cache it filled (refs/main written by huggingface_hub).
    with hub_environment(hub, tmp_path, offline=True):
      again = MathTask(path=GSM8K, hf_config='main', num_eval=2)
    assert len(hub.downloads) == 3
    assert [again.train_prompt(i) for i in range(5)] == [task.train_prompt(i) for i in range(5)]
    with hub_environment(hub, tmp_path):
      with pytest.raises(ValueError, match='org/gated is gated: accept its conditions .* set '
                         'HF_TOKEN'):
        HubDataset('hf://datasets/org/gated')
      with pytest.raises(ValueError, match=r'no such dataset on the hub .*if it is private, '
                         'set HF_TOKEN'):
        HubDataset('hf://datasets/org/missing')
      with pytest.raises(ValueError, match="has no revision 'v9'"):
        HubDataset('hf://datasets/openai/gsm8k@v9')
    with hub_environment(hub, tmp_path, token='hf_secret'):
      assert sorted(HubDataset('hf://datasets/org/gated', 'main').splits) == ['test', 'train']
