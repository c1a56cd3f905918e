"""LoRA: forward and gradients equal the merged model's, only adapters train, the PEFT export
loads in peft + transformers with our merged logits, checkpoints round-trip bitwise."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from smoke_config import smoke_config  # tests/smoke_config.py

from rlax_llm import checkpoint as checkpoint_lib
from rlax_llm.backends import local as local_backend
from rlax_llm.config import run_spec, validate_config
from rlax_llm.errors import ConfigError
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.files.pretrained import save_pretrained
from rlax_llm.models.model import create_model
from rlax_llm.models.quant import Int8Weight
from rlax_llm.paramserver.shards import leaf_specs
from rlax_llm.sharding import make_mesh, param_shardings
from rlax_llm.trainer.trainer import Trainer

CONFIG = DecoderConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=16, tie_embeddings=False)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 7)), jnp.int32)


def _lora(targets=lora_lib.TARGETS, rank=4, alpha=8.0, seed=0):
  """A tiny LoRA model whose B factors are random (fresh ones are zeros: no signal)."""
  base, params = create_model(CONFIG, seed=seed)
  model, params = lora_lib.create(base, params, lora_lib.LoRAConfig(rank, alpha, targets))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: (0.1 * jax.random.normal(next(keys), x.shape, x.dtype)
                       if lora_lib.is_adapter_path(path) and path[-1].key == 'b' else x),
      params)
  return model, params


def test_config_is_validated():
  with pytest.raises(ConfigError, match='rank'):
    lora_lib.LoRAConfig(0, 1.0)
  with pytest.raises(ConfigError, match='targets'):
    lora_lib.LoRAConfig(2, 1.0, ('q', 'lm_head'))
  assert lora_lib.LoRAConfig(2, 4.0, ('down', 'q')).targets == ('q', 'down')
  with pytest.raises(ConfigError, match='sync_dtype'):
    lora_lib.LoRAConfig(2, 1.0, sync_dtype='float16')
  with pytest.raises(ConfigError, match="lora.sync='merged' pushes merged"):
    lora_lib.LoRAConfig(2, 1.0, sync='merged', sync_dtype='bfloat16')
  # The run config's boundary says the same before anything is built.
  for fields, seen in [({'lora__sync_dtype': 'bfloat16'}, 'lora.rank=0'),
                       ({'lora__rank': 2, 'lora__sync': 'merged',
                         'lora__sync_dtype': 'bfloat16'}, "lora.sync='merged'"),
                       ({'lora__rank': 2, 'lora__sync_dtype': 'float16'}, 'sync_dtype')]:
    with pytest.raises(ConfigError, match=seen):
      validate_config(smoke_config(**fields))


def test_fresh_adapters_leave_the_model_unchanged_and_init_like_peft():
  base, params = create_model(CONFIG)
  model, lparams = lora_lib.create(base, params, lora_lib.LoRAConfig(4, 8.0, ('q', 'o')))
  np.testing.assert_array_equal(model.apply(lparams, TOKENS), base.apply(params, TOKENS))
  adapter = lparams['blocks']['attn']['wo_lora']  # stacked over the layers, as the blocks
  assert adapter['a'].shape == (2, 4, 8, 4) and adapter['b'].shape == (2, 4, 32)
  bound = (4 * 8) ** -0.5  # kaiming_uniform(a=sqrt(5)) over fan_in = heads * head_dim
  assert 0.5 * bound < np.abs(adapter['a']).max() <= bound
  assert not np.any(adapter['b'])
  axes = model.logical_axes()['blocks']['attn']
  assert tuple(axes['wo_lora']['a']) == ('layers', 'heads', 'head_dim', None)
  assert tuple(axes['wo_lora']['b']) == ('layers', None, 'embed')
  assert tuple(axes['wq_lora']['b']) == ('layers', None, 'heads', 'head_dim')
  assert 'wk_lora' not in axes


@pytest.mark.parametrize('targets', [lora_lib.TARGETS, ('v', 'down')])
def test_forward_and_gradient_equal_the_merged_models(targets):
  model, params = _lora(targets)
  base, merged = lora_lib.merge(model, params)
  assert not any(lora_lib.is_adapter_path(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(merged))
  np.testing.assert_allclose(model.apply(params, TOKENS), base.apply(merged, TOKENS),
                             rtol=1e-5, atol=1e-5)
  cotangent = jax.random.normal(jax.random.key(3), (2, 7, 48))
  loss = lambda m, p: jnp.sum(m.apply(p, TOKENS) * cotangent)
  grads = jax.grad(functools.partial(loss, model))(params)
  merged_grads = jax.grad(functools.partial(loss, base))(merged)
  scale = model.lora.scale
  for i in range(CONFIG.num_layers):
    for target in targets:
      part, name, _, _ = lora_lib._WEIGHTS[target]
      adapter = params['blocks'][part][name + lora_lib.SUFFIX]
      a = adapter['a'][i].reshape(-1, 4)
      b = adapter['b'][i].reshape(4, -1)
      g_w = merged_grads['blocks'][part][name][i].reshape(a.shape[0], b.shape[1])
      got = jax.tree.map(lambda x, i=i: x[i], grads['blocks'][part][name + lora_lib.SUFFIX])
      # d/dA <G, s A B> = s G B^T; d/dB = s A^T G.
      np.testing.assert_allclose(got['a'].reshape(a.shape), scale * g_w @ b.T,
                                 rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(got['b'].reshape(b.shape), scale * a.T @ g_w,
                                 rtol=1e-4, atol=1e-5)


def _trainer(model, params):
  objective = lambda p, batch, ref: (
      -jnp.mean(jax.nn.log_softmax(model.apply(p, batch['tokens']))[..., 0]), {})
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  return Trainer(model, params, optax.adamw(1e-2), objective, mesh,
                 trainable=lora_lib.trainable_mask(model))


def test_only_the_adapters_train():
  model, params = _lora(('q', 'v', 'up'))
  host = jax.tree.map(np.asarray, params)
  trainer = _trainer(model, params)
  # Optimizer state only for the adapters: adam's two moments of each A and B.
  adapter_sizes = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(host)
                      if lora_lib.is_adapter_path(p))
  moment_sizes = sum(x.size for x in jax.tree.leaves(trainer.opt_state) if x.ndim)
  assert moment_sizes == 2 * adapter_sizes
  metrics = trainer.step({'tokens': TOKENS})
  assert metrics['update/skipped'] == 0 and trainer.version == 1
  after = trainer.host_params()
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(host),
                              jax.tree.leaves(after)):
    if lora_lib.is_adapter_path(path):
      assert not np.array_equal(old, new), path
    else:
      np.testing.assert_array_equal(old, new, err_msg=str(path))


def test_checkpoint_round_trip_is_bitwise(tmp_path):
  model, params = _lora(('k', 'o', 'gate', 'down'))
  trainer = _trainer(model, params)
  trainer.step({'tokens': TOKENS})
  checkpointer = checkpoint_lib.Checkpointer(tmp_path, async_save=False)
  checkpointer.save(1, params=trainer.params, opt_state=trainer.opt_state,
                    trainer=trainer.counters(), controller={}, rollouts={})
  fresh = _trainer(model, _lora(('k', 'o', 'gate', 'down'), seed=5)[1])
  restored = checkpointer.restore(fresh.params, fresh.opt_state)
  checkpointer.close()
  fresh.load(restored.params, restored.opt_state, restored.trainer)
  for want, got in zip(jax.tree.leaves((trainer.params, trainer.opt_state)),
                       jax.tree.leaves((fresh.params, fresh.opt_state))):
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
  # The resumed trainer's next step is the original's, bit for bit.
  trainer.step({'tokens': TOKENS})
  fresh.step({'tokens': TOKENS})
  for want, got in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(fresh.params)):
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def test_peft_export_loads_in_peft_and_transformers(tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  peft = pytest.importorskip('peft')
  base_model, base_params = create_model(CONFIG)  # _lora's base
  model, params = _lora()
  base, merged = lora_lib.merge(model, params)
  save_pretrained(nnx.merge(base_model.graphdef, base_params), None, tmp_path / 'base')
  lora_lib.save_peft(model, params, tmp_path / 'adapter', base_model=str(tmp_path / 'base'))
  lora_lib.save_merged(model, params, None, tmp_path / 'merged')
  config = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  assert config['r'] == 4 and config['lora_alpha'] == 8.0
  reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'base')
  peft_model = peft.PeftModel.from_pretrained(reference, tmp_path / 'adapter').eval()
  ours = np.asarray(base.apply(merged, TOKENS))
  with torch.no_grad():
    theirs = peft_model(torch.tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'merged').eval()(
        torch.tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
  # The adapters matter: the base alone is far from the merged model.
  assert np.abs(np.asarray(base_model.apply(base_params, TOKENS)) - ours).max() > 1e-2
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
  np.testing.assert_allclose(exported, ours, atol=1e-4, rtol=0)


def _int8_wire(x: np.ndarray, factor: str) -> Int8Weight:
  """numpy's int8 wire factor, layer by layer (``x`` is stacked over the layers)."""
  layers = [_int8_wire_layer(layer, factor) for layer in x]
  return Int8Weight(q=np.stack([w.q for w in layers]), scale=np.stack([w.scale for w in layers]))


def _int8_wire_layer(x: np.ndarray, factor: str) -> Int8Weight:
  """One layer's int8 wire factor: the rank axis (A's last, B's first) gets one scale per
  component, max |x| / 127 over the rest (1 where all are zero), q = round(x / scale)."""
  axis = x.ndim - 1 if factor == 'a' else 0
  moved = np.moveaxis(x, axis, 0)
  flat = moved.reshape(moved.shape[0], -1)
  amax = np.abs(flat).max(axis=1)
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  q = np.clip(np.round(flat / scale[:, None]), -127, 127).astype(np.int8)
  return Int8Weight(q=np.moveaxis(q.reshape(moved.shape), 0, axis), scale=scale)


@pytest.mark.parametrize('sync_dtype', lora_lib.SYNC_DTYPES)
def test_a_local_run_with_lora_trains_the_adapters_and_pushes_them(tmp_path, sync_dtype):
  """lora.sync='adapters' (the default): the server's versions are the adapter trees alone
  (bitwise the trainer's, or with lora.sync_dtype='bfloat16' their bfloat16 rounding, half
  the bytes, or with 'int8' an int8 factor and a float32 scale per rank component, a quarter
  of the bytes and 2 r floats), the base server holds the frozen base; the worker samples
  with the base merged with the adapters it received. (lora.sync='merged' pushes the merged
  weights: tests/test_lora_run.py.)"""
  config = smoke_config(lora__rank=2, lora__targets='q,v,down', log__tensorboard=False,
                        eval__every_steps=0, total_steps=2, lora__sync_dtype=sync_dtype)
  with local_backend.build_run(config, tmp_path, run_spec(config)) as r:
    handle = r.controller.trainer
    start = handle.host_params().result()
    r.execute()
    trainer = handle.trainer
    end = handle.host_params().result()
    server, base_server = handle.server, handle.base_server
    pushed = server.get(server.latest_version()).params
    worker = r.controller.workers[0].worker
    held = worker.version, worker.engine, worker.params
  assert isinstance(trainer.model, lora_lib.LoRAModel) and trainer.version >= 1
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(start), jax.tree.leaves(end)):
    if lora_lib.is_adapter_path(path) and path[-1].key == 'b':
      assert np.any(new), path  # B starts at zeros: the adapters trained
    elif not lora_lib.is_adapter_path(path):
      np.testing.assert_array_equal(old, new, err_msg=str(path))  # the base is frozen
  merged = lora_lib.merge(trainer.model, end)[1]
  # The versions are the adapters alone, bitwise (in the sync dtype); the base went once, to
  # its own server.
  trained = lora_lib.adapter_tree(end)
  if sync_dtype == 'int8':  # q = round(x / scale), scale = max |x| / 127 per rank component
    synced = jax.tree_util.tree_map_with_path(lambda p, x: _int8_wire(np.asarray(x), p[-1].key),
                                              trained)
    # rank 2: 2 float32 per factor and layer (the factors are stacked over the layers)
    scale_bytes = sum(x.shape[0] for x in jax.tree.leaves(trained)) * 2 * 4
  else:
    synced = jax.tree.map(lambda x: np.asarray(x).astype(jnp.dtype(sync_dtype)), trained)
    scale_bytes = 0
  # (XLA's max / 127 may be a multiply by 1 / 127: an ulp apart from numpy's division.)
  check = np.testing.assert_array_equal if sync_dtype != 'int8' else functools.partial(
      np.testing.assert_allclose, rtol=3e-7, atol=0)
  jax.tree.map(check, pushed, synced)
  wire = {'float32': {np.float32}, 'bfloat16': {jnp.bfloat16}, 'int8': {np.int8, np.float32}}
  assert {np.asarray(x).dtype for x in jax.tree.leaves(pushed)} == set(map(np.dtype,
                                                                          wire[sync_dtype]))
  assert sum(np.asarray(x).nbytes for x in jax.tree.leaves(pushed)) == sum(
      x.nbytes for x in jax.tree.leaves(trained)) * jnp.dtype(sync_dtype).itemsize // 4 + (
          scale_bytes)
  assert base_server.versions() == [0]
  jax.tree.map(np.testing.assert_array_equal, base_server.get(0).params,
               lora_lib.base_tree(end))
  # The worker merged the version it holds (as the server holds it) into the base: the merged
  # weights, in its layout.
  version, engine, params = held
  assert version == trainer.version
  merge = lora_lib.merge_program(trainer.model)
  want = engine.place_params(merge(lora_lib.with_adapters(lora_lib.base_tree(end), pushed)))
  jax.tree.map(np.testing.assert_array_equal, params, want)
  exact = engine.place_params(merge(end))
  rounded = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                        jax.tree.leaves(exact)))
  assert rounded == (sync_dtype != 'float32')  # bfloat16 adapters: another policy
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(lora_lib.merge_program(
      trainer.model)(end)), strict=True):  # the program is merge's (eager and jitted agree)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_adapter_and_base_trees_split_and_join_the_params():
  _, params = _lora(targets=('q', 'down'))
  adapters, base = lora_lib.adapter_tree(params), lora_lib.base_tree(params)
  paths = lambda tree: [jax.tree_util.keystr(p) for p, _ in
                        jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert paths(adapters) == [p for p in paths(params) if '_lora' in p]
  assert paths(base) == [p for p in paths(params) if '_lora' not in p]
  assert set(adapters['blocks']) == {'attn', 'mlp'}
  assert set(adapters['blocks']['attn']) == {'wq_lora'}
  joined = lora_lib.with_adapters(base, adapters)
  assert jax.tree.structure(joined) == jax.tree.structure(params)
  assert all(a is b for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(params)))
  with pytest.raises(ConfigError, match='sync'):
    lora_lib.LoRAConfig(2, 1.0, sync='deltas')


def test_the_merge_is_the_same_bits_on_any_mesh():
  """``delta`` sums the rank's outer products in a fixed order: merging on one device or
  sharded over eight gives the same bits (a worker merges what a trainer would)."""
  model, params = _lora(rank=3)
  program = lora_lib.merge_program(model)
  one = program(params)
  mesh = make_mesh({'data': 1, 'fsdp': 4, 'tensor': 2})
  sharded = jax.device_put(params, param_shardings(params, model.logical_axes(), mesh))
  jax.tree.map(np.testing.assert_array_equal, program(sharded), one)


def test_the_int8_wire_rounds_each_rank_component_within_half_a_step():
  """lora.sync_dtype='int8': each factor travels as int8 with one float32 scale per rank
  component (A's columns, B's rows), each element within half a step of the trained value; the
  tree a worker expects (from the abstract params) is the one a trainer pushes; the policy the
  workers merge is the rounded adapters', close to the trained one but not the same bits."""
  model, params = _lora(rank=4)
  node = params['blocks']['mlp']['w_down_lora']
  node['b'] = node['b'].at[1].set(0)  # layer 1's B untrained: all zeros travel exactly
  lora = dataclasses.replace(model.lora, sync_dtype='int8')
  trained = lora_lib.adapter_tree(params)
  wire = lora_lib.synced_adapters(lora, trained)
  factors = jax.tree_util.tree_leaves_with_path(
      wire, is_leaf=lambda x: isinstance(x, Int8Weight))
  assert len(factors) == len(jax.tree.leaves(trained)) == 2 * 7  # factors stacked over layers
  for (path, w), x in zip(factors, jax.tree.leaves(trained), strict=True):
    assert isinstance(w, Int8Weight) and w.q.dtype == jnp.int8 and w.q.shape == x.shape
    # Stacked over the layers: a scale per layer and rank component.
    rank_axis = x.ndim - 1 if path[-1].key == 'a' else 1
    assert w.scale.shape == (x.shape[0], 4) and w.scale.dtype == jnp.float32
    scale = np.expand_dims(np.asarray(w.scale),
                           [a for a in range(1, x.ndim) if a != rank_axis])
    error = np.abs(np.asarray(w.q, np.float32) * scale - np.asarray(x))
    assert np.all(error <= scale / 2 * (1 + 1e-6)), jax.tree_util.keystr(path)
    peak = np.abs(np.asarray(w.q)).max(
        axis=tuple(a for a in range(1, x.ndim) if a != rank_axis))
    nonzero = np.any(np.asarray(x).reshape(x.shape[0], -1), axis=1)[:, None]
    assert np.all(peak == np.where(nonzero, 127, 0)), jax.tree_util.keystr(path)
  np.testing.assert_array_equal(wire['blocks']['mlp']['w_down_lora']['b'].q[1], 0)
  # The worker's expected tree (rollout.worker: from the abstract params) is the pushed one.
  expected = lora_lib.synced_adapters(lora, lora_lib.adapter_tree(model.abstract_params()))
  assert jax.tree.structure(expected) == jax.tree.structure(wire)
  assert leaf_specs(expected) == leaf_specs(wire)
  # A quarter of float32's bytes, plus 4 bytes per rank component of every factor.
  assert sum(x.nbytes for x in jax.tree.leaves(wire)) == sum(
      x.nbytes for x in jax.tree.leaves(trained)) // 4 + len(factors) * CONFIG.num_layers * 4 * 4
  # The workers' policy: the base merged with the dequantised adapters.
  base = lora_lib.base_tree(params)
  merged = lora_lib.merge_program(model)(lora_lib.with_adapters(base, wire))
  dequantised = jax.tree_util.tree_map_with_path(
      lambda path, w: lora_lib.wire_factor(w, path[-1].key), wire,
      is_leaf=lambda x: isinstance(x, Int8Weight))
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7), merged,
               lora_lib.merge(model, lora_lib.with_adapters(base, dequantised))[1])
  base_model = lora_lib.merge(model, params)[0]
  ours, exact, untuned = (np.asarray(base_model.apply(p, TOKENS))
                          for p in (merged, lora_lib.merge(model, params)[1], base))
  # The rounding moves the logits, by a few percent of what the adapters move them.
  assert 0 < np.abs(ours - exact).max() < 0.05 * np.abs(exact - untuned).max()
