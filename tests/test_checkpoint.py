"""Checkpoint writer and reader agree: round trips (resharded onto another mesh), refusal of a
checkpoint that does not fit, the warm-up's checkpoint, in-flight rollouts' state, and the
preemption guard."""

import dataclasses
import functools
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.checkpoint import (Checkpointer, CheckpointError, PreemptionGuard, SaveSchedule,
                                 latest_step)
from rlax_llm.data_types import Rollouts
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer import objectives
from rlax_llm.trainer.trainer import Trainer, make_optimizer

CONFIG = DecoderConfig(vocab_size=64, num_layers=2, embed_dim=32, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)


def _trainer(axes, config=CONFIG):
  model, params = create_model(config, seed=0)
  mesh = make_mesh(axes, jax.devices()[:int(np.prod(list(axes.values())))])
  return Trainer(model, params, make_optimizer(1e-3),
                 functools.partial(objectives.sft_objective, model), mesh)


def _sft_batch(seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, 64, (8, 12)).astype(np.int32)
  return {'tokens': tokens, 'loss_mask': np.ones((8, 12), np.float32)}


def _save(checkpointer, trainer, step, **extra):
  checkpointer.save(step, params=trainer.params, opt_state=trainer.opt_state,
                    trainer=trainer.counters(), controller={'step': step, **extra},
                    rollouts={})
  checkpointer.wait()


def test_restore_reshards_onto_another_mesh(tmp_path):
  """Saved from an 8-way fsdp mesh, restored onto data=2 x fsdp=2 x tensor=2: equal values,
  the target's shardings, and the same next update."""
  source = _trainer({'data': 1, 'fsdp': 8, 'tensor': 1})
  source.step(_sft_batch(0))
  _save(Checkpointer(tmp_path), source, 1)
  target = _trainer({'data': 2, 'fsdp': 2, 'tensor': 2})
  restored = Checkpointer(tmp_path).restore(target.params, target.opt_state)
  assert restored.step == 1 and restored.trainer == {'version': 1, 'nonfinite_streak': 0}
  for got, want, placed in zip(jax.tree.leaves(restored.params), jax.tree.leaves(source.params),
                               jax.tree.leaves(target.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.is_equivalent_to(placed.sharding, got.ndim)
  for got, want in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(source.opt_state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  target.load(restored.params, restored.opt_state, restored.trainer)
  assert target.version == 1
  source.step(_sft_batch(1))
  target.step(_sft_batch(1))
  for a, b in zip(jax.tree.leaves(source.params), jax.tree.leaves(target.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path):
  trainer = _trainer({'data': 1, 'fsdp': 1, 'tensor': 1})
  _save(Checkpointer(tmp_path), trainer, 3)
  listing = sorted(str(p) for p in tmp_path.rglob('*'))
  other = _trainer({'data': 1, 'fsdp': 1, 'tensor': 1},
                   dataclasses.replace(CONFIG, embed_dim=48))
  with pytest.raises(CheckpointError, match=r'does not fit this run\'s params \(.*'
                     r'blocks/attn/wk: saved \(2, 32, 2, 8\) float32, this run \(2, 48, 2, 8\) '
                     r'float32.*Nothing was '
                     r'overwritten'):
    Checkpointer(tmp_path).restore(other.params, other.opt_state)
  assert sorted(str(p) for p in tmp_path.rglob('*')) == listing



def test_checkpoint_with_the_layers_one_by_one_is_refused_saying_how_to_convert(tmp_path):
  """A checkpoint written before the blocks were stacked (``blocks/0/...``, one leaf per
  layer) is refused with one line naming the layout and the way out; nothing changes."""
  trainer = _trainer({'data': 1, 'fsdp': 1, 'tensor': 1})
  blocks = trainer.params['blocks']
  per_layer = dict(trainer.params, blocks={
      i: jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(CONFIG.num_layers)})
  checkpointer = Checkpointer(tmp_path)
  checkpointer.save(2, params=per_layer, opt_state=trainer.opt_state,
                    trainer=trainer.counters(), controller={'step': 2}, rollouts={})
  checkpointer.wait()
  listing = sorted(str(p) for p in tmp_path.rglob('*'))
  with pytest.raises(CheckpointError, match=r'one by one \(blocks/0/\.\.\.\).*'
                     r'rlax_llm\.models\.save_pretrained') as error:
    Checkpointer(tmp_path).restore(trainer.params, trainer.opt_state)
  assert '\n' not in str(error.value)
  assert sorted(str(p) for p in tmp_path.rglob('*')) == listing


def test_keep_and_schedule(tmp_path):
  trainer = _trainer({'data': 1, 'fsdp': 1, 'tensor': 1})
  schedule = SaveSchedule(every_steps=3)
  assert [s for s in range(1, 10) if schedule.due(s)] == [3, 6, 9]
  checkpointer = Checkpointer(tmp_path, keep=2)
  assert latest_step(tmp_path) is None
  for step in (3, 6, 9):
    _save(checkpointer, trainer, step)
  assert checkpointer.steps() == [6, 9]
  assert latest_step(tmp_path) == 9  # from the listing alone (what Ray's driver reads)
  assert Checkpointer(tmp_path).restore(trainer.params, trainer.opt_state).controller == {
      'step': 9}
  with pytest.raises(ValueError, match='checkpoint.keep=0 must be an int >= 1'):
    Checkpointer(tmp_path / 'x', keep=0)


def test_save_schedule_by_time(monkeypatch):
  """``every_seconds`` counts from the last save the controller recorded."""
  now = [100.0]
  monkeypatch.setattr('time.monotonic', lambda: now[0])
  schedule = SaveSchedule(every_seconds=10.0)
  now[0] = 109.0
  assert not schedule.due(1)
  now[0] = 110.0
  assert schedule.due(1)
  schedule.saved()
  assert not schedule.due(2) and not SaveSchedule().due(1)


def test_replicated_arrays_save_without_a_slice_program_on_one_cpu_host(tmp_path, caplog):
  """Params replicated over 8 CPU devices (the smoke config's trainer) save from one replica:
  Orbax's replica-parallel default compiles a ``slice`` per shape and replica (the test
  fails with it); they restore exactly."""
  trainer = _trainer({'data': 8, 'fsdp': 1, 'tensor': 1})
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(trainer.params))
  checkpointer = Checkpointer(tmp_path, async_save=False)
  with jax.log_compiles(), caplog.at_level('WARNING'):
    _save(checkpointer, trainer, 1)
  compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Compiling')]
  assert not compiled, compiled
  restored = checkpointer.restore(trainer.params, trainer.opt_state)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               (restored.params, restored.opt_state), (trainer.params, trainer.opt_state))


def test_warmup_checkpoint_round_trip(tmp_path):
  trainer = _trainer({'data': 1, 'fsdp': 1, 'tensor': 1})
  checkpointer = Checkpointer(tmp_path)
  assert checkpointer.restore_warmup(trainer.params) is None
  checkpointer.save_warmup(trainer.params, {'warmup/loss': 1.5})
  # Restored onto a template of zeros: the values come from the checkpoint, not the template.
  params, metrics = checkpointer.restore_warmup(jax.tree.map(jnp.zeros_like, trainer.params))
  assert metrics == {'warmup/loss': 1.5}
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(trainer.params))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, trainer.params)


def test_rollouts_state_round_trip():
  rng = np.random.RandomState(0)
  rollouts = Rollouts(
      prompt_ids=np.arange(4, dtype=np.int64), group_ids=np.array([0, 0, 1, 1], np.int32),
      prompt_tokens=rng.randint(0, 9, (4, 3)).astype(np.int32),
      prompt_lengths=np.array([3, 2, 3, 1], np.int32),
      completion_tokens=rng.randint(0, 9, (4, 5)).astype(np.int32),
      completion_mask=rng.rand(4, 5) > 0.3,
      behaviour_logprobs=rng.randn(4, 5).astype(np.float32),
      support_sizes=rng.randint(1, 9, (4, 5)).astype(np.int32),
      versions=rng.randint(-1, 3, (4, 5)).astype(np.int32),
      finish_reasons=np.array(['stop', 'length', 'stop', 'stop']),
      completions=['a', 'bé', '', '12'], sampling=SamplingSpec(0.7, 5, 0.9),
      timings={'generate_s': 0.25}, rewards=np.array([1, 0, 0.5, 1], np.float32),
      verifier_errors=2, restarts=None, on_swap='discard')
  arrays, meta = rollouts.to_state()
  back = Rollouts.from_state(arrays, meta)
  for field in dataclasses.fields(Rollouts):
    a, b = getattr(back, field.name), getattr(rollouts, field.name)
    if isinstance(b, np.ndarray):
      np.testing.assert_array_equal(a, b)
      assert a.dtype == b.dtype or field.name == 'finish_reasons', field.name
    else:
      assert a == b, field.name


def test_preemption_guard_turns_sigterm_into_a_flag():
  previous = signal.getsignal(signal.SIGTERM)
  with PreemptionGuard() as guard:
    assert guard.installed and not guard.requested.is_set()
    os.kill(os.getpid(), signal.SIGTERM)
    assert guard.requested.wait(5) and guard.signal_name == 'SIGTERM'
  assert signal.getsignal(signal.SIGTERM) == previous


def test_global_batch_builds_each_device_shard_from_the_host_copy(monkeypatch):
  """The multi-host path (every process holds the whole batch and builds its own devices'
  shards) gives the same global array as device_put; exercised here as one process."""
  from rlax_llm import sharding  # pylint: disable=import-outside-toplevel
  mesh = make_mesh({'data': 4, 'fsdp': 2, 'tensor': 1}, jax.devices()[:8])
  batch = {'tokens': np.arange(16 * 6, dtype=np.int32).reshape(16, 6),
           'adv': np.linspace(-1, 1, 16).astype(np.float32)}
  single = sharding.global_batch(batch, mesh)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)  # take the multi-process branch
  multi = sharding.global_batch(batch, mesh)
  for name in batch:
    np.testing.assert_array_equal(np.asarray(multi[name]), batch[name])
    assert multi[name].sharding == single[name].sharding
    assert len(multi[name].addressable_shards) == 8
