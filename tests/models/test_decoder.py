"""Decoder: cached decoding equals the full forward pass; config validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models.decoder import (ROPE_TABLE_MAX_ENTRIES, head_is_vocab_major, head_logits,
                                     linear, rope, rope_inv_freq,
                                     rope_table_length, rope_tables)
from rlax_llm.models.decoder_config import DecoderConfig, Execution
from rlax_llm.models.numerics import FLIPPED_MAX_ROWS, accumulated_product
from rlax_llm.models.model import create_model, to_weight_layout, with_weight_layout

CONFIG = DecoderConfig(vocab_size=19, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=24)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=3)


def test_full_forward_shape_and_causality(model_and_params):
  model, params = model_and_params
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 19, (2, 10)), jnp.int32)
  logits = model.apply(params, tokens)
  assert logits.shape == (2, 10, 19) and logits.dtype == jnp.float32
  # Changing a later token never changes earlier logits.
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % 19)
  np.testing.assert_allclose(model.apply(params, changed)[:, :7], logits[:, :7], atol=1e-6)
  assert not np.allclose(model.apply(params, changed)[:, 7:], logits[:, 7:])


def test_prefill_then_decode_equals_full_forward(model_and_params):
  """Right-padded prompts of different lengths, then one token at a time."""
  model, params = model_and_params
  rng = np.random.RandomState(1)
  batch, total = 3, 14
  tokens = jnp.asarray(rng.randint(0, 19, (batch, total)), jnp.int32)
  full = np.asarray(model.apply(params, tokens))
  prompt_lengths = jnp.array([4, 7, 5], jnp.int32)
  width = 7  # padded prompt width; positions past each length hold other tokens (junk)
  cache = model.init_cache(batch, max_len=total)
  logits, cache = model.apply(params, tokens[:, :width], cache=cache, num_valid=prompt_lengths)
  for b in range(batch):
    n = int(prompt_lengths[b])
    np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, prompt_lengths)
  rows = np.arange(batch)
  for _ in range(total - width):
    pos = np.asarray(cache.lengths)
    step_logits, cache = model.apply(params, tokens[rows, pos][:, None], cache=cache)
    np.testing.assert_allclose(step_logits[:, 0], full[rows, pos], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, prompt_lengths + total - width)


@pytest.mark.parametrize('block_length,batch', [(3, 3), (4, 3), (14, 3), (3, 1), (4, 1)])
def test_cache_in_blocks_equals_full_forward(model_and_params, block_length, batch):
  """A cache kept in blocks: a padded prefill whose rows span several blocks, then decoding
  one token at a time reading only the leading blocks (``attend``), gives the full
  forward's logits; the blocks past ``attend`` are left untouched. One row takes its own
  path (attention before the writes, ``_blocks_with``)."""
  model, params = model_and_params
  rng = np.random.RandomState(4)
  total, width = 14, 7
  tokens = jnp.asarray(rng.randint(0, 19, (3, total)), jnp.int32)[:batch]
  full = np.asarray(model.apply(params, tokens))
  lengths = jnp.array([4, 7, 5], jnp.int32)[:batch]
  cache = model.init_cache(batch, max_len=total, block_length=block_length)
  assert cache.block_length == block_length and cache.max_len >= total
  assert cache.num_blocks == -(-total // block_length)
  last, cache = model.prefill(params, tokens[:, :width], lengths, cache)
  np.testing.assert_allclose(last, full[np.arange(batch), lengths - 1], atol=1e-5)
  rows = np.arange(batch)
  step = jax.jit(lambda p, t, c, attend: model.apply(p, t, cache=c, attend=attend),
                 static_argnums=3)
  for _ in range(total - width):
    pos = np.asarray(cache.lengths)
    attend = int(pos.max()) + 1  # rounded up to whole blocks by the decoder
    before = cache
    logits, cache = step(params, tokens[rows, pos][:, None], cache, attend)
    np.testing.assert_allclose(logits[:, 0], full[rows, pos], atol=1e-5)
    used = -(-attend // block_length)
    for j in range(used, cache.num_blocks):  # not read, not written (all layers)
      assert cache.k[j] is before.k[j] or np.array_equal(cache.k[j], before.k[j])


def test_one_row_decode_step_updates_the_cache_in_place(model_and_params):
  """A one-row decode step with the cache donated copies no cache block (XLA:CPU copied
  every written block four times when attention read the written blocks)."""
  model, params = model_and_params
  cache = model.init_cache(1, max_len=12, block_length=4)
  step = jax.jit(lambda p, t, c: model.apply(p, t, cache=c, attend=8), donate_argnums=2)
  hlo = step.lower(params, jnp.zeros((1, 1), jnp.int32), cache).compile().as_text()
  entry = hlo[hlo.index('\nENTRY'):]
  block_shapes = {f'f32[{",".join(map(str, b.shape))}]' for b in cache.k + cache.v}
  copies = [line for line in entry.splitlines()
            if ' copy(' in line and any(f'= {s}' in line for s in block_shapes)]
  assert not copies, copies[:4]


def test_jitted_decode_step_matches(model_and_params):
  model, params = model_and_params
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, 19, (2, 6)), jnp.int32)
  full = model.apply(params, tokens)
  step = jax.jit(lambda p, t, c: model.apply(p, t, cache=c))
  cache = model.init_cache(2, 6)
  for t in range(6):
    out, cache = step(params, tokens[:, t:t + 1], cache)
    np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5)


def test_untied_embeddings_and_bf16_compute():
  config = DecoderConfig(vocab_size=11, num_layers=1, embed_dim=16, num_heads=2,
                         num_kv_heads=2, head_dim=8, mlp_dim=32, tie_embeddings=False,
                         execution=Execution(dtype=jnp.bfloat16))
  model, params = create_model(config)
  assert 'lm_head' in params and params['lm_head'].shape == (16, 11)
  assert params['embed'].dtype == jnp.float32  # param dtype stays fp32 (master weights)
  logits = model.apply(params, jnp.zeros((1, 4), jnp.int32))
  assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize('out_in', [False, True], ids=['in_out', 'out_in'])
@pytest.mark.parametrize('rows', [1, 5])
@pytest.mark.parametrize('out_dtype', [None, jnp.float32], ids=['bf16 out', 'f32 out'])
def test_accumulated_product_sums_in_float32_forward_and_backward(out_in, rows, out_dtype):
  """bfloat16 products summed in float32 and rounded once, in the value and both gradients
  (float64 references on the same bfloat16 inputs; a result rounded to bfloat16 before the
  end, or a float32 output rounded through bfloat16, misses the tight tolerance)."""
  rng = np.random.RandomState(rows)
  bf16 = jnp.bfloat16
  x = jnp.asarray(rng.randn(rows, 96), bf16)
  w = jnp.asarray(rng.randn(*((40, 96) if out_in else (96, 40))), bf16)
  g = jnp.asarray(rng.randn(rows, 40), out_dtype or bf16)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  w64 = w64.T if out_in else w64
  g64 = np.asarray(g.astype(bf16), np.float64)  # the cotangent is taken in x's dtype
  y, vjp = jax.vjp(lambda x, w: accumulated_product(x, w, out_in, out_dtype), x, w)
  dx, dw = vjp(g)
  assert y.dtype == (out_dtype or bf16) and dx.dtype == bf16 and dw.dtype == bf16
  dw_ref = x64.T @ g64
  for got, ref in ((y, x64 @ w64), (dx, g64 @ w64.T), (dw, dw_ref.T if out_in else dw_ref)):
    # float32 sums of exact bfloat16 products: within 1e-5 before the final rounding.
    exact = np.asarray(ref, np.float32).astype(got.dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(exact, np.float64),
                               rtol=1e-5 if got.dtype == jnp.float32 else 8e-3, atol=1e-5)
  if out_dtype is not None:  # not bfloat16-rounded: the float64 sums to float32 precision
    np.testing.assert_allclose(np.asarray(y, np.float64), x64 @ w64, rtol=1e-5, atol=1e-4)


def test_bfloat16_linear_and_head_take_the_accumulated_product():
  """In bfloat16 ``linear`` and ``head_logits`` run ``accumulated_product`` (its float32 dots
  in the forward and the gradient); in float32 the products are XLA's own."""
  bf16 = CONFIG.with_execution(dtype=jnp.bfloat16)
  x = jnp.ones((2, 3, 32), jnp.bfloat16)
  w = jnp.ones((32, 4, 8), jnp.bfloat16)
  embed = jnp.ones((50, 32), jnp.bfloat16)
  for fn, weight in ((lambda x, w: linear(x, w, bf16), w),
                     (lambda x, w: head_logits(x, w, bf16), embed)):
    grad = jax.make_jaxpr(jax.grad(lambda x, w, fn=fn: fn(x, w).astype(jnp.float32).sum(),
                                   argnums=(0, 1)))(x, weight)
    assert str(grad).count('preferred_element_type=float32') >= 3, grad
    assert 'custom_vjp_call' in str(jax.make_jaxpr(fn)(x, weight))
  assert not head_is_vocab_major(dataclasses.replace(bf16, tie_embeddings=True), 8)
  logits = head_logits(x, embed, bf16)
  assert logits.dtype == jnp.float32
  f32 = jax.make_jaxpr(lambda x, w: linear(x, w, CONFIG))(x.astype(jnp.float32),
                                                          w.astype(jnp.float32))
  assert 'custom_vjp_call' not in str(f32)


@pytest.mark.parametrize('shape', [(1, 1), (2,), (3, 1), (8, 1), (FLIPPED_MAX_ROWS,),
                                   (FLIPPED_MAX_ROWS + 1,), (4, 20)])
def test_head_logits_flipped_for_few_rows_matches_the_plain_product(shape):
  """A tied head of 2 to FLIPPED_MAX_ROWS rows runs as ``embed @ x.T`` on XLA:CPU (its
  transposes kept apart from the dot by barriers); the logits are the same products."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(*shape, 32), jnp.float32)
  embed = jnp.asarray(rng.randn(50, 32), jnp.float32)
  logits = head_logits(x, embed, CONFIG)
  assert logits.shape == shape + (50,) and logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, np.asarray(x) @ np.asarray(embed).T, rtol=1e-5,
                             atol=1e-5)
  rows = int(np.prod(shape))
  flipped = 'optimization_barrier' in str(jax.make_jaxpr(head_logits, static_argnums=2)(
      x, embed, CONFIG))
  assert flipped == (jax.default_backend() == 'cpu' and 1 < rows <= FLIPPED_MAX_ROWS)
  grad = jax.grad(lambda x: head_logits(x, embed, CONFIG).sum())(x)  # differentiable
  np.testing.assert_allclose(grad, np.broadcast_to(np.asarray(embed).sum(0), grad.shape),
                             rtol=1e-4, atol=1e-4)


def test_vocab_major_argmax_reads_the_flipped_head_in_place():
  """Where ``head_is_vocab_major``, the head's logits are the transpose of a ``[V, rows]``
  product and ``argmax(vocab_major=True)`` reads them without copying them to
  ``[rows, V]`` (the row-wise blocks copy them: the check can fail); same tokens."""
  from rlax_llm import policy  # pylint: disable=import-outside-toplevel
  config = dataclasses.replace(CONFIG, vocab_size=1024, tie_embeddings=True)
  rows = 8
  assert head_is_vocab_major(config, rows) == (jax.default_backend() == 'cpu')
  assert not head_is_vocab_major(config, 1)
  assert not head_is_vocab_major(config.with_execution(batch_invariant=True), rows)
  assert not head_is_vocab_major(dataclasses.replace(config, tie_embeddings=False), rows)
  x = jnp.asarray(np.random.RandomState(0).randn(rows, config.embed_dim), jnp.float32)
  w = jnp.asarray(np.random.RandomState(1).randn(1024, config.embed_dim), jnp.float32)
  blocked = f'f32[{rows},{1024 // policy.ARGMAX_BLOCK},{policy.ARGMAX_BLOCK}]'

  def compiled(vocab_major):
    fn = jax.jit(lambda x, w: policy.argmax(head_logits(x, w, config), vocab_major=vocab_major))
    entry = fn.lower(x, w).compile().as_text()
    return fn(x, w), entry[entry.index('\nENTRY'):]
  in_place, entry = compiled(head_is_vocab_major(config, rows))
  row_wise, row_entry = compiled(False)
  np.testing.assert_array_equal(in_place, row_wise)
  np.testing.assert_array_equal(in_place, jnp.argmax(head_logits(x, w, config), -1))
  if jax.default_backend() == 'cpu':
    assert f'= {blocked}' in row_entry
    assert f'= {blocked}' not in entry, [l for l in entry.splitlines() if blocked in l]


@pytest.mark.parametrize('shape', [(1, 1), (8, 1), (FLIPPED_MAX_ROWS,), (FLIPPED_MAX_ROWS + 1,),
                                   (4, 20)])
def test_linear_out_in_is_the_same_product(shape):
  """A weight in the ``'out_in'`` layout (``[N..., K]``) gives ``linear`` the product of its
  ``'in_out'`` transpose; up to FLIPPED_MAX_ROWS rows it runs as ``w @ x.T`` on XLA:CPU."""
  out_in = CONFIG.with_execution(weight_layout='out_in')
  rng = np.random.RandomState(1)
  x = jnp.asarray(rng.randn(*shape, 32), jnp.float32)
  w = jnp.asarray(rng.randn(32, 4, 8), jnp.float32)  # [K, heads, head_dim]
  w_out_in = w.transpose(1, 2, 0)
  expected = np.asarray(x).reshape(-1, 32) @ np.asarray(w).reshape(32, -1)
  for config, weight in ((CONFIG, w), (out_in, w_out_in)):
    out = linear(x, weight, config)
    assert out.shape == shape + (32,)
    np.testing.assert_allclose(out.reshape(-1, 32), expected, rtol=1e-5, atol=1e-5)
  flipped = 'optimization_barrier' in str(jax.make_jaxpr(linear, static_argnums=2)(
      x, w_out_in, out_in))
  assert flipped == (jax.default_backend() == 'cpu' and np.prod(shape) <= FLIPPED_MAX_ROWS)
  grads = [jax.grad(lambda w, c=c: linear(x, w, c).sum())(weight)
           for c, weight in ((CONFIG, w), (out_in, w_out_in))]
  np.testing.assert_allclose(grads[1], grads[0].transpose(1, 2, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'lm head'])
def test_weight_layouts_are_one_model(tie):
  """``to_weight_layout`` turns params into the other layout's: exactly what that layout
  initialises from the same seed, back again unchanged, and the same logits (one row per
  sequence takes the flipped products, more rows the transposed ones)."""
  config = dataclasses.replace(CONFIG, tie_embeddings=tie)
  model, params = create_model(config, seed=4)
  flipped = with_weight_layout(model, 'out_in')
  assert with_weight_layout(model, 'in_out') is model
  converted = to_weight_layout(params, model, flipped)
  assert converted['blocks']['attn']['wq'].shape == (2, 4, 8, 32)
  assert converted['blocks']['mlp']['w_down'].shape == (2, 32, 64)
  jax.tree.map(np.testing.assert_array_equal, converted,
               create_model(flipped.config, seed=4)[1])
  jax.tree.map(np.testing.assert_array_equal, to_weight_layout(converted, flipped, model),
               params)
  for shape in ((1, 1), (3, 9), (70, 1)):
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 19, shape), jnp.int32)
    np.testing.assert_allclose(flipped.apply(converted, tokens), model.apply(params, tokens),
                               atol=2e-5, rtol=0)
  other = create_model(dataclasses.replace(config, num_layers=1))[0]
  with pytest.raises(ValueError, match='differ only in weight_layout'):
    to_weight_layout(params, model, with_weight_layout(other, 'out_in'))


@pytest.mark.parametrize('layout', ['in_out', 'out_in'])
def test_unrolled_layers_are_the_scanned_model(layout):
  """``layer_loop='unrolled'`` (a list of per-layer blocks, the CPU engine's) is the scanned
  model: one seed draws the same weights, ``to_weight_layout`` unstacks them (and stacks them
  back) exactly, and the logits with and without a cache (per-layer blocks) are the same."""
  model, params = create_model(CONFIG, seed=4)
  unrolled = with_weight_layout(model, layout, layer_loop='unrolled')
  converted = to_weight_layout(params, model, unrolled)
  assert sorted(converted['blocks']) == list(range(CONFIG.num_layers))
  jax.tree.map(np.testing.assert_array_equal, converted,
               create_model(unrolled.config, seed=4)[1])
  jax.tree.map(np.testing.assert_array_equal, to_weight_layout(converted, unrolled, model),
               params)
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, 19, (3, 9)), jnp.int32)
  np.testing.assert_allclose(unrolled.apply(converted, tokens), model.apply(params, tokens),
                             atol=2e-5, rtol=0)
  lengths = jnp.array([9, 4, 6], jnp.int32)
  outs = []
  for m, p in ((model, params), (unrolled, converted)):
    cache = m.init_cache(3, 16, block_length=8)
    last, cache = m.prefill(p, tokens, lengths, cache)
    step, cache = m.decode_step(p, jnp.array([1, 2, 3], jnp.int32), cache)
    outs.append((last, step, cache))
  assert outs[0][2].stacked and not outs[1][2].stacked
  assert len(outs[1][2].k) == CONFIG.num_layers and outs[1][2].num_blocks == 2
  for got, want in zip(outs[1][:2], outs[0][:2]):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
  for i in range(CONFIG.num_layers):  # layer i's blocks are [i] of the stacked ones
    for got, want in zip(outs[1][2].v[i], outs[0][2].v):
      np.testing.assert_allclose(got, want[i], atol=2e-5, rtol=0)


def test_rope_matches_numpy_reference():
  rng = np.random.RandomState(0)
  x = rng.randn(1, 3, 2, 8).astype(np.float32)
  pos = np.array([[0, 1, 5]])
  out = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 10_000.0))
  half = 4
  inv = 1.0 / (10_000.0 ** (np.arange(half) / half))
  ang = pos[..., None] * inv
  cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  x1, x2 = x[..., :half], x[..., half:]
  ref = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  np.testing.assert_allclose(out, ref, atol=1e-5)
  np.testing.assert_allclose(out[:, 0], x[:, 0], atol=1e-6)  # position 0 is the identity


def test_rope_table_equals_the_in_program_values():
  inv = rope_inv_freq(8, 10_000.0)
  pos = jnp.asarray([[0, 1, 7, 23]])
  for table, computed in zip(rope_tables(pos, inv, 24), rope_tables(pos, inv)):
    np.testing.assert_allclose(table, computed, atol=2e-6, rtol=0)


def test_decoder_reads_rope_from_the_host_table_when_it_is_small(model_and_params):
  """A decode step evaluates no cos or sin when the table is small (XLA:CPU evaluated them
  again inside every layer's rope, for every head); past ROPE_TABLE_MAX_ENTRIES it does."""
  model, params = model_and_params
  assert rope_table_length(CONFIG) == CONFIG.max_seq_len
  long = dataclasses.replace(CONFIG, max_seq_len=ROPE_TABLE_MAX_ENTRIES // 4 + 1)
  assert rope_table_length(long) is None
  assert rope_table_length(long.with_execution(batch_invariant=True)) == long.max_seq_len

  def step_hlo(model):
    cache = model.init_cache(2, max_len=12)
    step = jax.jit(lambda p, t, c: model.apply(p, t, cache=c))
    return step.lower(params, jnp.zeros((2, 1), jnp.int32), cache).compile().as_text()
  assert ' cosine(' not in step_hlo(model) and ' sine(' not in step_hlo(model)
  long_model = create_model(long, seed=3)[0]
  assert ' cosine(' in step_hlo(long_model)


def test_logical_axes_cover_every_param(model_and_params):
  model, params = model_and_params
  axes = model.logical_axes()
  flat_params = jax.tree.leaves(params)
  flat_axes = jax.tree.leaves(axes)
  assert len(flat_params) == len(flat_axes)
  for p, spec in zip(flat_params, flat_axes):
    assert len(spec) == p.ndim
  assert axes['blocks']['attn']['wq'] == jax.sharding.PartitionSpec('layers', 'embed', 'heads',
                                                                    'head_dim')


@pytest.mark.parametrize('kwargs, message', [
    (dict(num_heads=3, num_kv_heads=2), 'multiple of num_kv_heads'),
    (dict(head_dim=7), 'even'),
    (dict(num_layers=0), 'num_layers'),
])
def test_config_validation(kwargs, message):
  base = dict(vocab_size=10, num_layers=1, embed_dim=16, num_heads=2, num_kv_heads=1,
              head_dim=8, mlp_dim=32)
  with pytest.raises(ValueError, match=message):
    DecoderConfig(**(base | kwargs))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('policy', ['full', 'dots'])
def test_remat_gives_same_loss_and_gradients(policy, dtype):
  """Also in bfloat16, whose products are ``accumulated_product``'s custom-VJP calls."""
  config = CONFIG.with_execution(dtype=jnp.dtype(dtype))
  base, params = create_model(config, seed=5)
  remat, _ = create_model(config.with_execution(remat=policy), seed=5)
  tokens = jnp.asarray(np.random.RandomState(7).randint(0, 19, (2, 8)), jnp.int32)

  def loss(model, p):
    return jnp.mean(jax.nn.log_softmax(model.apply(p, tokens))[..., 3])

  l0, g0 = jax.jit(jax.value_and_grad(lambda p: loss(base, p)))(params)
  l1, g1 = jax.jit(jax.value_and_grad(lambda p: loss(remat, p)))(params)
  if dtype == 'float32':
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)
    return
  # bfloat16: the recomputation rounds in other fusions (so before accumulated_product too):
  # each gradient within 2% of its norm.
  np.testing.assert_allclose(l1, l0, rtol=5e-3)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b) and np.linalg.norm(b) > 0


@pytest.mark.parametrize('policy', ['full', 'dots'])
def test_remat_gives_same_gradients_through_a_prefilled_cache(policy):
  """The prefix path (``Policy.window_log_probs``) differentiates a decode through the KV
  cache a prefill wrote: the recomputed blocks take the cache and its positions too."""
  base, params = create_model(CONFIG, seed=5)
  remat, _ = create_model(CONFIG.with_execution(remat=policy), seed=5)
  tokens = jnp.asarray(np.random.RandomState(9).randint(0, 19, (2, 9)), jnp.int32)
  lengths = jnp.array([3, 5], jnp.int32)

  def loss(model, p):
    _, cache = model.prefill(p, tokens[:, :5], lengths, model.init_cache(2, 12))
    logits, _ = model.decode_step(p, tokens[:, 6], cache)
    return jnp.mean(jax.nn.log_softmax(logits)[:, 4])

  l0, g0 = jax.value_and_grad(lambda p: loss(base, p))(params)
  l1, g1 = jax.jit(jax.value_and_grad(lambda p: loss(remat, p)))(params)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)


def _compiled_gradient_scratch_bytes(config: DecoderConfig, rows: int, length: int) -> int:
  """XLA's temp bytes of the compiled gradient of a mean of ``rows x length`` logits."""
  model, _ = create_model(dataclasses.replace(config, max_seq_len=length), seed=0)
  tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
  grad = jax.jit(jax.grad(lambda p, t: jnp.mean(model.apply(p, t))))
  return grad.lower(model.abstract_params(), tokens).compile().memory_analysis(
      ).temp_size_in_bytes


def test_remat_full_keeps_only_the_block_inputs_for_the_backward_pass():
  """Attention-dominated (4 heads, 256 positions): without remat each layer keeps its
  float32 attention-sized buffers for the backward pass; with remat 'full' a layer more
  adds only its block input (``[rows, T, E]``, the scan's saved carry) and a few buffers of
  its params' size (the gradients the backward scan stacks), the recomputation of one block
  at a time being the same for any depth. Before the layer scan (a Python loop over the
  blocks) XLA:CPU merged each block's recomputation into the forward pass: 'full' compiled
  to the same bytes as 'none' unless the recomputation was tied to the cotangents; the
  backward scan is a loop of its own that XLA does not merge."""
  rows, length = 2, 256
  attention = 4 * rows * CONFIG.num_heads * length ** 2  # one float32 [rows, H, T, T]
  block_input = 4 * rows * length * CONFIG.embed_dim
  _, params = create_model(CONFIG, seed=0)
  layer_params = sum(x.nbytes for x in jax.tree.leaves(params['blocks'])) // CONFIG.num_layers
  scratch = {(remat, layers): _compiled_gradient_scratch_bytes(
      dataclasses.replace(CONFIG.with_execution(remat=remat), num_layers=layers), rows,
      length) for remat in ('none', 'full') for layers in (1, 4)}
  assert scratch['none', 4] - scratch['none', 1] > 3 * 2 * attention
  assert scratch['full', 4] - scratch['full', 1] <= 3 * (block_input + 4 * layer_params)
  assert scratch['full', 4] < scratch['none', 4] / 3


def test_prefill_and_decode_step_api(model_and_params):
  model, params = model_and_params
  tokens = jnp.asarray(np.random.RandomState(8).randint(0, 19, (2, 9)), jnp.int32)
  full = np.asarray(model.apply(params, tokens))
  lengths = jnp.array([3, 5], jnp.int32)
  last, cache = model.prefill(params, tokens[:, :5], lengths, model.init_cache(2, 12))
  np.testing.assert_allclose(last, full[[0, 1], [2, 4]], atol=1e-5)
  step_logits, cache = model.decode_step(params, tokens[[0, 1], [3, 5]], cache)
  np.testing.assert_allclose(step_logits, full[[0, 1], [3, 5]], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [4, 6])


def test_unknown_remat_policy_and_weight_layout():
  with pytest.raises(ValueError, match="remat='some'"):
    Execution(remat='some')
  with pytest.raises(ValueError, match="weight_layout='k_n'"):
    Execution(weight_layout='k_n')
  with pytest.raises(ValueError, match='must be an Execution'):
    DecoderConfig(vocab_size=10, execution='fast')
