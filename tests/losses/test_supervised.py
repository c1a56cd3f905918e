"""Tests for rlax_llm.losses.supervised (token cross-entropy and entropy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.losses.supervised import token_cross_entropy


def np_log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def random_batch(seed, batch=3, length=6, vocab=11, scale=3.0):
  rng = np.random.RandomState(seed)
  logits = (scale * rng.normal(size=(batch, length, vocab))).astype(np.float32)
  targets = rng.randint(0, vocab, (batch, length)).astype(np.int32)
  # Make roughly half the targets the argmax so accuracy is neither 0 nor 1.
  hit = rng.rand(batch, length) < 0.5
  targets = np.where(hit, logits.argmax(-1), targets).astype(np.int32)
  mask = (rng.rand(batch, length) < 0.7).astype(np.float32)
  mask[0, 0] = 1.0
  return logits, targets, mask


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_token_cross_entropy_matches_numpy(seed):
  logits, targets, mask = random_batch(seed)
  loss, diags = jax.jit(token_cross_entropy)(logits, targets, mask)
  logp = np_log_softmax(logits)
  nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  m = mask > 0
  assert loss.shape == () and loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, nll[m].mean(), rtol=1e-5)
  accuracy = (logits.argmax(-1) == targets)[m].mean()
  assert 0.0 < accuracy < 1.0
  np.testing.assert_allclose(diags['accuracy'], accuracy, rtol=1e-6)


def test_token_cross_entropy_hand_case():
  # Uniform logits over 4 tokens: NLL = log 4 everywhere. Second row: target is the argmax.
  logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0]]])
  targets = jnp.array([[2, 1]])
  mask = jnp.array([[1, 1]])
  loss, diags = token_cross_entropy(logits, targets, mask)
  nll_1 = -(5.0 - np.log(np.exp(5.0) + 3.0))
  np.testing.assert_allclose(loss, (np.log(4.0) + nll_1) / 2, rtol=1e-6)
  # Uniform row: argmax is token 0, not the target 2 -> 1 of 2 correct.
  np.testing.assert_allclose(diags['accuracy'], 0.5)


def test_token_cross_entropy_masked_positions_do_not_count():
  logits, targets, mask = random_batch(3)
  loss, diags = token_cross_entropy(logits, targets, mask)
  junk_logits = np.where(mask[..., None] > 0, logits, 1e4 * np.sign(logits)).astype(np.float32)
  junk_targets = np.where(mask > 0, targets, 0).astype(np.int32)
  loss2, diags2 = token_cross_entropy(junk_logits, junk_targets, mask)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  np.testing.assert_allclose(diags2['accuracy'], diags['accuracy'], rtol=1e-6)
  loss0, diags0 = token_cross_entropy(logits, targets, np.zeros_like(mask))
  assert float(loss0) == 0.0 and float(diags0['accuracy']) == 0.0


def test_token_cross_entropy_bf16_logits():
  logits, targets, mask = random_batch(4)
  bf = jnp.asarray(logits, jnp.bfloat16)
  loss, _ = token_cross_entropy(bf, targets, mask)
  assert loss.dtype == jnp.float32
  logp = np_log_softmax(np.asarray(bf.astype(jnp.float32)))
  nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(loss, nll[mask > 0].mean(), rtol=1e-5)


def test_token_cross_entropy_shape_checks():
  logits, targets, mask = random_batch(5)
  with pytest.raises(AssertionError):
    token_cross_entropy(logits[0], targets[0], mask[0])
  with pytest.raises(AssertionError):
    token_cross_entropy(logits, targets, mask[:, :-1])
