"""Trainer: the sharded step on 8 fake devices matches one device; versions count updates;
non-finite updates are skipped, counted, and stop the run when they persist."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm import roles
from rlax_llm.cli import load_config_file
from rlax_llm.config import run_spec
from rlax_llm.data_types import TrainBatch
from rlax_llm.losses import LossConfig
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.objectives import rl_objective, sft_objective
from rlax_llm.trainer.trainer import (Bound, NonFiniteError, Trainer, learning_rate_schedule,
                                     make_optimizer)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = DecoderConfig(vocab_size=16, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=16)


def _rl_batch(seed=0, batch=8, length=10):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, 16, (batch, length)).astype(np.int32)
  mask = np.zeros((batch, length), np.float32)
  for b in range(batch):
    start = rng.randint(2, 5)
    mask[b, start:start + rng.randint(1, length - start)] = 1.0
  return TrainBatch(
      tokens=tokens, loss_mask=mask,
      behaviour_logprobs=(np.log(rng.uniform(0.05, 0.5, (batch, length))) * mask).astype(
          np.float32),
      support_sizes=np.where(mask > 0, 16, 0).astype(np.int32),
      advantages=rng.randn(batch).astype(np.float32),
      versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(batch // 4), 4).astype(np.int32))


def _make_trainer(mesh_shape, kl_beta=0.0, learning_rate=1e-2, max_nonfinite_updates=3,
                  config=CONFIG):
  model, params = create_model(config, seed=0)
  # Bound: equal trainers (this file's, tests/test_shared_programs.py's) share their programs.
  objective = Bound(rl_objective, Policy(model, SamplingSpec()), LossConfig(kl_beta=kl_beta))
  mesh = make_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
  return Trainer(model, params, make_optimizer(learning_rate), objective, mesh,
                 reference_params=params if kl_beta > 0 else None,
                 max_nonfinite_updates=max_nonfinite_updates)


def test_fake_devices_are_available():
  assert jax.device_count() == 8, 'tests/conftest.py should give 8 fake CPU devices'


@pytest.mark.parametrize('mesh_shape', [
    {'data': 8},
    {'data': 2, 'fsdp': 2, 'tensor': 2},
    {'fsdp': 4, 'tensor': 2},
])
def test_sharded_step_matches_single_device(mesh_shape):
  single = _make_trainer({'data': 1})
  sharded = _make_trainer(mesh_shape, kl_beta=0.0)
  for step in range(2):
    batch = _rl_batch(seed=step)
    m1 = single.step(batch)
    m8 = sharded.step(batch)
    np.testing.assert_allclose(m8['loss'], m1['loss'], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m8['grad_norm'], m1['grad_norm'], rtol=1e-5)
  # Adam divides by sqrt(v): float reassociation in sharded reductions shows up ~1e-6.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               single.host_params(), sharded.host_params())
  assert single.version == sharded.version == 2


def test_bfloat16_sharded_step_matches_single_device():
  """bfloat16 compute (``numerics.accumulated_product``'s float32-summed products and their
  custom gradient) under FSDP and tensor parallelism: the same step as on one device, to
  bfloat16's rounding of partial sums."""
  bf16 = CONFIG.with_execution(dtype=jnp.bfloat16)
  single = _make_trainer({'data': 1}, config=bf16)
  sharded = _make_trainer({'data': 2, 'fsdp': 2, 'tensor': 2}, config=bf16)
  f32 = _make_trainer({'data': 1})
  batch = _rl_batch(seed=0)
  m1, m8, m32 = single.step(batch), sharded.step(batch), f32.step(batch)
  # The loss (~0.04) is a small sum of terms of both signs: bfloat16 moves it by ~1e-3 from
  # the float32 step, and so does splitting the batch (the same before accumulated_product).
  for m in (m8, m32):
    np.testing.assert_allclose(m['loss'], m1['loss'], atol=2e-3)
    np.testing.assert_allclose(m['grad_norm'], m1['grad_norm'], rtol=1e-2)
  assert m1['grad_norm'] > 0


def test_params_are_actually_sharded():
  trainer = _make_trainer({'fsdp': 4, 'tensor': 2})
  wq = trainer.params['blocks']['attn']['wq']  # ('layers', 'embed', 'heads', 'head_dim')
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', 'tensor', None)
  assert len(wq.addressable_shards) == 8
  assert wq.addressable_shards[0].data.shape == (wq.shape[0], 32 // 4, 4 // 2, 8)
  # Optimizer state follows the params' shardings.
  mu = trainer.opt_state[1][0].mu['blocks']['attn']['wq']
  assert mu.sharding.spec == wq.sharding.spec


def test_step_changes_params_and_kl_reference_is_frozen():
  trainer = _make_trainer({'data': 2}, kl_beta=0.1)
  before = trainer.host_params()
  metrics = trainer.step(_rl_batch())
  after = trainer.host_params()
  assert 'kl' in metrics and np.isfinite(metrics['loss'])
  diffs = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
  assert max(diffs) > 0
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, jax.device_get(trainer.reference_params)))


def test_sft_step_reduces_loss():
  model, params = create_model(CONFIG, seed=0)
  trainer = Trainer(model, params, make_optimizer(3e-3), functools.partial(sft_objective, model),
                    make_mesh({'data': 2}))
  tokens = np.tile(np.arange(10, dtype=np.int32), (4, 1))
  batch = {'tokens': tokens, 'loss_mask': np.ones_like(tokens, np.float32)}
  losses = [trainer.step(batch)['loss'] for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]


def test_non_finite_updates_are_skipped_then_stop_the_run():
  """A NaN advantage makes the loss NaN: the update is not applied (params, optimizer state
  and version unchanged); after max_nonfinite_updates in a row, step raises."""
  trainer = _make_trainer({'data': 2}, max_nonfinite_updates=2)
  good = trainer.step(_rl_batch(seed=0))
  assert good['update/skipped'] == 0.0 and trainer.version == 1
  before = trainer.host_params()
  opt_before = jax.tree.map(np.asarray, jax.device_get(trainer.opt_state))
  bad = _rl_batch(seed=1)
  bad = bad.replace(advantages=np.full_like(bad.advantages, np.nan))
  metrics = trainer.step(bad)
  assert metrics['update/skipped'] == 1.0 and not np.isfinite(metrics['loss'])
  assert trainer.version == 1 and trainer.nonfinite_streak == 1
  jax.tree.map(np.testing.assert_array_equal, before, trainer.host_params())
  jax.tree.map(np.testing.assert_array_equal, opt_before,
               jax.tree.map(np.asarray, jax.device_get(trainer.opt_state)))
  # A finite step resets the streak; two bad ones in a row stop.
  trainer.step(_rl_batch(seed=2))
  assert trainer.nonfinite_streak == 0 and trainer.version == 2
  trainer.step(bad)
  with pytest.raises(NonFiniteError, match='2 consecutive updates were non-finite'):
    trainer.step(bad)
  assert trainer.version == 2


def test_huge_learning_rate_diverges_into_skipped_updates():
  """lr = 1e10 makes the params overflow; the guard refuses those updates."""
  trainer = _make_trainer({'data': 1}, learning_rate=1e10, max_nonfinite_updates=100)
  skipped = [trainer.step(_rl_batch(seed=i))['update/skipped'] for i in range(6)]
  assert max(skipped) == 1.0
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(trainer.host_params()))


@pytest.mark.parametrize('axes, message', [
    ({'data': 3, 'fsdp': 3}, 'needs 9 devices'),
    ({'data': -1, 'fsdp': -1}, 'At most one'),
    ({'model': 2}, 'Unknown mesh axes'),
    ({'data': -1, 'fsdp': 3}, 'do not divide'),
])
def test_make_mesh_errors(axes, message):
  with pytest.raises(ValueError, match=message):
    make_mesh(axes)


def test_learning_rate_schedule_values():
  assert learning_rate_schedule(1e-3, 0) == 1e-3  # constant
  schedule = learning_rate_schedule(1e-3, 10)
  values = np.array([float(schedule(i)) for i in range(13)])
  np.testing.assert_allclose(values[[0, 5, 10, 12]], [1e-3, 0.55e-3, 1e-4, 1e-4], rtol=1e-5)
  assert np.all(np.diff(values) <= 0)


@pytest.mark.parametrize('decay_steps, ratio', [(0, 1.0), (1, 0.1)])
def test_lr_decay_steps_config_key_scales_the_second_update(decay_steps, ratio):
  # Two AdamW steps on the same batch: the first update is identical; the second is
  # lr(1) / lr(0) times the constant-lr one (weight decay 0, so exactly that ratio).
  config = load_config_file(str(ROOT / 'configs' / 'default.py'))
  config.rl.weight_decay = 0.0
  deltas = {}
  for steps in (0, decay_steps):
    config.rl.lr_decay_steps = steps
    model, params = create_model(CONFIG, seed=0)
    trainer = roles.build_trainer(config, run_spec(config), model, params,
                                  make_mesh({'data': 1}, jax.devices()[:1]))
    trainer.step(_rl_batch())
    before = jax.device_get(trainer.params)
    trainer.step(_rl_batch())
    deltas[steps] = jax.tree.leaves(jax.tree.map(np.subtract, jax.device_get(trainer.params),
                                                 before))
  assert max(np.abs(d).max() for d in deltas[0]) > 1e-4  # the update is not negligible
  for decayed, constant in zip(deltas[decay_steps], deltas[0]):
    # atol: one float32 ulp of a param near 1 (the norm scales), lost in the subtraction.
    np.testing.assert_allclose(decayed, ratio * constant, rtol=1e-3, atol=1.2e-7)
