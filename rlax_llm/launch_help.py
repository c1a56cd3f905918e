"""``python -m rlax_llm.launch --help`` and ``--print_config``: what the launcher can run.

``help_text`` lists the config files next to the default one (``configs/``) with the variants
each declares in its ``VARIANTS`` tuple (``rlax_llm.config.config_variants``) and the first
paragraph of its docstring, then the launcher's flags. ``print_config`` prints a resolved
config (after ``--config.KEY=VALUE`` overrides) once it validates, as the JSON a run writes to
``workdir/config.json``. Neither builds a model or compiles anything.
"""

from __future__ import annotations

import ast
import os
import pathlib
import textwrap
from collections.abc import Sequence

import ml_collections

from rlax_llm.config import DEFAULT_CONFIG_PATH, ConfigError, config_variants, validate_config

HELP_FLAGS = ('-h', '--help', '-help')

_USAGE = """\
usage: python -m rlax_llm.launch [--config=PATH[:VARIANT]] [--config.KEY=VALUE ...]
                                 [--workdir=DIR] [--print_config]

Runs one RL post-training job (trainer, inference workers, controller) from a config file.
Every value is validated before any compute: a bad one stops the launch with one line that
names the key and the fix."""

_FLAGS = """\
flags:
  --config=PATH[:VARIANT]  config file and optional variant (default: configs/default.py)
  --config.KEY=VALUE       override one field, e.g. --config.rl.loss=dapo (after --config)
  --workdir=DIR            run directory (default: ./runs/<config name>-<timestamp>-<suffix>)
  --print_config           print the resolved, validated config as JSON and exit (no compute)
  -h, --help               this text; --helpfull lists every absl flag

examples:
  python -m rlax_llm.launch --config=configs/default.py:smoke --workdir=/tmp/run1
  python -m rlax_llm.launch --config=configs/smollm2.py --config.rl.loss=dapo --print_config

Cloud TPU recipes (TPU VM, multi-host slice, Ray on separate slices, GKE): launch/README.md."""


def wants_help(argv: Sequence[str]) -> bool:
  """Whether ``argv`` (without the program name) asks for ``--help`` before any ``--``."""
  for arg in argv:
    if arg == '--':
      return False
    if arg in HELP_FLAGS:
      return True
  return False


def _display(path: pathlib.Path) -> str:
  try:
    return str(path.relative_to(pathlib.Path.cwd()))
  except ValueError:
    return str(path)


def _summary(path: pathlib.Path) -> str:
  """The first paragraph of a config file's docstring, on one line ('' when it has none)."""
  try:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding='utf-8'))) or ''
  except (OSError, SyntaxError, ValueError) as e:
    return f'(unreadable: {type(e).__name__}: {e})'
  return ' '.join(doc.split('\n\n')[0].split())


def config_listing(directory: str | os.PathLike = DEFAULT_CONFIG_PATH.parent) -> str:
  """One entry per ``*.py`` config in ``directory``: its path, variants and summary."""
  paths = sorted(pathlib.Path(directory).glob('*.py'))
  if not paths:
    return f'configs: none found in {directory}'
  lines = [f'configs ({_display(pathlib.Path(directory))}/; pick one with '
           '--config=PATH[:VARIANT]):']
  for path in paths:
    try:
      variants = ', '.join(config_variants(path)) or '(none)'
    except Exception as e:  # pylint: disable=broad-exception-caught
      variants = f'(the file does not import: {type(e).__name__}: {e})'
    default = ' (the default)' if path.resolve() == DEFAULT_CONFIG_PATH.resolve() else ''
    lines.append(f'  {_display(path)}{default}  variants: {variants}')
    summary = _summary(path)
    if summary:
      lines.extend(textwrap.wrap(summary, width=92, initial_indent='      ',
                                 subsequent_indent='      '))
  return '\n'.join(lines)


def help_text() -> str:
  """The text of ``python -m rlax_llm.launch --help``."""
  return f'{_USAGE}\n\n{config_listing()}\n\n{_FLAGS}\n'


def print_config(config: ml_collections.ConfigDict) -> None:
  """Validates ``config`` and prints it as JSON (sorted keys), the ``config.json`` format.

  Raises:
    SystemExit: ``'error: ...'`` (status 1) naming the invalid key, as a launch would.
  """
  try:
    validate_config(config)
  except ConfigError as e:
    raise SystemExit(f'error: {e}') from None
  print(config.to_json_best_effort(indent=2, sort_keys=True))
