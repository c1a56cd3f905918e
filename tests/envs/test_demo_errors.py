"""Imperfect demonstrations of an environment (``env.demo_error_rate``): the oracle's
mistake on the chosen fraction of seeds, deterministic per seed; rate 0 is the oracle."""

import math

import pytest

from rlax_llm.envs import CalculatorEnv, GridEnv, make_env
from rlax_llm.envs.conversation import demonstration
from rlax_llm.envs.seeds import CHARSET, DEMO_SEED_START
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.trainer.warmup import demo_batch

CHARS = CharTokenizer(CHARSET)
N = 400  # demonstrations whose error fraction is checked


def oracle_actions(env, seed):
  """The oracle's actions in the episode of ``seed`` and the episode's last step."""
  env.reset(seed)
  actions = []
  while True:
    actions.append(env.oracle_action())
    step = env.step(actions[-1])
    if step.done:
      return actions, step


def within_binomial(count, n, rate):
  """``count`` of ``n`` draws is within 4 standard deviations of ``n * rate``."""
  return abs(count - n * rate) <= 4 * math.sqrt(n * rate * (1 - rate)) + 1


@pytest.mark.parametrize('env_class', [GridEnv, CalculatorEnv])
@pytest.mark.parametrize('rate', [0.3, 0.6])
def test_the_error_rate_is_honoured(env_class, rate):
  env = env_class(demo_error_rate=rate)
  erred = 0
  for seed in range(DEMO_SEED_START, DEMO_SEED_START + N):
    env.reset(seed)
    erred += env.demo_errs
  assert within_binomial(erred, N, rate), (erred, N, rate)


@pytest.mark.parametrize('name', ['grid', 'calculator'])
def test_rate_zero_is_the_oracle_exactly(name):
  plain, zero = make_env({'name': name}), make_env({'name': name, 'demo_error_rate': 0.0})
  for i in range(40):
    assert (demonstration(plain, DEMO_SEED_START + i, CHARS)
            == demonstration(zero, DEMO_SEED_START + i, CHARS))
  assert not zero.demo_errs


def test_grid_errors_walk_blind_to_the_holes():
  """An erring grid demonstration goes down to the bottom row, then right, and falls into
  the first hole on that route; the others are the oracle's shortest routes to the goal."""
  oracle, erring = GridEnv(), GridEnv(demo_error_rate=0.6)
  blind_falls = 0
  for seed in range(200):
    actions, last = oracle_actions(erring, seed)
    if not erring.demo_errs:
      assert (actions, last) == oracle_actions(oracle, seed)
      assert last.info['success'] is True
      continue
    assert actions == (['down'] * 3 + ['right'] * 3)[:len(actions)]
    route = [(r, 0) for r in range(1, 4)] + [(3, c) for c in range(1, 4)]
    holes = [cell for cell in route if erring.desc[cell[0]][cell[1]] == 'H']
    assert last.info['success'] is (not holes)
    blind_falls += bool(holes)
  assert blind_falls > 10  # the mistake loses episodes: a warm-up on them plateaus


def test_calculator_errors_add_instead_of_multiplying():
  erring = CalculatorEnv(demo_error_rate=1.0)
  actions, last = oracle_actions(erring, 7)
  assert f'{erring.a} + {erring.b}' in actions[0]
  assert actions[1] == f'The product is \\boxed{{{erring.a + erring.b}}}.'
  assert last.info['success'] is False and last.reward == 0.0


def test_the_warmup_rows_are_deterministic_per_seed():
  """Two fresh environments give the same imperfect warm-up rows; they differ from the
  oracle's exactly on the erring demonstrations."""
  make = lambda rate: lambda: GridEnv(demo_error_rate=rate)  # noqa: E731
  first = demo_batch(make(0.5), CHARS, 0, 16)
  again = demo_batch(make(0.5), CHARS, 0, 16)
  perfect = demo_batch(make(0.0), CHARS, 0, 16)
  assert (first['tokens'] == again['tokens']).all()
  env = GridEnv(demo_error_rate=0.5)
  differs = []
  for i in range(16):
    env.reset(DEMO_SEED_START + i)
    blind_is_oracle = oracle_actions(GridEnv(demo_error_rate=1.0), DEMO_SEED_START + i) == \
        oracle_actions(GridEnv(), DEMO_SEED_START + i)
    differs.append(env.demo_errs and not blind_is_oracle)
  row_differs = [first['tokens'][i].tolist() != perfect['tokens'][i].tolist()
                 for i in range(16)]
  assert row_differs == differs and any(differs)


@pytest.mark.parametrize('rate', [-0.1, 1.5, True, '0.3'])
@pytest.mark.parametrize('env_class', [GridEnv, CalculatorEnv])
def test_demo_error_rate_validation(env_class, rate):
  with pytest.raises(ValueError, match=r'demo_error_rate must be a number in \[0, 1\]'):
    env_class(demo_error_rate=rate)
