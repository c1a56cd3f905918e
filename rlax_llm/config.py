"""Config contract and validation (DESIGN.md "Config contract").

``validate_config`` runs before any compute: it checks that every contract key exists and
that every choice field holds a valid choice, and fails with a message naming the key, the
value seen and the valid choices. Before absl parses flags, ``check_config_spec`` loads the
``--config`` file once (a missing file, a syntax error or an unknown variant fails with one
line) and ``check_override_keys`` catches misspelled ``--config.a.b=v`` flags, suggesting the
closest valid keys.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import os
import pathlib
import traceback
from collections.abc import Sequence

import ml_collections

DEFAULT_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / 'configs' / 'default.py'

# Keys every config must have (docs, scripts and users rely on them).
REQUIRED_KEYS = (
    'seed', 'total_steps', 'model.name', 'task.name', 'rl.loss', 'rl.group_size',
    'rl.learning_rate', 'staleness.j', 'staleness.k', 'backend', 'checkpoint.every_steps',
    'eval.every_steps', 'mesh',
)

# Choice fields -> valid values (loss-related ones come from ``rlax_llm.losses``).
CHOICES = {
    'backend': ('local',),
    'model.name': ('tiny',),
    'task.name': ('arithmetic',),
    'model.param_dtype': ('float32', 'bfloat16'),
    'model.dtype': ('float32', 'bfloat16'),
    'rl.old_logprobs': ('behaviour', 'recompute'),
}


def choices() -> dict[str, tuple]:
  """Every choice field and its valid values (``None`` = use the loss's default)."""
  from rlax_llm import losses  # pylint: disable=import-outside-toplevel
  return CHOICES | {
      'rl.loss': tuple(sorted(losses.LOSSES)),
      'rl.advantage_estimator': (None,) + losses.ESTIMATORS,
      'rl.kl_estimator': (None,) + losses.KL_ESTIMATORS,
      'rl.aggregation': (None,) + losses.AGGREGATIONS,
      'rl.m2po_variant': losses.M2PO_VARIANTS,
      'rl.mismatch.level': losses.components.MISMATCH_LEVELS,
      'rl.mismatch.mode': losses.components.MISMATCH_MODES,
  }

POSITIVE_INTS = ('rl.group_size', 'rl.prompts_per_step', 'sampling.max_new_tokens',
                 'sampling.max_prompt_len')
NON_NEGATIVE_INTS = ('total_steps', 'warmup.steps', 'eval.every_steps',
                     'checkpoint.every_steps')


class ConfigError(ValueError):
  """A config that cannot run, with the key and the fix in the message."""


def _get(config: ml_collections.ConfigDict, dotted: str):
  node = config
  for i, part in enumerate(dotted.split('.')):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      parent = '.'.join(dotted.split('.')[:i]) or '<root>'
      valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      raise ConfigError(f'config key {dotted!r} is missing: {parent!r} has no field {part!r}'
                        f' (fields there: {valid}).')
    node = node[part]
  return node


def _flat_keys(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  keys = []
  for key, value in config.items():
    name = f'{prefix}{key}'
    keys.append(name)
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(_flat_keys(value, name + '.'))
  return keys


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` naming the first key that is missing or invalid."""
  for key in REQUIRED_KEYS:
    _get(config, key)
  for key, valid in choices().items():
    try:
      value = _get(config, key)
    except ConfigError:
      if key in REQUIRED_KEYS:
        raise
      continue
    if value not in valid:
      raise ConfigError(f'config.{key}={value!r} is not valid; choose one of {list(valid)}.')
  for key in POSITIVE_INTS + NON_NEGATIVE_INTS:
    try:
      value = _get(config, key)
    except ConfigError:
      continue
    low = 1 if key in POSITIVE_INTS else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ConfigError(f'config.{key}={value!r} must be an int >= {low}.')
  if _get(config, 'staleness.j') < 1 or _get(config, 'staleness.k') < 1:
    raise ConfigError('config.staleness.j and config.staleness.k must be >= 1 '
                      f'(got j={config.staleness.j}, k={config.staleness.k}).')


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
  valid = _flat_keys(config)
  for key, *value in overrides:
    if key in valid and value:
      _check_override_type(key, _get(config, key), value[0])
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
