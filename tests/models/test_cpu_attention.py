"""The compiled CPU decode-attention kernel (``rlax_llm.models.cpu_attention``).

It must agree with an exact (float64) softmax attention over each slot's positions on every
shape it accepts, refuse the ones it does not before any compute, and, inside the engine,
give the XLA attention's tokens and the trainer's log-probs. The engine picks it by
default where it applies and says why not elsewhere.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models import cpu_attention, numerics
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.rollout.driver import Driver, Job, VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.sharding import make_mesh

from parity import trainer_logprobs  # tests/parity.py

needs_kernel = pytest.mark.skipif(
    not cpu_attention.available(), reason=f'unavailable: {cpu_attention.unavailable_reason()}')

MESH = make_mesh({'data': 1}, jax.devices()[:1])


def reference(q, keys, values, lengths):
  """float64 softmax(q k / sqrt(D)) v over positions [0, clip(length, 1, capacity))."""
  k = np.concatenate([np.asarray(b, np.float64) for b in keys], -1)  # [B, KV, D, S]
  v = np.concatenate([np.asarray(b, np.float64) for b in values], -2)  # [B, KV, S, D]
  q = np.asarray(q, np.float64)
  out = np.zeros(q.shape)
  for b, n in enumerate(np.clip(lengths, 1, k.shape[-1])):
    s = np.einsum('kgd,kds->kgs', q[b], k[b, :, :, :n]) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    out[b] = np.einsum('kgs,ksd->kgd', p / p.sum(-1, keepdims=True), v[b, :, :n])
  return out


@needs_kernel
@pytest.mark.parametrize('groups,head_dim,block,blocks,lengths', [
    (3, 64, 64, 3, [1, 63, 64, 65, 100, 128, 150, 192]),  # SmolLM2's shape, block edges
    (1, 64, 16, 5, [1, 2, 17, 33, 80]),  # every scores tail: 16 positions at a time
    (8, 128, 32, 2, [5, 64, 31, 40]),
    (2, 128, 256, 1, [200, 7, 256]),  # one block longer than a 64-position pass
    (5, 64, 48, 2, [0, -3, 500, 96]),  # clamped: below 1 to 1, past the blocks to them
])
def test_kernel_equals_exact_attention(groups, head_dim, block, blocks, lengths):
  rng = np.random.default_rng(len(lengths) * groups)
  b, kv = len(lengths), 2
  q = rng.standard_normal((b, kv, groups, head_dim), np.float32) * 2
  keys = tuple(rng.standard_normal((b, kv, head_dim, block), np.float32) for _ in range(blocks))
  values = tuple(rng.standard_normal((b, kv, block, head_dim), np.float32)
                 for _ in range(blocks))
  got = jax.jit(cpu_attention.decode_attention)(q, keys, values,
                                                jnp.asarray(lengths, jnp.int32))
  want = reference(q, keys, values, np.asarray(lengths))
  assert got.dtype == jnp.float32 and got.shape == q.shape
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_kernel_refuses_what_it_does_not_support():
  q = jnp.zeros((2, 1, 3, 64))
  k, v = jnp.zeros((2, 1, 64, 32)), jnp.zeros((2, 1, 32, 64))
  n = jnp.ones(2, jnp.int32)
  with pytest.raises(ValueError, match='head_dim=32'):
    cpu_attention.decode_attention(jnp.zeros((2, 1, 3, 32)), (k,), (v,), n)
  with pytest.raises(ValueError, match='9 queries per kv head'):
    cpu_attention.decode_attention(jnp.zeros((2, 1, 9, 64)), (k,), (v,), n)
  with pytest.raises(ValueError, match='multiple of 16'):
    cpu_attention.decode_attention(q, (k[..., :24],), (v[:, :, :24],), n)
  with pytest.raises(ValueError, match='bfloat16'):
    cpu_attention.decode_attention(q.astype(jnp.bfloat16), (k,), (v,), n)
  with pytest.raises(ValueError, match='do not fit'):
    cpu_attention.decode_attention(q, (k, k[:1]), (v, v), n)
  with pytest.raises(ValueError, match='as many'):
    cpu_attention.decode_attention(q, (k,), (), n)


# A tiny model with SmolLM2's head_dim (64) and two queries per kv head.
CONFIG = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2,
                       head_dim=64, mlp_dim=96, max_seq_len=96)
PROMPTS = [(5, 9, 13), (7, 3, 22, 30, 31, 2), (11,), (40, 41, 42, 43, 44, 45, 46, 47, 10, 12)]


def engine_for(model, **kwargs):
  # A 48-position cache in three blocks of 16: steps cross block boundaries.
  kwargs = dict(attend_buckets=3, block_align=16) | kwargs
  return Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=32, pad_id=0,
                **kwargs)


def run(engine, params, spec, n):
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  keys = lambda i: np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(
      jax.random.key(i), j))) for j in range(n)])
  jobs = [Job(prompt_ids=p, num_samples=n, sampling=spec, max_new_tokens=30, stop_ids=(),
              keys=keys(i)) for i, p in enumerate(PROMPTS)]
  return Driver(engine, holder).run(jobs)


@needs_kernel
@pytest.mark.parametrize('spec', [GREEDY, SamplingSpec(1.0), SamplingSpec(0.7, top_k=8)])
def test_engine_with_the_kernel_matches_xla_and_the_trainer(spec):
  """Default engine: the kernel. Same tokens as XLA attention, log-probs within float32
  rounding of XLA's and within 1e-5 of the trainer's recompute."""
  model, params = create_model(CONFIG, seed=3)
  kernel, xla = engine_for(model), engine_for(model, decode_attention='xla')
  assert kernel.model.config.execution.decode_attention == 'cpu_kernel', (
      kernel.decode_attention_note)
  assert xla.model.config.execution.decode_attention == 'xla'
  got, want = run(kernel, params, spec, 2), run(xla, params, spec, 2)
  pairs = []
  for prompt, samples, references in zip(PROMPTS, got, want):
    for sample, ref in zip(samples, references):
      assert sample.tokens == ref.tokens and len(sample.tokens) == 30
      np.testing.assert_allclose(sample.logprobs, ref.logprobs, atol=4e-6, rtol=0)
      pairs.append((prompt, sample))
  if spec is not GREEDY:
    score = jax.jit(Policy(model, spec).sequence_log_probs)
    for (_, sample), trainer in zip(pairs, trainer_logprobs(score, params, pairs, 48)):
      np.testing.assert_allclose(trainer, sample.logprobs, atol=1e-5, rtol=0)


@needs_kernel
def test_engine_chooses_xla_where_the_kernel_does_not_apply_and_refuses_to_force_it():
  model = create_model(CONFIG)[0]
  small = create_model(dataclasses.replace(CONFIG, head_dim=8, embed_dim=32))[0]
  engine = engine_for(small)
  assert engine.model.config.execution.decode_attention == 'xla'
  assert 'head_dim=8' in engine.decode_attention_note
  with pytest.raises(ValueError, match="decode_attention='cpu_kernel' cannot run here: "
                                       'head_dim=8'):
    engine_for(small, decode_attention='cpu_kernel')
  one = Engine(model, MESH, slots=1, max_prefill_length=16, max_decode_length=32, pad_id=0)
  assert one.model.config.execution.decode_attention == 'xla'
  assert 'one slot' in one.decode_attention_note
  two = make_mesh({'data': 2}, jax.devices()[:2])
  with pytest.raises(ValueError, match='the mesh has 2 devices'):
    Engine(model, two, slots=4, max_prefill_length=16, max_decode_length=32, pad_id=0,
           decode_attention='cpu_kernel')
  assert Engine(model, two, slots=4, max_prefill_length=16, max_decode_length=32,
                pad_id=0).model.config.execution.decode_attention == 'xla'
  with pytest.raises(ValueError, match='multiple of 16'):
    engine_for(model, attend_buckets=6, block_align=8, decode_attention='cpu_kernel')
  with pytest.raises(ValueError, match="decode_attention='bogus'"):
    engine_for(model, decode_attention='bogus')
  with pytest.raises(ValueError, match='batch_invariant decoding needs'):
    CONFIG.with_execution(batch_invariant=True, decode_attention='cpu_kernel')


def test_without_a_compiler_the_engine_keeps_xla_and_says_why(monkeypatch):
  """No build (no compiler, or it failed): ``available()`` is False with the reason, the
  engine's default is XLA attention with that reason in its note, forcing the kernel fails
  with it, and calling the kernel raises instead of running anything."""
  why = 'no C++ compiler found ($CXX, g++, c++ or clang++)'
  monkeypatch.setattr(cpu_attention, '_build', lambda: (None, why))
  cpu_attention._register.cache_clear()
  try:
    assert not cpu_attention.available() and cpu_attention.unavailable_reason() == why
    model = create_model(CONFIG)[0]
    engine = engine_for(model)
    assert engine.model.config.execution.decode_attention == 'xla'
    assert why in engine.decode_attention_note
    with pytest.raises(ValueError, match='no C\\+\\+ compiler'):
      engine_for(model, decode_attention='cpu_kernel')
    with pytest.raises(RuntimeError, match='kernel is unavailable: no C'):
      cpu_attention.decode_attention(jnp.zeros((1, 1, 1, 64)), (jnp.zeros((1, 1, 64, 16)),),
                                     (jnp.zeros((1, 1, 16, 64)),), jnp.ones(1, jnp.int32))
  finally:
    monkeypatch.undo()
    cpu_attention._register.cache_clear()  # the real build again, for the tests after this


def test_the_build_is_cached_by_key_and_an_unwritable_cache_is_reported(tmp_path, monkeypatch):
  """A fresh cache directory gets one library named by the key, built from the shipped
  source and reused by the next call; a cache that cannot be written makes the kernel
  unavailable with that reason (not an exception in the engine)."""
  if cpu_attention._compiler() is None:
    pytest.skip('no C++ compiler here')
  monkeypatch.setenv('RLAX_LLM_KERNEL_CACHE', str(tmp_path / 'kernels'))
  cpu_attention._build.cache_clear()
  try:
    path, why = cpu_attention._build()
    assert why == '' and path.parent == tmp_path / 'kernels' and path.exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    built = path.stat().st_mtime_ns
    cpu_attention._build.cache_clear()
    assert cpu_attention._build() == (path, '') and path.stat().st_mtime_ns == built
    blocked = tmp_path / 'file'
    blocked.write_text('')
    monkeypatch.setenv('RLAX_LLM_KERNEL_CACHE', str(blocked / 'kernels'))
    cpu_attention._build.cache_clear()
    path, why = cpu_attention._build()
    assert path is None and 'cannot write the kernel cache' in why
  finally:
    monkeypatch.undo()
    cpu_attention._build.cache_clear()


@needs_kernel
def test_on_another_platform_every_cpu_only_path_falls_back_to_xla_with_the_same_results(
    monkeypatch):
  """With the platform query answering 'tpu' (as on a TPU or GPU host), the engine keeps
  XLA's attention and the model's weight layout, the flipped-product numerics are off, the
  kernel says why it is unavailable, and the engine's tokens and log-probs, and the model's
  logits, equal those of the CPU path."""
  model, params = create_model(CONFIG, seed=5)
  cpu = engine_for(model)
  assert cpu.model.config.execution.decode_attention == 'cpu_kernel'
  tokens = jnp.asarray([PROMPTS[1] + PROMPTS[0]], jnp.int32)
  cpu_logits = jax.jit(model.apply)(params, tokens)
  want = run(cpu, params, GREEDY, 2)

  monkeypatch.setattr(jax, 'default_backend', lambda: 'tpu')
  assert cpu_attention.unavailable_reason() == 'the default backend is tpu, not cpu'
  assert numerics.flips(4) is False
  other = engine_for(model)
  assert other.model.config.execution.decode_attention == 'xla'
  assert 'the default backend is tpu' in other.decode_attention_note
  assert other.model.config.execution.weight_layout == model.config.execution.weight_layout
  got = run(other, params, GREEDY, 2)
  for samples, references in zip(got, want):
    for sample, ref in zip(samples, references):
      assert sample.tokens == ref.tokens
      np.testing.assert_allclose(sample.logprobs, ref.logprobs, atol=4e-6, rtol=0)
  logits = jax.jit(model.apply)(params, tokens)
  np.testing.assert_allclose(logits, cpu_logits, atol=1e-5, rtol=0)
