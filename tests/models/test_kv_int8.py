"""The int8 KV cache (``model.kv_cache_quant='int8'``): the per-(token, kv head) round trip's
error bound, the engine's tokens and behaviour log-probs against a direct forward over the
dequantised keys and values (prefill, decode steps and ``Engine.extend``), its bytes against
float32, and a tiny run that samples with it and trains with the mismatch measured.

Per-token scales make a key's int8 copy depend on that key alone, so a forward over a whole
sequence through an int8 cache (``KVCache.init(..., quant='int8')``, written and read in one
call) attends to exactly the dequantised keys and values the engine's step-by-step decode
reads: that forward is the reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.config import validate_config
from rlax_llm.errors import ConfigError
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.kv_cache import KVCache, dequantize_kv, quantize_kv
from rlax_llm.models.model import create_model
from rlax_llm.rollout.engine import Engine, Extend, Insert
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.sharding import make_mesh

from recorded_run import assert_trained_with_mismatch, recorded_run  # tests/recorded_run.py
from smoke_config import smoke_config  # tests/smoke_config.py

CONFIG = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=64)
MESH = make_mesh({'data': 1}, jax.devices()[:1])
PROMPTS = [(5, 9, 13, 4), (7, 3, 22, 30, 31, 2, 8)]
OBSERVATIONS = [(20, 21, 22), (40, 41, 42, 43, 44, 45, 46, 47, 10, 12, 11)]
# Engine and reference both run float32 over the same dequantised keys and values; they
# differ only in the order XLA sums (a decode step against one long forward): measured at
# most 9.5e-7 on these log-probs, so 1e-5 leaves margin and stays below the int8 effect
# (the float32 cache's log-probs differ by 1.5e-4 to 9e-3 from the int8 cache's here).
ATOL = 1e-5


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def key(seed):
  return np.asarray(jax.random.key_data(jax.random.key(seed)))


def test_round_trip_error_is_at_most_half_a_step_per_token_and_head():
  x = jax.random.normal(jax.random.key(0), (3, 5, 2, 8)) * jnp.linspace(0.01, 30.0, 5)[
      None, :, None, None]
  x = x.at[0, 0, 0].set(0.0)  # an all-zero head: scale 1, exact
  q, scale = quantize_kv(x)
  assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (3, 5, 2, 1)
  err = np.abs(np.asarray(dequantize_kv(q, scale, jnp.float32)) - np.asarray(x))
  assert (err <= np.asarray(scale) / 2 * (1 + 1e-6)).all()
  amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(scale), np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
  assert (np.abs(np.asarray(q)).max(-1)[amax[..., 0] > 0] == 127).all()
  assert float(err[0, 0, 0].max()) == 0.0


def test_the_int8_cache_is_about_a_quarter_of_float32():
  nbytes = lambda cache: sum(x.nbytes for x in jax.tree.leaves(
      (cache.k, cache.v, cache.k_scale, cache.v_scale)))
  fp32 = KVCache.init(CONFIG, 4, 64, 32)
  int8 = KVCache.init(CONFIG, 4, 64, 32, quant='int8')
  assert {x.dtype for x in jax.tree.leaves((int8.k, int8.v))} == {jnp.dtype(jnp.int8)}
  assert int8.quantized and not fp32.quantized
  d = CONFIG.head_dim  # d int8 bytes and one float32 scale against 4 d bytes
  assert nbytes(int8) / nbytes(fp32) == pytest.approx((d + 4) / (4 * d))


def reference(model, params, sequences, quant):
  """Per sequence, float32 log-softmax logits ``[len - 1, V]`` predicting its tokens 1..,
  from one forward over it all through a fresh ``quant`` cache."""
  width = max(len(s) for s in sequences)
  tokens = np.zeros((len(sequences), width), np.int32)
  for row, s in enumerate(sequences):
    tokens[row, :len(s)] = s
  cache = KVCache.init(model.config, len(sequences), width, quant=quant)
  logits, _ = model.apply(params, jnp.asarray(tokens), cache=cache)
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
  return [logp[row, :len(s) - 1] for row, s in enumerate(sequences)]


def run_two_turns(engine, params, spec):
  """Turn 1 from a prefill, turn 2 after ``extend`` with an observation; per prompt the whole
  conversation and each drawn token's (position in it, log-prob)."""
  slots = (1, 3)
  state = engine.init_decode_state()
  state, first = engine.insert(engine.prefill(params, PROMPTS), state, [
      Insert(row=i, slot=slot, key=key(i), max_new_tokens=5, stop_ids=())
      for i, slot in enumerate(slots)], spec)
  seqs = {slot: list(p) for slot, p in zip(slots, PROMPTS)}
  drawn = {slot: [] for slot in slots}

  def decode(state, first):
    host = first.to_host()
    for i, slot in enumerate(slots):
      drawn[slot].append((len(seqs[slot]), float(host.logprobs[i])))
      seqs[slot].append(int(host.tokens[i]))
    live = {slot for i, slot in enumerate(slots) if not host.done[i]}
    while live:
      state, step = engine.generate(params, state, spec)
      host = step.to_host()
      for slot in sorted(live):
        drawn[slot].append((len(seqs[slot]), float(host.logprobs[slot])))
        seqs[slot].append(int(host.tokens[slot]))
        if host.done[slot]:
          live.remove(slot)
    return state
  state = decode(state, first)
  # The cache holds all but the last drawn token, which the extend feeds with the observation.
  extends = [Extend(slot=slot, start=len(seqs[slot]) - 1, tokens=(seqs[slot][-1],) + obs,
                    key=key(10 + i), max_new_tokens=6, stop_ids=())
             for i, (slot, obs) in enumerate(zip(slots, OBSERVATIONS))]
  for slot, obs in zip(slots, OBSERVATIONS):
    seqs[slot] += obs
  state, first = engine.extend(params, state, extends, spec)
  decode(state, first)
  return [seqs[s] for s in slots], [drawn[s] for s in slots]


@pytest.mark.parametrize('spec', [GREEDY, SamplingSpec(1.0)])
def test_the_engine_attends_to_the_dequantised_cache(model_and_params, spec):
  model, raw = model_and_params
  engine = Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=40, pad_id=0,
                  kv_cache_quant='int8')
  assert engine.decode_attention_note.startswith("'xla'") and 'int8' in (
      engine.decode_attention_note)
  params = engine.place_params(raw)
  state = engine.init_decode_state()
  assert {x.dtype for x in jax.tree.leaves((state.cache.k, state.cache.v))} == {
      jnp.dtype(jnp.int8)}
  seqs, drawn = run_two_turns(engine, params, spec)
  int8, fp32 = reference(model, raw, seqs, 'int8'), reference(model, raw, seqs, 'none')
  gaps = []
  for seq, draws, q_logp, f_logp in zip(seqs, drawn, int8, fp32):
    for position, logp in draws:
      token = seq[position]
      if spec.greedy:
        assert token == int(np.argmax(q_logp[position - 1]))
      else:
        np.testing.assert_allclose(logp, q_logp[position - 1, token], atol=ATOL, rtol=0)
        gaps.append(abs(f_logp[position - 1, token] - logp))
  if not spec.greedy:  # the float32 cache is another policy, close to it
    assert 1e-4 < max(gaps) < 0.1


def test_int8_cache_refuses_the_cpu_kernel_and_batch_invariance(model_and_params):
  model, _ = model_and_params
  with pytest.raises(ValueError, match='int8'):
    Engine(model, MESH, slots=4, max_prefill_length=8, max_decode_length=8, pad_id=0,
           kv_cache_quant='int8', decode_attention='cpu_kernel')
  invariant = create_model(CONFIG.with_execution(batch_invariant=True), seed=0)[0]
  with pytest.raises(ValueError, match='batch_invariant'):
    Engine(invariant, MESH, slots=4, max_prefill_length=8, max_decode_length=8, pad_id=0,
           kv_cache_quant='int8')


def test_the_config_validates_the_key():
  config = smoke_config(model__kv_cache_quant='int8')
  validate_config(config)
  config.model.batch_invariant = True
  with pytest.raises(ConfigError, match=r"model.kv_cache_quant='int8'.*Set "
                                        r"model.kv_cache_quant='none'"):
    validate_config(config)
  with pytest.raises(ConfigError, match='kv_cache_quant'):
    validate_config(smoke_config(model__kv_cache_quant='int4'))


def test_a_run_samples_with_an_int8_cache_and_trains(tmp_path):
  config = smoke_config(model__kv_cache_quant='int8', log__tensorboard=False,
                        eval__every_steps=0, rl__old_logprobs='recompute',
                        rl__mismatch__enabled=True)
  worker, _, start, final, _ = recorded_run(config, tmp_path)
  assert worker.engine.kv_cache_quant == 'int8'
  assert_trained_with_mismatch(tmp_path, start, final)
