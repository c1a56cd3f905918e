"""``model.inference_param_dtype='bfloat16'``: the trainer keeps float32 master weights and
pushes their bfloat16 cast once per version; the workers hold, pull (whole or as a lossless
delta, checked against the server's checksums) and sample with that copy; the trainer's
recompute stays float32, and the mismatch metrics measure the gap."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from rlax_llm import memory_fit, roles
from rlax_llm.data_types import GenerationRequest, make_train_batch
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import cast_params, create_model, with_param_dtype
from rlax_llm.paramserver import ParameterServer
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tasks import Prompt
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.trainer.scoring import Policy

from recorded_run import assert_trained_with_mismatch, recorded_run  # tests/recorded_run.py
from smoke_config import smoke_config  # tests/smoke_config.py


def _bf16_of(tree):
  """``tree``'s float32 leaves rounded to bfloat16 by numpy (ml_dtypes), an independent
  reference for the cast the trainer makes with XLA."""
  return [np.asarray(leaf).astype(ml_dtypes.bfloat16) for leaf in jax.tree.leaves(tree)]


def _assert_bits_equal(got, want):
  for a, b in zip(got, want, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_a_run_samples_with_the_bfloat16_copy_and_trains_the_float32_master(tmp_path):
  """With the float32 recompute as the PPO ratio's reference and TIS on, the ratio is
  exactly 1 and the bf16 gap goes to the mismatch weights (docs/rollout.md)."""
  config = smoke_config(model__inference_param_dtype='bfloat16', log__tensorboard=False,
                        eval__every_steps=0, rl__old_logprobs='recompute',
                        rl__mismatch__enabled=True)
  worker, sampled, start, final, trainer_model = recorded_run(config, tmp_path)
  assert {leaf.dtype for leaf in jax.tree.leaves(start)} == {np.dtype(np.float32)}
  assert {leaf.dtype for leaf in jax.tree.leaves(final)} == {np.dtype(np.float32)}
  assert worker.model.config.execution.param_dtype == jnp.bfloat16
  assert {leaf.dtype for leaf in jax.tree.leaves(worker.params)} == {jnp.dtype(jnp.bfloat16)}
  # The worker sampled version 0 with exactly the bf16 cast of the trainer's master weights.
  params, _, rollouts = next(x for x in sampled if not x[2].sampling.greedy)  # not eval's
  assert set(rollouts.versions[rollouts.completion_mask].tolist()) == {0}
  _assert_bits_equal(jax.tree.leaves(params), _bf16_of(start))
  # Its behaviour log-probs are the bf16 policy's (a direct forward with the bf16 copy), not
  # the float32 master's.
  batch = make_train_batch(rollouts, np.zeros(len(rollouts), np.float32))
  mask = np.asarray(batch.loss_mask[:, 1:]) > 0
  behaviour = np.asarray(batch.behaviour_logprobs[:, 1:])[mask]
  tokens, sizes = jnp.asarray(batch.tokens), jnp.asarray(batch.support_sizes)
  bf16 = Policy(worker.model, rollouts.sampling).sequence_log_probs(params, tokens, sizes)
  fp32 = Policy(trainer_model, rollouts.sampling).sequence_log_probs(
      start, tokens, sizes)
  gap_bf16 = np.abs(np.asarray(bf16.logp)[mask] - behaviour).max()
  gap_fp32 = np.abs(np.asarray(fp32.logp)[mask] - behaviour).max()
  assert gap_bf16 < 1e-5 and gap_fp32 > 1e-3, (gap_bf16, gap_fp32)
  # Training proceeds on the float32 master, and the mismatch metrics see the bf16 gap.
  for row in assert_trained_with_mismatch(tmp_path, start, final):
    assert row['mismatch/max_abs_dlogp'] > 1e-3  # the bf16 rounding, not float32's ~1e-6
    assert 0 < abs(row['mismatch/weight_mean'] - 1) < 0.05  # TIS weights pi_old / pi_bf16


def test_a_pull_after_a_delta_equals_the_cast_of_the_whole_float32_version():
  """The server holds what the trainer pushed (the bf16 casts) and checks it: a worker
  holding version 0 pulls version 1 as a sparse delta of the bf16 bits, verified against the
  checksums taken at push time, and ends up with exactly the bf16 cast of the float32
  version 1, as a worker pulling version 1 whole does."""
  tokenizer = CharTokenizer('0123456789+= ')
  model, params = create_model(DecoderConfig(vocab_size=tokenizer.vocab_size, num_layers=2,
                                             embed_dim=32, num_heads=4, num_kv_heads=2,
                                             head_dim=8, mlp_dim=64, max_seq_len=32), seed=3)
  inference = with_param_dtype(model, jnp.bfloat16)
  assert with_param_dtype(model, jnp.float32) is model
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  server = ParameterServer(keep=2)
  # A small RL-sized update of the float32 master: every element moves, most bf16 bits not.
  rng = np.random.default_rng(0)
  version_1 = jax.tree.map(
      lambda x: x + 1e-4 * np.abs(x).mean() * rng.standard_normal(x.shape).astype(np.float32),
      params)
  for version, master in enumerate((params, version_1)):
    on_device = jax.device_put(master)  # as the trainer holds them
    pushed = cast_params(on_device, inference)
    assert {leaf.dtype for leaf in jax.tree.leaves(pushed)} == {jnp.dtype(jnp.bfloat16)}
    server.push(version, pushed)

  def worker():
    return InferenceWorker(inference, tokenizer, mesh, max_prompt_len=8, max_new_tokens=4)
  held = worker()
  held.receiver.pull(0, server.update)
  delta = held.receiver.pull(1, server.update)
  whole = worker()
  full = whole.receiver.pull(1, server.update)
  assert full['sync/bytes'] == 2 * sum(x.size for x in jax.tree.leaves(params))
  assert delta['sync/changed'] < 0.2 * delta['sync/elements']
  assert delta['sync/bytes'] < 0.5 * full['sync/bytes']
  want = _bf16_of(version_1)
  for w in (held, whole):
    assert w.version == 1
    _assert_bits_equal(w.receiver._host_leaves, want)  # pylint: disable=protected-access
  # The two sample alike: the same weights, the same tokens and log-probs.
  request = [GenerationRequest(Prompt(0, '1+2=', ''), 4, SamplingSpec(1.0), 4)]
  a = held.generate(request, jax.random.key(0))
  b = whole.generate(request, jax.random.key(0))
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.behaviour_logprobs, b.behaviour_logprobs)


def test_the_worker_and_the_plan_hold_the_inference_copy_at_its_dtype():
  config = smoke_config(model__inference_param_dtype='bfloat16')
  task = roles.build_task(config)
  model, _, tokenizer = roles.build_model(config, task)
  assert roles.inference_model(config, model).config.execution.param_dtype == jnp.bfloat16
  config.model.inference_param_dtype = ''
  assert roles.inference_model(config, model) is model
  one = {'data': 1, 'fsdp': 1, 'tensor': 1}
  fp32 = memory_fit.run_memory_plan(model.config, config, one, one, shared=True)
  config.model.inference_param_dtype = 'bfloat16'
  bf16 = memory_fit.run_memory_plan(model.config, config, one, one, shared=True)
  assert bf16.inference_params == fp32.inference_params / 2
  assert bf16.params == fp32.params  # the trainer's master copy stays float32
  assert memory_fit.rollout_memory_bytes(model.config, config)['params_bytes'] == (
      bf16.inference_params)
  worker = roles.build_worker(config, model, tokenizer, make_mesh({'data': 1},
                                                                   jax.devices()[:1]))
  assert worker.model.config.execution.param_dtype == jnp.bfloat16
