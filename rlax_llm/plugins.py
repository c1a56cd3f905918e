"""The user's own objects, named in a config by import path (``'module.path:name'``).

A config names a task class (``task.name='my_pkg.tasks:MyTask'``) or a reward function
(``reward.<name>.fn='my_pkg.rewards:my_reward'``) from the user's own module, with no edit to
rlax_llm (docs/custom_tasks.md). ``import_object`` imports it and says, in one message naming
the config key, the value and the fix, what went wrong: not an import path, a module that is
not on the Python path or raises while importing, a missing attribute. What the object must be
(a task class, a function of ``(prompt, completion)``) is checked by its user
(``rlax_llm.tasks.task_class``, ``rlax_llm.rewards.function_reward``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

SEPARATOR = ':'


def is_import_path(value: object) -> bool:
  """Whether ``value`` is written as an import path (a str with ``':'``), right or wrong."""
  return isinstance(value, str) and SEPARATOR in value


def _dotted(text: str) -> bool:
  return bool(text) and all(part.isidentifier() for part in text.split('.'))


def import_object(spec: str, key: str) -> Any:
  """The object ``spec = 'module.path:name'`` names (``name`` may be dotted, e.g.
  ``'Class.method'``), importing the module.

  key: the config key ``spec`` came from (e.g. ``'task.name'``), for the messages.
  Raises ValueError naming ``key``, ``spec`` and the fix when ``spec`` is not of that form,
  the module cannot be imported (not on ``sys.path``, or it raises) or lacks the attribute.
  """
  module_name, sep, attribute = spec.partition(SEPARATOR) if isinstance(spec, str) else ('', '', '')
  if not sep or not _dotted(module_name) or not _dotted(attribute):
    raise ValueError(f'{key}={spec!r} is not an import path; write "module.path:name", e.g. '
                     '"my_pkg.my_module:MyTask" (the module importable from the Python path).')
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and (module_name == e.name or module_name.startswith(e.name + '.')):
      raise ValueError(
          f'{key}={spec!r}: no module named {e.name!r} on the Python path (sys.path: '
          f'{sys.path[:4]}...); install the package that holds it, or add its directory to '
          'PYTHONPATH (python -m puts the current directory on the path).') from None
    raise ValueError(f'{key}={spec!r}: importing module {module_name!r} failed: {e}; install '
                     f'what it imports.') from e
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ValueError(f'{key}={spec!r}: importing module {module_name!r} raised '
                     f'{type(e).__name__}: {e}; fix the module.') from e
  found: Any = module
  for part in attribute.split('.'):
    if not hasattr(found, part):
      where = getattr(module, '__file__', None) or module_name
      raise ValueError(f'{key}={spec!r}: module {module_name!r} ({where}) has no attribute '
                       f'{attribute!r}; check the name after the ":".')
    found = getattr(found, part)
  return found
