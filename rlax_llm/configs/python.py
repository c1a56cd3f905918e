"""GRPO on SmolLM2-135M-Instruct writing Python: MBPP-style problems asked in a chat turn,
rewarded by the fraction of their unit tests the program passes in the sandbox.

The model, its settings and the RL recipe are configs/smollm2.py's; the task is the python
task (docs/tasks.md): the bundled sample (``rlax_llm/tasks/data/python_sample.jsonl``, 10
problems, 2 held out) until ``--config.task.path=`` names your JSONL/Parquet files (MBPP:
``--config.task.question_field=text --config.task.tests_field=test_list
--config.task.setup_field=test_setup_code --config.task.solution_field=code``). The scorer is
``score_python`` (the program's last ```python block, then the tests one by one, in
``rlax_llm/sandbox.py`` with ``task.timeout_s`` and ``task.memory_mb``); a small format reward
(a closed ```python block) gives a signal before tests pass.
Variants (``--config=configs/python.py:VARIANT``):
  smoke: two RL steps on a few prompts with short completions (checks the path, minutes).
"""

import ml_collections

from rlax_llm.cli import CONFIG_DIR, load_config_file, task_section, unknown_variant

VARIANTS = ('smoke',)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  # SmolLM2's config (the model and the recipe, every key's meaning in the packaged default);
  # what differs follows.
  c = load_config_file(str(CONFIG_DIR / 'smollm2.py'))
  c.name = 'python'
  c.total_steps = 100
  # Every argument of PythonTask at its default (task_section) except these.
  c.task = task_section('python', num_eval=2, format='chat', shown_tests=1,
                        partial_credit=True, timeout_s=10.0, memory_mb=1024)
  c.rl.update(dict(prompts_per_step=4, group_size=8, lr_decay_steps=0))
  c.sampling.update(dict(temperature=0.8, max_prompt_len=160, max_new_tokens=192))
  c.rollout.update(dict(slots=32, oversample=1.0, short_batches='pad'))
  c.eval.every_steps = 10
  c.reward = ml_collections.ConfigDict(dict(
      task=ml_collections.ConfigDict(dict(weight=1.0)),
      format=ml_collections.ConfigDict(dict(weight=0.1))))

  if variant == 'smoke':
    _smoke(c)
  elif variant is not None:
    raise unknown_variant(variant, 'configs/python.py', VARIANTS)
  return c


def _smoke(c: ml_collections.ConfigDict) -> None:
  """Two RL steps of two prompts with short completions: checks the path, not learning."""
  c.name = 'python_smoke'
  c.total_steps = 2
  c.rl.update(dict(prompts_per_step=2, group_size=4))
  c.rollout.oversample = 0.0  # no dynamic sampling: the two steps train whatever they draw
  c.sampling.max_new_tokens = 48
  c.eval.every_steps = 0
