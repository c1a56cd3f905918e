"""Tasks: prompts + formatting + scorer, selected by ``config.name`` through ``make_task``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

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

__all__ = ['ArithmeticTask', 'CountdownTask', 'MathTask', 'Prompt', 'PythonTask', 'TASKS',
           'Task', 'make_task']


def make_task(config: Any) -> Task:
  """Builds the task ``TASKS[config.name]`` with the remaining config fields as kwargs.

  config: an ``ml_collections.ConfigDict`` (or any object with attributes, or a mapping)
    holding ``name`` plus the task constructor's keyword arguments, e.g.
    ``ConfigDict(dict(name='arithmetic', seed=0, max_operand=99, operations='+-'))``.
  Raises ValueError for an unknown name (listing the valid ones) or unknown fields.
  """
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
  if name not in TASKS:
    raise ValueError(f'unknown task name {name!r}; valid names: {sorted(TASKS)}.')
  task_cls = TASKS[name]
  accepted = [p for p in inspect.signature(task_cls).parameters if p != 'self']
  unknown = sorted(set(fields) - set(accepted))
  if unknown:
    raise ValueError(f'task {name!r} got unknown config fields {unknown}; '
                     f'{task_cls.__name__} accepts {accepted}.')
  return task_cls(**fields)
