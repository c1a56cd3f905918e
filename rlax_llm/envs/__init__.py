"""Multi-turn environments and the tools their agents call (docs/environments.md).

``make_env(config)`` builds the environment ``config.name`` names: a built-in one (``ENVS``)
or a class of the user's own by import path, ``'module.path:ClassName'`` (the same plug-in
mechanism as tasks, ``rlax_llm.plugins``); the config's other fields are its keyword
arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from rlax_llm import plugins
from rlax_llm.envs.base import Environment, EnvStep, TextEnv, observation_messages
from rlax_llm.envs.calculator import CalculatorEnv
from rlax_llm.envs.countdown_feedback import CountdownFeedbackEnv
from rlax_llm.envs.grid import GridEnv

ENVS: dict[str, type] = {
    'calculator': CalculatorEnv,
    'countdown_feedback': CountdownFeedbackEnv,
    'grid': GridEnv,
}

__all__ = [
  'ENVS',
  'CalculatorEnv',
  'CountdownFeedbackEnv',
  'EnvStep',
  'Environment',
  'GridEnv',
  'TextEnv',
  'env_class',
  'make_env',
  'observation_messages',
]


def env_class(name: str) -> type:
  """The class ``name`` selects: ``ENVS[name]`` or the class at the import path
  ``'module.path:ClassName'``. Raises ValueError (TypeError for an object that is not a
  class) naming ``env.name``, the value and the fix."""
  if isinstance(name, str) and name in ENVS:
    return ENVS[name]
  if not plugins.is_import_path(name):
    raise ValueError(f'unknown environment name {name!r}; valid names: {sorted(ENVS)}, or an '
                     'environment class of yours as "module.path:ClassName" '
                     '(docs/environments.md).')
  found = plugins.import_object(name, 'env.name')
  if not isinstance(found, type):
    raise TypeError(f'env.name={name!r} is a {type(found).__name__}, not a class; name an '
                    'environment class (docs/environments.md).')
  return found


def make_env(config: Any, tool_format: str | None = None) -> Environment:
  """Builds the environment ``env_class(config.name)`` with the config's other fields as
  keyword arguments.

  config: an ``ml_collections.ConfigDict`` or a mapping, e.g. ``{'name': 'calculator',
    'max_turns': 4}``.
  tool_format: the model's tool-call format (``tool_calls.tool_format_for(tokenizer)``),
    passed as ``tool_format`` to a class that takes it when the config leaves it unset or
    ``'auto'``.
  Raises ValueError for an unknown name, fields the class does not take or a required field
  left unset; TypeError for a name that is not a class or builds an object that is not an
  ``Environment`` (``name``, ``max_turns``, ``tools``, ``reset``, ``step``, ``state_key``).
  """
  if not isinstance(config, Mapping) and not hasattr(config, 'to_dict'):
    raise TypeError(f'make_env expects a ConfigDict or a mapping, got {type(config).__name__}.')
  fields = dict(config.to_dict() if hasattr(config, 'to_dict') else config)
  name = fields.pop('name', None)
  env_cls = env_class(name)
  parameters = inspect.signature(env_cls).parameters
  if 'tool_format' in parameters and fields.get('tool_format', 'auto') == 'auto':
    fields.pop('tool_format', None)
    if tool_format is not None:
      fields['tool_format'] = tool_format
  any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
  unknown = sorted(set(fields) - set(parameters))
  if unknown and not any_keyword:
    raise ValueError(f'environment {name!r} got unknown config fields {unknown}; '
                     f'{env_cls.__name__} accepts {sorted(parameters)}.')
  unset = [p for p, param in parameters.items() if param.default is param.empty
           and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
           and fields.get(p) is None]
  if unset:
    raise ValueError(f'environment {name!r}: {env_cls.__name__} requires {unset} (no '
                     'default); set ' + ', '.join(f'env.{p}=VALUE' for p in unset) + '.')
  env = env_cls(**fields)
  if not isinstance(env, Environment):
    lacking = [m for m in ('name', 'max_turns', 'tools', 'reset', 'step', 'state_key')
               if not hasattr(env, m)]
    raise TypeError(f'environment {name!r}: a {env_cls.__name__} lacks {lacking}; implement '
                    'the rlax_llm.envs.Environment protocol (docs/environments.md).')
  return env
