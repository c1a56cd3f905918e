"""A task class and a reward function of the user's own, by import path from the config
(docs/custom_tasks.md): resolution, the checks that name the value and the fix, and the
docs' example module run end to end through ``python -m rlax_llm.launch``."""

import inspect
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from scored_rows import Rows  # tests/scored_rows.py

from rlax_llm import plugins, rewards
from rlax_llm.cli import load_config, load_config_file, task_section
from rlax_llm.config import validate_config
from rlax_llm.errors import ConfigError
from rlax_llm.metrics import read_metrics
from rlax_llm.tasks import TASKS, ArithmeticTask, Prompt, make_task, task_class

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / 'docs' / 'examples'


@pytest.fixture
def examples_on_path(monkeypatch):
  """docs/examples importable, as PYTHONPATH=docs/examples makes it for the launcher."""
  monkeypatch.syspath_prepend(str(EXAMPLES))
  monkeypatch.chdir(ROOT)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  """Writes a module of the user's own (a unique name per test) and puts it on the path."""
  monkeypatch.syspath_prepend(str(tmp_path))
  count = iter(range(100))

  def write(source: str) -> str:
    name = f'user_mod_{tmp_path.name}_{next(count)}'.replace('-', '_')
    (tmp_path / f'{name}.py').write_text(textwrap.dedent(source))
    return name
  return write


GOOD_TASK = '''
from rlax_llm.tasks import Prompt, Task

class Echo(Task):
  name = 'echo'
  def __init__(self, seed: int = 0, word: str = 'ab', num_eval: int = 2, note: str | None = None):
    self.seed, self.word, self.num_eval, self.note = seed, word, num_eval, note
  @property
  def charset(self):
    return 'ab>'
  def train_prompt(self, index):
    return Prompt(prompt_id=index, text=self.word + '>', answer=self.word)
  def eval_prompts(self):
    return [Prompt(prompt_id=-1 - i, text='ba>', answer='ba') for i in range(self.num_eval)]
  def score(self, prompt, completion):
    return float(completion == prompt.answer)

def reward(prompt, completion):
  return float(len(completion))
'''


def test_import_object_resolves_and_names_what_is_wrong(user_module):
  module = user_module(GOOD_TASK)
  assert plugins.import_object(f'{module}:Echo', 'task.name').name == 'echo'
  assert plugins.import_object(f'{module}:Echo.score', 'fn').__name__ == 'score'
  with pytest.raises(ValueError, match=r"task.name='nope' is not an import path; write "
                     r'"module.path:name"'):
    plugins.import_object('nope', 'task.name')
  with pytest.raises(ValueError, match=r"'no_such_pkg_xyz.mod:C': no module named "
                     r"'no_such_pkg_xyz' on the Python path .*add its directory to PYTHONPATH"):
    plugins.import_object('no_such_pkg_xyz.mod:C', 'task.name')
  with pytest.raises(ValueError, match=rf"module '{module}' \(.*\) has no attribute 'Missing'; "
                     'check the name after the ":"'):
    plugins.import_object(f'{module}:Missing', 'task.name')
  broken = user_module('raise RuntimeError("half-written module")\n')
  with pytest.raises(ValueError, match=rf"importing module '{broken}' raised RuntimeError: "
                     'half-written module; fix the module'):
    plugins.import_object(f'{broken}:X', 'task.name')
  needs = user_module('import no_such_dependency_xyz\n')
  with pytest.raises(ValueError, match=rf"importing module '{needs}' failed: No module named "
                     "'no_such_dependency_xyz'"):
    plugins.import_object(f'{needs}:X', 'fn')


def test_task_class_by_import_path_builds_with_seed_and_fields(user_module):
  module = user_module(GOOD_TASK)
  task = make_task({'name': f'{module}:Echo', 'seed': 3, 'word': 'ba', 'num_eval': 1})
  assert (task.name, task.seed, task.train_prompt(5).text, len(task.eval_prompts())) == (
      'echo', 3, 'ba>', 1)
  assert task_class('arithmetic') is ArithmeticTask
  with pytest.raises(ValueError, match=rf"task '{module}:Echo' got unknown config fields "
                     r"\['words'\]; Echo accepts \['seed', 'word', 'num_eval', 'note'\]"):
    make_task({'name': f'{module}:Echo', 'seed': 0, 'words': 'x'})


@pytest.mark.parametrize('source, message', [
    ('Echo = 3\n', r"is a int, not a class; name a task class"),
    ('class Echo:\n  name = "e"\n  def score(self, p, c): return 0.0\n',
     r"Echo does not define \['train_prompt', 'eval_prompts'\]; a task class subclasses "
     'rlax_llm.tasks.Task'),
    ('from rlax_llm.tasks import Task\nclass Echo(Task):\n  name = "e"\n'
     '  def score(self, p, c): return 0.0\n',
     r"Echo does not define \['train_prompt', 'eval_prompts'\]"),
    ('from rlax_llm.tasks import Task\nclass Echo(Task):\n  name = "e"\n'
     '  def __init__(self, size=1): pass\n  def train_prompt(self, i): pass\n'
     '  def eval_prompts(self): return []\n  def score(self, p, c): return 0.0\n',
     r'takes no "seed" keyword; add seed: int = 0 to its __init__'),
])
def test_task_class_refuses_what_is_not_a_task_class(user_module, source, message):
  module = user_module(source)
  with pytest.raises(ValueError, match=message):
    task_class(f'{module}:Echo')


def test_make_task_refuses_a_missing_name_and_an_unset_required_argument(user_module):
  module = user_module('''
      from rlax_llm.tasks import Task
      class Nameless(Task):
        def __init__(self, seed=0, path=None): pass
        def train_prompt(self, i): pass
        def eval_prompts(self): return []
        def score(self, p, c): return 0.0
      class Needs(Nameless):
        name = 'needs'
        def __init__(self, path: str, seed: int = 0): pass
      ''')
  with pytest.raises(ValueError, match=r"a Nameless lacks \['name'\]; subclass "
                     r'rlax_llm.tasks.Task and set the class attribute name'):
    make_task({'name': f'{module}:Nameless', 'seed': 0})
  with pytest.raises(ValueError, match=r"Needs requires \['path'\] \(no default\); set "
                     '--config.task.path=VALUE'):
    make_task({'name': f'{module}:Needs', 'seed': 0, 'path': None})


@pytest.mark.parametrize('name', sorted(TASKS))
def test_task_section_holds_every_argument_at_its_default(name):
  section = task_section(name)
  task_cls = TASKS[name]
  assert section.name == name and 'seed' not in section
  built = make_task(section.to_dict() | {'seed': 0})
  assert type(built) is task_cls
  assert set(section) - {'name'} == set(inspect.signature(task_cls).parameters) - {'seed'}


def test_task_section_types_the_none_defaults_and_refuses_unknown_fields(user_module):
  module = user_module(GOOD_TASK)
  section = load_config([f'--config.task.name={module}:Echo', '--config.task.note=hi']).task
  assert (section.name, section.word, section.note) == (f'{module}:Echo', 'ab', 'hi')
  python = task_section('python', num_eval=1)
  assert python.path is None and python.num_eval == 1
  python.path = 'x.jsonl'  # a str placeholder: a str fits (and so does --config.task.path=)
  with pytest.raises(ValueError, match=r"task 'math' takes no field \['max_operand'\]; "
                     r"MathTask's fields: \['answer_field'"):
    task_section('math', max_operand=3)


def _reward_rows(completions):
  return Rows(prompt_ids=np.arange(len(completions)), group_ids=np.arange(len(completions)),
              completions=list(completions))


def test_function_reward_runs_per_row_with_the_prompt_it_answers(user_module):
  module = user_module('''
      import time
      def same_length(prompt, completion):
        return float(len(completion) == len(prompt.answer))
      def moody(prompt, completion):
        if completion == 'boom':
          raise RuntimeError('reward crashed')
        if completion == 'hang':
          time.sleep(30)
        if completion == 'nan':
          return float('nan')
        return 0.5
      def one_arg(completion):
        return 1.0
      ''')
  components = rewards.make_components({
      'task': {'weight': 1.0},
      'length': {'kind': 'function', 'fn': f'{module}:same_length', 'weight': 0.5}})
  assert [c.uses_prompts for c in components] == [False, True]
  prompts = [Prompt(0, '12+1=', '13'), Prompt(1, '1+1=', '2')]
  rows = Rows(prompt_ids=np.array([0, 0, 1]), group_ids=np.array([0, 0, 1]),
              completions=['13', '7', '22'], rewards=np.array([1.0, 0.0, 0.0], np.float32))
  total, parts = rewards.shape_rewards(rows, components, prompts)
  np.testing.assert_array_equal(parts['length'], [1.0, 0.0, 0.0])
  np.testing.assert_allclose(total, [1.5, 0.0, 0.0])
  with pytest.raises(ValueError, match="component 'length' reads the prompts"):
    rewards.shape_rewards(rows, components)

  moody = rewards.make_components({'m': {'kind': 'function', 'fn': f'{module}:moody',
                                         'timeout_s': 0.5}})
  start = time.monotonic()
  _, parts = rewards.shape_rewards(_reward_rows(['ok', 'boom', 'hang', 'nan']), moody,
                                   [Prompt(i, 'q', 'a') for i in range(4)])
  assert time.monotonic() - start < 5.0
  np.testing.assert_array_equal(parts['m'], [0.5, 0.0, 0.0, 0.0])

  with pytest.raises(ValueError, match=rf"reward.bad: fn='{module}:one_arg' has the signature "
                     r'\(completion\), which cannot be called as fn\(prompt, completion\)'):
    rewards.make_components({'bad': {'kind': 'function', 'fn': f'{module}:one_arg'}})


@pytest.mark.parametrize('spec, message', [
    ({'kind': 'function'}, "reward.r: kind 'function' needs fn='module.path:name'"),
    ({'kind': 'function', 'fn': 'nomodule'}, "reward.r: fn='nomodule' is not an import path"),
    ({'kind': 'function', 'fn': 'math:pi'}, "reward.r: fn='math:pi' is a float, not a "
     'function'),
    ({'kind': 'function', 'fn': 'math:hypot', 'timeout_s': 0}, 'reward.r: timeout_s must be a '
     'number of seconds > 0'),
    ({'kind': 'function', 'fn': 'math:hypot', 'window': 3}, r"reward.r \(function\) got "
     r"unknown parameter\(s\) \['window'\]; it accepts \['fn', 'timeout_s', 'kind', 'weight'\]"),
])
def test_function_reward_config_errors_name_the_key(spec, message):
  with pytest.raises(ValueError, match=message):
    rewards.make_components({'r': spec})


def test_validate_config_checks_the_task_class_against_the_model_and_warmup(user_module):
  module = user_module(GOOD_TASK + '''
class NoCharset(Echo):
  charset = None
class Repeats(Echo):
  charset = 'aab>'
''')
  config = load_config(['--config=configs/default.py:smoke', f'--config.task.name={module}:Echo'])
  with pytest.raises(ConfigError, match=rf"config.warmup.steps=80 needs warm-up demonstrations "
                     rf"but task '{module}:Echo' defines no sft_example"):
    validate_config(config)
  config = load_config(['--config=configs/default.py:smoke', f'--config.task.name={module}:Echo',
                        '--config.warmup.steps=0'])
  validate_config(config)
  for name, message in (('NoCharset', "has none \\(charset=None\\); use a pretrained model"),
                        ('Repeats', "charset: CharTokenizer alphabet 'aab>' repeats")):
    config = load_config(['--config=configs/default.py:smoke', '--config.warmup.steps=0',
                          f'--config.task.name={module}:{name}'])
    with pytest.raises(ConfigError, match=message):
      validate_config(config)


def test_the_docs_example_validates_from_the_command_line_and_its_config(examples_on_path):
  config = load_config(['--config=configs/default.py:smoke',
                        '--config.task.name=my_task:ReverseTask', '--config.task.max_length=3'])
  assert config.task.to_dict() == {'name': 'my_task:ReverseTask', 'min_length': 2,
                                   'max_length': 3, 'num_eval': 16, 'eval_percent': 10}
  validate_config(config)
  config = load_config_file('docs/examples/my_config.py')
  assert validate_config(config).controller.reward['length']['fn'] == 'my_task:same_length'
  from my_task import ReverseTask  # pylint: disable=import-outside-toplevel
  task = ReverseTask(seed=1)
  evals = {p.text for p in task.eval_prompts()}
  train = [task.train_prompt(i) for i in range(200)]
  assert not evals & {p.text for p in train}  # the held-out split never leaks
  assert train == [task.train_prompt(i) for i in range(200)]  # a function of (seed, index)
  assert all(set(p.text) <= set(task.charset) for p in train + task.eval_prompts())
  assert task.score(train[0], train[0].answer + ' ') == 1.0


def test_the_docs_example_runs_through_launch(tmp_path):
  """docs/custom_tasks.md's config: the task class and the reward function by import path,
  end to end (PYTHONPATH=docs/examples, as the page says)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join([str(EXAMPLES), str(ROOT), env.get('PYTHONPATH', '')])
  workdir = tmp_path / 'wd'
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=docs/examples/my_config.py:smoke',
       f'--workdir={workdir}'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['task']['name'] == 'my_task:ReverseTask'
  assert saved['reward']['length']['fn'] == 'my_task:same_length'
  rows = read_metrics(workdir / 'metrics.jsonl')
  assert [r['step'] for r in rows] == [1, 2]
  for row in rows:
    assert 0.0 <= row['reward/length'] <= 1.0 and 0.0 <= row['reward/task'] <= 1.0
    assert row['reward/mean'] == pytest.approx(row['reward/task'] + 0.1 * row['reward/length'],
                                               abs=1e-6)
    assert row['verifier/errors'] == 0


def test_a_failing_reward_function_logs_and_scores_zero(caplog):
  fn = rewards.function_reward('math:log')  # log(prompt, completion): raises TypeError
  with caplog.at_level(logging.ERROR):
    values = fn(_reward_rows(['a']), [Prompt(0, 'q', 'a')])
  np.testing.assert_array_equal(values, [0.0])
  assert 'Reward function math:log raised on prompt 0' in caplog.text
