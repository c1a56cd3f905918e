"""Tasks: prompts + formatting + scorer, selected by ``config.name`` through ``make_task``.

``config.name`` is a built-in name (``TASKS``) or the import path of a task class of the
user's own, ``'module.path:ClassName'`` (docs/custom_tasks.md); ``task_class`` resolves and
checks either, and the other fields of the config are the class's keyword arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from rlax_llm import plugins
from rlax_llm.tasks.arithmetic import ArithmeticTask
from rlax_llm.tasks.base import Prompt, Task
from rlax_llm.tasks.countdown import CountdownTask
from rlax_llm.tasks.math_task import MathTask
from rlax_llm.tasks.python_task import PythonTask

TASKS: dict[str, type] = {
    'arithmetic': ArithmeticTask,
    'countdown': CountdownTask,
    'math': MathTask,
    'python': PythonTask,
}

# What a task class must define itself (the rest of ``Task`` has uses a run may not make:
# ``charset`` for a tiny model, ``sft_example`` for the warm-up).
REQUIRED_METHODS = ('train_prompt', 'eval_prompts', 'score')

__all__ = [
  'REQUIRED_METHODS',
  'TASKS',
  'ArithmeticTask',
  'CountdownTask',
  'MathTask',
  'Prompt',
  'PythonTask',
  'Task',
  'defines',
  'make_task',
  'task_class',
  'task_parameters',
]


def defines(task_cls: type, member: str) -> bool:
  """Whether ``task_cls`` has ``member`` of its own (not the ``Task`` protocol's stub, which
  a subclass of ``Task`` inherits and which returns None)."""
  found = inspect.getattr_static(task_cls, member, None)
  return found is not None and found is not inspect.getattr_static(Task, member, None)


def task_class(name: str) -> type:
  """The class ``name`` selects: ``TASKS[name]``, or the class at the import path
  ``'module.path:ClassName'``, checked to be a task class.

  A class of the user's own must be a class, define ``train_prompt``, ``eval_prompts`` and
  ``score`` (subclassing ``Task`` is the simplest way to have the rest), and take ``seed`` as
  a keyword argument (``config.seed`` is passed). Raises ValueError naming ``task.name``, the
  value and the fix.
  """
  if not isinstance(name, str):
    raise ValueError(f'task.name={name!r} must be a str: one of {sorted(TASKS)}, or a class '
                     'of yours as "module.path:ClassName" (docs/custom_tasks.md).')
  if name in TASKS:
    return TASKS[name]
  if not plugins.is_import_path(name):
    raise ValueError(f'unknown task name {name!r}; valid names: {sorted(TASKS)}, or a task '
                     'class of yours as "module.path:ClassName" (docs/custom_tasks.md).')
  found = plugins.import_object(name, 'task.name')
  if not isinstance(found, type):
    raise ValueError(f'task.name={name!r} is a {type(found).__name__}, not a class; name a '
                     'task class (a subclass of rlax_llm.tasks.Task, docs/custom_tasks.md).')
  missing = [m for m in REQUIRED_METHODS if not defines(found, m)]
  if missing:
    raise ValueError(f'task.name={name!r}: {found.__name__} does not define {missing}; a task '
                     'class subclasses rlax_llm.tasks.Task and implements train_prompt, '
                     'eval_prompts and score (docs/custom_tasks.md).')
  if 'seed' not in task_parameters(found) and not _takes_any_keyword(found):
    raise ValueError(f'task.name={name!r}: {found.__name__}{inspect.signature(found)} takes no '
                     '"seed" keyword; add seed: int = 0 to its __init__ (config.seed is passed, '
                     'so that the prompts are a function of the seed).')
  return found


def task_parameters(task_cls: type) -> dict[str, inspect.Parameter]:
  """The keyword arguments of ``task_cls``'s constructor, by name (``*args``/``**kwargs``
  left out): what ``config.task`` may set, plus ``seed``."""
  return {name: p for name, p in inspect.signature(task_cls).parameters.items()
          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _takes_any_keyword(task_cls: type) -> bool:
  return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(task_cls).parameters.values())


def task_fields(config: Any) -> tuple[type, dict[str, Any]]:
  """``(task class, constructor kwargs)`` of a task config, checked as ``make_task`` checks
  them but without building the task (nothing is read): the class of ``config.name``, no
  field it does not take, every argument without a default set. Raises ValueError as
  ``make_task`` does."""
  if hasattr(config, 'to_dict'):
    fields = dict(config.to_dict())
  elif isinstance(config, Mapping):
    fields = dict(config)
  else:
    fields = dict(vars(config))
  if 'name' not in fields:
    raise ValueError(f'task config has no "name" field (fields: {sorted(fields)}); set '
                     f'name to one of {sorted(TASKS)}.')
  name = fields.pop('name')
  task_cls = task_class(name)
  parameters = task_parameters(task_cls)
  accepted = list(parameters)
  unknown = sorted(set(fields) - set(accepted))
  if unknown and not _takes_any_keyword(task_cls):
    raise ValueError(f'task {name!r} got unknown config fields {unknown}; '
                     f'{task_cls.__name__} accepts {accepted}.')
  unset = [p for p, param in parameters.items()
           if param.default is param.empty and fields.get(p) is None]
  if unset:
    raise ValueError(f'task {name!r}: {task_cls.__name__} requires {unset} (no default); set '
                     + ', '.join(f'--config.task.{p}=VALUE' for p in unset) + '.')
  return task_cls, fields


def make_task(config: Any) -> Task:
  """Builds the task ``task_class(config.name)`` with the remaining config fields as kwargs.

  config: an ``ml_collections.ConfigDict`` (or any object with attributes, or a mapping)
    holding ``name`` plus the task constructor's keyword arguments, e.g.
    ``ConfigDict(dict(name='arithmetic', seed=0, max_operand=99, operations='+'))``.
  Raises ValueError for an unknown name (listing the valid ones), a class that is not a task
  class, unknown fields, a required argument left unset (``task_fields``), or an object that
  lacks what a task has (``Task``'s members, a str ``name``).
  """
  task_cls, fields = task_fields(config)
  name = config['name'] if isinstance(config, Mapping) else getattr(config, 'name')
  task = task_cls(**fields)
  if not isinstance(task, Task) or not isinstance(getattr(task, 'name', None), str):
    lacking = [m for m in ('name', 'charset', 'train_prompt', 'eval_prompts', 'score',
                           'sft_example') if not hasattr(task, m)]
    raise ValueError(f'task {name!r}: a {task_cls.__name__} lacks '
                     f'{lacking or ["a str name"]}; subclass rlax_llm.tasks.Task and set the '
                     'class attribute name = "..." (docs/custom_tasks.md).')
  return task
