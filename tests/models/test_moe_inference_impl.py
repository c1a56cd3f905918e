"""The engine's expert computation chosen apart from the trainer's
(``model.inference_moe_impl``, ``roles.inference_model``): the engine's copy computes its
experts 'ragged', 'dense' or dense in the decode step only ('dense_decode',
``Execution.decode_moe_impl``) while the trainer keeps its own; the samples, behaviour
log-probs and recorded routes are the same to float rounding whichever; a dense model with the
knob set is refused.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.recipes import compile as compile_lib
from rlax_llm import roles
from rlax_llm.cli import load_config
from rlax_llm.config import validate_config
from rlax_llm.errors import ConfigError
from rlax_llm.models.decoder_config import Execution
from rlax_llm.models.model import abstract_model, create_model
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.rollout.driver import Driver, Job, VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tokenization import CharTokenizer

from smoke_config import smoke_config  # tests/smoke_config.py

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = TINY_MOE_PRESETS['tiny-qwen3-moe']
PROMPTS = ((1, 2, 3, 4, 5, 6), (3, 9, 11), (7, 7, 8, 2), (5, 4))
NEW_TOKENS = 6


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def _config(impl: str):
  return smoke_config(model__inference_moe_impl=impl)


def _sample(model, params) -> list:
  """One temperature-1 sample per prompt of ``PROMPTS`` (fixed keys) by an engine of
  ``model`` that records routes: ``[(tokens, logprobs, prompt routes, sampled tokens' routes)]``
  (the routes of prefill and of the decode steps)."""
  engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=len(PROMPTS),
                  max_prefill_length=8, max_decode_length=NEW_TOKENS, pad_id=0,
                  record_routes=True)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  spec = SamplingSpec(temperature=1.0)
  keys = lambda i: np.asarray(jax.random.key_data(jax.random.key(7 + i)))[None]
  jobs = [Job(prompt, 1, spec, NEW_TOKENS, (), keys(i)) for i, prompt in enumerate(PROMPTS)]
  samples = [s[0] for s in Driver(engine, holder).run(jobs)]
  return [(np.asarray(s.tokens), np.asarray(s.logprobs), np.asarray(s.prompt_routes),
           np.asarray(s.routes)) for s in samples]


@pytest.fixture(scope='module')
def ragged_samples(model_and_params):
  model, params = model_and_params
  return _sample(roles.inference_model(_config(''), model), params)


@pytest.mark.parametrize('impl', ['dense', 'dense_decode', 'blocked'])
def test_the_engine_samples_and_routes_as_the_trainers_impl(model_and_params, ragged_samples,
                                                            impl):
  """An engine computing its experts densely (every program, or the decode step alone) or
  in blocks of one expert each ('blocked', every program) samples the same tokens with the
  same behaviour log-probs (float32 rounding) and records the same experts for every prompt
  and sampled token as the trainer's grouped matmul."""
  model, params = model_and_params
  served = roles.inference_model(_config(impl), model)
  for got, want in zip(_sample(served, params), ragged_samples, strict=True):
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=2e-5, rtol=0)
    for routes, wanted in zip(got[2:], want[2:], strict=True):  # prefill's, decode's
      assert routes.shape[-2:] == (CONFIG.num_layers, CONFIG.num_experts_per_tok)
      assert len(routes) and (routes >= 0).all()
      np.testing.assert_array_equal(routes, wanted)


def test_the_knob_sets_the_engines_execution_and_leaves_the_trainers(model_and_params):
  """'' keeps the trainer's model; 'ragged' and 'dense' set the engine's ``moe_impl``;
  'dense_decode' its ``decode_moe_impl`` with ``moe_impl`` the trainer's; the worker's engine
  and the TPU compile tool's engine (``launch.recipes.compile.make_engine``) run with it,
  and the trainer's model is unchanged."""
  model, _ = model_and_params
  assert roles.inference_model(_config(''), model) is model
  runs = {impl: roles.inference_model(_config(impl), model).config.execution
          for impl in ('ragged', 'dense', 'dense_decode')}
  assert (runs['ragged'].moe_impl, runs['ragged'].decode_moe_impl) == ('ragged', '')
  assert (runs['dense'].moe_impl, runs['dense'].decode_moe_impl) == ('dense', '')
  assert (runs['dense_decode'].moe_impl, runs['dense_decode'].decode_moe_impl) == ('ragged',
                                                                                    'dense')
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  worker = roles.build_worker(_config('dense_decode'), model, CharTokenizer('abc'), mesh)
  compiled = compile_lib.make_engine(_config('dense_decode'), CONFIG, mesh, 'none')
  for engine in (worker.engine, compiled):
    run = engine.model.config.execution
    assert (run.moe_impl, run.decode_moe_impl) == ('ragged', 'dense')
  assert model.config.execution == Execution()  # the trainer's: ragged everywhere


def test_the_qwen3_30b_a3b_recipes_engine_decodes_dense_and_its_trainer_keeps_ragged(
    model_and_params):
  """configs/gsm8k_large.py's Qwen3-30B-A3B runs 'dense_decode' (benchmarks/RESULTS.md, "The
  engine's experts apart from the trainer's"; a tiny MoE stands for the preset, whose
  architecture the knob does not read); its dense variants leave the knob unset."""
  model, _ = model_and_params
  config = load_config([f'--config={ROOT / "configs/gsm8k_large.py"}:Qwen3-30B-A3B'])
  run = roles.inference_model(config, model).config.execution
  assert (run.moe_impl, run.decode_moe_impl) == ('ragged', 'dense')
  assert model.config.execution.decode_moe_impl == ''
  assert load_config([f'--config={ROOT / "configs/gsm8k_large.py"}:Qwen3-8B']
                     ).model.inference_moe_impl == ''


def _has_ragged_dot(model, params, length: int) -> bool:
  tokens = jnp.ones((2, length), jnp.int32)
  return 'ragged_dot' in str(jax.make_jaxpr(model.apply)(params, tokens))


def test_dense_decode_runs_one_token_steps_dense_and_longer_inputs_ragged(model_and_params):
  """``decode_moe_impl='dense'``: a one-token-per-row step (the engine's decode step) has no
  grouped matmul, a longer input (prefill, the trainer) keeps ``moe_impl``'s; traced only."""
  model, params = model_and_params
  served = roles.inference_model(_config('dense_decode'), model)
  assert not _has_ragged_dot(served, params, 1)
  assert _has_ragged_dot(served, params, 4)
  assert _has_ragged_dot(model, params, 1)


def test_a_dense_model_with_the_knob_set_is_refused():
  """At validation for the tiny model and the presets; when the workers' model is built for
  any other (an 'auto' checkpoint); an unknown value at validation."""
  with pytest.raises(ConfigError, match=r"config.model.inference_moe_impl applies to a mixture "
                                        r"of experts, but model.name='tiny' is dense"):
    validate_config(_config('dense'))
  dense = abstract_model(dataclasses.replace(CONFIG, family='qwen3', num_experts=0,
                                             num_experts_per_tok=0))
  with pytest.raises(ConfigError, match=r"inference_moe_impl='dense_decode' .* is dense "
                                        r"\(num_experts=0\); set model.inference_moe_impl=''"):
    roles.inference_model(_config('dense_decode'), dense)
  with pytest.raises(ConfigError, match=r"config.model.inference_moe_impl='grouped' is not "
                                        r"valid; choose one of \['', 'ragged', 'dense', "):
    validate_config(_config('grouped'))
  with pytest.raises(ValueError, match=r"Execution.decode_moe_impl='grouped'"):
    Execution(decode_moe_impl='grouped')


def test_model_moe_impl_sets_the_trainers_experts_and_the_engines_by_default(model_and_params):
  """``model.moe_impl`` (e.g. 'blocked', the CPU path) reaches the trainer's model
  (``roles.build_model``) and the workers' (``roles.inference_model``: the trainer's unless
  ``model.inference_moe_impl`` says otherwise); '' keeps ``Execution``'s default; refused on a
  dense model (at validation for the tiny model, when built for an 'auto' checkpoint)."""
  config = smoke_config(model__moe_impl='blocked')
  with config.unlocked():
    config.model.tiny.update(family='qwen3_moe', num_experts=4, num_experts_per_tok=2,
                             moe_mlp_dim=64, norm_topk_prob=True, qk_norm=True)
  validate_config(config)
  model, _, _ = roles.build_model(config, roles.build_task(config))
  assert model.config.execution.moe_impl == 'blocked'
  assert roles.inference_model(config, model).config.execution.moe_impl == 'blocked'
  config.model.inference_moe_impl = 'ragged'
  assert roles.inference_model(config, model).config.execution.moe_impl == 'ragged'
  config.model.moe_impl = ''
  assert roles.build_model(config, roles.build_task(config))[0].config.execution.moe_impl == (
      Execution().moe_impl)
  with pytest.raises(ConfigError, match=r"config.model.moe_impl applies to a mixture of "
                                        r"experts, but model.name='tiny' is dense"):
    validate_config(smoke_config(model__moe_impl='blocked'))
  with pytest.raises(ConfigError, match=r"config.model.moe_impl='grouped' is not valid"):
    validate_config(smoke_config(model__moe_impl='grouped'))
  dense = abstract_model(dataclasses.replace(CONFIG, family='qwen3', num_experts=0,
                                             num_experts_per_tok=0))
  with pytest.raises(ConfigError, match=r"model.moe_impl='blocked' .* is dense "
                                        r"\(num_experts=0\); set model.moe_impl=''"):
    # pylint: disable-next=protected-access
    roles._with_moe_impl(smoke_config(model__moe_impl='blocked'), dense)
