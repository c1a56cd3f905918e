"""The JetStream-API engine and the continuous-batching driver (tiny random model).

Greedy output equals naive decoding; behaviour log-probs equal the trainer's recompute;
samples do not depend on slots or batching; weights swap between steps without
recompiling, with every token tagged with the version that produced it; a randomized
submit/finish/swap workload answers every sample once and leaks no slot.
"""

import dataclasses
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.numerics import INVARIANT_KEYS
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.rollout.driver import Driver, Job, Sample, VersionedParams
from rlax_llm.rollout.engine import Engine, Insert, default_buckets
from rlax_llm.sharding import make_mesh

from parity import trainer_logprobs  # tests/parity.py

CONFIG = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=64)
PAD, EOS = 0, 1
MESH = make_mesh({'data': 1}, jax.devices()[:1])
PROMPTS = [(5, 9, 13), (7, 3, 22, 30, 31, 2), (11,), (40, 41, 42, 43, 44, 45, 46, 47, 10, 12)]


@pytest.fixture(scope='module')
def models():
  model, params = create_model(CONFIG, seed=0)
  _, other = create_model(CONFIG, seed=1)
  return model, params, other


def keys_for(seed, n):
  return np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), i)))
                   for i in range(n)])


def jobs_for(spec, n=3, max_new=10, stops=(EOS,), prompts=PROMPTS):
  return [Job(prompt_ids=p, num_samples=n, sampling=spec, max_new_tokens=max_new,
              stop_ids=stops, keys=keys_for(i, n)) for i, p in enumerate(prompts)]


# KV-cache layouts: one block, and several (cache of 28 positions: blocks of 8 and of 10).
CACHES = {'one block': {}, 'blocks of 8': dict(block_align=4),
          'blocks of 10': dict(attend_buckets=3, block_align=1)}


def make_driver(model, params, slots=4, version=0, engine_kwargs=None, **kwargs):
  engine = Engine(model, MESH, slots=slots, max_prefill_length=16, max_decode_length=12,
                  pad_id=PAD, **(engine_kwargs or {}))
  holder = VersionedParams()
  holder.set(version, engine.place_params(params))
  return Driver(engine, holder, **kwargs)


def test_default_buckets():
  assert default_buckets(64) == (8, 16, 24, 32, 40, 48, 56, 64)
  assert default_buckets(100) == (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
  assert default_buckets(8) == (8,) and default_buckets(5) == (5,)
  for longest in (33, 77, 300, 1000):  # padding past 32 tokens is at most a quarter
    bucket = next(b for b in default_buckets(2048) if b >= longest)
    assert bucket <= 1.25 * longest
  engine = Engine(create_model(CONFIG)[0], MESH, slots=2, max_prefill_length=16,
                  max_decode_length=4, pad_id=PAD, prefill_buckets=(4, 16))
  assert engine.bucket(3) == 4 and engine.bucket(5) == 16
  with pytest.raises(ValueError, match='longer than max_prefill_length=16'):
    engine.bucket(17)


def test_cache_blocks_and_attend_buckets():
  """The cache is kept in at most attend_buckets blocks of a multiple of block_align
  positions; the attend buckets are the block boundaries and cover the cache."""
  model = create_model(CONFIG)[0]
  make = lambda **kw: Engine(model, MESH, slots=2, max_prefill_length=16, max_decode_length=12,
                             pad_id=PAD, **kw)
  assert make().attend_buckets == (32,)  # 28 positions: one block of 32
  engine = make(block_align=4)
  assert engine.block_length == 8 and engine.attend_buckets == (8, 16, 24, 32)
  state = engine.init_decode_state()  # CPU: layers unrolled, each with its own blocks
  layers = CONFIG.num_layers
  assert engine.layer_loop == 'unrolled' and len(state.cache.k) == layers
  assert all(len(blocks) == 4 for blocks in state.cache.k)
  assert state.cache.k[1][0].shape == (2, CONFIG.num_kv_heads, CONFIG.head_dim, 8)
  assert state.cache.v[1][0].shape == (2, CONFIG.num_kv_heads, 8, CONFIG.head_dim)
  state = make(block_align=4, layer_loop='scan').init_decode_state()
  assert len(state.cache.k) == 4  # blocks, each stacked over the layers
  assert state.cache.k[0].shape == (layers, 2, CONFIG.num_kv_heads, CONFIG.head_dim, 8)
  assert state.cache.v[0].shape == (layers, 2, CONFIG.num_kv_heads, 8, CONFIG.head_dim)
  assert make(attend_buckets=3, block_align=1).attend_buckets == (10, 20, 30)
  assert make(attend_buckets=1, block_align=1).attend_buckets == (28,)
  with pytest.raises(ValueError, match='block_align'):
    make(block_align=0)


@pytest.mark.parametrize('cache', CACHES)
def test_greedy_equals_naive_decoding(models, cache):
  """Independent reference: one full forward pass per new token, argmax."""
  model, params, _ = models
  results = make_driver(model, params, engine_kwargs=CACHES[cache]).run(
      jobs_for(GREEDY, n=1, stops=()))
  forward = jax.jit(model.apply)
  for prompt, (sample,) in zip(PROMPTS, results):
    seq = list(prompt)
    for step in range(10):
      padded = np.full((1, 32), PAD, np.int32)  # causal: right padding changes nothing before
      padded[0, :len(seq)] = seq
      logits = np.asarray(forward(params, jnp.asarray(padded)))[0, len(seq) - 1]
      assert sample.tokens[step] == int(logits.argmax()), (prompt, step)
      seq.append(sample.tokens[step])
    assert sample.finish_reason == 'length' and sample.logprobs == [0.0] * 10


@pytest.mark.parametrize('cache', CACHES)
@pytest.mark.parametrize('spec', [SamplingSpec(1.0), SamplingSpec(0.7, top_k=5, top_p=0.9),
                                  SamplingSpec(1.0, top_p=0.8)])
def test_behaviour_logprobs_equal_the_trainer_recompute(models, spec, cache):
  """The trainer's recompute with the recorded support sizes gives the behaviour log-probs;
  top-p without top-k is cut by the sampler's mass bisection and by the trainer's count."""
  model, params, _ = models
  results = make_driver(model, params, engine_kwargs=CACHES[cache]).run(
      jobs_for(spec, n=4, stops=()))
  score = jax.jit(Policy(model, spec).sequence_log_probs)
  pairs = [(prompt, sample) for prompt, samples in zip(PROMPTS, results) for sample in samples]
  if spec.top_p < 1 and not spec.top_k:  # the cut kept neither one token nor every one
    supports = [n for _, sample in pairs for n in sample.supports]
    assert 1 < max(supports) < model.config.vocab_size, supports
  for (_, sample), trainer in zip(pairs, trainer_logprobs(score, params, pairs, 32)):
    np.testing.assert_allclose(trainer, sample.logprobs, atol=1e-5, rtol=0)


def test_engine_keeps_params_in_its_weight_layout(models):
  """On XLA:CPU the engine keeps its params ``'out_in'`` (faster decode-step products)
  unless the model is batch-invariant; ``place_params`` converts the trainer's ``'in_out'``
  params, and the samples match an engine kept ``'in_out'``."""
  model, params, _ = models
  cpu = jax.default_backend() == 'cpu'
  default = make_driver(model, params)
  plain = make_driver(model, params, engine_kwargs=dict(weight_layout='in_out',
                                                        layer_loop='scan'))
  assert default.engine.model.config.execution.weight_layout == ('out_in' if cpu else 'in_out')
  assert plain.engine.model is model
  blocks = default.holder.get()[1]['blocks']
  wq = blocks[1]['attn']['wq'] if cpu else blocks['attn']['wq']  # CPU: per-layer buffers
  assert wq.shape == ((4, 8, 32) if cpu else (CONFIG.num_layers, 32, 4, 8))
  jobs = jobs_for(SamplingSpec(1.0), n=2, stops=())
  for ours, theirs in zip(default.run(jobs), plain.run(jobs)):
    for a, b in zip(ours, theirs):
      assert a.tokens == b.tokens
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
  invariant = create_model(CONFIG.with_execution(batch_invariant=True))[0]
  engine = Engine(invariant, MESH, slots=2, max_prefill_length=16, max_decode_length=4,
                  pad_id=PAD, layer_loop='scan')
  assert engine.model is invariant


@pytest.mark.parametrize('attend_buckets,rows', [
    (1, 'chunks'), pytest.param(4, 'chunks', marks=pytest.mark.default_emitters), (4, 'floor')],
                         ids=['whole cache', 'attend buckets', 'attend buckets, floor'])
def test_batch_invariant_logprobs_equal_the_trainer_bitwise(attend_buckets, rows):
  """A ``batch_invariant`` model: behaviour log-probs are the trainer's recompute bit for
  bit, with requests queueing for slots and sequences crossing cache blocks (two blocks of
  ``INVARIANT_KEYS``; steps attend to the whole cache or to buckets of 32 positions), with
  either ``invariant_rows``."""
  config = dataclasses.replace(CONFIG, max_seq_len=160)
  model, params = create_model(config.with_execution(batch_invariant=True, invariant_rows=rows),
                               seed=0)
  engine = Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=112,
                  pad_id=PAD, attend_buckets=attend_buckets)
  assert engine.num_blocks == 2 and engine.block_length == INVARIANT_KEYS
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  spec = SamplingSpec(0.7, top_k=5, top_p=0.9)
  results = Driver(engine, holder).run(jobs_for(spec, n=3, max_new=70, stops=()))
  score = jax.jit(Policy(model, spec).sequence_log_probs)
  pairs = [(prompt, sample) for prompt, samples in zip(PROMPTS, results) for sample in samples]
  for (prompt, sample), trainer in zip(pairs, trainer_logprobs(score, params, pairs, 128)):
    assert len(prompt) + len(sample.tokens) > INVARIANT_KEYS  # into the second block
    np.testing.assert_array_equal(trainer, np.asarray(sample.logprobs, np.float32))


def test_samples_do_not_depend_on_slots_or_batching(models):
  """A sample's tokens depend on its own key only: 1 slot, 3 slots and 16 slots agree."""
  model, params, _ = models
  spec = SamplingSpec(1.0)
  outs = [make_driver(model, params, slots=slots).run(jobs_for(spec, n=3))
          for slots in (1, 3, 16)]
  for other in outs[1:]:
    for a_job, b_job in zip(outs[0], other):
      for a, b in zip(a_job, b_job):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_same_keys_same_samples_other_keys_other_samples(models):
  model, params, _ = models
  driver = make_driver(model, params)
  a = driver.run(jobs_for(SamplingSpec(1.0)))
  b = driver.run(jobs_for(SamplingSpec(1.0)))
  assert [[s.tokens for s in job] for job in a] == [[s.tokens for s in job] for job in b]
  other = [Job(j.prompt_ids, j.num_samples, j.sampling, j.max_new_tokens, j.stop_ids,
               keys_for(100 + i, j.num_samples)) for i, j in enumerate(jobs_for(
                   SamplingSpec(1.0)))]
  c = driver.run(other)
  assert [[s.tokens for s in job] for job in a] != [[s.tokens for s in job] for job in c]


def test_prefill_bucket_and_its_padding_do_not_matter(models):
  """The same prompt prefilled into a 4-token or a 16-token bucket (padding junk past its
  true length, and other prompts in the batch) gives the same samples."""
  model, params, _ = models
  spec = SamplingSpec(1.0)
  job = Job((5, 9, 13), 2, spec, 8, (), keys_for(7, 2))
  small = Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=12,
                 pad_id=PAD, prefill_buckets=(4, 16))
  outs = []
  for engine, others in ((small, []), (small, [Job(tuple(range(2, 14)), 1, spec, 8, (),
                                                    keys_for(8, 1))])):
    holder = VersionedParams()
    holder.set(0, engine.place_params(params))
    outs.append(Driver(engine, holder).run([job] + others)[0])
  big = make_driver(model, params)  # default buckets (16): another padded width
  outs.append(big.run([job])[0])
  for other in outs[1:]:
    assert [s.tokens for s in other] == [s.tokens for s in outs[0]]
    np.testing.assert_allclose([s.logprobs for s in other], [s.logprobs for s in outs[0]],
                               atol=1e-5)


def test_stop_tokens_end_a_sample_and_are_kept(models):
  model, params, _ = models
  greedy = make_driver(model, params).run(jobs_for(GREEDY, n=1, stops=()))
  stop = greedy[0][0].tokens[3]  # the 4th greedy token of the first prompt
  out = make_driver(model, params).run(jobs_for(GREEDY, n=1, stops=(EOS, stop)))
  first = out[0][0]
  cut = first.tokens.index(stop)
  assert cut <= 3 and first.finish_reason == 'stop' and first.tokens == greedy[0][0].tokens[
      :cut + 1]


def test_a_cancelled_job_ends_at_once_and_frees_its_slots(models):
  """Job 0 is cancelled before decode step 2: its samples end 'cancelled' with the tokens
  drawn so far; its slots and its pending samples go to the other jobs, whose samples are
  those of a run without the cancellation."""
  model, params, _ = models
  spec = SamplingSpec(1.0)
  jobs = jobs_for(spec, n=3, stops=())
  full = make_driver(model, params).run(jobs)
  driver = make_driver(model, params)
  steps = []
  driver.before_step = steps.append
  out = driver.run(jobs, cancelled=lambda j: j == 0 and len(steps) > 2)
  assert [s.finish_reason for s in out[0]] == ['cancelled'] * 3
  for cut, whole in zip(out[0], full[0]):
    assert len(cut.tokens) < len(whole.tokens) and cut.tokens == whole.tokens[:len(cut.tokens)]
  assert driver.stats['cancelled_samples'] == 3
  for a_job, b_job in zip(out[1:], full[1:]):
    for a, b in zip(a_job, b_job):
      assert a.tokens == b.tokens and a.finish_reason == b.finish_reason == 'length'


@pytest.mark.parametrize('on_swap', ['continue', 'discard'])
def test_weights_swap_between_steps_without_recompiling(models, on_swap):
  """Version 1 (other weights) arrives before decode step 3: every token records the
  version that produced it, no step mixes versions, nothing is recompiled."""
  model, params, other = models
  spec = SamplingSpec(1.0)
  jobs = jobs_for(spec, n=2, max_new=10, stops=())
  driver = make_driver(model, params, slots=8, on_swap=on_swap)
  driver.run(jobs)  # compile everything once
  compiled = driver.engine.compilations()
  new_params = driver.engine.place_params(other)
  start = driver.steps

  def swap(step):
    if step == start + 3:
      driver.holder.set(1, new_params)
  driver.before_step = swap
  results = driver.run(jobs)
  assert driver.engine.compilations() == compiled, 'a weight swap recompiled'
  assert driver.stats['swaps'] == 1
  reference_v0 = make_driver(model, params, slots=8).run(jobs)
  reference_v1 = make_driver(model, other, slots=8).run(jobs)
  for job, ref0, ref1 in zip(results, reference_v0, reference_v1):
    for sample, r0, r1 in zip(job, ref0, ref1):
      assert len(sample.tokens) == 10
      if on_swap == 'continue':
        # The first token (insert) and 3 decode steps used version 0, the rest version 1.
        assert sample.versions == [0] * 4 + [1] * 6 and sample.restarts == 0
        assert sample.tokens[:4] == r0.tokens[:4]
        np.testing.assert_allclose(sample.logprobs[:4], r0.logprobs[:4], atol=1e-6)
        # The steps after the swap really ran version 1: version 0 would give r0's draws.
        assert not np.allclose(sample.logprobs[4:], r0.logprobs[4:], atol=1e-3)
      else:
        # Discarded at the swap and regenerated from scratch with version 1.
        assert sample.versions == [1] * 10 and sample.restarts == 1
        assert sample.tokens == r1.tokens
        np.testing.assert_allclose(sample.logprobs, r1.logprobs, atol=1e-6)
  assert driver.stats.get('discarded_samples', 0) == (8 if on_swap == 'discard' else 0)


def _staggered_jobs(spec):
  """One sample per prompt, of 3, 9, 5 and 7 tokens: through 2 slots they finish apart."""
  return [Job(prompt_ids=p, num_samples=1, sampling=spec, max_new_tokens=n, stop_ids=(),
              keys=keys_for(i, 1)) for i, (p, n) in enumerate(zip(PROMPTS, (3, 9, 5, 7)))]


def test_prefill_ahead_takes_fewer_calls_and_changes_no_sample(models):
  """2 slots, 4 jobs: when the first slot frees, its prefill call also takes the last
  pending prompt (prefill_batch = slots by default), which the next freed slot then uses
  (two calls); prefill_batch=1 prefills only what the free slots need (three calls). The
  samples are the same either way."""
  model, params, _ = models
  spec = SamplingSpec(1.0)
  ahead = make_driver(model, params, slots=2)
  exact = make_driver(model, params, slots=2, prefill_batch=1)
  got, want = ahead.run(_staggered_jobs(spec)), exact.run(_staggered_jobs(spec))
  assert ahead.prefill_batch == 2 and ahead.stats['prefill_calls'] == 2
  assert exact.stats['prefill_calls'] == 3 and exact.stats['prefills'] == 4
  for (a,), (b,), n in zip(got, want, (3, 9, 5, 7)):
    assert a.tokens == b.tokens and len(a.tokens) == n
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match=r'prefill_batch=3 must be in \[1, slots=2\]'):
    make_driver(model, params, slots=2, prefill_batch=3)


def test_prefixes_computed_ahead_are_dropped_at_a_swap(models):
  """Job 3's prompt is prefilled ahead with version 0 (with job 2's, when job 0 ends) but
  its slot frees only after version 1 arrives: it is prefilled again, and every token of it
  is version 1 and equals version 1's own run."""
  model, params, other = models
  spec = SamplingSpec(1.0)
  driver = make_driver(model, params, slots=2)
  new_params = driver.engine.place_params(other)
  driver.before_step = lambda step: step == 5 and driver.holder.set(1, new_params)
  results = driver.run(_staggered_jobs(spec))
  assert driver.stats['prefill_calls'] == 3 and driver.stats['swaps'] == 1
  (early,), (late,) = results[2], results[3]
  assert early.versions[0] == 0 and early.versions[-1] == 1  # in flight at the swap
  (ref,) = make_driver(model, other, slots=2).run(_staggered_jobs(spec))[3]
  assert late.versions == [1] * 7 and late.tokens == ref.tokens
  np.testing.assert_allclose(late.logprobs, ref.logprobs, atol=1e-6, rtol=0)


def test_randomized_submit_finish_swap(models):
  """Random jobs (samples, lengths, stop tokens, prompts) through 3 slots with random swaps:
  every sample is answered exactly once, within its limits; no slot leaks."""
  model, params, other = models
  rng = random.Random(0)
  placed = None
  for trial in range(6):
    on_swap = ('continue', 'discard')[trial % 2]
    cache = list(CACHES.values())[trial % len(CACHES)]
    driver = make_driver(model, params, slots=3, on_swap=on_swap, engine_kwargs=cache)
    placed = placed or [driver.engine.place_params(p) for p in (params, other)]
    swaps = set(rng.sample(range(40), 4))
    version = [0]

    def maybe_swap(step, swaps=swaps, driver=driver, version=version):
      if step in swaps:
        version[0] += 1
        driver.holder.set(version[0], placed[version[0] % 2])
    driver.before_step = maybe_swap
    jobs = []
    for i in range(rng.randint(1, 7)):
      n = rng.randint(1, 5)
      prompt = tuple(rng.randrange(2, 48) for _ in range(rng.randint(1, 16)))
      stops = tuple(rng.sample(range(2, 48), rng.randint(0, 3)))
      jobs.append(Job(prompt, n, SamplingSpec(1.0), rng.randint(1, 12), stops,
                      keys_for(trial * 100 + i, n)))
    results = driver.run(jobs)
    assert [len(r) for r in results] == [j.num_samples for j in jobs]
    for job, samples in zip(jobs, results):
      for s in samples:
        assert 1 <= len(s.tokens) <= job.max_new_tokens
        assert len(s.logprobs) == len(s.versions) == len(s.supports) == len(s.tokens)
        assert s.finish_reason in ('stop', 'length')
        stops_at = [k for k, t in enumerate(s.tokens) if t in job.stop_ids]
        if s.finish_reason == 'stop':
          assert stops_at == [len(s.tokens) - 1]
        else:
          assert not stops_at and len(s.tokens) == job.max_new_tokens
        assert s.versions == sorted(s.versions)  # versions never go backwards
        if on_swap == 'discard':
          assert len(set(s.versions)) == 1
    remaining = np.asarray(driver.state.remaining)
    assert driver.stats['inserts'] >= sum(j.num_samples for j in jobs)
    # Every slot the driver used is free on the device too (or released at the next run).
    assert (remaining == 0).all(), remaining


def a_job(**fields):
  return Job(**(dict(prompt_ids=(3,), num_samples=1, sampling=GREEDY, max_new_tokens=4,
                     stop_ids=(EOS,), keys=keys_for(0, 1)) | fields))


@pytest.mark.parametrize('fields, message', [
    (dict(prompt_ids=()), 'job 1: the prompt is empty'),
    (dict(prompt_ids=tuple(range(2, 19))),
     'the prompt has 17 tokens, more than max_prefill_length=16'),
    (dict(max_new_tokens=13), 'max_new_tokens=13 is not in [1'),
    (dict(prompt_ids=(3, 48, 50)), 'job 1: the prompt holds ids outside the vocabulary '
                                   '[0, 48): [48, 50]'),
    (dict(prompt_ids=(3, -1)), 'the prompt holds ids outside the vocabulary [0, 48): [-1]'),
    (dict(stop_ids=(EOS, 2**40)), 'stop_ids holds ids outside the vocabulary'),
    (dict(stop_ids=tuple(range(1, 10))), '9 stop ids (1, 2, 3, 4, 5, 6, 7, 8, 9); at most '
                                         'MAX_STOP_IDS=8'),
    (dict(keys=np.zeros((1, 3), np.uint32)), 'keys of 3 words'),
    (dict(resume=(Sample(tokens=[3, 60]),)), 'job 1 sample 0: resume tokens holds ids '
                                             'outside the vocabulary [0, 48): [60]'),
])
def test_bad_jobs_are_refused_before_any_compute(models, fields, message):
  model, params, _ = models
  driver = make_driver(model, params)
  with pytest.raises(ValueError, match=re.escape(message)):
    driver.run([jobs_for(GREEDY)[0], a_job(**fields)])
  assert driver.steps == 0


@pytest.mark.parametrize('fields, message', [
    (dict(max_new_tokens=0), 'Job.max_new_tokens=0 must be an int >= 1'),
    (dict(num_samples=0), 'Job.num_samples=0 must be an int >= 1'),
    (dict(num_samples=2), 'Job.keys must be integer key data [num_samples=2, key size]'),
    (dict(keys=np.zeros((2,), np.uint32)), 'Job.keys must be integer key data'),
    (dict(keys=np.zeros((1, 2), np.float32)), 'got float32[1, 2]'),
    (dict(prompt_ids=(5.7, 9)), 'Job.prompt_ids must be a 1-D sequence of integer token ids; '
                                'got float64[2]'),
    (dict(prompt_ids=('5', 9)), 'Job.prompt_ids must be a 1-D sequence of integer'),
    (dict(stop_ids=((1, 2),)), 'Job.stop_ids must be a 1-D sequence of integer'),
])
def test_jobs_refuse_values_of_the_wrong_type(fields, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    a_job(**fields)


def test_jobs_take_arrays_and_typed_keys(models):
  """Prompts as numpy arrays or lists and typed PRNG keys are the same job as tuples and
  key data."""
  model, params, _ = models
  typed = jax.random.split(jax.random.key(5), 2)
  plain = a_job(prompt_ids=(3, 9, 4), num_samples=2, keys=jax.random.key_data(typed))
  for job in (a_job(prompt_ids=np.array([3, 9, 4]), num_samples=2, keys=typed),
              a_job(prompt_ids=[3, 9, 4], num_samples=2, keys=np.asarray(
                  jax.random.key_data(typed)).astype(np.int64))):
    assert job.prompt_ids == (3, 9, 4) and isinstance(job.prompt_ids[0], int)
    np.testing.assert_array_equal(job.keys, plain.keys)
    assert job.keys.dtype == np.uint32
  got = make_driver(model, params).run([a_job(prompt_ids=[3, 9, 4], num_samples=2,
                                              keys=typed)])
  want = make_driver(model, params).run([plain])
  assert [s.tokens for s in got[0]] == [s.tokens for s in want[0]]


def test_params_that_are_not_the_engines_are_refused(models):
  """Another model's weights, another dtype, params not placed in the engine's layout or
  another tree raise naming the leaf, before any compute: in ``place_params`` and when the
  driver reads a new version (they used to run, reshaped, or recompile every step)."""
  model, params, _ = models
  driver = make_driver(model, params)
  engine = driver.engine
  _, wider = create_model(dataclasses.replace(CONFIG, mlp_dim=2 * CONFIG.mlp_dim), seed=0)
  with pytest.raises(ValueError, match=r"params\[.*\] is float32\[.*128.*\]; this engine "
                                       r"needs float32\[.*64.*\] in the model's layout"):
    engine.place_params(wider)
  with pytest.raises(ValueError, match="params do not have the model's tree"):
    engine.place_params({'embed': params['embed']})
  placed = engine.place_params(params)
  cases = [(jax.tree.map(lambda x: x.astype(jnp.bfloat16), placed),
            r'is bfloat16\[.*\]; this engine needs float32'),
           # another model's (stacked) tree, or its shapes in the engine's tree
           (wider, 'this engine needs|do not have the model\'s tree')]
  if engine.model is not engine.source_model:  # XLA:CPU keeps the params as 'out_in'
    cases.append((params, 'in the engine\'s layout \\(pass them through place_params'))
  for version, (bad, message) in enumerate(cases, start=1):
    driver.holder.set(version, bad)
    steps = driver.steps
    with pytest.raises(ValueError, match=message):
      driver.run(jobs_for(GREEDY))
    assert driver.steps == steps
  driver.holder.set(9, placed)  # the right params run again
  assert len(driver.run(jobs_for(GREEDY))) == len(jobs_for(GREEDY))


def test_engine_and_holder_errors(models):
  model, params, _ = models
  with pytest.raises(ValueError, match='exceeds the model max_seq_len'):
    Engine(model, MESH, slots=2, max_prefill_length=60, max_decode_length=8, pad_id=PAD)
  with pytest.raises(ValueError, match='must be increasing'):
    Engine(model, MESH, slots=2, max_prefill_length=16, max_decode_length=8, pad_id=PAD,
           prefill_buckets=(16, 8))
  with pytest.raises(RuntimeError, match='no weights loaded'):
    VersionedParams().get()
  with pytest.raises(ValueError, match="on_swap='later'"):
    make_driver(model, params, on_swap='later')
  driver = make_driver(model, params)
  engine, (_, placed) = driver.engine, driver.holder.get()
  state = engine.init_decode_state()
  for longest in (0, engine.cache_length + 1):  # no slot holds 0, or more than the cache
    with pytest.raises(ValueError, match=f'longest={longest}: a slot holds 1 to cache_length'):
      engine.generate(placed, state, GREEDY, longest)
  state, step = engine.generate(placed, state, GREEDY, engine.cache_length)  # the largest
  assert not step.to_host().valid.any()  # nothing inserted: every slot inactive


def _uneven(jobs):
  """Job 0 ends first (4 tokens), while the first sample of job 1 is part-way."""
  return [dataclasses.replace(job, max_new_tokens=n) for job, n in zip(jobs, (4, 10, 7, 10))]


def _resumed(jobs, results):
  return [dataclasses.replace(job, resume=tuple(samples)) for job, samples in zip(jobs, results)]


@pytest.mark.parametrize('spec', [SamplingSpec(1.0), SamplingSpec(0.7, top_k=5, top_p=0.9)])
def test_partial_rollouts_continue_as_if_uninterrupted(models, spec):
  """APRIL: a run stopped after one complete job, then continued (twice, on another slot
  count and another cache layout: continuation prefixes then span several blocks), gives
  the samples of an uninterrupted run: same tokens and finish reasons, log-probs within
  prefill-vs-decode rounding."""
  model, params, _ = models
  jobs = _uneven(jobs_for(spec, n=3, max_new=10, stops=()))
  full = make_driver(model, params).run(jobs)
  driver = make_driver(model, params)
  first = driver.run(jobs, stop_after=1)
  assert sum(all(s.finish_reason for s in samples) for samples in first) >= 1
  partial = [s for samples in first for s in samples if s.finish_reason is None and s.tokens]
  assert partial, 'the stop left no sample part-way'
  assert driver.stats['stopped_early'] == 1
  assert driver.stats['unfinished_samples'] >= len(partial)
  second = make_driver(model, params, slots=3, engine_kwargs=CACHES['blocks of 8']).run(
      _resumed(jobs, first), stop_after=3)
  third = make_driver(model, params, slots=16).run(_resumed(jobs, second))
  assert all(s.finish_reason for samples in third for s in samples)
  for a_job, b_job in zip(full, third):
    for a, b in zip(a_job, b_job):
      assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
      assert a.supports == b.supports and b.versions == [0] * len(b.tokens)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_continued_samples_keep_old_versions_and_discard_restarts_them(models):
  """Tokens drawn before the stop keep version 0; the continuation draws with version 1.
  Under 'discard' no sample mixes versions: a resumed sample whose tokens version 0 drew
  starts over under version 1, and again at the swap to version 2 if still in flight."""
  model, params, other = models
  jobs = _uneven(jobs_for(SamplingSpec(1.0), n=3, max_new=10, stops=()))
  first = make_driver(model, params).run(jobs, stop_after=1)
  drawn = [[len(s.tokens) for s in samples] for samples in first]
  driver = make_driver(model, other, version=1)
  second = driver.run(_resumed(jobs, first))
  assert driver.stats['continued_samples'] == sum(
      1 for samples in first for s in samples if s.finish_reason is None and s.tokens)
  for samples, before, counts in zip(second, first, drawn):
    for s, b, n in zip(samples, before, counts):
      assert s.tokens[:n] == b.tokens and s.versions[:n] == [0] * n
      assert s.versions[n:] == [1] * (len(s.tokens) - n)
  # 'discard': the resumed samples restart at once (their tokens are version 0's), and a
  # swap after they entered restarts them again.
  holder_swaps = {2: 2}

  def swap(step):
    if step in holder_swaps:
      driver.holder.set(holder_swaps[step], driver.engine.place_params(params))
  driver = make_driver(model, other, version=1, on_swap='discard', before_step=swap)
  third = driver.run(_resumed(jobs, first))
  unfinished = 0
  for samples, before in zip(third, first):
    for s, b in zip(samples, before):
      if b.finish_reason:  # finished before the stop: kept as it was
        assert s.tokens == b.tokens and s.restarts == 0
      else:  # a continued one restarts; one not yet started just starts
        unfinished += bool(b.tokens)
        assert s.restarts >= bool(b.tokens) and len(set(s.versions)) == 1, s
  assert unfinished and driver.stats['discarded_samples'] >= unfinished
  # Without a swap during the run: each continued sample starts over once, under version 1.
  driver = make_driver(model, other, version=1, on_swap='discard')
  fourth = driver.run(_resumed(jobs, first))
  for samples, before in zip(fourth, first):
    for s, b in zip(samples, before):
      if not b.finish_reason:
        assert s.restarts == bool(b.tokens) and set(s.versions) == {1}, s
  assert driver.stats['discarded_samples'] == unfinished


def test_partial_rollout_errors(models):
  model, params, _ = models
  driver = make_driver(model, params)
  jobs = jobs_for(GREEDY, n=2, max_new=4)
  with pytest.raises(ValueError, match=r'stop_after=5 must be in \[1, 4\]'):
    driver.run(jobs, stop_after=5)
  with pytest.raises(ValueError, match='resume holds 1 samples for num_samples=2'):
    driver.run([dataclasses.replace(jobs[0], resume=(Sample(),))])
  long = Sample(tokens=[3] * 4, logprobs=[0.0] * 4, supports=[1] * 4, versions=[0] * 4)
  with pytest.raises(ValueError, match='unfinished with 4 tokens, but max_new_tokens=4'):
    driver.run([dataclasses.replace(jobs[0], resume=(long, Sample()))])
  engine = driver.engine  # cache 16 + 12 = 28 tokens; continuations use longer buckets
  assert engine.bucket(20, continuation=True) == 24 and engine.bucket(27, continuation=True) == 28
  with pytest.raises(ValueError, match='longer than max_prefill_length=16'):
    engine.bucket(20)
  with pytest.raises(ValueError, match='a continuation of 28 tokens leaves no room'):
    engine.bucket(28, continuation=True)
  prefix = engine.prefill(driver.holder.get()[1], [(3, 4)])
  with pytest.raises(ValueError, match=r'offset=4 \(tokens already drawn\) must be in \[0, '):
    engine.insert(prefix, driver.state, [Insert(0, 0, keys_for(0, 1)[0], 4, (), offset=4)],
                  GREEDY)


def test_greedy_decode_step_reads_the_flipped_heads_logits_in_place():
  """The engine's greedy decode step passes the head's layout to argmax (``Engine`` and
  ``head_logits`` agree through ``head_is_vocab_major``): on XLA:CPU the step copies no
  logits into row-wise argmax blocks, and its tokens are the full forward pass's argmax."""
  from rlax_llm.policy import ARGMAX_BLOCK  # pylint: disable=import-outside-toplevel
  config = dataclasses.replace(CONFIG, vocab_size=4 * ARGMAX_BLOCK, tie_embeddings=True)
  model, params = create_model(config, seed=0)
  slots = 4
  engine = Engine(model, MESH, slots=slots, max_prefill_length=16, max_decode_length=12,
                  pad_id=PAD)
  placed = engine.place_params(params)
  state = engine.init_decode_state()
  entry = engine._generate.lower(placed, state, spec=GREEDY,  # pylint: disable=protected-access
                                 attend=engine.attend_buckets[0]).compile().as_text()
  entry = entry[entry.index('\nENTRY'):]
  if jax.default_backend() == 'cpu':
    blocked = f'f32[{slots},4,{ARGMAX_BLOCK}]'
    assert f'= {blocked}' not in entry, [line for line in entry.splitlines() if blocked in line]
  prompts = [(5, 9, 13), (7, 3, 22, 30)]
  driver = Driver(engine, VersionedParams())
  driver.holder.set(0, placed)
  jobs = [Job(p, 1, GREEDY, 6, (), np.zeros((1, 2), np.uint32)) for p in prompts]
  for prompt, (sample,) in zip(prompts, driver.run(jobs)):
    tokens = list(prompt)
    for _ in range(6):
      tokens.append(int(jnp.argmax(model.apply(params, jnp.asarray([tokens]))[0, -1])))
    assert sample.tokens == tokens[len(prompt):]
