"""A config of your own: the packaged default, with ReverseTask (docs/examples/my_task.py)
and a reward function of yours beside the task's reward. Run from the repository root:

    PYTHONPATH=docs/examples python -m rlax_llm.launch --config=docs/examples/my_config.py

Variants: smoke (a few steps, what tests/tasks/test_plugins.py runs).
"""

import ml_collections

from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config_file, task_section

VARIANTS = ('smoke',)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = load_config_file(f'{DEFAULT_CONFIG_PATH}:smoke' if variant == 'smoke'
                       else str(DEFAULT_CONFIG_PATH))
  c.name = 'reverse'
  # name: the class by import path; the other fields: its constructor's keyword arguments
  # (task_section fills in every one at its default, so --config.task.X= can set each).
  c.task = task_section('my_task:ReverseTask', max_length=4, num_eval=16)
  c.reward = ml_collections.ConfigDict(dict(
      task=dict(weight=1.0),  # the task's score
      # my_task.same_length(prompt, completion) -> float, 10 s per call at most
      length=dict(kind='function', fn='my_task:same_length', weight=0.1, timeout_s=10.0),
  ))
  if variant == 'smoke':  # the default's smoke variant, shorter still
    c.total_steps = 2
    c.warmup.steps = 0  # RL from the random init: the run checks the path, not learning
    c.task.num_eval = 8
    c.eval.every_steps = 0
  elif variant is not None:
    raise ValueError(f'Unknown variant {variant!r} of my_config.py; valid: smoke.')
  return c
