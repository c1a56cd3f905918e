"""``Engine.extend``: a conversation's KV cache kept across turns (tiny random model).

Turn 2 of a conversation decoded after appending the observation to the slot's cache equals
turn 2 decoded after prefilling the whole conversation from scratch, and only the appended
tokens are run through the model.
"""

import jax
import numpy as np
import pytest

from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.rollout.engine import Engine, Extend, Insert
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.sharding import make_mesh

CONFIG = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=64)
PAD = 0
MESH = make_mesh({'data': 1}, jax.devices()[:1])
# KV-cache layouts: one block, and several (as tests/rollout/test_engine.py).
CACHES = {'one block': {}, 'blocks of 8': {'block_align': 4},
          'blocks of 10': {'attend_buckets': 3, 'block_align': 1}}


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def key(seed):
  return np.asarray(jax.random.key_data(jax.random.key(seed)))


def decode(engine, params, state, spec, first, slots):
  """Steps until every slot in ``slots`` is done; ``first``: the insert/extend result.
  Returns ``(state, {slot: (tokens, logprobs)})``."""
  host = first.to_host()
  out = {slot: ([int(host.tokens[i])], [float(host.logprobs[i])])
         for i, slot in enumerate(slots)}
  live = {slot for i, slot in enumerate(slots) if not host.done[i]}
  while live:
    state, step = engine.generate(params, state, spec)
    host = step.to_host()
    for slot in list(live):
      out[slot][0].append(int(host.tokens[slot]))
      out[slot][1].append(float(host.logprobs[slot]))
      if host.done[slot]:
        live.remove(slot)
  return state, out


@pytest.mark.parametrize('cache', CACHES)
@pytest.mark.parametrize('spec', [GREEDY, SamplingSpec(0.7, top_k=5)])
def test_turn_two_after_extend_equals_a_prefill_from_scratch(model_and_params, spec, cache):
  model, raw = model_and_params
  engine = Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=24,
                  pad_id=PAD, **CACHES[cache])
  params = engine.place_params(raw)
  prompts = [(5, 9, 13, 4), (7, 3, 22, 30, 31, 2, 8)]
  observations = [(20, 21, 22), (40, 41, 42, 43, 44, 45, 46, 47, 10, 12, 11)]
  turn_slots = (1, 3)  # a slot other than 0, and one with a higher index
  state = engine.init_decode_state()
  prefix = engine.prefill(params, prompts)
  state, first = engine.insert(prefix, state, [
      Insert(row=i, slot=slot, key=key(i), max_new_tokens=5, stop_ids=())
      for i, slot in enumerate(turn_slots)], spec)
  state, turn1 = decode(engine, params, state, spec, first, turn_slots)
  # Turn 2: the last sampled token (not yet in the cache) and the observation.
  news = [(turn1[slot][0][-1],) + obs for slot, obs in zip(turn_slots, observations)]
  before = engine.prefilled_tokens
  extends = [Extend(slot=slot, start=len(p) + 4, tokens=new, key=key(10 + i),
                    max_new_tokens=6, stop_ids=())
             for i, (slot, p, new) in enumerate(zip(turn_slots, prompts, news))]
  state, first = engine.extend(params, state, extends, spec)
  assert engine.prefilled_tokens - before == sum(len(n) for n in news)  # only the new ones
  state, turn2 = decode(engine, params, state, spec, first, turn_slots)

  for i, (slot, prompt, obs) in enumerate(zip(turn_slots, prompts, observations)):
    whole = prompt + tuple(turn1[slot][0]) + obs
    fresh = engine.init_decode_state()
    prefix = engine.prefill(params, [whole], continuation=True)
    fresh, first = engine.insert(prefix, fresh, [
        Insert(row=0, slot=0, key=key(10 + i), max_new_tokens=6, stop_ids=())], spec)
    _, reference = decode(engine, params, fresh, spec, first, (0,))
    assert turn2[slot][0] == reference[0][0], (slot, turn2[slot][0], reference[0][0])
    np.testing.assert_allclose(turn2[slot][1], reference[0][1], atol=1e-5, rtol=0)


def test_extend_refuses_what_does_not_fit(model_and_params):
  model, raw = model_and_params
  engine = Engine(model, MESH, slots=2, max_prefill_length=8, max_decode_length=8,
                  pad_id=PAD)
  params = engine.place_params(raw)
  state = engine.init_decode_state()
  ok = {'slot': 0, 'start': 4, 'tokens': (3, 4), 'key': key(0), 'max_new_tokens': 4,
        'stop_ids': ()}
  for change, message in [({'slot': 2}, 'slot 2 out of range'),
                          ({'tokens': ()}, 'no tokens'),
                          ({'start': 12}, 'need 17 positions'),
                          ({'max_new_tokens': 9}, 'max_new_tokens=9')]:
    with pytest.raises(ValueError, match=message):
      engine.extend(params, state, [Extend(**{**ok, **change})], GREEDY)
  with pytest.raises(ValueError, match='same slot'):
    engine.extend(params, state, [Extend(**ok), Extend(**ok)], GREEDY)
  assert engine.prefilled_tokens == 0
