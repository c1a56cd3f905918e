"""An environment run's seed stream, as the ``Task`` the controller draws prompts from.

An environment run (``env.name`` set; docs/environments.md, "Training on an environment")
keeps the single-turn run's data machinery: the controller draws a batch of prompts from the
grain stream of ``train_prompt(index)`` (its iterator position is the checkpoint's data
position) and evaluates on ``eval_prompts()``. Here a prompt is an environment seed: its
``text`` is the seed (``env_seed``), and the conversation is what ``env.reset(seed)`` gives.
Train prompt ``index`` is seed ``index``; the held-out prompts are the seeds
``eval_seed_start + i``, ``i < num_eval``, above every seed of the stream (``2**40`` long).
The warm-up's demonstrations (``DEMO_SEED_START``) play seeds disjoint from the held-out ones.

Validation: hyper-parameters are picked on other seeds than the held-out ones, those from
``VALIDATION_SEED_START`` (``agent.eval_seed_start=VALIDATION_SEED_START`` evaluates on
them). ``seed_split`` names the split of a seed. Distinct seeds may still give one task
instance (a 4x4 grid has few likely maps); an environment that can tell keeps the splits'
instances apart itself (``GridEnv(split_maps=True)``).
"""

from __future__ import annotations

import string
from typing import Any

from rlax_llm.tasks.base import Prompt

# The seed of the warm-up's demonstration 0 (``trainer.warmup.demo_batch``): demonstration ``i`` plays
# seed ``DEMO_SEED_START + i``, below the held-out seeds (``>= 2**40``) and far above any train
# step's seeds.
DEMO_SEED_START = 2**39

# The first held-out seed (``agent.eval_seed_start``'s default) and the first validation seed:
# held-out seeds lie in ``[HELD_OUT_SEED_START, VALIDATION_SEED_START)``, validation seeds above.
HELD_OUT_SEED_START = 2**40
VALIDATION_SEED_START = 2**41
SPLITS = ('train', 'held_out', 'validation')

# A tiny character-level model's alphabet in an environment run: printable ASCII and newline
# (what the built-in environments write).
CHARSET = string.printable.replace('\x0b', '').replace('\x0c', '').replace('\r', '')


def env_seed(prompt: Prompt) -> int:
  """The environment seed ``prompt`` stands for (an ``EnvSeeds`` prompt's text)."""
  return int(prompt.text)


def seed_split(seed: int) -> str:
  """The split an environment seed belongs to (``SPLITS``): ``'train'`` below
  ``HELD_OUT_SEED_START`` (the train stream and the warm-up's demonstrations), ``'held_out'``
  up to ``VALIDATION_SEED_START``, ``'validation'`` from there."""
  if seed < HELD_OUT_SEED_START:
    return 'train'
  return 'held_out' if seed < VALIDATION_SEED_START else 'validation'


class EnvSeeds:
  """The seeds of environment ``name`` as a task: ``train_prompt(i)`` is seed ``i``,
  ``eval_prompts()`` the ``num_eval`` seeds from ``eval_seed_start`` (ids ``-1 - i``)."""

  def __init__(self, name: str, num_eval: int, eval_seed_start: int):
    if eval_seed_start < HELD_OUT_SEED_START:
      raise ValueError(f'agent.eval_seed_start={eval_seed_start} must be >= 2**40, above the '
                       'seeds of the train stream (held-out seeds are never trained on); '
                       f'{VALIDATION_SEED_START} (VALIDATION_SEED_START) for the validation '
                       'split.')
    self.name = f'env:{name}'
    self.num_eval = num_eval
    self.eval_seed_start = eval_seed_start

  @property
  def charset(self) -> str:
    return CHARSET

  def train_prompt(self, index: int) -> Prompt:
    return Prompt(prompt_id=index, text=str(index), answer='')

  def eval_prompts(self) -> list[Prompt]:
    return [Prompt(prompt_id=-1 - i, text=str(self.eval_seed_start + i), answer='')
            for i in range(self.num_eval)]

  def score(self, prompt: Prompt, completion: str) -> float:
    """Never called: an environment run's rewards come from its episodes."""
    raise NotImplementedError(f'{self.name}: rewards come from the environment\'s episodes, '
                              f'not from scoring a completion of prompt {prompt.prompt_id} '
                              f'({completion!r:.40}).')


def env_seeds(config: Any) -> EnvSeeds:
  """The ``EnvSeeds`` of a run config (``env.name``, ``agent.num_eval``,
  ``agent.eval_seed_start``)."""
  return EnvSeeds(config.env.name, config.agent.num_eval, config.agent.eval_seed_start)
