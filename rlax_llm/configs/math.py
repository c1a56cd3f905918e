"""GRPO on SmolLM2-135M-Instruct (configs/smollm2.py's model and recipe) for final-answer math:
the math task (rlax_llm/tasks/math_task.py, docs/tasks.md) asked in a chat turn to reason and
put its answer in \\boxed{}, rewarded 1/0 by the math scorer (math-verify).

By default the bundled sample (14 GSM8K/MATH-style problems, no download) checks the path end
to end. Variants (``--config=configs/math.py:VARIANT``) read a dataset from the Hugging Face
hub (downloaded once into the hub cache; HF_HUB_OFFLINE=1 then reads the cache only):
  gsm8k: openai/gsm8k, config main, train split, 200 problems of its test split held out.
  math500: HuggingFaceH4/MATH-500 (500 MATH problems, one test split), 100 of them held out.
``--config.task.path=hf://datasets/ORG/NAME`` (with task.hf_config, task.split,
task.eval_split, task.question_field, task.answer_field) or local JSONL/Parquet files take
another data set. A 135M model solves few of these; the recipe is the starting point to
scale (``--config.model.name`` / ``model.path``).
"""

import ml_collections

from rlax_llm.cli import CONFIG_DIR, load_config_file, task_section, unknown_variant

VARIANTS = ('gsm8k', 'math500')


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  # SmolLM2's config (the model and the recipe, every key's meaning in the packaged default);
  # what differs follows.
  c = load_config_file(str(CONFIG_DIR / 'smollm2.py'))
  c.name = 'math'
  c.total_steps = 200
  # Every argument of MathTask at its default (task_section) except these: path None is the
  # bundled sample; hf_config, split, eval_split choose a hub dataset's parts; scorer 'math'
  # (math-verify; a reference of words compared as normalised text).
  c.task = task_section('math', num_eval=4, format='chat', scorer='math')
  c.sampling.update(dict(max_prompt_len=160, max_new_tokens=256))
  c.rl.update(dict(prompts_per_step=4, lr_decay_steps=0))
  c.rollout.update(dict(slots=64, oversample=1.0, short_batches='pad'))
  c.eval.every_steps = 20

  if variant == 'gsm8k':
    c.name = 'math_gsm8k'
    c.task.update(dict(path='hf://datasets/openai/gsm8k', hf_config='main', split='train',
                       eval_split='test', num_eval=200))
    c.sampling.max_prompt_len = 320  # GSM8K's longest question + the chat template
  elif variant == 'math500':
    c.name = 'math_math500'
    c.task.update(dict(path='hf://datasets/HuggingFaceH4/MATH-500', split='test',
                       eval_split='', num_eval=100, question_field='problem',
                       answer_field='answer'))
    c.sampling.update(dict(max_prompt_len=768, max_new_tokens=512))
  elif variant is not None:
    raise unknown_variant(variant, 'configs/math.py', VARIANTS)
  return c
