"""Tests for rlax_llm.policy: the sampling transform, exact behaviour log-probs, and the
trainer-side log-probs of the same policy."""

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlax_llm import policy as policy_lib
from rlax_llm.policy import sample, token_log_probs, transform_logits
from rlax_llm.sampling_spec import GREEDY, SamplingSpec

VOCAB = 10
BATCH = 64


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = np.max(x, axis=-1, keepdims=True)
  return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def np_top_k_keep(scaled, k):
  """bool [B, V]: the k largest entries of each row."""
  order = np.argsort(-scaled, axis=-1)[:, :k]
  keep = np.zeros(scaled.shape, bool)
  np.put_along_axis(keep, order, True, axis=-1)
  return keep


def np_top_p_keep(scaled, top_p):
  """bool [B, V]: sort descending, keep a token while the mass before it is < top_p.

  Also returns the smallest distance between a mass-before value and ``top_p`` (to skip cases
  that float32 rounding could decide differently).
  """
  probs = np.exp(np_log_softmax(scaled))
  order = np.argsort(-probs, axis=-1)
  sorted_probs = np.take_along_axis(probs, order, axis=-1)
  before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
  keep_sorted = before < top_p
  keep = np.zeros(scaled.shape, bool)
  np.put_along_axis(keep, order, keep_sorted, axis=-1)
  return keep, np.min(np.abs(before - top_p))


def np_truncated_logp(scaled, keep):
  """log-probs renormalised over the kept set (-inf elsewhere)."""
  return np_log_softmax(np.where(keep, scaled, -np.inf))


def sample_tokens(logits, key, temperature=1.0, top_k=0, top_p=1.0):
  return sample(logits, key, SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p))[:2]


def kept_set(logits, top_k=0, top_p=1.0):
  """bool [B, V]: the support of the policy (temperature 1)."""
  return np.asarray(transform_logits(jnp.asarray(logits), SamplingSpec(1.0, top_k, top_p))[1])


def random_logits(seed, batch=BATCH, vocab=VOCAB, scale=2.0):
  rng = np.random.RandomState(seed)
  return (scale * rng.normal(size=(batch, vocab))).astype(np.float32)


def check_samples(tokens, logprobs, keep, ref_logp):
  tokens = np.asarray(tokens)
  assert tokens.dtype == np.int32 and tokens.shape == (keep.shape[0],)
  assert np.asarray(logprobs).dtype == np.float32
  rows = np.arange(len(tokens))
  assert np.all(keep[rows, tokens]), 'sampled a token outside the kept set'
  np.testing.assert_allclose(logprobs, ref_logp[rows, tokens], rtol=1e-5, atol=1e-5)


def test_temperature_zero_is_argmax_with_zero_logprob():
  logits = random_logits(0)
  tokens, logprobs = sample_tokens(jnp.asarray(logits), jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(tokens, logits.argmax(-1))
  assert tokens.dtype == jnp.int32
  np.testing.assert_array_equal(logprobs, np.zeros(BATCH, np.float32))
  # Truncation is irrelevant for greedy decoding.
  tokens2, logprobs2 = sample_tokens(jnp.asarray(logits), jax.random.key(1), temperature=0.0,
                                     top_k=3, top_p=0.5)
  np.testing.assert_array_equal(tokens2, tokens)
  np.testing.assert_array_equal(logprobs2, 0.0)


@pytest.mark.parametrize('temperature', [0.5, 1.0, 1.7])
def test_logprob_is_temperature_scaled_log_softmax(temperature):
  logits = random_logits(1)
  tokens, logprobs = sample_tokens(jnp.asarray(logits), jax.random.key(2),
                                   temperature=temperature)
  scaled = logits.astype(np.float64) / temperature
  check_samples(tokens, logprobs, np.ones_like(logits, bool), np_log_softmax(scaled))
  assert len(np.unique(np.asarray(tokens))) > 1  # actually sampled, not greedy


@pytest.mark.parametrize('top_k', [1, 3, VOCAB - 1, VOCAB, VOCAB + 5])
def test_top_k(top_k):
  logits = random_logits(2)
  temperature = 0.8
  tokens, logprobs = sample_tokens(jnp.asarray(logits), jax.random.key(3),
                                   temperature=temperature, top_k=top_k)
  scaled = logits.astype(np.float64) / temperature
  keep = np_top_k_keep(scaled, min(top_k, VOCAB))
  check_samples(tokens, logprobs, keep, np_truncated_logp(scaled, keep))
  if top_k == 1:
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    np.testing.assert_array_equal(logprobs, 0.0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), top_p=st.floats(0.05, 0.99),
       temperature=st.sampled_from([0.6, 1.0, 1.5]), top_k=st.sampled_from([0, 4]))
def test_top_p_matches_numpy_nucleus(seed, top_p, temperature, top_k):
  logits = random_logits(seed, batch=16)
  scaled = logits.astype(np.float64) / temperature
  keep = np.ones(scaled.shape, bool)
  if top_k:
    keep = np_top_k_keep(scaled, top_k)
  # top-p acts on the distribution already restricted to the top-k set.
  keep_p, margin = np_top_p_keep(np.where(keep, scaled, -np.inf), top_p)
  assume(margin > 1e-4)
  keep &= keep_p
  tokens, logprobs = sample_tokens(jnp.asarray(logits), jax.random.key(seed),
                                   temperature=temperature, top_k=top_k, top_p=top_p)
  check_samples(tokens, logprobs, keep, np_truncated_logp(scaled, keep))
  # truncate_logits keeps exactly that set.
  np.testing.assert_array_equal(kept_set(scaled.astype(np.float32), top_k, top_p), keep)


def test_top_p_hand_case():
  # probs 0.5, 0.3, 0.15, 0.05 (already sorted). Mass before: 0, 0.5, 0.8, 0.95.
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keep = lambda p: kept_set(logits, top_p=p)
  np.testing.assert_array_equal(keep(0.3), [[True, False, False, False]])  # first always kept
  np.testing.assert_array_equal(keep(0.45), [[True, False, False, False]])
  np.testing.assert_array_equal(keep(0.6), [[True, True, False, False]])
  np.testing.assert_array_equal(keep(0.9), [[True, True, True, False]])
  np.testing.assert_array_equal(keep(1.0), [[True, True, True, True]])


def test_top_p_boundary_is_strict():
  """A token whose mass-before equals top_p exactly is dropped ("< top_p", not "<=")."""
  # probs 1/2, 1/4, 1/8, 1/8: powers of two, exact in float32 on CPU.
  logits = jnp.array([[1.0, 1.0 - np.log(2.0), 1.0 - np.log(4.0), 1.0 - np.log(4.0)]],
                     jnp.float32)
  probs = np.asarray(jax.nn.softmax(logits))
  if not np.array_equal(probs, [[0.5, 0.25, 0.125, 0.125]]):
    pytest.skip(f'softmax not exact on this backend: {probs}')
  keep = lambda p: kept_set(logits, top_p=p)
  np.testing.assert_array_equal(keep(0.5), [[True, False, False, False]])
  np.testing.assert_array_equal(keep(0.75), [[True, True, False, False]])
  # The two 1/8 tokens tie: at mass-before 0.75 < 0.8 the first is kept, and so is its tie.
  np.testing.assert_array_equal(keep(0.8), [[True, True, True, True]])


def test_empirical_frequencies_match_probabilities():
  logits = np.array([1.0, 0.5, -0.3, 2.0, 0.0], np.float32)
  temperature = 0.7
  n = 4000
  tokens, logprobs = sample_tokens(jnp.broadcast_to(jnp.asarray(logits), (n, 5)),
                                   jax.random.key(42), temperature=temperature)
  probs = np.exp(np_log_softmax(logits / temperature))
  freq = np.bincount(np.asarray(tokens), minlength=5) / n
  np.testing.assert_allclose(freq, probs, atol=0.03)
  np.testing.assert_allclose(np.exp(logprobs), probs[np.asarray(tokens)], rtol=1e-5)


def test_empirical_frequencies_with_truncation():
  logits = np.array([1.0, 0.5, -0.3, 2.0, 0.0], np.float32)
  n = 4000
  tokens, _ = sample_tokens(jnp.broadcast_to(jnp.asarray(logits), (n, 5)), jax.random.key(7),
                            temperature=1.0, top_k=4, top_p=0.8)
  keep = np_top_k_keep(logits[None].astype(np.float64), 4)
  keep &= np_top_p_keep(np.where(keep, logits[None], -np.inf), 0.8)[0]
  probs = np.exp(np_truncated_logp(logits[None].astype(np.float64), keep))[0]
  assert keep.sum() == 3
  freq = np.bincount(np.asarray(tokens), minlength=5) / n
  np.testing.assert_allclose(freq, probs, atol=0.03)


def test_same_key_same_samples_different_key_different_samples():
  logits = jnp.asarray(random_logits(5, scale=0.5))
  a = sample_tokens(logits, jax.random.key(0))
  b = sample_tokens(logits, jax.random.key(0))
  c = sample_tokens(logits, jax.random.key(1))
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert np.any(np.asarray(a[0]) != np.asarray(c[0]))


def test_works_under_jit_with_bf16_logits():
  logits = random_logits(6)
  bf = jnp.asarray(logits, jnp.bfloat16)
  fn = jax.jit(lambda x, key: sample_tokens(x, key, temperature=0.9, top_k=5, top_p=0.9))
  tokens, logprobs = fn(bf, jax.random.key(0))
  scaled = np.asarray(bf.astype(jnp.float32), np.float64) / 0.9
  keep = np_top_k_keep(scaled, 5)
  keep_p, margin = np_top_p_keep(np.where(keep, scaled, -np.inf), 0.9)
  assert margin > 1e-4
  keep &= keep_p
  check_samples(tokens, logprobs, keep, np_truncated_logp(scaled, keep))


@pytest.mark.parametrize('kwargs, message', [
    (dict(temperature=-0.1), 'temperature=-0.1'), (dict(temperature=float('nan')), 'temperature=nan'),
    (dict(temperature=float('inf')), 'temperature=inf'), (dict(top_p=0.0), 'top_p=0.0'),
    (dict(top_p=-0.5), 'top_p=-0.5'), (dict(top_p=1.01), 'top_p=1.01'),
    (dict(top_k=-1), 'top_k=-1'), (dict(top_k=2.5), 'top_k=2.5'), (dict(temperature='1'), "temperature='1'"),
    (dict(temperature=True), 'temperature=True'), (dict(top_k=np.bool_(True)), 'top_k=np.True_'),
    (dict(top_k=np.float32(3.0)), 'top_k=np.float32(3.0)'),
])
def test_invalid_sampling_spec_raises_naming_the_field(kwargs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    SamplingSpec(**kwargs)


@pytest.mark.parametrize('spec_kwargs', [{}, dict(top_k=5), dict(top_p=0.9)])
def test_tiny_temperatures_give_no_positive_log_probs(spec_kwargs):
  """Dividing by a small T magnified the logits' rounding: jitted, log-probs of logits
  around 20 reached +0.8 at T = 1e-6 and inf at 1e-30 (XLA rounds the two uses of
  ``logits / T`` differently). Shifted by the row max first, the largest logit's log-prob is
  exactly 0, none is positive, and the draw is the argmax once T is tiny."""
  logits = 3.0 * jax.random.normal(jax.random.key(0), (8, 64)) + 20.0  # LLM-like logits
  keys = jax.random.split(jax.random.key(1), 8)
  for temperature in (1e-2, 1e-4, 1e-6, 1e-30):
    spec = SamplingSpec(temperature, **spec_kwargs)
    logp, kept = jax.jit(lambda x, spec=spec: policy_lib.log_probs(x, spec))(logits)
    logp = np.asarray(logp)[np.asarray(kept)]
    assert not np.isnan(logp).any() and logp.max() == 0.0, (temperature, logp.max())
    tokens, token_logp, _ = jax.jit(
        lambda x, k, spec=spec: policy_lib.sample_rows(x, k, spec))(logits, keys)
    assert np.all(np.asarray(token_logp) <= 0.0)
    if temperature <= 1e-6:
      np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
  with pytest.raises(ValueError, match="below float32's smallest normal number"):
    SamplingSpec(1e-40)


def test_sampling_spec_takes_numpy_numbers():
  """Values read from numpy arrays (a config sweep, a dataset) are numbers too; the spec
  stores them as Python types, so it equals and hashes like one built from them."""
  spec = SamplingSpec(np.float64(0.7), top_k=np.int64(5), top_p=np.float32(0.5))
  assert spec == SamplingSpec(0.7, top_k=5, top_p=0.5)
  assert type(spec.temperature) is float and type(spec.top_k) is int


def test_greedy_is_refused_for_rollouts_but_valid_for_evaluation():
  with pytest.raises(ValueError, match='not valid for RL rollouts'):
    SamplingSpec(temperature=0.0).check_for_rollouts()
  assert SamplingSpec(temperature=0.7).check_for_rollouts().temperature == 0.7
  tokens, logp, support = sample(jnp.asarray(random_logits(0)), jax.random.key(0),
                                 GREEDY)
  np.testing.assert_array_equal(support, 1)
  np.testing.assert_array_equal(logp, 0.0)
  with pytest.raises(ValueError, match='temperature > 0'):
    token_log_probs(jnp.zeros((2, 4)), jnp.zeros((2,), jnp.int32), GREEDY)


@pytest.mark.parametrize('temperature, top_k, top_p', [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (0.7, 0, 0.8), (1.3, 4, 0.9)])
def test_token_log_probs_equal_the_behaviour_log_probs(temperature, top_k, top_p):
  """The trainer-side function scores a sampled token exactly as the sampler did."""
  logits = jnp.asarray(random_logits(11, batch=256))
  spec = SamplingSpec(temperature, top_k, top_p)
  tokens, behaviour, support = sample(logits, jax.random.key(3), spec)
  logp, in_support = token_log_probs(logits, tokens, spec)
  np.testing.assert_array_equal(logp, behaviour)
  assert np.all(np.asarray(in_support))
  # With the recorded support size the trainer reproduces the same distribution.
  np.testing.assert_allclose(token_log_probs(logits, tokens, spec, support)[0], behaviour,
                             atol=1e-6)
  kept = np.asarray(transform_logits(logits, spec)[1])
  np.testing.assert_array_equal(support, kept.sum(-1))
  # On the same logits the recorded size gives back exactly the set the sampler kept (with
  # top_k the trainer ranks only the top k, without it the whole vocabulary).
  np.testing.assert_array_equal(transform_logits(logits, spec, support)[1], kept)


@pytest.mark.parametrize('top_k, top_p', [(3, 1.0), (0, 0.7), (4, 0.8)])
def test_naive_renormalisation_would_bias_the_ratio_by_log_kept_mass(top_k, top_p):
  """A trainer using plain log_softmax(z / T) sees log r = log S (S = kept mass) on-policy."""
  logits = jnp.asarray(random_logits(12, batch=128))
  spec = SamplingSpec(0.9, top_k, top_p)
  tokens, behaviour, _ = sample(logits, jax.random.key(4), spec)
  naive = np.take_along_axis(np_log_softmax(np.asarray(logits, np.float64) / 0.9),
                             np.asarray(tokens)[:, None], axis=-1)[:, 0]
  kept = np.asarray(transform_logits(logits, spec)[1])
  log_kept_mass = np.log(np.sum(np.where(kept, np.exp(np_log_softmax(
      np.asarray(logits, np.float64) / 0.9)), 0.0), axis=-1))
  np.testing.assert_allclose(naive - np.asarray(behaviour), log_kept_mass, atol=1e-5)
  assert np.all(log_kept_mass < -1e-3)  # a real bias on every row
  ours, _ = token_log_probs(logits, tokens, spec)
  np.testing.assert_array_equal(np.asarray(ours) - np.asarray(behaviour), 0.0)


def test_tokens_outside_the_support_get_a_finite_continuous_score():
  """Off-policy a token can fall outside the new support: finite, below every kept token,
  equal to its logit minus the kept set's normaliser, with a finite gradient."""
  logits = jnp.asarray([[3.0, 2.0, 1.0, -1.0, -4.0]])
  spec = SamplingSpec(1.0, top_k=2)
  logp, in_support = token_log_probs(jnp.broadcast_to(logits, (5, 5)), jnp.arange(5), spec)
  np.testing.assert_array_equal(in_support, [True, True, False, False, False])
  normaliser = np.log(np.exp(3.0) + np.exp(2.0))
  np.testing.assert_allclose(logp, np.array([3.0, 2.0, 1.0, -1.0, -4.0]) - normaliser,
                             rtol=1e-6)
  grad = jax.grad(lambda z: token_log_probs(z, jnp.array([4]), spec)[0].sum())(logits)
  assert np.all(np.isfinite(np.asarray(grad)))
  # Continuity at the boundary: the 3rd token just outside top-2 scores as if it were kept
  # with the same normaliser (no jump to -inf).
  near = jnp.asarray([[3.0, 2.0, 2.0 - 1e-4]])
  lp, sup = token_log_probs(near, jnp.array([2]), spec)
  assert not bool(sup[0]) and abs(float(lp[0]) - float(token_log_probs(
      near, jnp.array([1]), spec)[0][0])) < 1e-3


def test_recorded_support_size_is_robust_to_rounding_at_the_top_p_threshold():
  """Nudging the logits by float-rounding-sized amounts can move a token across the top-p
  threshold and change the recomputed kept set; the recorded support size keeps the
  normaliser continuous."""
  # probs 0.5, 0.3, 0.15, 0.05: with top_p = 0.8 the third token sits exactly on the edge.
  base = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float64))
  spec = SamplingSpec(1.0, top_p=0.8)
  kept_sets = set()
  for eps in (-1e-6, 0.0, 1e-6):
    nudged = jnp.asarray(base + np.array([[0.0, eps, -eps, 0.0]]), jnp.float32)
    kept_sets.add(tuple(np.asarray(transform_logits(nudged, spec)[1])[0]))
  assert len(kept_sets) > 1, 'the threshold decision should flip under the nudge'
  logps = []
  for eps in (-1e-6, 0.0, 1e-6):
    nudged = jnp.asarray(base + np.array([[0.0, eps, -eps, 0.0]]), jnp.float32)
    logps.append(float(token_log_probs(nudged, jnp.array([0]), spec,
                                       jnp.array([2]))[0][0]))
  assert max(logps) - min(logps) < 1e-5, logps


def test_entropy_is_the_entropy_of_the_truncated_distribution():
  logits = jnp.asarray(random_logits(13, batch=8))
  spec = SamplingSpec(0.8, top_k=4)
  scaled = np.asarray(logits, np.float64) / 0.8
  keep = np_top_k_keep(scaled, 4)
  logp = np_truncated_logp(scaled, keep)
  safe = np.where(keep, logp, 0.0)  # -inf off the support
  expected = -np.sum(np.where(keep, np.exp(safe) * safe, 0.0), axis=-1)
  np.testing.assert_allclose(policy_lib.entropy(logits, spec), expected, rtol=1e-5)


@settings(deadline=None, max_examples=80)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 40), ties=st.booleans(),
       specials=st.sampled_from(['none', 'nan', 'inf', '-inf', 'all-inf']),
       block=st.sampled_from([2, 3, 4, 7, policy_lib.ARGMAX_BLOCK]),
       vocab_major=st.booleans())
def test_argmax_equals_jnp_argmax_with_ties_and_non_finite_values(seed, vocab, ties,
                                                                  specials, block, vocab_major):
  """policy.argmax replaces jnp.argmax on the decode path, so it must agree everywhere: the
  first of tied maxima, a NaN counting as the largest, infinities, a row of -inf; in blocks
  (small ``block``: several blocks, a padded last one) or whole (a vocabulary of at most
  two blocks); read row-wise or, ``vocab_major``, along the columns of ``x.T``."""
  rng = np.random.RandomState(seed)
  x = rng.randn(6, vocab).astype(np.float32)
  if ties:
    x = np.round(x)  # many equal entries, often several maxima per row
  where = rng.rand(6, vocab) < 0.3
  if specials == 'all-inf':
    x[2] = -np.inf
  elif specials != 'none':
    x[where] = float(specials)
  got = jax.jit(lambda x: policy_lib.argmax(x, block=block, vocab_major=vocab_major))(
      jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), -1)))
  assert got.dtype == jnp.int32


def test_argmax_in_blocks_over_a_real_vocabulary():
  """At SmolLM2's 49,152 tokens (192 blocks) and an odd 50,001 (a padded last block): tied
  maxima in different blocks, a NaN, a row of -inf, a maximum in the padded block."""
  for vocab in (49_152, 50_001):
    x = np.random.RandomState(vocab).randn(5, vocab).astype(np.float32)
    x[0, [70_00, 30_000, 49_000]] = 9.0  # ties across blocks: the first wins
    x[1, 40_000] = np.nan
    x[1, 45_000] = np.inf
    x[2] = -np.inf
    x[3, vocab - 1] = 10.0  # the last entry (in the padded block when vocab is odd)
    x[4, :4] = 50.0
    for vocab_major in (False, True):
      got = jax.jit(lambda x: policy_lib.argmax(x, vocab_major=vocab_major))(jnp.asarray(x))
      np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=-1))
      np.testing.assert_array_equal(np.asarray(got)[:4], [7_000, 40_000, 0, vocab - 1])


def test_argmax_vocab_major_takes_two_dimensional_logits():
  with pytest.raises(ValueError, match=r'vocab_major=True\) takes \[B, V\] logits, got '
                     r'shape \(2, 1, 5\)'):
    policy_lib.argmax(jnp.zeros((2, 1, 5)), vocab_major=True)


@pytest.mark.parametrize('spec', [SamplingSpec(temperature=1.0),
                                  SamplingSpec(temperature=0.7, top_k=40)])
def test_rows_drawn_over_argmax_blocks_equal_each_rows_own_draw(spec):
  """sample_rows over a vocabulary of several argmax blocks (the last one padded): each
  row's token, log-prob and support equal ``sample`` of that row alone with its key, which
  is jax.random.categorical's draw."""
  rows = 19
  logits = jax.random.normal(jax.random.key(11), (rows, 1000)) * 3
  keys = jax.random.split(jax.random.key(12), rows)
  tokens, logp, support = jax.jit(
      lambda x, k: policy_lib.sample_rows(x, k, spec))(logits, keys)
  batch_logp = np.asarray(jax.jit(lambda x: policy_lib.log_probs(x, spec)[0])(logits))
  for b in range(rows):
    alone = sample(logits[b:b + 1], keys[b], spec)
    np.testing.assert_array_equal([int(tokens[b]), int(support[b])],
                                  [int(alone[0][0]), int(alone[2][0])])
    # The log-prob is the batch transform's (a row alone may round its normaliser
    # differently with default numerics, ~1e-7).
    np.testing.assert_array_equal(float(logp[b]), batch_logp[b, int(tokens[b])])
    np.testing.assert_allclose(float(logp[b]), float(alone[1][0]), atol=1e-6)
  assert len(set(np.asarray(tokens).tolist())) > rows // 2, tokens  # real draws, not a constant


@pytest.mark.parametrize('spec', [SamplingSpec(temperature=1.0),
                                  SamplingSpec(temperature=0.7, top_k=5, top_p=0.9)])
def test_sampled_tokens_equal_jax_random_categorical(spec):
  """sample draws by Gumbel-max with policy.argmax: the same tokens as
  jax.random.categorical on the truncated log-probs, for the same key."""
  logits = jax.random.normal(jax.random.key(3), (BATCH, 300)) * 3
  for seed in range(5):
    key = jax.random.key(seed)
    tokens, _, _ = sample(logits, key, spec)
    logp, kept = policy_lib.log_probs(logits, spec)
    expected = jax.random.categorical(key, jnp.where(kept, logp, -jnp.inf), axis=-1)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))


def mixed_spread_logits(seed, batch=16, vocab=VOCAB):
  """Rows from nearly flat to peaked: under small ``SORTED_PREFIXES`` some rows' top-p cut
  is decided by the shortest prefix and others need the search over the whole row."""
  return random_logits(seed, batch, vocab) * np.linspace(0.1, 5.0, batch, dtype=np.float32)[
      :, None]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), top_p=st.floats(0.05, 0.99),
       top_k=st.sampled_from([0, 2, 4]),
       prefixes=st.sampled_from([(), (1,), (2, 5), (1, 3, 6), (3, 20)]))
def test_sorted_prefixes_keep_the_numpy_nucleus(seed, top_p, top_k, prefixes):
  """Whichever prefix lengths of the sorted logits are tried before the search, the kept
  set is the nucleus (top-k first), and the recorded support size gives it back."""
  logits = mixed_spread_logits(seed)
  keep = np_top_k_keep(logits, top_k) if top_k else np.ones(logits.shape, bool)
  keep_p, margin = np_top_p_keep(np.where(keep, logits, -np.inf), top_p)
  assume(margin > 1e-4)
  spec = SamplingSpec(1.0, top_k, top_p)
  with mock.patch.object(policy_lib, 'SORTED_PREFIXES', prefixes):
    kept = np.asarray(transform_logits(jnp.asarray(logits), spec)[1])
    np.testing.assert_array_equal(kept, keep & keep_p)
    again = transform_logits(jnp.asarray(logits), spec, jnp.asarray(kept.sum(-1)))[1]
    np.testing.assert_array_equal(np.asarray(again), kept)


@pytest.mark.parametrize('spec', [SamplingSpec(1.0, top_p=0.9), SamplingSpec(1.0, 4, 0.8),
                                  SamplingSpec(0.8, top_k=3)])
def test_a_rows_draw_does_not_depend_on_the_batch(monkeypatch, spec):
  """sample_rows decides the top-p cut on the whole batch (one search for all rows when one
  row needs it); each row's kept set, log-prob and token still equal its own draw alone."""
  monkeypatch.setattr(policy_lib, 'SORTED_PREFIXES', (2, 5))
  logits = jnp.asarray(mixed_spread_logits(5, batch=12))
  keys = jax.random.split(jax.random.key(7), 12)
  tokens, logp, support = policy_lib.sample_rows(logits, keys, spec)
  kept = np.asarray(transform_logits(logits, spec)[1])
  for b in range(12):
    alone = sample(logits[b:b + 1], keys[b], spec)
    np.testing.assert_array_equal([int(tokens[b]), int(support[b])],
                                  [int(alone[0][0]), int(alone[2][0])])
    np.testing.assert_array_equal(float(logp[b]), float(alone[1][0]))
    np.testing.assert_array_equal(kept[b], np.asarray(transform_logits(logits[b:b + 1],
                                                                       spec)[1])[0])
  if spec.top_p < 1 and not spec.top_k:  # the batch has rows decided by each prefix length
    assert int(support.min()) <= 2 and int(support.max()) > 5, support


def test_the_search_runs_only_when_the_prefixes_leave_a_row_undecided():
  """_in_sorted_prefixes evaluates prefixes in order and stops at the first that decides
  every row (lax.cond: the longer prefixes and the search are not run); after the last
  prefix only the rows it left undecided take the search's threshold."""
  def run(undecided_at):
    calls = []

    def solve(n):
      jax.debug.callback(lambda: calls.append(n))
      decided = jnp.full((3,), n > undecided_at).at[0].set(True)
      return jnp.full((3, 1), n, jnp.int32), decided

    def search():
      jax.debug.callback(lambda: calls.append('search'))
      return jnp.full((3, 1), -1, jnp.int32)

    result = jax.jit(lambda: policy_lib._in_sorted_prefixes(solve, [2, 5], search))()
    jax.effects_barrier()
    return np.asarray(result)[:, 0].tolist(), calls

  assert run(undecided_at=0) == ([2, 2, 2], [2])
  assert run(undecided_at=2) == ([5, 5, 5], [2, 5])
  assert run(undecided_at=7) == ([5, -1, -1], [2, 5, 'search'])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.sampled_from([1, 2, 7, 64]),
       ties=st.booleans(), specials=st.booleans())
def test_bisect_finds_the_kth_largest_like_a_sort(seed, vocab, ties, specials):
  """With a count as the predicate, _bisect returns each row's k-th largest entry: negative
  and positive values, ties, signed zeros and infinities included."""
  rng = np.random.RandomState(seed)
  x = (rng.normal(size=(6, vocab)) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
  if ties:
    x = np.round(x)
  if specials:
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=min(4, flat.size), replace=False)
    flat[picks] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf], np.float32), len(picks))
  k = rng.randint(1, vocab + 1, size=6)
  got = policy_lib._bisect(jnp.asarray(x), lambda kept: kept.sum(-1) >= jnp.asarray(k))
  kth = -np.sort(-x, axis=-1)[np.arange(6), k - 1]
  np.testing.assert_array_equal(np.asarray(got)[:, 0] == kth, True)
  # A predicate that only the whole row meets gives the smallest entry.
  whole = policy_lib._bisect(jnp.asarray(x), lambda kept: kept.all(-1))
  np.testing.assert_array_equal(np.asarray(whole)[:, 0] == x.min(-1), True)


def test_bisect_tells_adjacent_floats_apart():
  one, above = np.float32(1.0), np.nextafter(np.float32(1.0), np.float32(2.0))
  x = jnp.asarray([[one, above], [-above, -one]])
  got = policy_lib._bisect(x, lambda kept: kept.sum(-1) >= 1)
  np.testing.assert_array_equal(np.asarray(got)[:, 0], np.asarray(x).max(-1))


def test_order_keys_order_like_the_floats():
  values = np.array([-np.inf, -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 1.0, 2.5, 3e38, np.inf],
                    np.float32)
  keys = np.asarray(policy_lib._order_keys(jnp.asarray(values)))
  assert np.all(np.diff(keys.astype(np.int64)) > 0), keys


def test_the_nucleus_ends_at_the_first_position_that_reaches_top_p():
  """A running mass that dips by an ulp after reaching top_p (float rounding) does not keep
  the positions after the dip."""
  dip = np.nextafter(np.float32(0.8), np.float32(0))
  before = jnp.asarray([[0.0, 0.5, 0.8, dip, 0.9], [0.0, 0.3, 0.6, 0.7, 0.75]], jnp.float32)
  np.testing.assert_array_equal(policy_lib._nucleus(before, 0.8),
                                [[True, True, False, False, False], [True] * 5])


def test_rows_not_active_never_make_the_batch_sort_a_longer_prefix(monkeypatch):
  """An engine's free slots (``active=False``) do not send the top-p cut past the shortest
  prefix (to a longer one or to the search); the active rows still draw as they would
  alone."""
  monkeypatch.setattr(policy_lib, 'SORTED_PREFIXES', (3, 6))
  largest = policy_lib._largest
  sorted_lengths = []

  def recorded(x, n):
    jax.debug.callback(lambda: sorted_lengths.append(n))
    return largest(x, n)

  monkeypatch.setattr(policy_lib, '_largest', recorded)
  bisect = policy_lib._bisect

  def recorded_bisect(x, holds):
    jax.debug.callback(lambda: sorted_lengths.append('search'))
    return bisect(x, holds)

  monkeypatch.setattr(policy_lib, '_bisect', recorded_bisect)
  spec = SamplingSpec(1.0, top_p=0.9)
  logits = jnp.asarray(mixed_spread_logits(5, batch=12))
  keys = jax.random.split(jax.random.key(7), 12)
  alone = [sample(logits[b:b + 1], keys[b], spec) for b in range(12)]
  active = np.array([int(a[2][0]) < 3 for a in alone])  # decided by the 3 largest
  assert 0 < active.sum() < 12
  draw = jax.jit(lambda active: policy_lib.sample_rows(logits, keys, spec, active=active))
  sorted_lengths.clear()
  tokens, logp, support = draw(jnp.asarray(active))
  jax.effects_barrier()
  assert sorted_lengths == [3]
  for b in np.flatnonzero(active):
    assert (int(tokens[b]), float(logp[b]), int(support[b])) == tuple(
        float(x[0]) if i == 1 else int(x[0]) for i, x in enumerate(alone[b]))
  sorted_lengths.clear()
  draw(jnp.ones(12, bool))
  jax.effects_barrier()
  assert sorted_lengths == [3, 6, 'search']
