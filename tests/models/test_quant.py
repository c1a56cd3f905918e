"""Int8 weight-only quantised rollouts (``model.inference_quant='int8'``): the per-channel
round trip's error bound, the quantised projection against the dequantised-weight matmul, the
engine sampling with the quantised policy, and a tiny run that samples int8 and trains the
float32 master with the mismatch measured."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.data_types import make_train_batch
from rlax_llm.models.decoder import linear
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model, to_weight_layout, with_weight_layout
from rlax_llm.models.quant import Int8Weight, dequantize, quantize, quantize_params
from rlax_llm.rollout.driver import Driver, Job, VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.scoring import Policy

from parity import trainer_logprobs  # tests/parity.py
from recorded_run import assert_trained_with_mismatch, recorded_run  # tests/recorded_run.py
from smoke_config import smoke_config  # tests/smoke_config.py

CONFIG = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=64)
MESH = make_mesh({'data': 1}, jax.devices()[:1])
PROMPTS = [(5, 9, 13), (7, 3, 22, 30, 31, 2), (11,)]


@pytest.mark.parametrize('layout', ['in_out', 'out_in'])
@pytest.mark.parametrize('shape,outputs', [((32, 4, 8), 2), ((4, 8, 32), 1), ((32, 64), 1)])
def test_round_trip_error_is_at_most_half_a_step_per_channel(layout, shape, outputs):
  w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.01, 3.0, shape[-1])
  if layout == 'out_in':  # outputs first
    order = tuple(range(len(shape) - outputs, len(shape))) + tuple(
        range(len(shape) - outputs))
    w = w.transpose(order)
  w = w.at[(0,) * w.ndim].set(0.0)
  q = quantize(w, outputs, layout)
  assert q.q.dtype == jnp.int8 and q.q.shape == w.shape and q.scale.dtype == jnp.float32
  n = int(np.prod(w.shape[-outputs:] if layout == 'in_out' else w.shape[:outputs]))
  assert q.scale.shape == (n,)
  flat = lambda a: np.asarray(a).reshape(-1, n) if layout == 'in_out' else np.asarray(
      a).reshape(n, -1).T  # [K, N]
  err = np.abs(flat(dequantize(q, layout)) - flat(w))
  scale = np.asarray(q.scale)
  assert (err <= scale / 2 * (1 + 1e-6)).all()
  np.testing.assert_allclose(scale, np.abs(flat(w)).max(axis=0) / 127, rtol=1e-6)
  assert np.abs(flat(q.q)).max() == 127  # each channel's largest weight hits the range


@pytest.mark.parametrize('layout', ['in_out', 'out_in'])
@pytest.mark.parametrize('rows', [1, 3, 40])
def test_quantised_projection_equals_the_dequantised_weight_matmul(layout, rows):
  config = CONFIG.with_execution(weight_layout=layout)
  for shape, outputs in (((32, 4, 8), 2), ((4, 8, 32), 1)):  # q (reads embed), o (writes it)
    w = jax.random.normal(jax.random.key(1), shape)
    if layout == 'out_in':
      w = jnp.moveaxis(w, tuple(range(len(shape) - outputs, len(shape))),
                       tuple(range(outputs)))
    q = quantize(w, outputs, layout)
    x = jax.random.normal(jax.random.key(2), (rows, 32))  # K = embed = heads * head_dim
    got = linear(x, q, config)
    want = linear(x, dequantize(q, layout), config)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


def test_quantised_params_are_the_same_in_either_layout():
  model, params = create_model(CONFIG, seed=0)
  flipped = with_weight_layout(model, 'out_in')
  a = quantize_params(params, model)
  b = quantize_params(to_weight_layout(params, model, flipped), flipped)
  wq = a['blocks']['attn']['wq']
  assert isinstance(wq, Int8Weight) and wq.q.dtype == jnp.int8
  assert wq.scale.shape == (CONFIG.num_layers, CONFIG.num_heads * CONFIG.head_dim)
  assert not isinstance(a['embed'], Int8Weight)  # embedding (and lm head) stay as they are
  np.testing.assert_array_equal(a['blocks']['mlp']['w_down'].scale,
                                b['blocks']['mlp']['w_down'].scale)
  tokens = jnp.array([[3, 4, 5, 6, 7]])
  np.testing.assert_allclose(model.apply(a, tokens), flipped.apply(b, tokens), atol=1e-5)


def test_an_unrolled_models_int8_layers_are_the_stacked_ones_layer_by_layer():
  """A ``layer_loop='unrolled'`` model (per-layer leaves, the CPU engine's) quantises each
  layer's weight as the stacked model quantises its slice: the same int8 values and scales."""
  model, params = create_model(CONFIG, seed=0)
  unrolled = with_weight_layout(model, 'in_out', layer_loop='unrolled')
  stacked = quantize_params(params, model)
  per_layer = quantize_params(to_weight_layout(params, model, unrolled), unrolled)
  for i in range(CONFIG.num_layers):
    wo = per_layer['blocks'][i]['attn']['wo']
    assert isinstance(wo, Int8Weight) and wo.scale.shape == (CONFIG.embed_dim,)
    jax.tree.map(lambda got, want, i=i: np.testing.assert_array_equal(got, want[i]),
                 per_layer['blocks'][i], stacked['blocks'])


def test_the_int8_engine_records_the_quantised_policys_logprobs():
  model, params = create_model(CONFIG, seed=0)
  spec = SamplingSpec(1.0)
  engine = Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=10, pad_id=0,
                  quant='int8')
  placed = engine.place_params(params)
  assert {leaf.dtype for leaf in jax.tree.leaves(placed['blocks'])} == {
      jnp.dtype(jnp.int8), jnp.dtype(jnp.float32)}
  holder = VersionedParams()
  holder.set(0, placed)
  keys = lambda i: np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(
      jax.random.key(i), j))) for j in range(3)])
  jobs = [Job(prompt_ids=p, num_samples=3, sampling=spec, max_new_tokens=10, stop_ids=(),
              keys=keys(i)) for i, p in enumerate(PROMPTS)]
  results = Driver(engine, holder).run(jobs)
  pairs = [(p, s) for p, samples in zip(PROMPTS, results) for s in samples]
  quantised = quantize_params(params, model)
  score = jax.jit(Policy(model, spec).sequence_log_probs)
  gaps = []
  for (_, sample), q_logp, f_logp in zip(pairs, trainer_logprobs(score, quantised, pairs, 32),
                                         trainer_logprobs(score, params, pairs, 32)):
    assert len(sample.tokens) == 10 and np.isfinite(sample.logprobs).all()
    np.testing.assert_allclose(q_logp, sample.logprobs, atol=1e-5, rtol=0)
    gaps.append(np.abs(f_logp - np.asarray(sample.logprobs)).max())
  assert max(gaps) > 1e-4  # the float32 policy is another one


def test_a_run_samples_int8_and_trains_the_float32_master(tmp_path):
  """The worker samples with the int8 copy of each version it pulls; the trainer's float32
  recompute is the PPO ratio's reference, and the TIS weights and mismatch metrics carry the
  quantisation gap."""
  config = smoke_config(model__inference_quant='int8', log__tensorboard=False,
                        eval__every_steps=0, rl__old_logprobs='recompute',
                        rl__mismatch__enabled=True)
  worker, sampled, start, final, _ = recorded_run(config, tmp_path)
  held, placed, rollouts = next(x for x in sampled if not x[2].sampling.greedy)
  # The worker holds (and verifies deltas of) the float32 pull, and samples with int8.
  assert {leaf.dtype for leaf in jax.tree.leaves(held)} == {np.dtype(np.float32)}
  blocks = placed['blocks']  # per layer where the engine runs its layers unrolled (CPU)
  wq = (blocks[0] if worker.engine.layer_loop == 'unrolled' else blocks)['attn']['wq']
  assert isinstance(wq, Int8Weight) and wq.q.dtype == jnp.int8
  batch = make_train_batch(rollouts, np.zeros(len(rollouts), np.float32))
  mask = np.asarray(batch.loss_mask[:, 1:]) > 0
  behaviour = np.asarray(batch.behaviour_logprobs[:, 1:])[mask]
  tokens, sizes = jnp.asarray(batch.tokens), jnp.asarray(batch.support_sizes)
  policy = Policy(worker.model, rollouts.sampling)
  int8 = policy.sequence_log_probs(quantize_params(held, worker.model), tokens, sizes)
  fp32 = policy.sequence_log_probs(held, tokens, sizes)
  assert np.abs(np.asarray(int8.logp)[mask] - behaviour).max() < 1e-5
  assert np.abs(np.asarray(fp32.logp)[mask] - behaviour).max() > 1e-4
  assert_trained_with_mismatch(tmp_path, start, final)
