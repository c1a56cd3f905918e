"""The supervised warm-up of an environment run (rlax_llm.trainer.warmup.demo_batch).

Writer and reader agree: a demonstration's ids and loss mask
(``envs.conversation.demonstration``) are what the episode runner records for a model that
samples the oracle's actions; the warm-up's rows mask exactly the oracle's turns, on seeds
disjoint from the held-out ones; a warm-up on them trains; a run asks for an oracle only
when it warms up.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from rlax_llm.config import validate_config
from rlax_llm.envs import CalculatorEnv, GridEnv, make_env
from rlax_llm.envs.seeds import CHARSET, DEMO_SEED_START, env_seeds
from rlax_llm.errors import ConfigError
from rlax_llm.cli import load_config_file
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.rollout.driver import VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.envs.conversation import demonstration
from rlax_llm.rollout.episodes import Episode, EpisodeRunner
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.trainer.warmup import demo_batch, supervised_warmup

MESH = make_mesh({'data': 1}, jax.devices()[:1])
CHARS = CharTokenizer(CHARSET)


class _Forced:
  """A host step whose token is the script's next one, done at the end of its turn."""

  def __init__(self, step, engine):
    self.step, self.engine = step, engine

  def to_host(self):
    host = self.step.to_host()
    token = self.engine.turn[self.engine.position]
    self.engine.position += 1
    done = self.engine.position == len(self.engine.turn)
    return dataclasses.replace(host, tokens=np.full_like(host.tokens, token),
                               done=np.full_like(host.done, done))


class ScriptedEngine:
  """``engine``, but every turn draws the next of ``turns`` (lists of ids) instead of
  sampling: a model that writes exactly those turns. One episode at a time."""

  def __init__(self, engine, turns):
    self.engine, self.turns = engine, list(turns)
    self.turn, self.position = [], 0

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def _next_turn(self, result):
    state, step = result
    self.turn, self.position = self.turns.pop(0), 0
    return state, _Forced(step, self)

  def insert(self, *args):
    return self._next_turn(self.engine.insert(*args))

  def extend(self, *args):
    return self._next_turn(self.engine.extend(*args))

  def generate(self, *args):
    state, step = self.engine.generate(*args)
    return state, _Forced(step, self)


def _record(env, seed, tokenizer, turns):
  """The trajectory the runner records for ``env`` from ``seed`` when the model writes
  ``turns``, on a tiny random model of ``tokenizer``'s vocabulary."""
  config = DecoderConfig(vocab_size=tokenizer.vocab_size, num_layers=1, embed_dim=16,
                         num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=512)
  model, params = create_model(config, seed=0)
  engine = Engine(model, MESH, slots=1, max_prefill_length=320, max_decode_length=64,
                  pad_id=tokenizer.pad_id)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  run = EpisodeRunner(ScriptedEngine(engine, turns), holder, tokenizer,
                      max_concurrent_episodes=1, max_turn_tokens=64, timeout_s=120.0)
  key = np.asarray(jax.random.key_data(jax.random.key(0)))
  [trajectory] = run.run([Episode(env, seed=seed, key=key)], SamplingSpec(1.0))
  return trajectory


@pytest.mark.parametrize('case', ['calculator-smollm2', 'grid-chars'])
def test_a_demonstration_is_what_an_episode_with_its_actions_records(case, request):
  if case == 'calculator-smollm2':
    tokenizer = request.getfixturevalue('smollm2_tokenizer')  # the SmolLM2 case alone
    make = functools.partial(CalculatorEnv, max_turns=3)
  else:
    tokenizer, make = CHARS, functools.partial(GridEnv, size=3, max_turns=6)
  seed = DEMO_SEED_START + 5
  ids, mask = demonstration(make(), seed, tokenizer)
  # The oracle's turns: the masked runs, each ending with eos.
  turns, current = [], []
  for token, m in zip(ids, mask):
    if m:
      current.append(token)
      if token == tokenizer.eos_id:
        turns.append(current)
        current = []
  assert len(turns) >= 2 and not current
  trajectory = _record(make(), seed, tokenizer, turns)
  assert trajectory.termination == 'done' and trajectory.success
  assert trajectory.tokens.tolist() == ids
  assert trajectory.loss_mask.tolist() == mask
  assert trajectory.num_turns == len(turns)


def test_demo_batch_masks_the_oracles_turns_on_seeds_apart_from_the_held_out_ones(
    smollm2_tokenizer):
  tokenizer = smollm2_tokenizer
  make = functools.partial(make_env, {'name': 'calculator'}, 'simple')
  batch = demo_batch(make, tokenizer, 3, 4)
  assert batch['tokens'].dtype == np.int32 and batch['loss_mask'].dtype == np.float32
  assert batch['tokens'].shape == batch['loss_mask'].shape and batch['tokens'].shape[0] == 4
  for row, (tokens, mask) in enumerate(zip(batch['tokens'], batch['loss_mask'])):
    env = make()
    env.reset(DEMO_SEED_START + 3 + row)
    first = env.oracle_action()
    shown = tokenizer.decode(tokens[mask > 0], stop_at_eos=False)
    assert shown.startswith(first) and f'\\boxed{{{env.a * env.b}}}' in shown
    assert shown.count('<|im_end|>') == 2  # each turn ends with eos
  held_out = [int(p.text) for p in env_seeds(load_config_file('configs/agent.py')).eval_prompts()]
  assert DEMO_SEED_START + 10**6 < min(held_out)
  # Demonstrations are deterministic: the same rows again.
  np.testing.assert_array_equal(demo_batch(make, tokenizer, 3, 4)['tokens'], batch['tokens'])
  # max_turns caps a demonstration as agent.max_turns caps an episode: one turn only.
  capped = demo_batch(make, tokenizer, 3, 1, max_turns=1)
  assert tokenizer.decode(capped['tokens'][0][capped['loss_mask'][0] > 0],
                          stop_at_eos=False).count('<|im_end|>') == 1


def test_a_warm_up_on_demonstrations_lowers_the_loss():
  make = functools.partial(GridEnv, size=2, max_turns=2, instruction='{grid}')
  config = DecoderConfig(vocab_size=CHARS.vocab_size, num_layers=1, embed_dim=32, num_heads=2,
                         num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=64)
  model, params = create_model(config, seed=0)
  batches = functools.partial(demo_batch, make, CHARS)
  first = batches(0, 8)
  assert first['loss_mask'].sum() > 0
  _, metrics = supervised_warmup(model, params, batches, MESH, steps=30, batch_size=8,
                                 learning_rate=1e-2, source='grid oracle episodes')
  _, one = supervised_warmup(model, params, batches, MESH, steps=1, batch_size=8,
                             learning_rate=1e-2)
  assert metrics['warmup/loss'] < 0.5 * one['warmup/loss']


class NoOracleGrid(GridEnv):
  """The grid without its oracle."""

  oracle_action = None


def test_an_environment_run_warms_up_only_with_an_oracle():
  config = load_config_file('configs/agent.py:smoke')
  config.warmup.steps = 10
  validate_config(config)  # the grid has an oracle
  config.env.name = 'test_warmup:NoOracleGrid'
  with pytest.raises(ConfigError, match=r'config.warmup.steps=10 .*NoOracleGrid.*defines no '
                                        r'oracle_action\(\); set warmup.steps=0'):
    validate_config(config)
