"""Trainer memory levers keep the maths: chunked log-probs equal the full-logits ones (values
and gradients) and their memory does not grow with ``V x T``; micro-batched gradient
accumulation gives the whole batch's loss and gradients, on one device and sharded."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlax_llm.losses import LossConfig
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer import objectives
from rlax_llm.trainer.trainer import Trainer
from train_batches import random_train_batch  # tests/train_batches.py

VOCAB = 64
CONFIG = DecoderConfig(vocab_size=VOCAB, num_layers=2, embed_dim=32, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)


def _batch(seed=0, batch=8, length=20, vocab=VOCAB, support=None):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, vocab, (batch, length)).astype(np.int32)
  mask = np.zeros((batch, length), np.float32)
  for b in range(batch):  # ragged completions, one row with no loss tokens
    if b == batch - 1:
      continue
    start = rng.randint(2, 6)
    mask[b, start:start + rng.randint(1, length - start)] = 1.0
  return random_train_batch(rng, tokens, mask, vocab, support)


@pytest.mark.parametrize('spec,chunk', [
    (SamplingSpec(), 4),
    (SamplingSpec(temperature=0.7, top_k=8, top_p=0.9), 7),  # chunk does not divide T - 1
    (SamplingSpec(temperature=1.3), 64),  # chunk longer than the sequence
])
@pytest.mark.parametrize('tied', [True, False])
def test_chunked_log_probs_equal_full_logits(spec, chunk, tied):
  config = dataclasses.replace(CONFIG, tie_embeddings=tied)
  model, params = create_model(config, seed=1)
  policy = Policy(model, spec)
  batch = _batch(support=8 if spec.top_k else None)

  def run(c):
    out = policy.sequence_log_probs(params, batch.tokens, batch.support_sizes, chunk=c)

    def loss(p):
      s = policy.sequence_log_probs(p, batch.tokens, batch.support_sizes, chunk=c)
      return jnp.sum(jnp.where(s.in_support, s.logp, 0.0) * batch.loss_mask[:, 1:])
    return out, jax.grad(loss)(params)

  (full, g_full), (chunked, g_chunked) = run(0), run(chunk)
  np.testing.assert_array_equal(full.in_support, chunked.in_support)
  np.testing.assert_allclose(full.logp, chunked.logp, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(full.entropy, chunked.entropy, atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunked)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_full)) > 1e-3


def _logprob_grad_temp_bytes(vocab, length, chunk):
  config = dataclasses.replace(CONFIG, vocab_size=vocab, max_seq_len=length)
  model, params = create_model(config, seed=0)
  policy = Policy(model, SamplingSpec())
  batch = _batch(batch=4, length=length, vocab=vocab)

  def loss(p):
    s = policy.sequence_log_probs(p, batch.tokens, batch.support_sizes, chunk=chunk)
    return jnp.sum(s.logp * batch.loss_mask[:, 1:])
  compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_log_prob_memory_does_not_grow_with_vocab_times_length():
  # How much the compiled gradient's temporaries grow when V goes 1024 -> 4096, at two
  # lengths. Unchunked, the growth is the extra [B, T, V] logits (and their gradient), so it
  # scales with T; chunked, it is V x E (embedding gradient) plus one chunk's logits, the
  # same at both lengths.
  def growth(length, chunk):
    return (_logprob_grad_temp_bytes(4096, length, chunk)
            - _logprob_grad_temp_bytes(1024, length, chunk))
  logits_growth = {t: 4 * (t - 1) * (4096 - 1024) * 4 for t in (64, 256)}
  full = {t: growth(t, 0) for t in (64, 256)}
  chunked = {t: growth(t, 16) for t in (64, 256)}
  for t in (64, 256):
    assert full[t] >= logits_growth[t], (t, full, chunked)
  assert full[256] - full[64] >= logits_growth[256] - logits_growth[64]
  # One-sided: with the scanned layer stack XLA:CPU's buffer assignment reuses more at the
  # longer length (growth 2.1 MB at 64 positions, 0 at 256); what must not happen is growth
  # that scales with the length.
  assert chunked[256] - chunked[64] < 0.05 * (logits_growth[256] - logits_growth[64]), (
      full, chunked)
  for t in (64, 256):
    assert chunked[t] < 0.5 * full[t], (t, full, chunked)


def _trainer(loss_config, micro_batches, mesh_shape=None, seed=0):
  model, params = create_model(CONFIG, seed=seed)
  objective = functools.partial(objectives.rl_objective,
                                Policy(model, SamplingSpec(temperature=0.9)), loss_config)
  shape = mesh_shape or {'data': 1}
  devices = jax.devices()[:int(np.prod(list(shape.values())))]
  # Plain SGD with rate 1: the param change is the gradient (Adam would amplify rounding
  # where a gradient is ~0, since its first step is ~sign(g)).
  return Trainer(model, params, optax.sgd(1.0), objective, make_mesh(shape, devices),
                 micro_batches=micro_batches, totals_fn=objectives.loss_totals,
                 reference_params=params if loss_config.kl_beta > 0 else None)


@pytest.mark.parametrize('loss_config', [
    LossConfig(loss='grpo', kl_beta=0.05),  # seq-mean-token-mean, with the KL term
    LossConfig(loss='dapo'),  # token-mean
    LossConfig(loss='drgrpo'),  # seq-mean-token-sum-norm
])
def test_micro_batches_give_the_whole_batch_update(loss_config):
  batch = _batch(seed=3, batch=8)
  full, micro = _trainer(loss_config, 1), _trainer(loss_config, 4)
  m_full, m_micro = full.step(batch), micro.step(batch)
  np.testing.assert_allclose(m_full['loss'], m_micro['loss'], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m_full['grad_norm'], m_micro['grad_norm'], rtol=1e-4)
  assert m_full['grad_norm'] > 1e-3
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(micro.params)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_micro_batches_on_a_sharded_mesh_match_one_device():
  batch = _batch(seed=4, batch=16)
  config = LossConfig(loss='grpo')
  one = _trainer(config, 1)
  sharded = _trainer(config, 2, mesh_shape={'data': 2, 'fsdp': 2, 'tensor': 2})
  m_one, m_sharded = one.step(batch), sharded.step(batch)
  np.testing.assert_allclose(m_one['loss'], m_sharded['loss'], rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(sharded.params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_micro_batched_sft_matches_whole_batch():
  model, params = create_model(CONFIG, seed=0)
  batch = {'tokens': _batch().tokens, 'loss_mask': _batch().loss_mask}
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  objective = functools.partial(objectives.sft_objective, model)
  out = []
  for micro in (1, 2):
    trainer = Trainer(model, params, optax.sgd(1.0), objective, mesh,
                      micro_batches=micro, totals_fn=objectives.loss_totals)
    out.append((trainer.step(batch), trainer.params))
  np.testing.assert_allclose(out[0][0]['loss'], out[1][0]['loss'], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1])):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_micro_batch_errors():
  model, params = create_model(CONFIG, seed=0)
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  objective = functools.partial(objectives.sft_objective, model)
  with pytest.raises(ValueError, match='needs totals_fn'):
    Trainer(model, params, optax.sgd(1e-2), objective, mesh, micro_batches=2)
  with pytest.raises(ValueError, match='micro_batches=0'):
    Trainer(model, params, optax.sgd(1e-2), objective, mesh, micro_batches=0)
  trainer = Trainer(model, params, optax.sgd(1e-2), objective, mesh, micro_batches=3,
                    totals_fn=objectives.loss_totals)
  with pytest.raises(ValueError, match=r'not divisible by micro_batches=3'):
    trainer.step({'tokens': _batch().tokens, 'loss_mask': _batch().loss_mask})
  m2po = _trainer(LossConfig(loss='m2po'), 2)
  with pytest.raises(ValueError, match='M2PO'):
    m2po.step(_batch())
