"""scripts/setup.sh installs without byte-compiling, and scripts/test.sh (and run.sh) let Python
write the bytecode of what the tests import: pip would compile every installed module (about
22,000, of which the tests import about a quarter), and with ``PYTHONDONTWRITEBYTECODE`` set in the
environment every test process and every run a test launches would compile its imports again.
Checked on the scripts' text (running them installs a virtualenv) and on a Python started with
the variable cleared as test.sh clears it."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _commands(script: str) -> list[str]:
  """The script's commands, continuation lines joined, comments left out."""
  text = re.sub(r'\\\n\s*', ' ', (ROOT / script).read_text())
  return [line.strip() for line in text.splitlines()
          if line.strip() and not line.strip().startswith('#')]


def test_every_pip_install_of_setup_skips_the_bytecode():
  installs = [c for c in _commands('scripts/setup.sh') if '-m pip install' in c]
  assert len(installs) == 3, installs  # pip itself, rlax_llm with its extras, the --no-deps two
  for command in installs:
    assert '--no-compile' in command.split(), command


def test_test_sh_clears_pythondontwritebytecode_before_setup_and_pytest():
  commands = _commands('scripts/test.sh')
  cleared = commands.index('unset PYTHONDONTWRITEBYTECODE')
  assert cleared < commands.index('bash scripts/setup.sh')
  assert all(cleared < i for i, c in enumerate(commands) if '-m pytest' in c)


def test_run_sh_clears_pythondontwritebytecode_before_setup_and_the_launch():
  commands = _commands('scripts/run.sh')
  cleared = commands.index('unset PYTHONDONTWRITEBYTECODE')
  assert cleared < commands.index('bash scripts/setup.sh')
  assert cleared < next(i for i, c in enumerate(commands) if '-m rlax_llm.launch' in c)


def test_a_python_started_without_the_variable_writes_the_bytecode_of_its_imports(tmp_path):
  (tmp_path / 'imported_once.py').write_text('VALUE = 1\n')
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE='1')
  env.pop('PYTHONPATH', None)
  run = lambda env: subprocess.run([sys.executable, '-c', 'import imported_once'], cwd=tmp_path,
                                   env=env, check=True, timeout=60)
  run(env)
  assert not (tmp_path / '__pycache__').exists()  # the variable set: nothing written
  del env['PYTHONDONTWRITEBYTECODE']  # as scripts/test.sh's `unset`
  run(env)
  assert list((tmp_path / '__pycache__').glob('imported_once.*.pyc'))
