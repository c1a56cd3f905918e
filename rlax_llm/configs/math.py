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

import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from rlax_llm.cli import load_config_file

VARIANTS = ('gsm8k', 'math500')


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  # configs/smollm2.py (its model, GRPO recipe and the schema); what differs follows.
  c = load_config_file(str(pathlib.Path(__file__).with_name('smollm2.py')))
  c.name = 'math'
  c.total_steps = 200
  c.task = ml_collections.ConfigDict(dict(
      name='math',
      path=placeholder(str),  # None: the bundled sample; files, a glob, or hf://datasets/...
      eval_path=placeholder(str),  # held-out files (None: the split below or held out)
      hf_config='',  # a hub dataset's config ('' for its default)
      split='train',  # a hub dataset's train split
      eval_split=placeholder(str),  # None: 'test' when the dataset has one; '': held out
      num_eval=4,
      question_field='question', answer_field='answer',
      scorer='math',  # 'math' (math-verify; words as normalised text), 'normalised', 'exact'
      math_timeout_s=5.0,
      format='chat', system_prompt=placeholder(str), instruction=placeholder(str),
  ))
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
    raise ValueError(f'Unknown variant {variant!r} of configs/math.py; valid: '
                     f'{", ".join(VARIANTS)}.')
  return c
