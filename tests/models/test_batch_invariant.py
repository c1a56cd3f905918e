"""Batch-invariant numerics (``Execution.batch_invariant``): a position's logits are
bitwise the same in a full forward of any width and batch, in a prefill and in decode steps
over any cache layout; every scoring path of the trainer agrees bitwise; gradients are the
default numerics' up to rounding. The control: with the default numerics the same
comparisons differ (so these tests can fail)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_llm.models.decoder_config import DecoderConfig, Execution
from rlax_llm.models.numerics import INVARIANT_KEYS, invariant_matmul
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.rollout.driver import Driver, Job, VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.sharding import activation_sharding, make_mesh, param_shardings

from parity import trainer_logprobs  # tests/parity.py

# SmolLM2-135M's layer shapes (GQA, 3 query heads per kv head), two layers.
GQA = DecoderConfig(vocab_size=1000, num_layers=2, embed_dim=576, num_heads=9, num_kv_heads=3,
                    head_dim=64, mlp_dim=1536, max_seq_len=160,
                    execution=Execution(batch_invariant=True))
# Multi-head (one query row per kv head in a decode step), Qwen3's q/k norms, an untied lm
# head and a head_dim whose attention scale is not a power of two.
MHA = DecoderConfig(vocab_size=300, num_layers=2, embed_dim=96, num_heads=4, num_kv_heads=4,
                    head_dim=24, mlp_dim=200, max_seq_len=160, qk_norm=True,
                    tie_embeddings=False, family='qwen3',
                    execution=Execution(batch_invariant=True))
# Qwen2's q/k/v biases.
BIAS = dataclasses.replace(MHA, num_kv_heads=2, qk_norm=False, qkv_bias=True,
                           tie_embeddings=True, family='qwen2')
LENGTH = 70  # tokens of the sequence under test; its prompt is the first PROMPT
PROMPT = 27


def _sequence(config, seed=0):
  return np.random.RandomState(seed).randint(0, config.vocab_size, LENGTH).astype(np.int32)


def _full(model, params, seq, width, batch, row):
  """Logits of ``seq`` as row ``row`` of a ``[batch, width]`` forward, other rows random."""
  tokens = np.random.RandomState(1).randint(0, model.config.vocab_size, (batch, width))
  tokens[row] = 0
  tokens[row, :len(seq)] = seq
  return np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens, jnp.int32)))[row, :len(seq)]


def _cached(model, params, seq, *, slots, max_len, block_length, bucket=32, row=1):
  """Logits of ``seq``: its prompt prefilled (padded to ``bucket``) into slot ``row`` of a
  cache of ``slots`` slots, then one decode step per token; other slots hold other tokens.
  Row ``t`` of the result predicts token ``t + 1`` (rows before the prompt's last: NaN)."""
  cache = model.init_cache(slots, max_len, block_length)
  rng = np.random.RandomState(2)
  prompts = rng.randint(0, model.config.vocab_size, (slots, bucket)).astype(np.int32)
  lengths = np.full((slots,), 5, np.int32)
  prompts[row, :PROMPT], lengths[row] = seq[:PROMPT], PROMPT
  last, cache = jax.jit(model.prefill)(params, jnp.asarray(prompts), jnp.asarray(lengths), cache)
  out = np.full((len(seq), model.config.vocab_size), np.nan, np.float32)
  out[PROMPT - 1] = np.asarray(last)[row]
  step = jax.jit(lambda p, t, c, attend: model.apply(p, t[:, None], cache=c, attend=attend),
                 static_argnums=3)
  for t in range(PROMPT, len(seq)):
    tokens = rng.randint(0, model.config.vocab_size, (slots,)).astype(np.int32)
    tokens[row] = seq[t]
    attend = -(-(t + 1) // block_length) * block_length if block_length else None
    logits, cache = step(params, jnp.asarray(tokens), cache, attend)
    out[t] = np.asarray(logits)[row, 0]
  return out


def _comparisons(config):
  """The largest difference of each way of computing the sequence's logits from a batch-1
  forward of width 80: a wider, batched forward, and decoding with 1 and 8 slots over one
  cache block, 8 slots over blocks of 64 (the sequence crosses a block) and 1 slot over
  blocks of 128. (Each case compiles its own prefill and steps; slots and layouts are each
  varied, not crossed, to keep the test's compile time down.)"""
  model, params = create_model(config, seed=0)
  seq = _sequence(config)
  reference = _full(model, params, seq, 80, 1, 0)
  scored = slice(PROMPT - 1, None)
  gaps = {'width 160, batch 3': _full(model, params, seq, 160, 3, 2)[scored]}
  for name, slots, kwargs in (('one block', 1, dict(max_len=150, block_length=None)),
                              ('one block', 8, dict(max_len=150, block_length=None)),
                              ('blocks of 64', 8, dict(max_len=160, block_length=64)),
                              ('blocks of 128', 1, dict(max_len=256, block_length=128))):
    gaps[f'{name}, {slots} slots'] = _cached(model, params, seq, slots=slots, row=slots - 1,
                                             **kwargs)[scored]
  return {k: float(np.abs(v - reference[scored]).max()) for k, v in gaps.items()}


FLOOR = dict(invariant_rows='floor')  # weight matmuls of at least 64 rows instead of chunks


@pytest.mark.parametrize('config', [GQA, MHA, BIAS, GQA.with_execution(**FLOOR),
                                    MHA.with_execution(**FLOOR)],
                         ids=['gqa', 'mha_qk_norm_untied', 'bias', 'gqa_floor', 'mha_floor'])
def test_logits_are_bitwise_equal_across_batches_padding_and_caches(config):
  gaps = _comparisons(config)
  assert all(g == 0.0 for g in gaps.values()), str(gaps)


def test_behaviour_logprobs_equal_the_trainer_bitwise_on_smollm2_shapes():
  """The default ``'chunks'`` rows on SmolLM2-135M's layer shapes (GQA; the slow case of
  tests/rollout/test_engine_smollm2.py runs it on the real 30-layer model): 8 prompts of 5
  to 40 tokens sampled at temperature 1 in 8 slots, sequences crossing into the cache's
  second block; the trainer's recompute of the 8 rows in one batch padded to 96 positions
  gives the worker's behaviour log-probs bit for bit."""
  model, params = create_model(GQA, seed=0)
  assert model.config.execution.invariant_rows == 'chunks'  # the default
  rng = np.random.RandomState(6)
  prompts = [tuple(rng.randint(1, GQA.vocab_size, n)) for n in (5, 9, 13, 17, 25, 29, 33, 40)]
  engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=8,
                  max_prefill_length=40, max_decode_length=40, pad_id=0)
  assert engine.model is model and engine.block_length == INVARIANT_KEYS
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  spec = SamplingSpec(1.0)
  keys = [np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(1), i)))[None]
          for i in range(len(prompts))]
  jobs = [Job(p, 1, spec, 40, (), k) for p, k in zip(prompts, keys)]
  pairs = [(p, samples[0]) for p, samples in zip(prompts, Driver(engine, holder).run(jobs))]
  assert sum(len(p) + len(s.tokens) > INVARIANT_KEYS for p, s in pairs) == 4  # 40 tokens each
  score = jax.jit(Policy(model, spec).sequence_log_probs)
  for (_, sample), trainer in zip(pairs, trainer_logprobs(score, params, pairs, 96)):
    np.testing.assert_array_equal(trainer, np.asarray(sample.logprobs, np.float32))


def test_the_default_numerics_differ_on_the_same_comparisons():
  gaps = _comparisons(GQA.with_execution(batch_invariant=False))
  assert max(gaps.values()) > 0.0, gaps


@pytest.mark.default_emitters
def test_trainer_scoring_paths_agree_bitwise():
  """Full sequence, lm head in chunks, and the shared-prefix window all give the same bits."""
  model, params = create_model(GQA, seed=0)
  policy = Policy(model, SamplingSpec(0.8))
  rng = np.random.RandomState(3)
  prompt = rng.randint(0, GQA.vocab_size, 20)
  tokens = np.stack([np.concatenate([prompt, rng.randint(0, GQA.vocab_size, 44)])
                     for _ in range(4)]).astype(np.int32)
  tokens = jnp.asarray(tokens)
  full = np.asarray(jax.jit(policy.sequence_log_probs)(params, tokens).logp)
  chunked = np.asarray(jax.jit(lambda p, t: policy.sequence_log_probs(p, t, chunk=16))(
      params, tokens).logp)
  window = np.asarray(jax.jit(lambda p, t: policy.window_log_probs(
      p, t, None, jnp.full((4,), 20), width=40, share=2))(params, tokens).logp)
  np.testing.assert_array_equal(chunked, full)
  np.testing.assert_array_equal(window, full[:, 19:59])


@pytest.mark.default_emitters
def test_a_data_parallel_mesh_keeps_the_bits():
  model, params = create_model(dataclasses.replace(MHA, num_layers=1), seed=0)
  tokens = jnp.asarray(np.random.RandomState(5).randint(0, MHA.vocab_size, (8, 48)), jnp.int32)
  single = np.asarray(jax.jit(model.apply)(params, tokens))
  mesh = make_mesh({'data': 8})
  placed = jax.device_put(params, param_shardings(model.abstract_params(),
                                                  model.logical_axes(), mesh))

  def forward(p, t):
    with activation_sharding(mesh):
      return model.apply(p, t)

  sharded = jax.jit(forward)(placed, jax.device_put(tokens, NamedSharding(mesh, P('data'))))
  np.testing.assert_array_equal(np.asarray(sharded), single)


def test_gradients_equal_the_default_numerics_to_rounding():
  fast = MHA.with_execution(batch_invariant=False)
  model, params = create_model(MHA, seed=0)
  fast_model, _ = create_model(fast, seed=0)
  tokens = jnp.asarray(np.random.RandomState(4).randint(0, MHA.vocab_size, (3, 40)), jnp.int32)

  def loss(m):
    return lambda p: Policy(m, SamplingSpec(1.0)).sequence_log_probs(p, tokens).logp.mean()

  value, grads = jax.jit(jax.value_and_grad(loss(model)))(params)
  fast_value, fast_grads = jax.jit(jax.value_and_grad(loss(fast_model)))(params)
  np.testing.assert_allclose(value, fast_value, rtol=1e-5)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    f = fast_grads
    for key in path:
      f = f[key.key]
    np.testing.assert_allclose(g, f, rtol=1e-3, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('rows', ['chunks', 'floor'])
@pytest.mark.parametrize('spec,w_shape', [('ck,kn->cn', (24, 40)), ('ce,ve->cv', (40, 24))])
def test_invariant_matmul_gradient_is_the_plain_matmuls_without_the_chunk_loop(spec, w_shape,
                                                                                 rows):
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(3, 50, 24), jnp.float32)  # 150 rows: 5 chunks, the last padded
  w = jnp.asarray(rng.randn(*w_shape), jnp.float32)
  g = jnp.asarray(rng.randn(3, 50, 40), jnp.float32)
  plain = lambda x, w: jnp.einsum(spec.replace('c', '...'), x, w)
  inv = lambda x, w: invariant_matmul(x, w, spec, rows)
  loss = lambda f: jax.jit(jax.grad(lambda x, w: (f(x, w) * g).sum(), argnums=(0, 1)))
  for got, want in zip(loss(inv)(x, w), loss(plain)(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # This gradient needs no forward product, so the program is the backward alone: two
  # whole-batch matmuls, no chunk loop.
  program = jax.jit(jax.grad(lambda x, w: (inv(x, w) * g).sum(), (0, 1))).lower(x, w).as_text()
  assert program.count('stablehlo.while') == 0 and program.count('stablehlo.dot_general') == 2


@pytest.mark.parametrize('rows,count,products', [
    ('chunks', 1, [2]), ('chunks', 8, [8]), ('chunks', 32, [32]), ('chunks', 33, [32, 2]),
    ('chunks', 100, [32, 4]), ('chunks', 96, [32]), ('floor', 8, [64]), ('floor', 100, [100])])
def test_invariant_matmul_product_sizes(rows, count, products):
  """'chunks': 32-row chunks, and the rest one product of its own row count (one row padded
  to two: a single row would take the matrix-vector path); 'floor': at least 64 rows."""
  x = jnp.zeros((count, 64), jnp.float32)
  w = jnp.zeros((64, 96), jnp.float32)
  text = jax.jit(lambda x, w: invariant_matmul(x, w, 'ck,kn->cn', rows)).lower(x, w).as_text()
  found = sorted(int(m) for m in re.findall(r'dot_general[^\n]*\(tensor<(\d+)x64xf32>', text))
  assert found == sorted(products), (found, products)


def test_chunks_round_a_row_the_same_for_every_row_count():
  """The small-row kernel's property 'chunks' relies on (and the reason for padding one row
  to two): row r of a product of 1 to 40 rows has the bits it has in a 32-row chunk."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(40, 64), jnp.float32)
  w = jnp.asarray(rng.randn(64, 96), jnp.float32)
  product = jax.jit(lambda x: invariant_matmul(x, w, 'ck,kn->cn', 'chunks'))
  chunk = np.asarray(product(x[:32]))
  for count in (1, 2, 5, 8, 31, 32, 33, 40):
    got = np.asarray(product(x[:count]))
    np.testing.assert_array_equal(got[:32], chunk[:count], err_msg=f'{count} rows')
    # Rows past the first chunk: the same bits as the same rows multiplied on their own.
    np.testing.assert_array_equal(got[32:], np.asarray(product(x[32:count])).reshape(-1, 96)
                                  if count > 32 else got[32:], err_msg=f'{count} rows')


def test_an_unknown_invariant_rows_mode_is_refused():
  with pytest.raises(ValueError, match=r"invariant_rows='rows'; choose one of \('chunks', "):
    GQA.with_execution(invariant_rows='rows')


def test_cache_blocks_must_be_whole_pieces_and_the_engine_keeps_them_so():
  small = dataclasses.replace(MHA, num_layers=1)
  model, params = create_model(small, seed=0)
  with pytest.raises(ValueError, match=f'multiple of {INVARIANT_KEYS} positions, got 32'):
    model.apply(params, jnp.zeros((1, 4), jnp.int32), cache=model.init_cache(1, 64, 32))
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  # Attend buckets of 40 positions; the cache is still kept in blocks of exactly one piece.
  engine = Engine(model, mesh, slots=2, max_prefill_length=64, max_decode_length=96, pad_id=0,
                  block_align=8)
  assert engine.attend_buckets == (40, 80, 120, 160)
  assert engine.block_length == INVARIANT_KEYS and engine.num_blocks == 3
  state = engine.init_decode_state()
  assert [k.shape for k in state.cache.k] == [(small.num_layers, 2, small.num_kv_heads,
                                               small.head_dim, INVARIANT_KEYS)] * 3
