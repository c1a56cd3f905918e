"""The command-line boundary: config files, their variants and ``--config.KEY=VALUE`` overrides.

Every entry point (``python -m rlax_llm.launch``, ``rlax_llm.evaluate``, ``rlax_llm.serve``,
the Cloud TPU tooling in ``launch/``) turns its command line into a config here, before absl parses
its own flags and before anything imports JAX: a missing file, a syntax error, an unknown
variant, a misspelled key or a value of the wrong type fails in a second with one line.

* ``load_config_file('path[:variant]')``: runs the file's ``get_config(variant)``.
* ``load_config(argv)``: the ``--config`` file of ``argv`` (or the packaged default) with its
  overrides applied, as a locked ``ConfigDict``; ``split_config_args`` separates those
  arguments from the entry point's own flags.
* ``task_section(name, **fields)``: the ``task`` group of a task, every constructor argument
  at its default. A ``--config.task.name=`` that changes the file's task starts the group
  over from the new task's ``task_section`` (the file's task fields configured another task),
  and the other ``--config.task.*`` overrides apply on top of it.

The three command lines (``python -m rlax_llm.launch``, ``rlax_llm.evaluate``,
``rlax_llm.serve``) read their arguments on one path: ``command_line(argv, usage, define)``
prints the usage for ``-h``/``--help`` (before the config loads, so help works with a broken
one), separates the config arguments (``split_config_args``; ``load_config`` loads them) and
parses the entry point's own flags (``define``; ``checkpoint_flag`` is the ``--checkpoint``
of evaluate and serve), one ``error: ...`` line for a bad one; ``one_line_errors`` turns an
``RlaxError`` raised while the command runs into that same line and exit status 1.

The config files ship inside the package (``rlax_llm/configs/``, ``DEFAULT_CONFIG_PATH``);
the repository's ``configs/`` is a link to that directory, so ``--config=configs/X.py``
works from a checkout and an installed wheel finds the same files.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import importlib.machinery
import importlib.util
import os
import pathlib
import sys
import textwrap
import traceback
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections.config_dict import placeholder

from rlax_llm.errors import ConfigError, Preempted, RlaxError

CONFIG_DIR = pathlib.Path(__file__).resolve().parent / 'configs'
DEFAULT_CONFIG_PATH = CONFIG_DIR / 'default.py'
HELP_FLAGS = ('-h', '--help', '-help')
# absl's: ``app.run`` answers them where an entry point runs under it (``known_only``); the
# others have only their own usage to print.
ABSL_HELP_FLAGS = ('--helpfull', '-helpfull', '--helpshort', '-helpshort')


def lookup(config: ml_collections.ConfigDict, dotted: str):
  """``config.a.b`` for ``dotted='a.b'``; ``ConfigError`` naming the missing field."""
  node = config
  for i, part in enumerate(dotted.split('.')):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      parent = '.'.join(dotted.split('.')[:i]) or '<root>'
      valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      raise ConfigError(f'config key {dotted!r} is missing: {parent!r} has no field {part!r}'
                        f' (fields there: {valid}).')
    node = node[part]
  return node


def flat_keys(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  """Every dotted key of ``config``, groups (``'rl'``) and leaves (``'rl.loss'``)."""
  keys = []
  for key, value in config.items():
    name = f'{prefix}{key}'
    keys.append(name)
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(flat_keys(value, name + '.'))
  return keys


def _where(error: BaseException, path: str) -> str:
  """' (configs/x.py, line 12)': the innermost frame of ``error`` in ``path`` (else anywhere)."""
  frames = traceback.extract_tb(error.__traceback__)
  ours = [f for f in frames if os.path.realpath(f.filename) == os.path.realpath(path)]
  frame = (ours or frames or [None])[-1]
  if frame is None:
    return ''
  name = path if ours else frame.filename
  return f' ({name}, line {frame.lineno})'


def _describe(error: BaseException) -> str:
  """'ValueError: message' on one line."""
  text = str(error).strip().replace('\n', ' ')
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def config_variants(path: str | os.PathLike) -> tuple[str, ...]:
  """The named variants a config file declares in its module-level ``VARIANTS`` tuple."""
  module_spec = importlib.util.spec_from_file_location('_rlax_llm_config_variants', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return tuple(getattr(module, 'VARIANTS', ()))


def unknown_variant(variant: str, config_file: str, variants: Sequence[str]) -> ValueError:
  """The error a config file's ``get_config`` raises for a variant it does not declare
  (``load_config_file`` turns it into a ``ConfigError`` naming the file)."""
  return ValueError(f'Unknown variant {variant!r} of {config_file}; valid: '
                    f'{", ".join(variants)}.')


def variant_entry(variant: str | None, table: dict[str, Any], config_file: str) -> Any:
  """For a config file whose variants are the keys of ``table``: the entry of ``variant``
  (the first key's when None), or ``unknown_variant``'s error."""
  name = next(iter(table)) if variant is None else variant
  if name not in table:
    raise unknown_variant(name, config_file, tuple(table))
  return table[name]


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """Loads ``path[:variant]`` the way ``config_flags`` does (``get_config(variant)``).

  Like ``config_flags``, everything after the first ``:`` is the variant, passed to
  ``get_config`` (``path:`` passes ``''``); without a ``:`` it calls ``get_config()``.

  Raises:
    ConfigError: the file does not exist, does not import (the message names the file and
      line), has no ``get_config``, ``get_config`` raises (for a variant: the file has no such
      variant) or returns something other than a ``ConfigDict``.
  """
  path, sep, variant = spec.partition(':')
  if not path:
    raise ConfigError(f'config spec {spec!r} names no file; pass --config=PATH[:VARIANT], '
                      'e.g. --config=configs/default.py:smoke.')
  file = pathlib.Path(path)
  if not file.exists():
    raise ConfigError(f'config file {path!r} does not exist (relative paths are read from '
                      f'{os.getcwd()}); pass --config=PATH[:VARIANT] naming an existing file.')
  if not file.is_file():
    raise ConfigError(f'config file {path!r} is not a file; pass --config=PATH[:VARIANT] '
                      'naming a Python file that defines get_config.')
  loader = importlib.machinery.SourceFileLoader('_rlax_llm_config', path)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  try:
    loader.exec_module(module)
  except SyntaxError as e:
    where = path if os.path.realpath(e.filename or path) == os.path.realpath(path) else e.filename
    text = f' ({e.text.strip()!r})' if e.text and e.text.strip() else ''
    raise ConfigError(f'config file {path} does not import: {type(e).__name__} at line '
                      f'{e.lineno} of {where}: {e.msg}{text}. Fix that line.') from e
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ConfigError(f'config file {path} does not import: {_describe(e)}'
                      f'{_where(e, path)}.') from e
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise ConfigError(f'config file {path} has no get_config(); a config file must define '
                      'get_config(variant=None) returning an ml_collections.ConfigDict.')
  call = f'get_config({variant!r})' if sep else 'get_config()'
  try:
    config = get_config(variant) if sep else get_config()
  except (ValueError, KeyError, TypeError) as e:
    if not sep:
      raise ConfigError(f'{call} in {path} raised {_describe(e)}{_where(e, path)}.') from e
    raise ConfigError(f'{path} has no variant {variant!r} ({_describe(e)})') from e
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ConfigError(f'{call} in {path} raised {_describe(e)}{_where(e, path)}.') from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'{call} in {path} returned {type(config).__name__}, not an '
                      'ml_collections.ConfigDict; make it return the config.')
  return config


def config_spec(argv: Sequence[str]) -> str:
  """The ``--config`` value in ``argv`` (the last one, as absl takes), or the default file."""
  spec = str(DEFAULT_CONFIG_PATH)
  for i, arg in enumerate(argv):
    if arg == '--':
      break
    flag, eq, value = arg.partition('=')
    if flag in ('--config', '-config'):
      if eq:
        spec = value
      elif i + 1 < len(argv):
        spec = argv[i + 1]
  return spec


def check_config_spec(argv: Sequence[str]) -> ml_collections.ConfigDict:
  """Loads the ``--config=path[:variant]`` file named in ``argv`` (or the default) once.

  Runs before absl parses flags, so a bad config file fails with one line instead of
  ``config_flags``' traceback or a misleading "'seed' is missing".

  Returns:
    The loaded config (pass it to ``check_override_keys``).

  Raises:
    SystemExit: ``'error: ...'`` when ``load_config_file`` fails (see there).
  """
  try:
    return load_config_file(config_spec(argv))
  except ConfigError as e:
    raise SystemExit(f'error: {e}') from None


def check_override_keys(argv: Sequence[str],
                        config: ml_collections.ConfigDict | None = None) -> None:
  """Exits with a clear message if a ``--config.KEY=...`` flag names no config field.

  Args:
    argv: the command line without the program name.
    config: the ``--config`` file's config as ``check_config_spec(argv)`` returns it; loaded
      (and checked) here when ``None`` and there are overrides.
  """
  overrides = [a[len('--config.'):].split('=', 1) for a in argv if a.startswith('--config.')]
  if not overrides:
    return
  if config is None:
    config = check_config_spec(argv)
  valid = flat_keys(config)
  for key, *value in overrides:
    if key in valid and value:
      _check_override_type(key, lookup(config, key), value[0])
    if key not in valid:
      close = difflib.get_close_matches(key, valid, n=3)
      parent = key.rpartition('.')[0]
      siblings = [k.rpartition('.')[2] for k in valid if k.rpartition('.')[0] == parent]
      hint = f' Did you mean {" or ".join(close)}?' if close else ''
      raise SystemExit(f'error: --config.{key}: unknown config key {key!r}.{hint} '
                       f'Valid keys under {parent or "<root>"!r}: {sorted(siblings)}.')


def _check_override_type(key: str, current, text: str) -> None:
  """Exits if ``text`` cannot become the type of the field's current value."""
  kind = type(current)
  if kind is bool:
    ok = text.lower() in ('true', 'false', '1', '0')
  elif kind in (int, float):
    try:
      kind(text)
      ok = True
    except ValueError:
      ok = False
  else:
    return  # strings, None and nested values are parsed by config_flags itself
  if not ok:
    raise SystemExit(f'error: --config.{key}={text!r}: expected type {kind.__name__} '
                     f'(the default is {current!r}).')


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """``(config arguments, the rest)`` of ``argv`` (without the program name), order kept.

  Config arguments are ``--config=SPEC`` / ``--config SPEC`` and ``--config.KEY=VALUE``;
  everything from a ``--`` on belongs to the rest.
  """
  ours, rest = [], []
  args = iter(enumerate(argv))
  for i, arg in args:
    if arg == '--':
      rest.extend(argv[i:])
      break
    if arg in ('--config', '-config') and i + 1 < len(argv):
      ours.extend((arg, next(args)[1]))
    elif arg.partition('=')[0] in ('--config', '-config') or arg.startswith('--config.'):
      ours.append(arg)
    else:
      rest.append(arg)
  return ours, rest


# The types a config field of a task argument can have (what ``--config.task.X=`` parses).
_FIELD_TYPES = (bool, int, float, str)


def _field_type(annotation) -> type | None:
  """The first of ``_FIELD_TYPES`` in ``annotation`` (a type or a union), else None."""
  options = typing.get_args(annotation) or (annotation,)
  return next((t for t in _FIELD_TYPES if t in options), None)


def task_section(name: str, **fields) -> ml_collections.ConfigDict:
  """The ``task`` config group of the task ``name`` (a built-in name or a task class's
  ``'module.path:ClassName'``, ``rlax_llm.tasks.task_class``): ``name`` and every keyword
  argument of its constructor but ``seed`` (``config.seed`` is passed) at its default, then
  ``fields``. An argument whose default is None (or that has none) is a typed placeholder
  (its annotation's ``str``, ``int``, ``float`` or ``bool``), so ``--config.task.X=VALUE``
  can set it.

  Raises ValueError when ``name`` names no task class or a field of ``fields`` is not one of
  its arguments.
  """
  # rlax_llm.tasks loads numpy and every task; only a config that names a task needs it.
  from rlax_llm import tasks  # pylint: disable=import-outside-toplevel
  task_cls = tasks.task_class(name)
  parameters = tasks.task_parameters(task_cls)
  try:
    hints = typing.get_type_hints(task_cls.__init__)
  except Exception:  # pylint: disable=broad-exception-caught  # unresolvable annotations
    hints = {}
  section = ml_collections.ConfigDict({'name': name})
  for key, parameter in parameters.items():
    if key == 'seed':
      continue
    default = None if parameter.default is parameter.empty else parameter.default
    if default is None:
      default = placeholder(_field_type(hints.get(key)) or object)
    section[key] = default
  unknown = sorted(set(fields) - set(section) - {'name'})
  if unknown:
    raise ValueError(f'task {name!r} takes no field {unknown}; {task_cls.__name__}\'s fields: '
                     f'{sorted(k for k in section if k != "name")}.')
  section.update(fields)
  return section


def _task_override(argv: Sequence[str]) -> str | None:
  """The last ``--config.task.name=VALUE`` of ``argv`` (as absl takes the last), or None."""
  names = [a.partition('=')[2] for a in argv if a.startswith('--config.task.name=')]
  return names[-1] if names else None


def _switch_task(argv: Sequence[str], config: ml_collections.ConfigDict
                 ) -> ml_collections.ConfigDict | None:
  """``config`` with the task group of ``--config.task.name=`` (``task_section``) when that
  names another task than ``config``'s, else None. A ``--config.task.X`` override that the new
  task does not take exits naming the task's fields."""
  name = _task_override(argv)
  task = config.get('task')
  if name is None or not isinstance(task, ml_collections.ConfigDict) or task.get('name') == name:
    return None
  try:
    section = task_section(name)
  except ValueError as e:
    raise SystemExit(f'error: --config.task.name={name}: {e}') from None
  fields = sorted(k for k in section if k != 'name')
  for arg in argv:
    key = arg[len('--config.'):].partition('=')[0] if arg.startswith('--config.') else ''
    if key.startswith('task.') and key[len('task.'):] not in section:
      raise SystemExit(
          f'error: --config.{key}: task {name!r} takes no field {key[len("task."):]!r}; its '
          f'fields: {fields}. (--config.task.name={name} starts the task group over from '
          f'that task\'s defaults; the config file\'s task fields were for {task.get("name")!r}.)')
  switched = copy.deepcopy(config)  # keeps the placeholders' types (--config.model.path=)
  with switched.unlocked():
    switched.task = section
  return switched


def load_config(argv: Sequence[str], base: ml_collections.ConfigDict | None = None
                ) -> ml_collections.ConfigDict:
  """The config ``argv``'s config arguments describe, overrides applied, locked.

  Args:
    argv: config arguments (``split_config_args``): ``--config=path[:variant]`` (default:
      ``DEFAULT_CONFIG_PATH``) and ``--config.KEY=VALUE`` overrides.
    base: start from this config instead of a file (``argv`` then names no ``--config``
      file, only overrides): a run's own ``config.json`` (``rlax_llm.run_config.saved_config``).

  A ``--config.task.name=`` naming another task than the config's replaces its task group
  with that task's ``task_section`` before the other overrides apply.

  Raises:
    SystemExit: ``'error: ...'``: the file cannot be loaded, an override names no field or
      its value does not parse, or ``--config.task.name`` names no task class.
  """
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  argv = list(argv)
  loaded = base if base is not None else check_config_spec(argv)
  switched = _switch_task(argv, loaded)
  if switched is not None:  # start from the loaded config, its task group replaced
    base = switched
    argv = [a for a in argv if a.startswith('--config.')]  # the file is loaded: overrides
  check_override_keys(argv, switched if switched is not None else loaded)
  values = flags.FlagValues()
  if base is None:
    holder = config_flags.DEFINE_config_file(
        'config', str(DEFAULT_CONFIG_PATH), 'Config file.', flag_values=values,
        lock_config=True, sys_argv=['rlax_llm', *argv])
  else:
    holder = config_flags.DEFINE_config_dict('config', base, 'Config.', flag_values=values,
                                             lock_config=True, sys_argv=['rlax_llm', *argv])
  try:
    values(['rlax_llm', *argv])
  except flags.Error as e:
    raise SystemExit(f'error: {e}') from None
  return holder.value


# ------------------------------------------------------------------- the command lines


@dataclasses.dataclass(frozen=True)
class CommandLine:
  """A command line read by ``command_line``: ``config_args`` for ``load_config``, the
  entry point's own flags' ``values`` by name, and ``rest``: the arguments its flags do not
  name (``known_only``: for absl's ``app.run``), else ``[]``."""

  config_args: list[str]
  values: dict[str, Any]
  rest: list[str]


def wants_help(argv: Sequence[str], also: Sequence[str] = ()) -> bool:
  """Whether ``argv`` (without the program name) asks for ``--help`` (or a flag in
  ``also``) before any ``--``."""
  for arg in argv:
    if arg == '--':
      return False
    if arg in HELP_FLAGS or arg in also:
      return True
  return False


def checkpoint_flag(values, verb: str):
  """Defines ``--checkpoint`` on the absl ``FlagValues`` ``values``: the params to ``verb``
  (evaluate, serve), a run's workdir or one of its checkpoint directories."""
  return flags.DEFINE_string(
      'checkpoint', None, f'Params to {verb}: a run\'s workdir (its latest checkpoint) or a '
      "checkpoint directory, local or gs:// (default: the config's own: model.path or the "
      'seeded init).', flag_values=values)


def command_line(argv: Sequence[str], usage: Callable[[], str],
                 define: Callable[[Any], dict[str, Any]], *, known_only: bool = False
                 ) -> CommandLine | None:
  """Reads ``argv`` (with the program name) as every entry point does.

  Args:
    argv: ``sys.argv``.
    usage: the ``--help`` text (printed to stdout, and None returned, when ``argv`` asks for
      help: before anything else, so it works with a broken config; also for absl's
      ``--helpfull``/``--helpshort`` unless ``known_only`` leaves those to ``app.run``).
    define: defines the entry point's own flags on the absl ``FlagValues`` it is given and
      returns their holders by name.
    known_only: leave the arguments no flag of ``define`` names in ``CommandLine.rest``
      (absl's own flags, which ``app.run`` parses), instead of refusing them; the entry
      point's flags, and ``--config``, are then listed by absl's ``--helpfull`` too
      (``_list_in_absl_help``).

  Raises:
    SystemExit: ``'error: ...'``: a flag is unknown or its value does not parse.
  """
  if wants_help(argv[1:], also=() if known_only else ABSL_HELP_FLAGS):
    sys.stdout.write(usage())
    return None
  config_args, rest = split_config_args(argv[1:])
  values = flags.FlagValues()
  holders = define(values)
  try:
    unparsed = values([argv[0], *rest], known_only=known_only)
  except flags.Error as e:
    raise SystemExit(f'error: {e}') from None
  if known_only:
    module = sys.modules[define.__module__]  # '__main__' under ``python -m``: its real name
    _list_in_absl_help(values, getattr(module.__spec__, 'name', None) or module.__name__)
  return CommandLine(config_args, {name: holder.value for name, holder in holders.items()},
                     list(unparsed[1:]) if known_only else [])


def flags_help(define: Callable[[Any], dict[str, Any]],
               entries: Sequence[tuple[str, str]] = ()) -> list[str]:
  """``--help`` lines for an entry point's flags: ``entries`` (``(flag, text)`` pairs, e.g.
  ``--config``) first, then every flag ``define`` defines (as ``command_line`` takes it) with
  its help string and its default, each wrapped to 100 columns. Read from the definitions,
  so the list cannot fall behind them."""
  values = flags.FlagValues()
  entries = list(entries)
  for name in define(values):
    flag = values[name]
    default = '' if flag.default in (None, False) else f' (default: {flag.default})'
    entries.append((f'--{name}', flag.help + default))
  return [textwrap.fill(f'{flag}: {text}', 100, initial_indent='  ', subsequent_indent='      ')
          for flag, text in entries]


def _list_in_absl_help(values: flags.FlagValues, module: str) -> None:
  """Adds the entry point's flags (parsed already, on their own ``values``) and a ``--config``
  entry to absl's ``flags.FLAGS`` under ``module``, so that ``--helpfull``, which ``app.run``
  answers from ``flags.FLAGS``, lists them beside absl's own. ``--config`` is never parsed by
  absl (``split_config_args`` takes it out first); its entry is there to be listed."""
  flags.DEFINE_string(
      'config', None, 'Config file, PATH[:VARIANT] (default: the packaged '
      'rlax_llm/configs/default.py); --config.KEY=VALUE overrides a field (both read by '
      'rlax_llm.cli before the other flags).',
      flag_values=values)
  for name in list(values):
    if name not in flags.FLAGS:
      flags.FLAGS[name] = values[name]
      flags.FLAGS.register_flag_by_module(module, values[name])


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
  """Runs a command's body: an ``RlaxError`` (what the user must fix) exits with one
  ``error: ...`` line and status 1; ``Preempted`` (a checkpoint was saved) prints its
  message and returns, status 0."""
  try:
    yield
  except Preempted as e:
    print(e)
  except RlaxError as e:
    raise SystemExit(f'error: {e}') from None
