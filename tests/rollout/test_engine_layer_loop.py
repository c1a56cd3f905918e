"""The engine's layer loop (``Engine(layer_loop=...)``, tiny random model).

``'unrolled'`` (each layer's weights and KV-cache blocks in their own buffers, a Python loop
over the layers: the default on XLA:CPU) and ``'scan'`` (the trainer's stacked layers, one
``jax.lax.scan``) sample the same tokens (temperature 1 with the same keys: equal logits
draw equal tokens; greedy log-probs would all be 0) with the same log-probs through prefill,
insert, decode steps and ``extend``, in one-block and several-block caches, with an int8 KV
cache and with int8 weights; the float engines' log-probs are the scanned trainer forward's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model, token_logprobs
from rlax_llm.rollout.engine import Engine, Extend, Insert
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh

from test_engine_extend import decode, key  # tests/rollout/test_engine_extend.py

CONFIG = DecoderConfig(vocab_size=48, num_layers=3, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=64)
PAD = 0
MESH = make_mesh({'data': 1}, jax.devices()[:1])
PROMPTS = [(5, 9, 13, 4), (7, 3, 22, 30, 31, 2, 8)]
OBSERVATIONS = [(20, 21, 22), (40, 41, 42, 43, 44, 45, 46, 47, 10, 12, 11)]
SLOTS = (1, 3)
SPEC = SamplingSpec(1.0)  # log-probs of the whole softmax
# Cache layouts (one block; blocks of 8 positions) and quantisations; float ones are also
# compared with the trainer's forward pass.
VARIANTS = {'one block': {}, 'blocks of 8': dict(block_align=4),
            'int8 cache, blocks of 8': dict(block_align=4, kv_cache_quant='int8'),
            'int8 weights': dict(quant='int8')}


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def make(model, layer_loop, **kwargs):
  return Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=24,
                pad_id=PAD, layer_loop=layer_loop, **kwargs)


def conversation(engine, raw):
  """Two turns per slot: prompts prefilled and inserted, decoded; then each slot's last
  token and an observation appended by ``extend``, decoded. Returns
  ``(turn1, turn2)``, each ``[(tokens, logprobs) per slot]``."""
  params = engine.place_params(raw)
  state = engine.init_decode_state()
  prefix = engine.prefill(params, PROMPTS)
  state, first = engine.insert(prefix, state, [
      Insert(row=i, slot=slot, key=key(i), max_new_tokens=5, stop_ids=())
      for i, slot in enumerate(SLOTS)], SPEC)
  state, turn1 = decode(engine, params, state, SPEC, first, SLOTS)
  turn1 = [turn1[slot] for slot in SLOTS]
  extends = [Extend(slot=slot, start=len(prompt) + 4, tokens=(tokens[-1],) + obs,
                    key=key(10 + i), max_new_tokens=6, stop_ids=())
             for i, (slot, prompt, (tokens, _), obs) in enumerate(
                 zip(SLOTS, PROMPTS, turn1, OBSERVATIONS))]
  state, first = engine.extend(params, state, extends, SPEC)
  _, turn2 = decode(engine, params, state, SPEC, first, SLOTS)
  return turn1, [turn2[slot] for slot in SLOTS]


def test_default_is_unrolled_on_cpu_but_batch_invariant_and_the_choice_is_checked(
    model_and_params):
  model, raw = model_and_params
  engine = Engine(model, MESH, slots=2, max_prefill_length=8, max_decode_length=8, pad_id=PAD)
  cpu = all(d.platform == 'cpu' for d in MESH.devices.flat)
  assert engine.layer_loop == ('unrolled' if cpu else 'scan')
  assert engine.model.config.execution.layer_loop == engine.layer_loop
  placed = engine.place_params(raw)
  if cpu:  # one buffer per layer and weight, each layer's own cache blocks
    assert sorted(placed['blocks']) == list(range(CONFIG.num_layers))
    np.testing.assert_array_equal(placed['blocks'][2]['mlp_norm']['scale'],
                                  raw['blocks']['mlp_norm']['scale'][2])
    assert len(engine.init_decode_state().cache.k) == CONFIG.num_layers
  # A batch-invariant model's log-probs must be the (scanned) trainer's bit for bit.
  invariant = create_model(CONFIG.with_execution(batch_invariant=True))[0]
  assert Engine(invariant, MESH, slots=2, max_prefill_length=8, max_decode_length=8,
                pad_id=PAD).layer_loop == 'scan'
  with pytest.raises(ValueError, match="layer_loop='loop' is not a layer loop"):
    Engine(model, MESH, slots=2, max_prefill_length=8, max_decode_length=8, pad_id=PAD,
           layer_loop='loop')


@pytest.mark.parametrize('variant', VARIANTS)
def test_unrolled_and_scan_sample_the_same_tokens(model_and_params, variant):
  model, raw = model_and_params
  kwargs = VARIANTS[variant]
  unrolled = conversation(make(model, 'unrolled', **kwargs), raw)
  scan = conversation(make(model, 'scan', **kwargs), raw)
  for turn_u, turn_s in zip(unrolled, scan):
    for (tokens_u, logp_u), (tokens_s, logp_s) in zip(turn_u, turn_s):
      assert tokens_u == tokens_s
      np.testing.assert_allclose(logp_u, logp_s, atol=1e-5, rtol=0)
  if kwargs.get('quant') or kwargs.get('kv_cache_quant'):
    return  # a quantised policy is not the trainer's
  # The trainer's (scanned, no cache) forward over each whole conversation.
  for i, prompt in enumerate(PROMPTS):
    (tokens1, logp1), (tokens2, logp2) = unrolled[0][i], unrolled[1][i]
    whole = prompt + tuple(tokens1) + OBSERVATIONS[i] + tuple(tokens2)
    ids = jnp.asarray([whole], jnp.int32)
    logp = np.asarray(token_logprobs(model.apply(raw, ids[:, :-1]), ids[:, 1:]))[0]
    start2 = len(prompt) + len(tokens1) + len(OBSERVATIONS[i])
    np.testing.assert_allclose(logp1, logp[len(prompt) - 1:len(prompt) - 1 + len(tokens1)],
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(logp2, logp[start2 - 1:start2 - 1 + len(tokens2)],
                               atol=1e-5, rtol=0)
