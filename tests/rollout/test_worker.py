"""The inference worker: typed requests in, whole Rollouts out; reload threshold j; sharded
params on the inference mesh; and the policy contract with the trainer (one definition)."""

import dataclasses
import functools
import re
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm import policy as policy_lib
from rlax_llm.data_types import FollowLatest, GenerationRequest, Rollouts, make_train_batch
from rlax_llm.losses import LossConfig
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.paramserver import ParameterServer
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sharding import make_mesh
from rlax_llm.tasks import Prompt
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.trainer.objectives import rl_objective

ALPHABET = string.digits + string.ascii_letters[:51]  # 61 characters: vocab 64
TOKENIZER = CharTokenizer(ALPHABET)
CONFIG = DecoderConfig(vocab_size=TOKENIZER.vocab_size, num_layers=2, embed_dim=32,
                       num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)
PROMPTS = [Prompt(0, 'abc12', ''), Prompt(1, 'Yq', ''), Prompt(2, 'hello9x', ''),
           Prompt(3, 'k', '')]
MAX_NEW = 12


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=1)


def make_worker(model, params, mesh_axes=None, version=5):
  mesh = make_mesh(mesh_axes or {'data': 1}, jax.devices()[:int(np.prod(
      list((mesh_axes or {'data': 1}).values())))])
  worker = InferenceWorker(model, TOKENIZER, mesh, max_prompt_len=8, max_new_tokens=MAX_NEW,
                           slots=16)
  worker.load(version, params)
  return worker


def held_tree(worker):
  """The host params of the version ``worker``'s receiver holds: what its next delta
  applies to."""
  receiver = worker.receiver
  # pylint: disable-next=protected-access
  return jax.tree_util.tree_unflatten(receiver._treedef, receiver._host_leaves)


def requests(spec, n=4, prompts=PROMPTS):
  return [GenerationRequest(p, n, spec, MAX_NEW) for p in prompts]


def test_generate_returns_whole_rollouts(model_and_params):
  model, params = model_and_params
  worker = make_worker(model, params)
  out = worker.generate(requests(SamplingSpec(0.9)), jax.random.key(0))
  b = 4 * len(PROMPTS)
  assert len(out) == b
  np.testing.assert_array_equal(out.prompt_ids, np.repeat([0, 1, 2, 3], 4))
  np.testing.assert_array_equal(out.group_ids, np.repeat([0, 1, 2, 3], 4))
  assert out.prompt_tokens.shape == (b, 8) and out.completion_tokens.shape == (b, MAX_NEW)
  np.testing.assert_array_equal(out.prompt_lengths, np.repeat([6, 3, 8, 2], 4))  # bos + text
  mask = out.completion_mask
  np.testing.assert_array_equal(out.versions, np.where(mask, 5, -1))
  np.testing.assert_array_equal(out.behaviour_logprobs[~mask], 0.0)
  assert np.all(out.behaviour_logprobs[mask] <= 0.0)
  assert set(out.finish_reasons) <= {'stop', 'length'}
  for row in range(b):
    length = int(mask[row].sum())
    ended = out.finish_reasons[row] == 'stop'
    assert ended == (out.completion_tokens[row, length - 1] == TOKENIZER.eos_id)
    assert out.completions[row] == TOKENIZER.decode(out.completion_tokens[row])
  assert out.sampling == SamplingSpec(0.9) and out.rewards is None
  assert out.timings['generate_s'] > 0 and out.timings['tokens_per_s'] > 0


def test_same_key_same_rollouts(model_and_params):
  model, params = model_and_params
  worker = make_worker(model, params)
  a = worker.generate(requests(SamplingSpec(1.0), n=2), jax.random.key(3))
  b = worker.generate(requests(SamplingSpec(1.0), n=2), jax.random.key(3))
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)



def test_a_batch_split_between_workers_draws_the_same_tokens(model_and_params):
  """``first``: a request's keys come from its index in the batch, so the batch's two halves
  generated apart (as two workers would, ``first`` 0 and 2) are the whole batch's rows."""
  model, params = model_and_params
  worker = make_worker(model, params)
  whole = worker.generate(requests(SamplingSpec(1.0), n=3), jax.random.key(4))
  halves = [worker.generate(requests(SamplingSpec(1.0), n=3, prompts=PROMPTS[lo:lo + 2]),
                            jax.random.key(4), first=lo) for lo in (0, 2)]
  np.testing.assert_array_equal(np.concatenate([h.sample_keys for h in halves]),
                                whole.sample_keys)
  np.testing.assert_array_equal(
      np.concatenate([h.completion_tokens for h in halves]), whole.completion_tokens)
  # Without the offset the second half would draw the first half's keys.
  shifted = worker.generate(requests(SamplingSpec(1.0), n=3, prompts=PROMPTS[2:]),
                            jax.random.key(4))
  assert not np.array_equal(shifted.sample_keys, whole.sample_keys[6:])
  with pytest.raises(ValueError, match='first=-1 must be an int >= 0'):
    worker.generate(requests(SamplingSpec(1.0)), jax.random.key(4), first=-1)

# The policy contract: on-policy, the trainer's recomputed log-probs equal the behaviour
# log-probs the worker recorded, and every importance ratio is 1.
@pytest.mark.parametrize('top_p', [1.0, 0.9])
@pytest.mark.parametrize('top_k', [0, 20])
@pytest.mark.parametrize('temperature', [1.0, 0.7, 1.3])
def test_trainer_recomputes_the_behaviour_log_probs(model_and_params, temperature, top_k,
                                                    top_p):
  model, params = model_and_params
  spec = SamplingSpec(temperature, top_k, top_p)
  worker = make_worker(model, params)
  rollouts = worker.generate(requests(spec, n=8), jax.random.key(11))
  batch = make_train_batch(rollouts, np.zeros(len(rollouts), np.float32))
  mask = np.asarray(batch.loss_mask[:, 1:]) > 0
  assert mask.sum() > 100
  policy = Policy(model, rollouts.sampling)  # the trainer's policy: the same transform
  scored = policy.sequence_log_probs(params, jnp.asarray(batch.tokens),
                                     jnp.asarray(batch.support_sizes))
  trainer_logp = np.asarray(scored.logp)[mask]
  behaviour = np.asarray(batch.behaviour_logprobs[:, 1:])[mask]
  np.testing.assert_allclose(trainer_logp, behaviour, atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.exp(trainer_logp - behaviour), 1.0, atol=1e-5, rtol=0)
  assert np.asarray(scored.in_support)[mask].all()
  if top_k or top_p < 1:  # truncation is active: the naive softmax would be biased
    naive = Policy(model, SamplingSpec(temperature)).sequence_log_probs(
        params, jnp.asarray(batch.tokens)).logp
    assert np.max(np.asarray(naive)[mask] - behaviour) < -1e-3
  # The same through the trainer's objective: the loss's ratio diagnostics read exactly 1.
  objective = functools.partial(rl_objective, policy, LossConfig(loss='grpo'))
  _, diags = jax.jit(objective)(params, batch, None)
  for key in ('is/ratio_max', 'is/ratio_min', 'is/ratio_mean'):
    assert abs(float(diags[key]) - 1.0) < 1e-5, (key, float(diags[key]))
  assert float(diags['mismatch/max_abs_dlogp']) < 1e-5
  assert float(diags['policy/out_of_support_fraction']) == 0.0


def test_recompute_path_gives_exact_ratios_and_measures_the_mismatch(model_and_params):
  """old_logprobs='recompute': the proximal log-probs are the trainer's own, so the ratio is
  exactly 1; the mismatch diagnostics compare them with the (here perturbed) behaviour."""
  model, params = model_and_params
  spec = SamplingSpec(1.0)
  rollouts = make_worker(model, params).generate(requests(spec, n=4), jax.random.key(2))
  batch = make_train_batch(rollouts, np.ones(len(rollouts), np.float32))
  shift = 0.25 * np.asarray(batch.loss_mask)
  batch = batch.replace(behaviour_logprobs=np.asarray(batch.behaviour_logprobs) - shift)
  objective = functools.partial(rl_objective, Policy(model, spec),
                                LossConfig(loss='grpo', old_logprobs='recompute'))
  _, diags = jax.jit(objective)(params, batch, None)
  assert float(diags['is/ratio_max']) == 1.0 and float(diags['is/ratio_min']) == 1.0
  np.testing.assert_allclose(float(diags['mismatch/max_abs_dlogp']), 0.25, atol=1e-4)
  # With 'behaviour' the same perturbation shows in the ratio: exp(0.25).
  objective = functools.partial(rl_objective, Policy(model, spec), LossConfig(loss='grpo'))
  _, diags = jax.jit(objective)(params, batch, None)
  np.testing.assert_allclose(float(diags['is/ratio_mean']), np.exp(0.25), rtol=1e-4)


def test_a_failed_load_keeps_the_held_version(model_and_params):
  """Params that are not the model's raise and change nothing: the version held, its
  device params and the base the next delta applies to stay the last good version's."""
  model, params = model_and_params
  worker = make_worker(model, params, version=5)
  held = worker.params
  bad = jax.tree.map(lambda x: x[..., :1], params)
  with pytest.raises(ValueError, match='this engine needs'):
    worker.load(6, bad)
  assert worker.version == 5 and worker.params is held
  server = ParameterServer(keep=2)
  server.push(5, params)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  changed = jax.tree_util.tree_unflatten(treedef, [leaves[0] + 1.0] + leaves[1:])
  server.push(6, changed)  # one leaf changed: the others come from the worker's base
  worker.receiver.apply(server.update(6, base_version=5))
  assert worker.version == 6
  jax.tree.map(np.testing.assert_array_equal, held_tree(worker), changed)


def test_reload_threshold_j(model_and_params):
  """``Receiver.follow(latest, j, fetch)``, the free-running rule: pull the server's newest
  version when nothing is held or it is j or more versions ahead."""
  model, params = model_and_params
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  worker = InferenceWorker(model, TOKENIZER, mesh, max_prompt_len=8, max_new_tokens=MAX_NEW)
  server = ParameterServer(keep=2)
  follow = lambda j: worker.receiver.follow(server.latest_version, j, server.update)
  with pytest.raises(LookupError, match='holds no weights'):
    follow(1)
  server.push(0, params)
  assert follow(3)['sync/updates'] == 1 and worker.version == 0  # nothing held: always load
  for version in (1, 2):
    server.push(version, params)
    assert not follow(3), version  # only 1, 2 versions ahead
  assert worker.version == 0 and worker.reloads == 1
  server.push(3, params)
  assert follow(3) and worker.version == 3  # 3 ahead: reload
  assert not follow(1) and worker.reloads == 2
  server.push(4, params)
  assert follow(1) and worker.version == 4
  rollouts = worker.generate(requests(SamplingSpec(1.0), n=1), jax.random.key(0))
  assert set(rollouts.versions[rollouts.completion_mask].tolist()) == {4}
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match='reload threshold j='):
      follow(bad)


def test_params_are_sharded_on_the_inference_mesh(model_and_params, monkeypatch):
  """Inference follows the logical-axis rules too (no silent replication), with the same
  output as one device: greedy, and sampled with a top-p cut (supports of 1-7 tokens) whose
  sorted prefixes (``policy.SORTED_PREFIXES``, shortened to this vocabulary) are chosen
  over sharded rows, and the bisection takes the rows they leave undecided."""
  monkeypatch.setattr(policy_lib, 'SORTED_PREFIXES', (2, 5))
  model, params = model_and_params
  sharded = make_worker(model, params, {'fsdp': 2, 'tensor': 2})
  unrolled = sharded.engine.layer_loop == 'unrolled'  # CPU: per-layer buffers
  layer = lambda blocks: blocks[1] if unrolled else blocks
  wq = layer(sharded.params['blocks'])['attn']['wq']
  axes = tuple(layer(sharded.engine.model.logical_axes()['blocks'])['attn']['wq'])
  expected = {('layers', 'embed', 'heads', 'head_dim'): (None, 'fsdp', 'tensor', None),  # in_out
              ('layers', 'heads', 'head_dim', 'embed'): (None, 'tensor', None, 'fsdp'),  # out_in
              ('embed', 'heads', 'head_dim'): ('fsdp', 'tensor', None),  # unrolled
              ('heads', 'head_dim', 'embed'): ('tensor', None, 'fsdp')}
  assert wq.sharding.spec == jax.sharding.PartitionSpec(*expected[axes])
  single = make_worker(model, params)
  for spec in (GREEDY, SamplingSpec(0.2, top_p=0.9)):
    a = single.generate(requests(spec, n=2), jax.random.key(0))
    b = sharded.generate(requests(spec, n=2), jax.random.key(0))
    np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
    np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.support_sizes, b.support_sizes)


def test_chat_prompts_use_the_chat_template(model_and_params):
  model, params = model_and_params
  worker = make_worker(model, params)
  chat = Prompt(7, 'x', '', messages=({'role': 'user', 'content': 'x'},))
  with pytest.raises(ValueError, match='has no chat template'):
    worker.generate([GenerationRequest(chat, 1, GREEDY, 4)], jax.random.key(0))


@pytest.mark.parametrize('prompt, message', [
    (Prompt(9, 'abcdefghijk', ''), 'prompt 9 encodes to 12 tokens'),
    (Prompt(9, '!', ''), "character '!'"),
])
def test_bad_prompts_raise_naming_the_prompt(model_and_params, prompt, message):
  model, params = model_and_params
  worker = make_worker(model, params)
  with pytest.raises(ValueError, match=message):
    worker.generate([GenerationRequest(prompt, 1, GREEDY, 4)], jax.random.key(0))


def test_mixed_specs_run_in_phases_and_bad_lengths_raise(model_and_params):
  model, params = model_and_params
  worker = make_worker(model, params)
  mixed = [GenerationRequest(PROMPTS[0], 2, GREEDY, 4),
           GenerationRequest(PROMPTS[1], 3, SamplingSpec(1.0), 6)]
  out = worker.generate(mixed, jax.random.key(0))
  assert out.sampling is None and len(out) == 5
  np.testing.assert_array_equal(out.behaviour_logprobs[:2], 0.0)  # greedy: point masses
  np.testing.assert_array_equal(out.completion_tokens[0], out.completion_tokens[1])
  assert (out.completion_mask[:2].sum(1) <= 4).all() and (out.completion_mask[2:].sum(1) <= 6).all()
  assert np.all(out.behaviour_logprobs[2:][out.completion_mask[2:]] < 0)
  with pytest.raises(ValueError, match=r'max_new_tokens=30 is not in \[1, max_decode_length=12\]'):
    worker.generate([GenerationRequest(PROMPTS[0], 1, GREEDY, 30)], jax.random.key(0))
  with pytest.raises(ValueError, match='at least one request'):
    worker.generate([], jax.random.key(0))
  empty = InferenceWorker(model, TOKENIZER, make_mesh({'data': 1}, jax.devices()[:1]),
                          max_prompt_len=8, max_new_tokens=MAX_NEW)
  with pytest.raises(RuntimeError, match='no weights'):
    empty.generate(requests(GREEDY), jax.random.key(0))


def test_partial_rollouts_resume_through_requests(model_and_params):
  """APRIL through the typed interface: a call stopped after one finished request returns
  'unfinished' rows with their keys; requests resuming them (after a to_state round trip,
  as a checkpoint stores them) give the rows of an uninterrupted call."""
  model, params = model_and_params
  worker = make_worker(model, params)
  reqs = requests(SamplingSpec(0.9), n=6)
  full = worker.generate(reqs, jax.random.key(3))
  part = worker.generate(reqs, jax.random.key(3), stop_after=1)
  unfinished = part.unfinished_groups
  assert 1 <= unfinished.size <= 3 and set(part.finish_reasons) >= {'unfinished'}
  cut = part.finish_reasons == 'unfinished'
  assert (part.completion_mask[cut].sum(1) > 0).any()  # some were cut part-way
  assert part.sample_keys.shape == (24, 2) and part.sample_keys.dtype == np.uint32
  with pytest.raises(ValueError, match='are unfinished'):
    make_train_batch(part, np.zeros(24, np.float32))
  state = Rollouts.from_state(*part.to_state())
  resumed = [GenerationRequest(r.prompt, 6, r.sampling, MAX_NEW,
                               resume=state.select(state.group_ids == g))
             if g in unfinished else r for g, r in enumerate(reqs)]
  out = worker.generate(resumed, jax.random.key(99))  # the resumed rows keep their keys
  for g in range(4):
    rows = out.group_ids == g
    if g not in unfinished:  # a new request: drawn with the new key
      continue
    np.testing.assert_array_equal(out.completion_tokens[rows], full.completion_tokens[rows])
    np.testing.assert_array_equal(out.finish_reasons[rows], full.finish_reasons[rows])
    np.testing.assert_allclose(out.behaviour_logprobs[rows], full.behaviour_logprobs[rows],
                               atol=1e-5)
    np.testing.assert_array_equal(out.sample_keys[rows], full.sample_keys[rows])
  with pytest.raises(ValueError, match='must hold num_samples=4 rows with sample_keys'):
    GenerationRequest(PROMPTS[0], 4, SamplingSpec(0.9), MAX_NEW,
                      resume=state.select(state.group_ids == 0))
  with pytest.raises(ValueError, match=r'rows answer prompts \[1\], not 0'):
    GenerationRequest(PROMPTS[0], 6, SamplingSpec(0.9), MAX_NEW,
                      resume=state.select(state.group_ids == 1))


def test_a_corrupted_update_names_the_leaf_and_changes_nothing(model_and_params):
  """The worker checks every leaf it rebuilt against the checksum the server took at push
  time: one flipped bit in a delta's values is an error naming the leaf."""
  model, params = model_and_params
  worker = make_worker(model, params, version=5)
  server = ParameterServer(keep=2)
  server.push(5, params)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  server.push(6, jax.tree_util.tree_unflatten(treedef, [leaves[0] + 1.0] + leaves[1:]))
  update = server.update(6, base_version=5)
  buckets = [list(b) for b in update.buckets]
  first = buckets[0][0]  # leaf 0 changed everywhere: sent whole
  corrupted = np.array(first.full, copy=True)
  corrupted.reshape(-1).view(np.uint32)[0] ^= 1
  buckets[0][0] = dataclasses.replace(first, full=corrupted)
  bad = dataclasses.replace(update, buckets=tuple(tuple(b) for b in buckets))
  path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][0][0])
  with pytest.raises(ValueError, match=re.escape(f'leaf {path} of version 6 fails its checksum')):
    worker.receiver.apply(bad)
  assert worker.version == 5
  worker.receiver.apply(update)
  assert worker.version == 6


def test_generate_at_pulls_the_named_version_itself(model_and_params):
  """The worker pulls the version it is asked to sample with from the server (whole, then
  a delta from the one it holds), reports the pull's figures, and a version the server has
  dropped is a clear error."""
  model, params = model_and_params
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  worker = InferenceWorker(model, TOKENIZER, mesh, max_prompt_len=8, max_new_tokens=MAX_NEW)
  server = ParameterServer(keep=2)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  for version in range(3):
    server.push(version, jax.tree_util.tree_unflatten(
        treedef, [leaves[0] + version] + leaves[1:]))
  with pytest.raises(KeyError, match=r'version 0 is not held: it was dropped'):
    worker.generate_at(0, server.update, requests(SamplingSpec(1.0), n=1), jax.random.key(0))
  assert worker.version == -1
  model_bytes = sum(leaf.nbytes for leaf in leaves)
  out = worker.generate_at(1, server.update, requests(SamplingSpec(1.0), n=1),
                           jax.random.key(0))
  assert worker.version == 1 and set(out.versions[out.completion_mask].tolist()) == {1}
  assert out.timings['sync/updates'] == 1 and out.timings['sync/bytes'] == model_bytes
  out = worker.generate_at(2, server.update, requests(SamplingSpec(1.0), n=1),
                           jax.random.key(0))
  assert out.timings['sync/bytes'] == leaves[0].nbytes  # one leaf changed, sent whole
  assert out.timings['sync/changed'] == leaves[0].size
  out = worker.generate_at(2, server.update, requests(SamplingSpec(1.0), n=1),
                           jax.random.key(0))
  assert not any(key.startswith('sync/') for key in out.timings)  # held: no pull
  jax.tree.map(np.testing.assert_array_equal, held_tree(worker), server.get(2).params)


def test_free_running_pulls_between_decode_steps(model_and_params):
  """generate_at(FollowLatest(j)): the worker pulls the server's latest version before
  generating and, between decode steps, whenever the server is j or more versions ahead;
  the driver swaps it in mid-sequence and every token records the version that drew it."""
  model, params = model_and_params
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  worker = InferenceWorker(model, TOKENIZER, mesh, max_prompt_len=8, max_new_tokens=MAX_NEW)
  server = ParameterServer(keep=4)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  version_params = lambda v: jax.tree_util.tree_unflatten(
      treedef, [leaves[0] + 0.01 * v] + leaves[1:])
  server.push(0, version_params(0))
  # Rows that stop (eos) before a swap hold one version; the checks below take the longer.
  reqs = [GenerationRequest(p, 2, SamplingSpec(1.0), MAX_NEW) for p in PROMPTS[:2]]
  with pytest.raises(ValueError, match='needs latest'):
    worker.generate_at(FollowLatest(1), server.update, reqs, jax.random.key(0))

  def push_at(*steps):
    start = worker.driver.steps
    pushes = iter(range(server.latest_version() + 1, 100))

    def before_step(step):
      if step - start in steps:
        version = next(pushes)
        server.push(version, version_params(version))
    worker.driver.before_step = before_step

  push_at(3)
  out = worker.generate_at(FollowLatest(1), server.update, reqs, jax.random.key(0),
                           latest=server.latest_version)
  assert worker.version == 1 and out.timings['sync/updates'] == 2  # whole, then a delta
  long = out.completion_mask.sum(1) > 4
  assert long.any()
  for row, mask in zip(out.versions[long], out.completion_mask[long]):
    # insert + 3 decode steps with version 0, then version 1 (j = 1: one ahead reloads).
    np.testing.assert_array_equal(row[mask][:4], 0)
    np.testing.assert_array_equal(row[mask][4:], 1)
  assert out.mixed_versions[long].all()
  # j = 2: one version ahead is not enough; two are.
  push_at(2, 5)
  out = worker.generate_at(FollowLatest(2), server.update, reqs, jax.random.key(1),
                           latest=server.latest_version)
  assert worker.version == 3 and out.timings['sync/updates'] == 1
  long = out.completion_mask.sum(1) > 6
  for row, mask in zip(out.versions[long], out.completion_mask[long]):
    np.testing.assert_array_equal(row[mask][:6], 1)
    np.testing.assert_array_equal(row[mask][6:], 3)
