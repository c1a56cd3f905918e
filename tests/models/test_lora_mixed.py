"""LoRA's MLP targets (``gate, up, down``) on a stack mixing dense and MoE layers (Qwen3-MoE's
``mlp_only_layers``): adapters on the dense runs' MLPs only (the experts have none), a step
that trains them and leaves the base bitwise, the merge's logits, the PEFT export's tensors
on transformers' model with our merged logits, and the refusal where no layer is dense."""

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlax_llm.errors import ConfigError
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.files.pretrained import save_pretrained
from rlax_llm.models.model import create_model
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.models.quant import Int8Weight
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.trainer import Trainer

os.environ.setdefault('HF_HUB_OFFLINE', '1')

TINY = TINY_MOE_PRESETS['tiny-qwen3-moe']
# dense, dense, MoE, MoE, dense: three runs, two of them dense (tests/models/test_moe_mixed.py)
MIXED = dataclasses.replace(TINY, num_layers=5, mlp_only_layers=(0, 1, 4))
TARGETS = ('q', 'gate', 'up', 'down')
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, 48, (2, 7)), jnp.int32)


@functools.cache
def _models():
  """``(base, base params, LoRA model, its params)`` of ``MIXED`` with ``TARGETS``, each B
  factor random (fresh ones are zeros: no signal)."""
  base, params = create_model(MIXED, seed=0)
  model, lparams = lora_lib.create(base, params, lora_lib.LoRAConfig(4, 8.0, TARGETS), seed=1)
  return base, params, model, _random_b(lparams)


def _random_b(params):
  """``params`` with each adapter's B factor random (0.1 N(0, 1))."""
  keys = iter(jax.random.split(jax.random.key(2), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (0.1 * jax.random.normal(next(keys), x.shape, x.dtype)
                       if lora_lib.is_adapter_path(path) and path[-1].key == 'b' else x),
      params)


def _adapters(params):
  """``{(run name, module, adapter name)}`` of every adapter in ``params``."""
  return {(path[0].key, path[1].key, path[2].key)
          for path, _ in jax.tree_util.tree_leaves_with_path(params)
          if lora_lib.is_adapter_path(path)}


def test_mlp_targets_adapt_the_dense_runs_and_not_the_experts():
  _, _, model, params = _models()
  runs = MIXED.layer_runs()
  assert [(r.name, r.moe) for r in runs] == [('blocks', False), ('blocks_1', True),
                                             ('blocks_2', False)]
  mlp = {'w_gate_lora', 'w_up_lora', 'w_down_lora'}
  expected = {(r.name, 'attn', 'wq_lora') for r in runs} | {
      (r.name, 'mlp', name) for r in runs if not r.moe for name in mlp}
  assert _adapters(params) == expected
  assert not any(k.endswith(lora_lib.SUFFIX) for k in params['blocks_1']['moe'])
  assert params['blocks']['mlp']['w_up_lora']['a'].shape == (2, MIXED.embed_dim, 4)
  assert params['blocks_2']['mlp']['w_down_lora']['b'].shape == (1, 4, MIXED.embed_dim)
  assert lora_lib.run_targets(model.lora, runs[1].moe) == ('q',)
  assert lora_lib.run_targets(model.lora, runs[0].moe) == TARGETS
  # the trainable mask marks these adapters and nothing else
  mask = lora_lib.trainable_mask(model)
  marked = {path for path, leaf in jax.tree_util.tree_leaves_with_path(mask) if leaf}
  assert {(p[0].key, p[1].key, p[2].key) for p in marked} == expected
  assert sum(jax.tree.leaves(mask)) == 2 * len(expected)


def test_a_step_trains_the_dense_runs_adapters_and_leaves_the_base():
  """Gradients reach the dense runs' MLP adapters (and every run's attention adapter); a
  trainer step changes those and nothing of the base, the experts included."""
  _, _, model, params = _models()
  loss = lambda p: -jnp.mean(jax.nn.log_softmax(model.apply(p, TOKENS))[..., 0])
  grads = jax.grad(loss)(params)
  for run, module, name in _adapters(params):
    for factor in 'ab':
      assert float(jnp.abs(grads[run][module][name][factor]).max()) > 0, (run, name, factor)
  host = jax.tree.map(np.asarray, params)
  objective = lambda p, batch, ref: (
      -jnp.mean(jax.nn.log_softmax(model.apply(p, batch['tokens']))[..., 0]), {})
  trainer = Trainer(model, params, optax.adamw(1e-2), objective,
                    make_mesh({'data': 1}, jax.devices()[:1]),
                    trainable=lora_lib.trainable_mask(model))
  assert trainer.step({'tokens': TOKENS})['update/skipped'] == 0
  after = trainer.host_params()
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(host),
                              jax.tree.leaves(after), strict=True):
    if lora_lib.is_adapter_path(path):
      assert not np.array_equal(old, new), path
    else:
      np.testing.assert_array_equal(old, new, err_msg=str(path))


def test_the_merge_gives_the_adapted_models_logits():
  base, base_params, model, params = _models()
  merged_model, merged = lora_lib.merge(model, params)
  assert not _adapters(merged)
  ours = np.asarray(jax.jit(model.apply)(params, TOKENS))
  np.testing.assert_allclose(np.asarray(jax.jit(merged_model.apply)(merged, TOKENS)), ours,
                             atol=1e-5)
  # the MLP adapters matter: the merge moved the dense runs' MLP weights, not the experts
  assert not np.allclose(merged['blocks']['mlp']['w_up'], base_params['blocks']['mlp']['w_up'])
  jax.tree.map(np.testing.assert_array_equal, merged['blocks_1']['moe'],
               base_params['blocks_1']['moe'])
  assert np.abs(np.asarray(jax.jit(base.apply)(base_params, TOKENS)) - ours).max() > 1e-2


def test_the_peft_export_names_the_dense_mlps_and_gives_the_merged_logits(tmp_path):
  """The PEFT export's tensors, applied to transformers' model of the base as PEFT's LoRA
  layers apply them (``W + lora_alpha / r * B @ A`` on each module its ``target_modules``
  pattern matches, full match as PEFT's ``check_target_module_exists``), give our merged
  logits; the pattern matches every adapted module and no expert.

  Not ``peft.PeftModel.from_pretrained``: PEFT 0.21 on transformers 5 rewrites the
  ``gate_proj``, ``up_proj`` and ``down_proj`` targets of a Qwen3-MoE model to its fused
  experts' parameters (``peft.utils.transformers_weight_conversion``), whatever the pattern,
  so it adapts the experts (with fresh zero factors) in place of the dense layers' MLPs
  (docs/models.md#lora)."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  base, base_params, model, params = _models()
  merged_model, merged = lora_lib.merge(model, params)
  save_pretrained(nnx.merge(base.graphdef, base_params), None, tmp_path / 'base')
  lora_lib.save_peft(model, params, tmp_path / 'adapter', base_model=str(tmp_path / 'base'))
  config = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  tensors = lora_lib.peft_tensors(model, params)
  adapted = {name[len('base_model.model.'):-len('.lora_A.weight')]
             for name in tensors if name.endswith('.lora_A.weight')}
  assert len(adapted) == MIXED.num_layers + 3 * 3  # q everywhere, the MLP on 3 dense layers
  assert 'model.layers.4.mlp.down_proj' in adapted
  assert not any('layers.2.mlp' in name or 'layers.3.mlp' in name for name in adapted)
  reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'base').eval()
  modules = dict(reference.named_modules())
  matched = {name for name in modules if re.fullmatch(config['target_modules'], name)}
  assert matched == adapted
  scale = config['lora_alpha'] / config['r']
  with torch.no_grad():
    for name in adapted:
      a, b = (torch.from_numpy(np.asarray(tensors[f'base_model.model.{name}.lora_{f}.weight']))
              for f in 'AB')
      modules[name].weight += scale * b @ a
    theirs = reference(torch.tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
  ours = np.asarray(jax.jit(merged_model.apply)(merged, TOKENS))
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def test_mlp_targets_are_refused_where_every_layer_is_moe():
  base, params = create_model(TINY, seed=0)
  with pytest.raises(ConfigError, match=r"lora.targets includes \['down', 'up'\].*'q,k,v,o'"):
    lora_lib.create(base, params, lora_lib.LoRAConfig(2, 4.0, ('q', 'up', 'down')))


@pytest.mark.parametrize('sync_dtype', ['float32', 'int8'])
def test_adapter_only_sync_and_an_int8_base_follow_the_dense_runs(sync_dtype):
  """The adapter tree a version pushes (``adapter_tree``, on the wire in ``sync_dtype``)
  holds the dense runs' MLP adapters; a worker merging it into the base it pulled once
  (``pushed_base``, ``merge_program``) gets the trainer's merged weights. With a QLoRA base
  (``base_quant='int8'``) the MoE run's experts are int8 too and the merge is the
  dequantised base plus the adapters."""
  base, base_params, _, _ = _models()
  config = lora_lib.LoRAConfig(4, 8.0, TARGETS, base_quant='int8', sync_dtype=sync_dtype)
  model, params = lora_lib.create(base, base_params, config, seed=1)
  params = _random_b(params)
  assert isinstance(params['blocks']['mlp']['w_up'], Int8Weight)
  assert any(isinstance(w, Int8Weight) for w in params['blocks_1']['moe'].values())
  adapters = lora_lib.adapter_tree(params)
  assert _adapters(adapters) == _adapters(_models()[3])
  pushed = lora_lib.pushed_params(model, params, base)
  worker = lora_lib.merge_program(model)(
      lora_lib.with_adapters(lora_lib.pushed_base(model, params, base), pushed))
  trainer = lora_lib.merge_program(model)(params)
  assert not np.allclose(trainer['blocks_2']['mlp']['w_down'],
                         lora_lib.dequantized(model, lora_lib.base_tree(params))['blocks_2']['mlp'][
                             'w_down'])
  atol = 1e-6 if sync_dtype == 'float32' else 1e-2  # int8: the wire's rounding of B
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=atol, rtol=0), worker,
               trainer)
  np.testing.assert_allclose(np.asarray(jax.jit(base.apply)(trainer, TOKENS)),
                             np.asarray(jax.jit(model.apply)(params, TOKENS)), atol=1e-4)
