"""``python -m rlax_llm.launch --help`` and ``--print_config``: what the launcher can run.

``help_text`` lists the config files shipped in the package (``rlax_llm/configs/``, linked as
``configs/`` in a checkout) with the variants each declares in its ``VARIANTS`` tuple
(``rlax_llm.cli.config_variants``) and the first paragraph of its docstring, then the
launcher's flags. ``print_config`` prints a resolved config (after ``--config.KEY=VALUE``
overrides) once it validates, as JSON in the layout of ``workdir/config.json``, with the
values the run uses in place of the placeholders a loss fills in
(``rlax_llm.config.effective_config``). Neither builds a model or compiles anything.
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys
import textwrap

import ml_collections

from rlax_llm import hub_check
from rlax_llm.cli import CONFIG_DIR, DEFAULT_CONFIG_PATH, config_variants
from rlax_llm.config import effective_config, validate_config
from rlax_llm.errors import ConfigError

_USAGE = """\
usage: python -m rlax_llm.launch [--config=PATH[:VARIANT]] [--config.KEY=VALUE ...]
                                 [--workdir=DIR] [--print_config]

Runs one RL post-training job (trainer, inference workers, controller) from a config file.
Every value is validated before any compute: a bad one stops the launch with one line that
names the key and the fix."""

_FLAGS = """\
flags:
  --config=PATH[:VARIANT]  config file and optional variant (default: the packaged
                           configs/default.py)
  --config.KEY=VALUE       override one field, e.g. --config.rl.loss=dapo (after --config)
  --workdir=DIR            run directory, a local path or gs://BUCKET/... (default:
                           ./runs/<config name>-<timestamp>-<suffix>)
  --print_config           print the resolved, validated config as JSON and exit (no compute)
  -h, --help               this text; --helpfull lists every absl flag

examples:
  python -m rlax_llm.launch --config=configs/default.py:smoke --workdir=/tmp/run1
  python -m rlax_llm.launch --config=configs/smollm2.py --config.rl.loss=dapo --print_config

Cloud TPU recipes (TPU VM, multi-host slice, Ray on separate slices, GKE): launch/README.md."""


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


def config_listing(directory: str | os.PathLike = CONFIG_DIR) -> str:
  """One entry per ``*.py`` config in ``directory``: its path, variants and summary.

  Paths are shown as ``--config`` takes them from the current directory: ``configs/X.py``
  where ``./configs`` is the packaged directory (a checkout's link to it), else absolute.
  """
  directory = pathlib.Path(directory)
  link = pathlib.Path('configs')
  if link.is_dir() and link.resolve() == directory.resolve():
    directory = link
  paths = sorted(directory.glob('*.py'))
  if not paths:
    return f'configs: none found in {directory}'
  lines = [f'configs ({_display(directory)}/; pick one with '
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
  """Validates ``config`` and prints its ``effective_config`` as JSON (sorted keys) on stdout.

  The hub ids it names are checked as a dry run checks them (``rlax_llm.hub_check``; offline,
  one note on stderr says they were not verified). The meshes are checked over this
  process's devices, as a launch here would check them (``roles.check_meshes``); a config
  sized for a TPU slice fails that on a laptop's one device, and the error then says how to
  check it for the slice's chips here (CPU devices standing in for them) or with the recipes.

  Raises:
    ConfigError: the invalid key (the command line prints it as one ``error: ...`` line).
  """
  online, notes = hub_check.verify(config)
  validate_config(config, read_hub=online)
  # The meshes over this process's devices, as a launch's roles.prepare checks them first
  # (JAX and the roles' code load only now, once the JAX-free validation passed).
  import jax  # pylint: disable=import-outside-toplevel
  from rlax_llm import roles  # pylint: disable=import-outside-toplevel
  try:
    roles.check_meshes(config)
  except ConfigError as e:
    raise ConfigError(
        f'{str(e).rstrip(".")} (this machine has {roles.device_count_text()}, '
        f'{jax.default_backend().upper()}). For a TPU slice, check the config for its chips '
        'here with CPU devices standing in for them: JAX_PLATFORMS=cpu '
        'JAX_NUM_CPU_DEVICES=CHIPS python -m rlax_llm.launch ... --print_config, or with the '
        'recipes: python -m launch.recipes tpu-vm --tpu-type=SLICE --config=... --dry-run.'
        ) from None
  for note in notes:
    print(f'note: {note}', file=sys.stderr)
  print(effective_config(config).to_json_best_effort(indent=2, sort_keys=True))
