"""Config contract and validation (DESIGN.md "Config contract").

``validate_config`` runs before any compute: it checks that every contract key exists and
that every choice field holds a valid choice, and fails with a message naming the key, the
value seen and the valid choices. ``check_override_keys`` catches misspelled
``--config.a.b=v`` flags before absl parses them, suggesting the closest valid keys.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
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


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """Loads ``path[:variant]`` the way ``config_flags`` does (``get_config(variant)``)."""
  path, _, variant = spec.partition(':')
  module_spec = importlib.util.spec_from_file_location('_rlax_llm_config', path)
  if module_spec is None or not pathlib.Path(path).exists():
    raise ConfigError(f'config file {path!r} does not exist.')
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def check_override_keys(argv: Sequence[str]) -> None:
  """Exits with a clear message if a ``--config.KEY=...`` flag names no config field."""
  spec = str(DEFAULT_CONFIG_PATH)
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      spec = arg.split('=', 1)[1]
    elif arg == '--config' and i + 1 < len(argv):
      spec = argv[i + 1]
  overrides = [a[len('--config.'):].split('=', 1) for a in argv if a.startswith('--config.')]
  if not overrides:
    return
  try:
    config = load_config_file(spec)
  except ConfigError as e:
    raise SystemExit(f'error: {e}') from None
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
