"""Rollout routing replay (R3, ``model.routing_replay='r3'``) end to end: the engine records
the experts of every token it feeds, the routes travel in ``Rollouts`` and ``TrainBatch``
(and through in-flight checkpoints), the trainer replays them (full and shared-prefix
forwards) with ``moe/route_flip_fraction``; the router's aux loss in the objective; the
bf16-inference measurement; a GRPO run with R3 that trains and resumes exactly.
"""

import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.config import validate_config
from rlax_llm.data_types import Rollouts, make_train_batch
from rlax_llm.errors import ConfigError
from rlax_llm.loss_spec import LossConfig
from rlax_llm.models.model import create_model
from rlax_llm.models.moe import NO_ROUTE
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.rollout.driver import Driver, Job, VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.scoring import Policy

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks'))
import moe_routing_replay  # benchmarks/moe_routing_replay.py  # noqa: E402

CONFIG = TINY_MOE_PRESETS['tiny-qwen3-moe']
SPEC = SamplingSpec(temperature=1.0)
PROMPTS = ((1, 2, 3, 4, 5), (3, 9, 11), (7, 7, 8, 2))


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


@pytest.fixture(scope='module')
def rollouts(model_and_params):
  """Float32 engine rollouts of ``PROMPTS`` (2 samples each, one cut short and continued:
  APRIL's continuation prefill) as ``Rollouts``, through the benchmark's packing."""
  model, params = model_and_params
  return moe_routing_replay.rollouts(CONFIG, params, prompts=6, prompt_len=6, new_tokens=8,
                                     seed=1, inference_dtype=jnp.float32)


def _own_routes(model, params, tokens):
  return np.asarray(jax.jit(lambda p, t: model.apply(p, t, return_routes=True)[1])(
      params, jnp.asarray(tokens)))


def test_the_engine_records_the_routes_of_every_token_it_feeds(model_and_params):
  """Prompt tokens (prefill) and sampled tokens (the decode step that feeds them), also for
  a sample continued after a cut (its drawn tokens as the continuation's prefill routed
  them); a sample's last token is never fed, so it has none. Float32 on both sides: the
  trainer's forward routes every token the same way."""
  model, params = model_and_params
  engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=4,
                  max_prefill_length=6, max_decode_length=8, pad_id=0, record_routes=True)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  keys = lambda j: np.stack([np.asarray(jax.random.key_data(jax.random.key(10 * j + i)))
                             for i in range(2)])
  jobs = [Job(p, 2, SPEC, 3 if j == 0 else 8, (), keys(j)) for j, p in enumerate(PROMPTS)]
  driver = Driver(engine, holder)
  first = driver.run(jobs, stop_after=1)
  assert any(s.finish_reason is None and s.tokens for samples in first for s in samples)
  jobs = [dataclasses.replace(job, resume=tuple(first[j])) for j, job in enumerate(jobs)]
  results = driver.run(jobs)
  for prompt, samples in zip(PROMPTS, results):
    for sample in samples:
      assert len(sample.routes) == len(sample.tokens) - 1
      got = np.concatenate([sample.prompt_routes, np.stack(sample.routes)])
      want = _own_routes(model, params, [prompt + tuple(sample.tokens)])[0]
      assert got.dtype == np.int16 or got.dtype == np.int8
      np.testing.assert_array_equal(got, want[:len(got)])


def test_dense_models_refuse_routing_replay():
  dense = create_model(dataclasses.replace(CONFIG, family='qwen3', num_experts=0,
                                           num_experts_per_tok=0, moe_mlp_dim=0,
                                           norm_topk_prob=False))[0]
  with pytest.raises(ValueError, match='the model is dense'):
    Engine(dense, make_mesh({'data': 1}, jax.devices()[:1]), slots=1, max_prefill_length=4,
           max_decode_length=4, pad_id=0, record_routes=True)
  from rlax_llm.cli import load_config_file
  config = load_config_file(str(ROOT / 'configs/default.py') + ':smoke')
  config.model.routing_replay = 'r3'
  with pytest.raises(ConfigError, match=r"config.model.routing_replay applies to a mixture of "
                                        r"experts, but model.name='tiny' is dense"):
    validate_config(config)
  config.model.routing_replay = 'off'
  config.rl.moe_aux_loss_coef = 0.01
  with pytest.raises(ConfigError, match='config.rl.moe_aux_loss_coef applies to a mixture'):
    validate_config(config)


def test_routes_travel_with_the_rollouts_into_the_train_batch(rollouts, model_and_params):
  """Selected, concatenated, stored and restored (an in-flight checkpoint) with the other
  arrays; packed at their tokens' positions, NO_ROUTE on padding and on each last token."""
  again = Rollouts.from_state(*rollouts.to_state())
  np.testing.assert_array_equal(again.prompt_routes, rollouts.prompt_routes)
  np.testing.assert_array_equal(again.completion_routes, rollouts.completion_routes)
  rows = np.arange(len(rollouts)) % 2 == 0
  joined = Rollouts.concatenate([rollouts.select(rows), rollouts.select(~rows)])
  np.testing.assert_array_equal(joined.completion_routes[:rows.sum()],
                                rollouts.completion_routes[rows])
  batch = make_train_batch(rollouts, np.zeros(len(rollouts), np.float32))
  assert batch.routes.shape == batch.tokens.shape + (CONFIG.num_layers,
                                                     CONFIG.num_experts_per_tok)
  model, params = model_and_params
  own = _own_routes(model, params, batch.tokens)
  length = rollouts.prompt_lengths + rollouts.completion_mask.sum(axis=1)
  for i, n in enumerate(length):
    np.testing.assert_array_equal(batch.routes[i, :n - 1], own[i, :n - 1])
    assert np.all(batch.routes[i, n - 1:] == NO_ROUTE)


@pytest.fixture(scope='module')
def objective(model_and_params, rollouts):
  """``rl_objective``'s ``(loss, metrics)`` of the float32 rollouts' batch, with its
  gradients when ``grads``."""
  model, _ = model_and_params
  batch = jax.tree.map(jnp.asarray, make_train_batch(
      rollouts, np.linspace(-1.0, 1.0, len(rollouts)).astype(np.float32)))

  @functools.partial(jax.jit, static_argnames=('window', 'chunk', 'replay', 'coef', 'grads'))
  def run(params, window=0, chunk=0, replay=False, coef=0.0, grads=False):
    fn = lambda p: rl_objective(Policy(model, SPEC), LossConfig(), p, batch, None,
                                logprob_chunk=chunk, window=window, routing_replay=replay,
                                moe_aux_loss_coef=coef)
    return jax.value_and_grad(fn, has_aux=True)(params) if grads else fn(params)
  return run


def test_replaying_float32_routes_changes_nothing_and_flips_none(objective, model_and_params):
  """The rollouts' engine ran in float32: replaying its routes is the trainer's own routing,
  in the full forward, the chunked log-prob one and the shared-prefix one (Prefix Grouper's
  windows). (Replayed gradients: tests/models/test_moe_replay.py.)"""
  params = model_and_params[1]
  loss, metrics = objective(params, replay=True)
  plain_loss, plain = objective(params)
  assert float(metrics['moe/route_flip_fraction']) == 0.0
  assert 'moe/route_flip_fraction' not in plain
  np.testing.assert_allclose(loss, plain_loss, atol=1e-6)
  chunked_loss, chunked_metrics = objective(params, chunk=4, replay=True)
  assert float(chunked_metrics['moe/route_flip_fraction']) == 0.0
  np.testing.assert_allclose(chunked_loss, loss, atol=1e-5)
  window_loss, window_metrics = objective(params, window=8, replay=True)
  assert float(window_metrics['moe/route_flip_fraction']) == 0.0
  np.testing.assert_allclose(window_loss, loss, atol=1e-5)


def test_the_aux_loss_enters_the_objective_only_when_weighted(objective, model_and_params,
                                                             rollouts):
  """A positive weight adds the router's load-balancing loss and changes the router's
  gradient; 0 traces the very program of an objective without the knob."""
  params = model_and_params[1]
  batch = make_train_batch(rollouts, np.zeros(len(rollouts), np.float32))
  trace = lambda **kw: str(jax.make_jaxpr(lambda p: rl_objective(
      Policy(model_and_params[0], SPEC), LossConfig(), p, batch, None, **kw))(params))
  assert trace(moe_aux_loss_coef=0.0) == trace()
  (loss, metrics), grads = objective(params, grads=True)
  (aux_loss, aux_metrics), aux_grads = objective(params, coef=0.5, grads=True)
  assert 'moe/aux_loss' not in metrics and float(aux_metrics['moe/aux_loss']) > 0
  np.testing.assert_allclose(aux_loss, loss + 0.5 * aux_metrics['moe/aux_loss'], rtol=1e-6)
  router = lambda g: np.asarray(g['blocks']['moe']['router'])
  assert np.max(np.abs(router(aux_grads) - router(grads))) > 1e-6


def test_r3_on_a_bf16_inference_copy_flips_no_choice_and_lowers_the_mismatch():
  """The issue's measurement, small: a bfloat16 engine and a float32 trainer."""
  got = moe_routing_replay.measure(CONFIG, prompts=8, prompt_len=6, new_tokens=16)
  assert got['off']['flipped_choices'] > 0
  assert got['on']['flipped_choices'] == 0.0
  assert got['on']['mismatch/kl'] < got['off']['mismatch/kl']


def test_episodes_record_the_routes_of_the_whole_conversation():
  """Multi-turn: the prompt (prefill), each sampled token (the step that feeds it) and each
  observation with the turn's last token (``extend``) are recorded, so the batch row of a
  conversation carries routes for every token but its last, the trainer forward's own."""
  sys.path.insert(0, str(ROOT / 'tests' / 'rollout'))
  from test_episodes import MESH, TOKENIZER, ToyEnv, episodes  # pylint: disable=import-error
  from rlax_llm.data_types import make_trajectory_batch
  from rlax_llm.rollout.episodes import EpisodeRunner
  config = dataclasses.replace(CONFIG, vocab_size=TOKENIZER.vocab_size, max_seq_len=96)
  model, params = create_model(config, seed=3)
  engine = Engine(model, MESH, slots=2, max_prefill_length=16, max_decode_length=48,
                  pad_id=TOKENIZER.pad_id, record_routes=True)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  runner = EpisodeRunner(engine, holder, TOKENIZER, max_concurrent_episodes=2,
                         max_turn_tokens=6, timeout_s=60.0)
  trajectories = runner.run(episodes([ToyEnv(), ToyEnv()]), SPEC)
  assert all(x.num_turns == 3 for x in trajectories)
  batch = make_trajectory_batch(trajectories, np.zeros(2, np.float32)).train
  own = _own_routes(model, params, batch.tokens)
  for i, x in enumerate(trajectories):
    n = len(x.tokens)
    np.testing.assert_array_equal(batch.routes[i, :n - 1], own[i, :n - 1])
    assert np.all(batch.routes[i, n - 1:] == NO_ROUTE)


def r3_smoke(steps=4):
  """configs/default.py:smoke on a tiny mixture of experts (model.tiny overrides) with R3
  and a bfloat16 inference copy."""
  from test_resume import smoke  # its 4 warm-up steps, evaluation and checkpoints every 2
  config = smoke(steps)
  with config.unlocked():
    config.model.tiny.update(family='qwen3_moe', num_experts=4, num_experts_per_tok=2,
                             moe_mlp_dim=64, norm_topk_prob=True, qk_norm=True)
  config.model.routing_replay = 'r3'
  config.model.inference_param_dtype = 'bfloat16'
  return config


# Three launches of a tiny MoE run: ~100 s here. Its CI counterparts: the routes' in-flight
# checkpoint round trip (test_routes_travel_with_the_rollouts_into_the_train_batch) and the
# replaying objective (test_replaying_float32_routes_changes_nothing_and_flips_none).
@pytest.mark.slow
def test_a_grpo_run_with_r3_trains_and_resumes_exactly_after_a_sigterm(tmp_path):
  """The smoke run on a tiny MoE with R3 (tests/test_resume.py's pattern: ``Preempt`` is the
  stop event a SIGTERM sets): every step replays routes and updates the weights, and a run
  stopped after its second RL step and relaunched ends with the same metrics and
  bit-identical params."""
  from test_resume import Preempt, read, run_once
  ref_summary, ref_params = run_once(r3_smoke(), tmp_path / 'ref', None)
  metrics, ledger = read(tmp_path / 'ref')
  assert ref_summary['steps'] == 4 and len(metrics) == 4
  assert all('moe/route_flip_fraction' in row and np.isfinite(row['loss']) for row in metrics)
  assert all(row['grad_norm'] > 0 for row in metrics)
  summary, _ = run_once(r3_smoke(), tmp_path / 'run', Preempt(4 + 2))
  assert summary['preempted'] and summary['steps'] == 2
  summary, params = run_once(r3_smoke(), tmp_path / 'run', None)
  assert summary['steps'] == 4
  assert read(tmp_path / 'run') == (metrics, ledger)
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
