"""Tests for rlax_llm.rollout.sampler (KV-cached generation with behaviour log-probs)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models.decoder import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.policy import GREEDY, Policy, SamplingSpec
from rlax_llm.rollout.sampler import generate

CONFIG = DecoderConfig(vocab_size=12, num_layers=1, embed_dim=16, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_dim=32, max_seq_len=32)
PROMPT_LENGTHS = np.array([3, 5, 2, 4], np.int32)
PROMPT_WIDTH = 5
N = 6
EOS, PAD = 11, 0
T1 = SamplingSpec(temperature=1.0)


def sample(model, spec, params, prompts, lengths, key, version, eos=EOS, pad=PAD):
  return generate(Policy(model, spec), params, jnp.asarray(prompts), jnp.asarray(lengths), key,
                  version, max_new_tokens=N, eos_id=eos, pad_id=pad)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


@pytest.fixture(scope='module')
def prompts():
  rng = np.random.RandomState(0)
  tokens = rng.randint(1, EOS, (len(PROMPT_LENGTHS), PROMPT_WIDTH)).astype(np.int32)
  for b, length in enumerate(PROMPT_LENGTHS):
    tokens[b, length:] = PAD
  return tokens


@pytest.fixture(scope='module')
def sampler_t1(model_and_params):
  return lambda params, *args: sample(model_and_params[0], T1, params, *args)


@pytest.fixture(scope='module')
def full_logits(model_and_params):
  model, params = model_and_params
  return jax.jit(model.apply)


def full_sequences(prompts, tokens):
  """Each row's prompt (without padding) followed by its completion, right-padded with PAD."""
  tokens = np.asarray(tokens)
  seqs = np.full((len(prompts), PROMPT_WIDTH + N), PAD, np.int32)
  for b, length in enumerate(PROMPT_LENGTHS):
    seqs[b, :length] = prompts[b, :length]
    seqs[b, length:length + N] = tokens[b]
  return seqs


def completion_logits(full_logits, params, prompts, tokens):
  """Full (uncached) forward logits predicting each completion token: float [B, N, V]."""
  seqs = full_sequences(prompts, tokens)
  logits = np.asarray(full_logits(params, jnp.asarray(seqs)))
  return np.stack([logits[b, length - 1:length - 1 + N]
                   for b, length in enumerate(PROMPT_LENGTHS)])


def check_invariants(samples, version, eos=EOS, pad=PAD):
  tokens = np.asarray(samples.tokens)
  mask = np.asarray(samples.mask)
  assert tokens.shape == mask.shape == (len(PROMPT_LENGTHS), N)
  assert tokens.dtype == np.int32 and mask.dtype == bool
  np.testing.assert_array_equal(samples.versions, np.where(mask, version, -1))
  np.testing.assert_array_equal(samples.lengths, mask.sum(1))
  np.testing.assert_array_equal(np.asarray(samples.logprobs)[~mask], 0.0)
  for b in range(tokens.shape[0]):
    eos_at = np.flatnonzero(tokens[b] == eos)
    eos_at = eos_at[mask[b, eos_at]]  # eos tokens that were actually generated
    if len(eos_at):
      first = eos_at[0]
      assert samples.finished[b]
      assert mask[b, :first + 1].all() and not mask[b, first + 1:].any()
      assert (tokens[b, first + 1:] == pad).all()
      assert samples.lengths[b] == first + 1
    else:
      assert not samples.finished[b]
      assert mask[b].all() and samples.lengths[b] == N


def test_behaviour_logprobs_are_exact_at_temperature_one(model_and_params, prompts,
                                                          sampler_t1, full_logits):
  model, params = model_and_params
  samples = sampler_t1(params, prompts, PROMPT_LENGTHS, jax.random.key(0), 7)
  # Recompute with the full forward pass through the policy, as the trainer does.
  seqs = full_sequences(prompts, samples.tokens)
  recomputed = np.asarray(Policy(model, T1).sequence_log_probs(params, jnp.asarray(seqs)).logp)
  expected = np.stack([recomputed[b, length - 1:length - 1 + N]
                       for b, length in enumerate(PROMPT_LENGTHS)])
  mask = np.asarray(samples.mask)
  assert mask.sum() >= 8
  np.testing.assert_allclose(np.asarray(samples.logprobs)[mask], expected[mask], atol=1e-5)
  check_invariants(samples, 7)


def test_behaviour_logprobs_are_exact_with_truncation(model_and_params, prompts, full_logits):
  """temperature 0.7, top-k 5, top-p 0.9: log-probs of the renormalised truncated softmax."""
  model, params = model_and_params
  spec = SamplingSpec(temperature=0.7, top_k=5, top_p=0.9)
  samples = sample(model, spec, params, prompts, PROMPT_LENGTHS, jax.random.key(3), 2)
  scaled = completion_logits(full_logits, params, prompts, samples.tokens) / 0.7
  scaled = scaled.astype(np.float64)
  kth = np.sort(scaled, axis=-1)[..., -5:-4]
  keep = scaled >= kth
  z = np.where(keep, scaled, -np.inf)
  probs = np.exp(z - z.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  order = np.argsort(-probs, axis=-1)
  sorted_probs = np.take_along_axis(probs, order, axis=-1)
  before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
  keep_p = np.zeros_like(keep)
  np.put_along_axis(keep_p, order, before < 0.9, axis=-1)
  keep &= keep_p
  z = np.where(keep, scaled, -np.inf)
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  tokens = np.asarray(samples.tokens)
  mask = np.asarray(samples.mask)
  picked_keep = np.take_along_axis(keep, tokens[..., None], axis=-1)[..., 0]
  picked_logp = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
  assert picked_keep[mask].all()
  np.testing.assert_allclose(np.asarray(samples.logprobs)[mask], picked_logp[mask], atol=1e-5)
  check_invariants(samples, 2)


def test_rng_determinism(model_and_params, prompts, sampler_t1):
  _, params = model_and_params
  a = sampler_t1(params, prompts, PROMPT_LENGTHS, jax.random.key(1), 0)
  b = sampler_t1(params, prompts, PROMPT_LENGTHS, jax.random.key(1), 0)
  c = sampler_t1(params, prompts, PROMPT_LENGTHS, jax.random.key(2), 0)
  for field in ('tokens', 'logprobs', 'mask', 'versions', 'lengths', 'finished'):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  # 4 rows x first token alone: with ~12 comparable tokens the chance of equality is ~1e-4.
  assert np.any(np.asarray(a.tokens) != np.asarray(c.tokens))


def test_padding_content_does_not_matter(model_and_params, prompts, sampler_t1):
  _, params = model_and_params
  junk = prompts.copy()
  for b, length in enumerate(PROMPT_LENGTHS):
    junk[b, length:] = (np.arange(PROMPT_WIDTH - length) + 3) % EOS
  a = sampler_t1(params, prompts, PROMPT_LENGTHS, jax.random.key(4), 0)
  b = sampler_t1(params, junk, PROMPT_LENGTHS, jax.random.key(4), 0)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_invariants_across_seeds(model_and_params, prompts, sampler_t1):
  """versions / lengths / eos handling; both finished and unfinished rows occur."""
  _, params = model_and_params
  finished = []
  for seed in range(6):
    samples = sampler_t1(params, prompts, PROMPT_LENGTHS, jax.random.key(seed),
                         jnp.asarray(seed + 10, jnp.int32))
    check_invariants(samples, seed + 10)
    finished.extend(np.asarray(samples.finished).tolist())
  assert any(finished) and not all(finished)


def test_greedy_matches_uncached_argmax_and_stops_at_eos(model_and_params, prompts,
                                                         full_logits):
  model, params = model_and_params
  # Force an eos: take row 0's first greedy token (from the uncached forward pass) as eos id.
  first_logits = np.asarray(full_logits(params, jnp.asarray(prompts)))
  eos = int(first_logits[0, PROMPT_LENGTHS[0] - 1].argmax())
  pad = (eos + 1) % CONFIG.vocab_size
  samples = sample(model, GREEDY, params, prompts, PROMPT_LENGTHS, jax.random.key(0), 3,
                   eos=eos, pad=pad)
  np.testing.assert_array_equal(samples.logprobs, 0.0)
  assert bool(samples.finished[0]) and int(samples.lengths[0]) == 1
  np.testing.assert_array_equal(samples.tokens[0], [eos] + [pad] * (N - 1))
  np.testing.assert_array_equal(samples.mask[0], [True] + [False] * (N - 1))
  np.testing.assert_array_equal(samples.versions[0], [3] + [-1] * (N - 1))
  check_invariants(samples, 3, eos=eos, pad=pad)
  # Independent reference: naive decoding, one full forward pass per new token.
  tokens = np.asarray(samples.tokens)
  mask = np.asarray(samples.mask)
  assert mask[1:].sum() >= 6
  seqs = full_sequences(prompts, np.full((len(PROMPT_LENGTHS), N), pad))
  for step in range(N):
    logits = np.asarray(full_logits(params, jnp.asarray(seqs)))
    for b, length in enumerate(PROMPT_LENGTHS):
      if mask[b, step]:
        assert tokens[b, step] == logits[b, length - 1 + step].argmax(), (b, step)
        seqs[b, length + step] = tokens[b, step]
