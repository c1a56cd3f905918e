"""The commands the docs quote still run: every command in a fenced shell block of docs/*.md,
README.md and launch/**/README.md is either one that runs offline in seconds (a dry run,
``--print_config``, ``--help``, the slice table) or on ``SKIPPED`` with the reason; and the
newcomer path of docs/own_model_and_data.md runs top to bottom offline, printing what the
doc quotes.

Cost: the default run parses every runnable command in-process (its recipe options, config,
variant and overrides: no JAX, a second) and runs the newcomer path's two commands (two
processes); running every runnable command is ``slow`` (one process each)."""

import dataclasses
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from launch.recipes import cli as recipes_cli
from launch.recipes import serve_tpu_vm
from one_device import ROOT, one_device_env
from rlax_llm.cli import load_config

DOCS = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md')),
        *sorted((ROOT / 'launch').rglob('README.md'))]
SHELL = ('bash', 'sh', 'shell', 'console')

# Commands that do not run offline in seconds, by their start, with the reason.
SKIPPED = {
    'pip install': 'installs packages from an index (network)',
    'python3 -m venv': 'the fresh-install check of docs/install.md (network, minutes)',
    'fresh/bin/python': 'the fresh-install check of docs/install.md (network, minutes)',
    'gcloud ': 'Google Cloud (network and credentials)',
    'bash scripts/run.sh': 'the default training run (minutes)',
    'bash scripts/test.sh': 'the test suite',
    'python scripts/plot_run.py': "plots a finished run's workdir",
    'python -m launch.recipes compile': 'compiles for TPU with libtpu (minutes; '
                                        'tests/test_tpu_compile.py compiles the smoke recipe)',
    'python -m rlax_llm.evaluate': 'an evaluation: loads a model and decodes, or reads a run',
    'python -m rlax_llm.launch': 'a training run (its --print_config form runs here)',
    'python launch/gke/render.py ...': 'an elided command (the one above it, with --output)',
    'PYTHONPATH=docs/examples python -m rlax_llm.launch': 'a training run of a docs/examples '
                                                         'task',
    '.venv/bin/python benchmarks/': 'a benchmark (minutes)',
    '.venv/bin/python -m pytest': 'the slow tests',
    'python -m rlax_llm.rollout.jetstream_adapter': 'a server (runs until stopped)',
    'RLAX_API_KEY=sk-local python -m rlax_llm.serve': 'a server (runs until stopped)',
    'docker build': 'builds and pushes a container image',
    'for id in 0 1; do': 'two local processes of a multi-host run (training)',
    'XLA_FLAGS=--xla_force_host_platform_device_count=2': 'the loop above: a training run',
    'done; wait': 'the loop above',
    'python -m rlax_llm.export': "exports a run's checkpoint (tests/test_export_cli.py runs it)",
    'if [ $(gcloud ': 'Google Cloud (network and credentials)',
}
# Lines that only close a shell construct opened on an earlier line (matched whole).
CLOSERS = {'fi', 'done', 'esac'}
RUNNABLE = ('--dry-run', '--print_config', '--help', 'launch.recipes slices')
# Placeholders the reader replaces, where the command checks the value's form: an example
# value (BUCKET, IMAGE and the like pass as they are).
PLACEHOLDERS = {'@PROJECT.iam.gserviceaccount.com': '@my-project.iam.gserviceaccount.com'}
# Wrappers of the recipes: the recipe each runs (their scripts exec python -m launch.recipes).
WRAPPERS = {'bash launch/tpu_vm/launch.sh': 'tpu-vm', 'bash launch/multihost/launch.sh':
            'multihost', 'bash launch/ray/launch.sh': 'ray',
            'python launch/gke/render.py': 'gke', 'python launch/gke/render_ray.py': 'gke-ray'}


@dataclasses.dataclass(frozen=True)
class Command:
  doc: str  # the doc's path relative to the checkout
  text: str  # continuation lines joined, comment and prompt left out
  output: tuple[str, ...]  # the lines of the plain ``` block right after it, if any

  @property
  def args(self) -> list[str]:
    return shlex.split(self.text)

  def __str__(self) -> str:
    return f'{self.doc}: {self.text[:90]}'


def doc_commands() -> list[Command]:
  """Every command of the fenced shell blocks of ``DOCS``; the last of a block gets the
  output block after it: the next fence, when it has no language and no heading comes
  between (prose may)."""
  out = []
  for doc in DOCS:
    text = doc.read_text()
    fences = list(re.finditer(r'^```(\w*)\n(.*?)^```$', text, re.DOTALL | re.MULTILINE))
    for i, fence in enumerate(fences):
      if fence.group(1) not in SHELL:
        continue
      after = fences[i + 1] if i + 1 < len(fences) else None
      output = ()
      if (after is not None and after.group(1) == ''
          and not re.search(r'^#', text[fence.end():after.start()], re.MULTILINE)):
        output = tuple(after.group(2).splitlines())
      lines = [line for line in fence.group(2).replace('\\\n', ' ').splitlines()
               if line.strip() and not line.lstrip().startswith('#')]
      for line in lines:
        command = ' '.join(shlex.split(line.removeprefix('$ '), comments=True))
        out.append(Command(str(doc.relative_to(ROOT)), command,
                           output if line == lines[-1] else ()))
  return out


COMMANDS = doc_commands()


def _runnable(command: Command) -> bool:
  return any(flag in command.args or ' '.join(command.args[1:4]).endswith(flag)
             for flag in RUNNABLE) and '...' not in command.args


def _skip_reason(command: Command) -> str | None:
  if command.text in CLOSERS:
    return 'closes the shell construct above'
  return next((why for start, why in SKIPPED.items() if command.text.startswith(start)), None)


RUNNABLE_COMMANDS = [c for c in COMMANDS if _runnable(c)]


def _recipe_argv(command: Command) -> list[str] | None:
  """The ``python -m launch.recipes`` arguments of a recipe command or wrapper, or None."""
  args = command.args
  if args[:3] == ['python', '-m', 'launch.recipes']:
    return args[3:]
  for start, recipe in WRAPPERS.items():
    if command.text.startswith(start + ' '):
      return [recipe, *args[len(start.split()):]]
  return None


def test_every_doc_command_runs_here_or_is_skipped_with_a_reason():
  unsorted = [str(c) for c in COMMANDS if not _runnable(c) and _skip_reason(c) is None]
  assert not unsorted, ('these doc commands neither run offline (a dry run, --print_config, '
                        f'--help) nor are on SKIPPED with a reason: {unsorted}')
  assert len(RUNNABLE_COMMANDS) >= 10, [str(c) for c in RUNNABLE_COMMANDS]


@pytest.mark.parametrize('command', RUNNABLE_COMMANDS, ids=str)
def test_every_runnable_doc_command_parses(command):
  """The cheap guarantee: the recipe, its options, the config file and variant and every
  --config.KEY=VALUE load (what breaks when a flag, key or variant is renamed)."""
  argv = _recipe_argv(command)
  if argv is not None:
    parser = recipes_cli.build_parser()
    if argv[:1] == ['serve-tpu-vm']:
      parser, argv = serve_tpu_vm.build_parser(), argv[1:]
    opts, rest = parser.parse_known_args(argv)
    overrides = recipes_cli._split_overrides(rest)  # pylint: disable=protected-access
    if getattr(opts, 'recipe', None) != 'slices':
      load_config([f'--config={opts.config}', *overrides])
    return
  assert command.args[:3] == ['python', '-m', 'rlax_llm.launch'], command
  load_config([a for a in command.args[3:] if a.startswith('--config')])


def _run(command: Command) -> subprocess.CompletedProcess:
  """``command`` as a user runs it from the checkout, offline (HF_HUB_OFFLINE: the hub is
  never asked), on one CPU device."""
  text = command.text
  for placeholder, example in PLACEHOLDERS.items():
    text = text.replace(placeholder, example)
  args = shlex.split(text)
  env = dict(one_device_env(), HF_HUB_OFFLINE='1', PYTHON=sys.executable)
  if args[0] == 'python':
    args = [sys.executable, *args[1:]]
  return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize('command', RUNNABLE_COMMANDS, ids=str)
def test_every_runnable_doc_command_runs_offline(command):
  result = _run(command)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]


# ---------------------------------------------------------------- the newcomer path, offline

NEWCOMER = [c for c in RUNNABLE_COMMANDS if c.doc == 'docs/own_model_and_data.md']
# What varies between machines: why the hub was not asked (the test sets HF_HUB_OFFLINE so
# that it never is; the doc shows a machine without a network).
_OFFLINE = re.compile(r'not verified: (no network|HF_HUB_OFFLINE is set) \(offline\)')


def _normalise(line: str) -> str:
  return _OFFLINE.sub('not verified: REASON (offline)', line)


@pytest.fixture(scope='module')
def newcomer_runs() -> dict[Command, subprocess.CompletedProcess]:
  return {command: _run(command) for command in NEWCOMER}


def test_the_newcomer_path_is_the_print_config_then_the_dry_run():
  assert [c.args[2] for c in NEWCOMER] == ['rlax_llm.launch', 'launch.recipes']
  assert '--print_config' in NEWCOMER[0].args and '--dry-run' in NEWCOMER[1].args
  assert all(c.output for c in NEWCOMER), 'each newcomer command is followed by its output'


@pytest.mark.parametrize('step', range(len(NEWCOMER)))
def test_the_newcomer_path_runs_offline_and_prints_what_the_doc_quotes(newcomer_runs, step):
  command = NEWCOMER[step]
  result = newcomer_runs[command]
  assert result.returncode == 0, result.stderr[-3000:]
  printed = {_normalise(line) for line in (result.stdout + result.stderr).splitlines()}
  missing = [line for line in command.output if _normalise(line) not in printed]
  assert not missing, (f'{command}: the doc quotes lines the command no longer prints: '
                       f'{missing}\nit printed:\n{result.stdout[-3000:]}{result.stderr[-2000:]}')
  assert not os.path.exists(ROOT / 'runs' / 'own-smoke')  # --print_config runs nothing
