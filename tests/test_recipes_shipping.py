"""The recipes ship what the run needs (``launch.recipes.checks.check_shipped``): a module the
config imports that git archive would not copy (untracked, or outside the checkout: only on
this machine's PYTHONPATH) and task data the hosts cannot see are refused with the fix.

Against a throwaway git checkout in tmp_path (cheap, in-process); one dry run end to end
(slow)."""

import os
import pathlib
import subprocess
import sys
import types

import pytest

from launch.recipes.checks import check_shipped
from launch.recipes.slices import SliceError
from smoke_config import smoke_config  # tests/smoke_config.py

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _git(root: pathlib.Path, *args: str) -> None:
  subprocess.run(['git', '-C', str(root), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path):
  """A git checkout holding a committed reward module and data file, and untracked ones."""
  root = tmp_path / 'repo'
  (root / 'data').mkdir(parents=True)
  for name in ('my_reward.py', 'data/train.jsonl', 'scratch_reward.py', 'data/local.jsonl'):
    (root / name).write_text('{}\n')
  _git(root, 'init', '-q')
  _git(root, 'add', 'my_reward.py', 'data/train.jsonl')
  _git(root, '-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q', '-m', 'x')
  return root


def _module(name: str, path: pathlib.Path) -> types.ModuleType:
  module = types.ModuleType(name)
  module.__file__ = str(path)
  return module


def test_committed_modules_and_data_and_installed_packages_pass(checkout):
  config = smoke_config(task__name='math', task__path='data/train.jsonl')
  line = check_shipped(config, [_module('my_reward', checkout / 'my_reward.py'), pytest,
                                types.ModuleType('builtin_like')], checkout, 'HEAD')
  assert line == 'the hosts get what the config imports and reads: committed at HEAD'


def test_an_untracked_module_the_config_imports_is_refused_with_git_add(checkout):
  with pytest.raises(SliceError) as e:
    check_shipped(smoke_config(), [_module('scratch_reward', checkout / 'scratch_reward.py')],
                  checkout, 'HEAD')
  assert str(e.value) == ('the config imports scratch_reward from scratch_reward.py, which is '
                          'not committed at HEAD: git archive does not copy it to the hosts; git '
                          'add scratch_reward.py and commit it.')


def test_a_committed_module_found_through_pythonpath_is_refused(checkout):
  """docs/examples/my_task.py imported as my_task (PYTHONPATH=docs/examples): committed, but
  on the hosts the launch runs in the checkout's root with no PYTHONPATH."""
  (checkout / 'examples').mkdir()
  (checkout / 'examples' / 'my_task.py').write_text('')
  (checkout / 'examples' / '__init__.py').write_text('')
  _git(checkout, 'add', 'examples')
  _git(checkout, '-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q', '-m', 'y')
  with pytest.raises(SliceError, match=r"^the config imports my_task from examples/my_task.py, "
                     r"found through this machine's PYTHONPATH: .* where my_task does not "
                     r"import; move the module to the checkout's root"):
    check_shipped(smoke_config(), [_module('my_task', checkout / 'examples' / 'my_task.py')],
                  checkout, 'HEAD')
  assert check_shipped(smoke_config(), [
      _module('examples.my_task', checkout / 'examples' / 'my_task.py'),
      _module('examples', checkout / 'examples' / '__init__.py')], checkout, 'HEAD')


def test_the_config_file_loaded_as_a_module_is_left_to_the_config_check(checkout):
  config_file = checkout / 'my_reward.py'  # any committed file: ml_collections' module name
  module = _module('config_config', config_file)
  with pytest.raises(SliceError, match='found through this machine'):
    check_shipped(smoke_config(), [module], checkout, 'HEAD')
  assert check_shipped(smoke_config(), [module], checkout, 'HEAD', config_file)


def test_a_module_only_on_the_local_pythonpath_is_refused(checkout, tmp_path):
  elsewhere = tmp_path / 'mine' / 'rewards.py'
  with pytest.raises(SliceError, match=r'the config imports rewards from .*/mine/rewards.py, '
                     r'outside .*: the hosts get only this checkout and the packages their '
                     r'setup installs; move the module into the checkout and commit it, or make '
                     r'it a package installed on every host.'):
    check_shipped(smoke_config(), [_module('rewards', elsewhere)], checkout, 'HEAD')


@pytest.mark.parametrize('path, says', [
    ('data/local.jsonl', "config.task.path='data/local.jsonl' is not a file committed at HEAD"),
    ('/home/me/train.jsonl', "config.task.path='/home/me/train.jsonl' is on this machine only: "
     'commit the data into the checkout'),
    ('{root}/data/train.jsonl', 'inside this checkout, but the hosts\' copy is elsewhere '
     '(~/rlax_llm): give it relative to the checkout (data/train.jsonl)'),
])
def test_task_data_the_hosts_cannot_see_is_refused(checkout, path, says):
  config = smoke_config(task__name='math', task__path=path.format(root=checkout))
  with pytest.raises(SliceError) as e:
    check_shipped(config, [], checkout, 'HEAD')
  assert says in str(e.value)


def test_hub_datasets_and_bundled_files_need_no_shipping(checkout):
  for path in ('hf://datasets/openai/gsm8k', 'math_sample.jsonl'):
    config = smoke_config(task__name='math', task__path=path)
    assert check_shipped(config, [], checkout, 'HEAD').endswith('committed at HEAD')


@pytest.mark.slow  # a dry run (20 s here); the default run sees the check's line in the
# newcomer path's dry run (tests/test_doc_commands.py), and the check's cases above
def test_dry_run_refuses_a_task_class_only_on_the_local_pythonpath(tmp_path):
  """End to end: the task class comes from a module on PYTHONPATH outside the checkout (the
  dry run used to approve it, and the hosts would fail to import it)."""
  (tmp_path / 'c64_my_task.py').write_text(
      'from rlax_llm.tasks.arithmetic import ArithmeticTask\n\n\n'
      'class MyTask(ArithmeticTask):\n  name = "my_task"\n')
  env = dict(os.environ, HF_HUB_OFFLINE='1',
             PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
  result = subprocess.run(
      [sys.executable, '-m', 'launch.recipes', 'tpu-vm', '--tpu-type=v5e-4', '--zone=z',
       '--workdir=gs://b/r', '--config=configs/default.py:smoke',
       '--config.task.name=c64_my_task:MyTask', '--dry-run'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and result.stdout == '', result.stderr[-2000:]
  assert result.stderr.startswith(f'error: the config imports c64_my_task from '
                                  f'{tmp_path / "c64_my_task.py"}, outside {ROOT}'), result.stderr
