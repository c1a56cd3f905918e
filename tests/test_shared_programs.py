"""Roles alike share their compiled programs in one process (a second run, a sweep, a test
session): ``Model`` compares by value, and trainers, engines and teachers built alike get the
same jitted functions and trace nothing; other settings (learning rate, loss, mesh, slots,
top-k) never share a program. Tiny models: each test compiles a few small programs."""

import collections
import contextlib
import dataclasses
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.data_types import TrainBatch
from rlax_llm.losses import LossConfig
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import abstract_model, create_model, with_param_dtype
from rlax_llm.rollout.engine import Engine, Insert
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.scoring import Policy
from rlax_llm.trainer.teacher import Teacher
from rlax_llm.trainer.trainer import Bound, Trainer, make_optimizer

CONFIG = DecoderConfig(vocab_size=16, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=16)
ONE = make_mesh({'data': 1}, jax.devices()[:1])
TWO = make_mesh({'data': 2}, jax.devices()[:2])
EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'traced',
          '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lowered',
          '/jax/core/compile/backend_compile_duration': 'compiled'}


@contextlib.contextmanager
def programs_made():
  """Counts the programs JAX traces, lowers and compiles inside the block."""
  counts = collections.Counter()

  def listen(event, duration, **_):
    del duration
    if event in EVENTS:
      counts[EVENTS[event]] += 1

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def _batch():
  """8 rows of 10 tokens: tests/trainer/test_trainer.py's batch shape, so that in one process
  the two files' equal trainers share the step's compiled program too."""
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, 16, (8, 10)).astype(np.int32)
  mask = np.zeros((8, 10), np.float32)
  for row, length in enumerate((2, 6, 4, 7, 1, 5, 3, 6)):  # the token- and sequence-means differ
    mask[row, 3:3 + length] = 1.0
  return TrainBatch(
      tokens=tokens, loss_mask=mask,
      behaviour_logprobs=(np.log(rng.uniform(0.05, 0.5, (8, 10))) * mask).astype(np.float32),
      support_sizes=np.where(mask > 0, 16, 0).astype(np.int32),
      advantages=rng.randn(8).astype(np.float32),
      versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(2), 4).astype(np.int32))


def _trainer(learning_rate=1e-2, loss='grpo', mesh=ONE, bind=Bound):
  model, params = create_model(CONFIG, seed=0)  # a new, equal model each time
  objective = bind(rl_objective, Policy(model, SamplingSpec()), LossConfig(loss=loss))
  return Trainer(model, params, make_optimizer(learning_rate), objective, mesh)


def test_models_compare_by_config_graph_and_adapters():
  (first, params), (again, _) = create_model(CONFIG, seed=0), create_model(CONFIG, seed=1)
  assert first == again == abstract_model(CONFIG)
  assert hash(first) == hash(again) == hash(abstract_model(CONFIG))
  restored = pickle.loads(pickle.dumps(first))
  assert restored == first and hash(restored) == hash(first)
  assert first != abstract_model(CONFIG.with_execution(remat='full'))
  assert first != with_param_dtype(first, jnp.bfloat16)
  assert first != abstract_model(dataclasses.replace(CONFIG, num_layers=3))
  rank = lambda r: lora_lib.create(first, params, lora_lib.LoRAConfig(rank=r, alpha=8.0))[0]
  assert rank(2) == rank(2) and hash(rank(2)) == hash(rank(2))
  assert rank(2) != rank(4) and rank(2) != first


def test_a_trainer_alike_reuses_the_step_and_traces_nothing():
  first = _trainer()
  want = first.step(_batch())
  want_params = first.host_params()
  with programs_made() as made:
    second = _trainer()
    got = second.step(_batch())
  assert second._step is first._step  # pylint: disable=protected-access
  assert made == {}, made
  jax.tree.map(np.testing.assert_array_equal, got, want)
  jax.tree.map(np.testing.assert_array_equal, second.host_params(), want_params)


@pytest.mark.parametrize('change', [dict(learning_rate=3e-3), dict(loss='dapo'),
                                    dict(mesh=TWO)])
def test_a_trainer_with_other_settings_gets_its_own_step(change):
  """Another learning rate or loss: another program and another update; another mesh: its
  own program, whose params lie on that mesh."""
  first, other = _trainer(), _trainer(**change)
  assert other._step is not first._step  # pylint: disable=protected-access
  first.step(_batch())
  other.step(_batch())
  leaf = jax.tree.leaves(other.params)[0]
  assert leaf.sharding.mesh == other.mesh
  if 'mesh' not in change:
    differ = jax.tree.map(lambda a, b: not np.array_equal(a, b), first.host_params(),
                          other.host_params())
    assert any(jax.tree.leaves(differ))


def test_an_objective_bound_by_identity_is_not_shared():
  """A plain ``functools.partial`` is its own key: no sharing, never a wrong program."""
  first, again = _trainer(bind=functools.partial), _trainer(bind=functools.partial)
  assert again._step is not first._step  # pylint: disable=protected-access


def _engine(model, slots=2, pad_id=0):
  return Engine(model, ONE, slots=slots, max_prefill_length=8, max_decode_length=4,
                pad_id=pad_id)


def _generate(engine, params):
  """Prefill two prompts, insert them, one decode step: what the two steps returned."""
  params = engine.place_params(params)
  prefix = engine.prefill(params, [(5, 9, 13), (7, 3)])
  keys = [np.asarray(jax.random.key_data(jax.random.key(i))) for i in range(2)]
  state, first = engine.insert(prefix, engine.init_decode_state(), [
      Insert(row=i, slot=i, key=keys[i], max_new_tokens=3, stop_ids=(1,)) for i in range(2)],
                               GREEDY)
  state, step = engine.generate(params, state, GREEDY)
  return np.asarray(first.data), np.asarray(step.data)  # tokens, log-probs, ...


def test_an_engine_alike_reuses_its_programs_and_traces_nothing():
  model, params = create_model(CONFIG, seed=0)
  first = _engine(model)
  want = _generate(first, params)
  with programs_made() as made:
    second = _engine(create_model(CONFIG, seed=0)[0])
    got = _generate(second, params)
  assert second._generate is first._generate  # pylint: disable=protected-access
  assert made == {}, made
  np.testing.assert_array_equal(got, want)
  for other in (_engine(model, slots=4), _engine(model, pad_id=2)):
    assert other._generate is not first._generate  # pylint: disable=protected-access
    assert other._insert is not first._insert  # pylint: disable=protected-access


def test_teachers_alike_share_their_scoring_program():
  model, params = create_model(CONFIG, seed=0)
  tokenizer = CharTokenizer('abcdefghijkl')
  teacher = lambda **kw: Teacher(model, params, tokenizer, tokenizer, **kw)
  assert teacher(top_k=2)._score is teacher(top_k=2)._score  # pylint: disable=protected-access
  assert teacher(top_k=2)._score is not teacher(top_k=3)._score  # pylint: disable=protected-access
  assert teacher()._score is not teacher(temperature=0.5)._score  # pylint: disable=protected-access
