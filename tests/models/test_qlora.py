"""QLoRA (``lora.base_quant='int8'``): LoRA adapters over an int8 base. Forward and adapter
gradients equal those over the dequantised base; the trainer holds int8 projections and trains
only the adapters; a tiny run trains, round-trips its checkpoint, and its workers sample with
the policy the trainer recomputes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from recorded_run import recorded_run  # tests/recorded_run.py
from smoke_config import smoke_config  # tests/smoke_config.py

from rlax_llm import checkpoint as checkpoint_lib
from rlax_llm.config import validate_config
from rlax_llm.data_types import make_train_batch
from rlax_llm.errors import ConfigError
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.models.quant import PROJECTIONS, Int8Weight, dequantize
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.scoring import Policy
from rlax_llm.trainer.trainer import Trainer, learning_rate_schedule, make_optimizer

CONFIG = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=16, tie_embeddings=False)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 7)), jnp.int32)
TARGETS = ('q', 'o', 'up', 'down')


def _random_b(params, seed):
  """``params`` with random adapter B factors (fresh ones are zeros: no signal)."""
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (0.1 * jax.random.normal(next(keys), x.shape, x.dtype)
                       if lora_lib.is_adapter_path(path) and path[-1].key == 'b' else x),
      params, is_leaf=lambda x: isinstance(x, Int8Weight))


def _qlora(seed=0, config=CONFIG):
  """A tiny QLoRA model (int8 base, float32 adapters on ``TARGETS``, random B), and the same
  adapters over the dequantised base (a float32 ``LoRAModel``)."""
  base, params = create_model(config, seed=seed)
  lora = lora_lib.LoRAConfig(4, 8.0, TARGETS, base_quant='int8')
  model, quantised = lora_lib.create(base, params, lora)
  quantised = _random_b(quantised, seed + 1)
  reference = lora_lib.lora_model(base, lora_lib.LoRAConfig(4, 8.0, TARGETS))
  return model, quantised, reference, lora_lib.dequantized(model, quantised)


def _projections(params):
  return [w for part in params['blocks'].values() for name, w in part.items()
          if name in PROJECTIONS]


def test_config_is_validated():
  with pytest.raises(ConfigError, match='base_quant'):
    lora_lib.LoRAConfig(2, 1.0, base_quant='nf4')
  assert lora_lib.from_config(smoke_config(lora__rank=2, lora__base_quant='int8')).base_quant \
      == 'int8'
  for fields, match in (({'lora__base_quant': 'int8'}, 'lora.rank > 0'),
                        ({'lora__base_quant': 'fp4', 'lora__rank': 2}, 'base_quant'),
                        ({'lora__base_quant': 'int8', 'lora__rank': 2,
                          'model__batch_invariant': True}, 'batch_invariant')):
    with pytest.raises(ConfigError, match=match):
      validate_config(smoke_config(**fields))


def test_create_quantises_every_projection_and_keeps_the_rest():
  base, params = create_model(CONFIG, seed=0)
  model, quantised = lora_lib.create(base, params, lora_lib.LoRAConfig(2, 4.0, ('v',),
                                                                       base_quant='int8'))
  layout = CONFIG.execution.weight_layout
  block, source = quantised['blocks'], params['blocks']
  for part in ('attn', 'mlp'):
    for name, w in block[part].items():
      if name in PROJECTIONS:
        assert isinstance(w, Int8Weight) and w.q.dtype == jnp.int8, name
        # One scale per layer and output channel.
        assert w.scale.dtype == jnp.float32 and w.scale.shape[0] == CONFIG.num_layers
        assert w.scale.ndim == 2
        # Per output channel: within half a step of the float32 weight.
        err = np.abs(np.asarray(dequantize(w, layout)) - np.asarray(source[part][name]))
        assert err.max() <= np.asarray(w.scale).max() / 2 + 1e-7
  np.testing.assert_array_equal(quantised['embed'], params['embed'])
  # The model's abstract params and logical axes describe the int8 tree (sharding, restore).
  assert jax.tree.structure(model.abstract_params()) == jax.tree.structure(quantised)
  wq_axes = model.logical_axes()['blocks']['attn']['wq']
  assert isinstance(wq_axes, Int8Weight)


def test_forward_and_adapter_gradients_equal_the_dequantised_bases():
  model, quantised, reference, dequantised = _qlora()
  np.testing.assert_allclose(model.apply(quantised, TOKENS), reference.apply(dequantised, TOKENS),
                             rtol=1e-5, atol=1e-5)
  # The merged model is the dequantised base plus the adapters.
  base, merged = lora_lib.merge(model, quantised)
  assert {x.dtype for x in jax.tree.leaves(merged)} == {jnp.dtype(jnp.float32)}
  np.testing.assert_allclose(base.apply(merged, TOKENS), reference.apply(dequantised, TOKENS),
                             rtol=1e-5, atol=1e-5)
  cotangent = jax.random.normal(jax.random.key(3), (2, 7, 48))

  def adapter_grads(m, params):
    base_part, adapters = lora_lib.base_tree(params), lora_lib.adapter_tree(params)
    loss = lambda a: jnp.sum(m.apply(lora_lib.with_adapters(base_part, a), TOKENS) * cotangent)
    return jax.grad(loss)(adapters)
  got, want = adapter_grads(model, quantised), adapter_grads(reference, dequantised)
  assert jax.tree.leaves(got)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5), got, want)


@pytest.mark.parametrize('policy', ['full', 'dots'])
def test_remat_gives_the_same_adapter_gradients(policy):
  """Rematerialised blocks (the scan body a ``jax.checkpoint``) recompute over the int8
  base and the adapters alike."""
  (model, params, _, _), (remat, same, _, _) = _qlora(), _qlora(
      config=CONFIG.with_execution(remat=policy))
  jax.tree.map(np.testing.assert_array_equal, params, same)

  def adapter_grads(m):
    base_part, adapters = lora_lib.base_tree(params), lora_lib.adapter_tree(params)
    loss = lambda a: jnp.mean(jax.nn.log_softmax(
        m.apply(lora_lib.with_adapters(base_part, a), TOKENS))[..., 3])
    return jax.jit(jax.value_and_grad(loss))(adapters)
  (l0, g0), (l1, g1) = adapter_grads(model), adapter_grads(remat)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  assert jax.tree.leaves(g1)
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-6), g1, g0)


def _trainer(model, params, optimizer=None):
  """A one-device trainer of ``model``'s adapters (a toy objective)."""
  loss = lambda p, batch, ref: (jnp.mean(model.apply(p, batch['tokens']) ** 2), {})
  return Trainer(model, params, optimizer or optax.adamw(1e-2), loss, make_mesh({'data': 1}, jax.devices()[:1]),
                 trainable=lora_lib.trainable_mask(model))


def test_the_trainer_holds_an_int8_base_and_trains_only_the_adapters():
  model, quantised, _, _ = _qlora()
  float_base = lora_lib.dequantized(model, quantised)
  trainer = _trainer(model, quantised)
  projections = _projections(trainer.params)
  assert len(projections) == 7  # each stacked over the layers
  assert all(w.q.shape[0] == CONFIG.num_layers for w in projections)
  for w in projections:  # one byte per weight, four per output channel's scale
    assert isinstance(w, Int8Weight) and w.q.dtype == jnp.int8
    assert w.q.nbytes == w.q.size and w.scale.nbytes == 4 * w.scale.size
  int8_bytes = sum(w.q.nbytes + w.scale.nbytes for w in projections)
  float_bytes = sum(w.nbytes for w in _projections(float_base))
  assert int8_bytes < 0.3 * float_bytes
  adapter_sizes = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(quantised)
                      if lora_lib.is_adapter_path(p))
  assert sum(x.size for x in jax.tree.leaves(trainer.opt_state) if x.ndim) == 2 * adapter_sizes
  host = jax.tree.map(np.asarray, quantised)
  assert trainer.step({'tokens': TOKENS})['update/skipped'] == 0
  after = trainer.host_params()
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(host), jax.tree.leaves(after)):
    if lora_lib.is_adapter_path(path):
      assert not np.array_equal(old, new), path
    else:  # the int8 base (q and scale) and the rest, bitwise
      assert old.dtype == new.dtype
      np.testing.assert_array_equal(old, new, err_msg=str(path))


def test_a_tiny_run_trains_samples_the_trainers_policy_and_round_trips(tmp_path):
  """configs/default.py:smoke with lora.rank=2 and lora.base_quant='int8' (adapter-only sync,
  float32 workers): the base pushed once is the dequantised int8 base, and the behaviour
  log-probs the worker records are the trainer's recompute on the same tokens (1e-5)."""
  # Three steps: with the stacked layers' draws of this seed, both versions a two-step run
  # samples still have B = 0 (nothing trained yet is sampled).
  config = smoke_config(lora__rank=2, lora__base_quant='int8', log__tensorboard=False,
                        eval__every_steps=0, checkpoint__every_steps=1,
                        checkpoint__async_save=False, total_steps=3)
  worker, sampled, start, final, model = recorded_run(config, tmp_path)
  assert isinstance(model, lora_lib.LoRAModel) and model.lora.base_quant == 'int8'
  assert all(isinstance(w, Int8Weight) and w.q.dtype == np.int8 for w in _projections(final))
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(start), jax.tree.leaves(final)):
    if lora_lib.is_adapter_path(path) and path[-1].key == 'b':
      assert np.any(new), path  # B starts at zeros: the adapters trained
    elif not lora_lib.is_adapter_path(path):
      np.testing.assert_array_equal(old, new, err_msg=str(path))  # the int8 base is frozen
  # The worker's base is the dequantised int8 base (float32), pulled once.
  jax.tree.map(np.testing.assert_array_equal,
               worker.receiver._base,  # pylint: disable=protected-access
               lora_lib.dequantized(model, lora_lib.base_tree(start)))
  # Sampler and trainer agree on the policy: the trainer's recompute (int8 base, adapters of
  # the version sampled) of the worker's tokens is its behaviour log-probs.
  checked, trained = 0, False
  for held, _, rollouts in sampled:
    if rollouts.sampling.greedy:
      continue
    params = lora_lib.with_adapters(lora_lib.base_tree(start), held)
    batch = make_train_batch(rollouts, np.zeros(len(rollouts), np.float32))
    mask = np.asarray(batch.loss_mask[:, 1:]) > 0
    logp = Policy(model, rollouts.sampling).sequence_log_probs(
        params, jnp.asarray(batch.tokens), jnp.asarray(batch.support_sizes)).logp
    np.testing.assert_allclose(np.asarray(logp)[mask],
                               np.asarray(batch.behaviour_logprobs[:, 1:])[mask],
                               atol=1e-5, rtol=0)
    checked += 1
    trained |= any(np.any(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(held)
                   if path[-1].key == 'b')
  assert checked and trained  # a version with trained adapters among those checked
  # The last checkpoint restores the int8 base and the adapters bitwise.
  checkpointer = checkpoint_lib.Checkpointer(tmp_path, async_save=False)
  optimizer = make_optimizer(learning_rate_schedule(config.rl.learning_rate),
                             weight_decay=config.rl.weight_decay,
                             max_grad_norm=config.rl.max_grad_norm)  # the run's structure
  fresh = _trainer(model, final, optimizer)
  restored = checkpointer.restore(fresh.params, fresh.opt_state)
  checkpointer.close()
  assert restored is not None
  assert all(isinstance(w, Int8Weight) for w in _projections(restored.params))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.params),
               jax.tree.map(np.asarray, final))
