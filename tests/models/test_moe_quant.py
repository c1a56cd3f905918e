"""Int8 experts in the inference copy (``model.inference_quant='int8'`` on a mixture of
experts): ``quant.quantize_params`` quantises the stacked expert weights with a float32 scale
per (layer, expert, output channel), the router kept; the int8 model's logits equal those of
the float32 model whose weights are ``q * scale`` in both ``moe_impl``s; the engine samples
with the int8 copy and records its routes for R3; a QLoRA base of a mixture of experts holds
int8 experts too.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from rlax_llm.data_types import make_train_batch
from rlax_llm.loss_spec import LossConfig
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.model import create_model, to_weight_layout, token_logprobs, \
    with_weight_layout
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.models.quant import EXPERTS, Int8Weight, dequantize, quantize_params
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.scoring import Policy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / 'benchmarks'))
import moe_routing_replay  # benchmarks/moe_routing_replay.py  # noqa: E402

CONFIG = TINY_MOE_PRESETS['tiny-qwen3-moe']
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, CONFIG.vocab_size, (4, 10)), jnp.int32)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def _numpy_int8(w):
  """An expert weight ``[..., K, N]`` quantised and dequantised in NumPy: per output channel
  ``s = max |w| / 127`` over the inputs, ``round(w / s) * s``."""
  w = np.asarray(w, np.float32)
  scale = np.abs(w).max(axis=-2, keepdims=True) / np.float32(127)
  return np.round(w / scale) * scale


def _dequantised(params, model):
  """The float32 weights the int8 copy of ``params`` stands for: every projection ``q * scale``
  (``quant.dequantize``) and the experts quantised and dequantised in NumPy (``_numpy_int8``),
  not by the code under test."""
  layout = model.config.execution.weight_layout
  out = jax.tree.map(
      lambda w: np.asarray(dequantize(w, layout)) if isinstance(w, Int8Weight) else w,
      quantize_params(params, model), is_leaf=lambda x: isinstance(x, Int8Weight))
  for name in EXPERTS:
    out['blocks']['moe'][name] = _numpy_int8(params['blocks']['moe'][name])
  return out


def test_the_int8_copy_quantises_every_expert_per_layer_expert_and_channel(model_and_params):
  """Experts int8 with a scale per (layer, expert, output channel), ``|w - q * scale| <=
  scale / 2``; the router, norms and embedding kept; an unrolled model's (the CPU engine's)
  per-layer experts are the stacked ones layer by layer."""
  model, params = model_and_params
  quantised = quantize_params(params, model)
  layers, experts = CONFIG.num_layers, CONFIG.num_experts
  outputs = {'experts_gate': CONFIG.moe_mlp_dim, 'experts_up': CONFIG.moe_mlp_dim,
             'experts_down': CONFIG.embed_dim}
  for name in EXPERTS:
    w, got = np.asarray(params['blocks']['moe'][name]), quantised['blocks']['moe'][name]
    assert isinstance(got, Int8Weight) and got.q.dtype == jnp.int8 and got.q.shape == w.shape
    assert got.scale.dtype == jnp.float32
    assert got.scale.shape == (layers, experts, 1, outputs[name])
    np.testing.assert_allclose(got.scale, np.abs(w).max(axis=-2, keepdims=True) / 127,
                               rtol=1e-6)
    assert (np.abs(np.asarray(got.q, np.float32) * got.scale - w) <= got.scale / 2 * (1 + 1e-6)
            ).all()
  assert not isinstance(quantised['blocks']['moe']['router'], Int8Weight)
  assert not isinstance(quantised['blocks']['mlp_norm']['scale'], Int8Weight)
  unrolled = with_weight_layout(model, 'in_out', layer_loop='unrolled')
  per_layer = quantize_params(to_weight_layout(params, model, unrolled), unrolled)
  for i in range(layers):
    down = per_layer['blocks'][i]['moe']['experts_down']
    assert isinstance(down, Int8Weight) and down.scale.shape == (experts, 1, CONFIG.embed_dim)
    jax.tree.map(lambda got, want, i=i: np.testing.assert_array_equal(got, want[i]),
                 per_layer['blocks'][i]['moe'], quantised['blocks']['moe'])


@pytest.mark.parametrize('impl', ['ragged', 'dense'])
def test_int8_moe_logits_equal_the_dequantised_float32_models(model_and_params, impl):
  """The int8 model (experts and attention ``(x @ q) * scale``) against the float32 model of
  weights ``q * scale``: equal to float32 rounding; the float32 original is another policy."""
  base, params = model_and_params
  model = create_model(CONFIG.with_execution(moe_impl=impl))[0]
  quantised = quantize_params(params, model)
  forward = jax.jit(model.apply)
  got = forward(quantised, TOKENS)
  np.testing.assert_allclose(got, forward(_dequantised(params, model), TOKENS), atol=1e-5,
                             rtol=0)
  assert np.abs(np.asarray(got) - np.asarray(forward(params, TOKENS))).max() > 1e-3


def test_the_int8_engine_samples_and_records_the_int8_models_routes(model_and_params):
  """The engine samples with the int8 copy (experts included): its behaviour log-probs and
  the routes it records for every fed token are the dequantised model's; the trainer's R3
  objective on the float32 master replays them and reports the flip fraction and
  ``mismatch/*``."""
  model, params = model_and_params
  rollouts = moe_routing_replay.rollouts(CONFIG, params, prompts=4, prompt_len=6, new_tokens=8,
                                         seed=1, inference_dtype=jnp.float32, quant='int8')
  batch = jax.tree.map(jnp.asarray, make_train_batch(rollouts, np.linspace(
      -1.0, 1.0, len(rollouts)).astype(np.float32)))
  reference = _dequantised(params, model)
  policy = Policy(model, SamplingSpec(temperature=1.0))
  own = np.asarray(jax.jit(lambda p: model.apply(p, batch.tokens, return_routes=True)[1])(
      reference))
  recorded = np.asarray(batch.routes)
  fed = recorded[..., 0, 0] >= 0
  assert fed.sum() >= 4 * (6 + 8 - 1) - 4  # every prompt and fed sampled token
  np.testing.assert_array_equal(recorded[fed], own[fed])
  mask = np.asarray(batch.loss_mask[:, 1:]) > 0
  logp = policy.sequence_log_probs(reference, batch.tokens, batch.support_sizes).logp
  np.testing.assert_allclose(np.asarray(logp)[mask],
                             np.asarray(batch.behaviour_logprobs[:, 1:])[mask], atol=1e-5)
  _, metrics = jax.jit(lambda p: rl_objective(policy, LossConfig(), p, batch, None,
                                              routing_replay=True))(params)
  assert 0.0 <= float(metrics['moe/route_flip_fraction']) < 1.0
  assert np.isfinite(float(metrics['mismatch/kl'])) and float(metrics['mismatch/kl']) > 0


def test_a_qlora_base_of_a_mixture_of_experts_holds_int8_experts(model_and_params):
  """``lora.base_quant='int8'`` quantises the frozen base with the same ``quantize_params``:
  the experts int8 too; the adapters train through them (finite, non-zero gradients) and the
  merged model (``lora.merge``: ``q * scale`` folded back) gives the QLoRA model's logits."""
  model, params = model_and_params
  lmodel, lparams = lora_lib.create(model, params, lora_lib.LoRAConfig(
      rank=2, alpha=4.0, targets=('q', 'v'), base_quant='int8'))
  assert isinstance(lparams['blocks']['moe']['experts_down'], Int8Weight)
  marks = traverse_util.flatten_dict(lora_lib.trainable_mask(lmodel))
  flat = traverse_util.flatten_dict(lparams)

  def loss(adapters):
    logits = lmodel.apply(traverse_util.unflatten_dict({**flat, **adapters}), TOKENS)
    return -jnp.mean(token_logprobs(logits[:, :-1], TOKENS[:, 1:])), logits
  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      {k: v for k, v in flat.items() if marks[k]})
  norms = [float(jnp.linalg.norm(g)) for g in grads.values()]
  assert all(np.isfinite(norms)) and max(norms) > 0
  merged_model, merged = lora_lib.merge(lmodel, lparams)
  np.testing.assert_allclose(jax.jit(merged_model.apply)(merged, TOKENS), logits, atol=1e-5,
                             rtol=0)
