"""Train, validation and held-out environment seeds, and the grid's maps, never overlap:
hyper-parameters are picked on validation maps, results reported on held-out ones."""

import pathlib

import pytest

from rlax_llm.cli import load_config_file
from rlax_llm.config import validate_config
from rlax_llm.envs import GridEnv
from rlax_llm.envs.grid import map_split
from rlax_llm.envs.seeds import (
  DEMO_SEED_START,
  HELD_OUT_SEED_START,
  VALIDATION_SEED_START,
  EnvSeeds,
  seed_split,
)
from rlax_llm.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_seed_ranges_are_disjoint():
  recipe = load_config_file(f'{ROOT}/configs/agent.py:grid_small')
  held_out = EnvSeeds('grid', recipe.agent.num_eval, recipe.agent.eval_seed_start)
  validation = EnvSeeds('grid', recipe.agent.num_eval, VALIDATION_SEED_START)
  train = [held_out.train_prompt(i).text for i in (0, 1, 2**39 - 1)]
  assert {seed_split(int(t)) for t in train} == {'train'}
  assert seed_split(DEMO_SEED_START) == seed_split(HELD_OUT_SEED_START - 1) == 'train'
  assert {seed_split(int(p.text)) for p in held_out.eval_prompts()} == {'held_out'}
  assert {seed_split(int(p.text)) for p in validation.eval_prompts()} == {'validation'}


def maps(env, seeds):
  out = set()
  for seed in seeds:
    env.reset(seed)
    out.add(tuple(env.desc))
  return out


def test_grid_split_maps_are_disjoint():
  """The recipe's grid: 100 train seeds (stream and warm-up), 32 held-out and 32 validation
  seeds give three disjoint sets of maps; without split_maps they share maps."""
  recipe = load_config_file(f'{ROOT}/configs/agent.py:grid_small')
  assert recipe.env.split_maps is True
  kwargs = {k: v for k, v in recipe.env.to_dict().items() if k != 'name'}
  env = GridEnv(**kwargs)
  train = maps(env, [*range(60), *range(DEMO_SEED_START, DEMO_SEED_START + 40)])
  held_out = maps(env, range(HELD_OUT_SEED_START, HELD_OUT_SEED_START + 32))
  validation = maps(env, range(VALIDATION_SEED_START, VALIDATION_SEED_START + 32))
  assert not train & held_out and not train & validation and not held_out & validation
  assert {map_split(list(m)) for m in held_out} == {'held_out'}
  assert len(held_out) > 10 and len(validation) > 10  # still many maps to evaluate on
  plain = GridEnv(**{**kwargs, 'split_maps': False})
  assert maps(plain, range(100)) & maps(plain, range(HELD_OUT_SEED_START,
                                                       HELD_OUT_SEED_START + 32))


def test_a_train_seed_keeps_its_map_when_it_is_a_train_map():
  env, plain = GridEnv(split_maps=True), GridEnv()
  kept = 0
  for seed in range(30):
    env.reset(seed)
    plain.reset(seed)
    if map_split(plain.desc) == 'train':
      assert env.desc == plain.desc
      kept += 1
  assert kept > 15


def test_the_config_refuses_a_bad_demo_error_rate():
  config = load_config_file(f'{ROOT}/configs/agent.py:grid_small')
  config.env.demo_error_rate = 1.5
  with pytest.raises(ConfigError, match=r'demo_error_rate must be a number in \[0, 1\]'):
    validate_config(config, read_hub=False)


def test_split_maps_must_be_a_bool():
  with pytest.raises(ValueError, match="split_maps must be True or False, got 'yes'"):
    GridEnv(split_maps='yes')
