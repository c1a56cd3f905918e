"""Trainer: the sharded step on 8 fake devices matches one device; versions count updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models.decoder import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.trainer.objectives import RLLossConfig, rl_objective, sft_objective
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.trainer import Trainer, make_optimizer
from rlax_llm.types import TrainBatch

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
      advantages=rng.randn(batch).astype(np.float32),
      versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(batch // 4), 4).astype(np.int32))


def _make_trainer(mesh_shape, kl_beta=0.0):
  model, params = create_model(CONFIG, seed=0)
  loss_config = RLLossConfig(kl_beta=kl_beta)
  objective = lambda m, p, b, ref: rl_objective(m, p, b, ref, loss_config)
  mesh = make_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
  return Trainer(model, params, make_optimizer(1e-2), objective, mesh,
                 frozen_params=params if kl_beta > 0 else None)


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


def test_params_are_actually_sharded():
  trainer = _make_trainer({'fsdp': 4, 'tensor': 2})
  wq = trainer.params['blocks'][0]['attn']['wq']  # ('embed', 'heads', 'head_dim')
  assert wq.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor', None)
  assert len(wq.addressable_shards) == 8
  assert wq.addressable_shards[0].data.shape == (32 // 4, 4 // 2, 8)
  # Optimizer state follows the params' shardings.
  mu = trainer.opt_state[1][0].mu['blocks'][0]['attn']['wq']
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
               jax.tree.map(np.asarray, jax.device_get(trainer.frozen_params)))


def test_sft_step_reduces_loss():
  model, params = create_model(CONFIG, seed=0)
  trainer = Trainer(model, params, make_optimizer(3e-3), sft_objective, make_mesh({'data': 2}))
  tokens = np.tile(np.arange(10, dtype=np.int32), (4, 1))
  batch = {'tokens': tokens, 'loss_mask': np.ones_like(tokens, np.float32)}
  losses = [trainer.step(batch)['loss'] for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize('axes, message', [
    ({'data': 3, 'fsdp': 3}, 'needs 9 devices'),
    ({'data': -1, 'fsdp': -1}, 'At most one'),
    ({'model': 2}, 'Unknown mesh axes'),
    ({'data': -1, 'fsdp': 3}, 'do not divide'),
])
def test_make_mesh_errors(axes, message):
  with pytest.raises(ValueError, match=message):
    make_mesh(axes)
