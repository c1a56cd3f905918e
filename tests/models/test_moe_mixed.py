"""Stacks mixing dense and MoE layers (Qwen3-MoE's ``decoder_sparse_step`` and
``mlp_only_layers``): transformers' rule for which layer is MoE, one scanned params subtree per
run of layers of one kind (a homogeneous stack's tree, logits and export unchanged), parity
with transformers' ``Qwen3MoeForCausalLM`` (logits, gradients, aux loss, export), the engine's
unrolled and cached forms, LoRA and the int8 copy over every run, routes per MoE layer, and a
GRPO run with R3 that trains.
"""

import dataclasses
import functools
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

os.environ.setdefault('HF_HUB_OFFLINE', '1')
torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from rlax_llm.models import lora, quant  # noqa: E402
from rlax_llm.models.decoder_config import LAYERS_AXIS  # noqa: E402
from rlax_llm.models.files import hf  # noqa: E402
from rlax_llm.models.files.pretrained import from_pretrained, save_pretrained  # noqa: E402
from rlax_llm.models.model import (create_model, split_module, to_weight_layout,  # noqa: E402
                                   with_weight_layout)
from rlax_llm.models.moe import NO_ROUTE  # noqa: E402
from rlax_llm.models.presets import TINY_MOE_PRESETS, active_params, count_params  # noqa: E402
from rlax_llm.models.quant import Int8Weight  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# tests/models/test_moe_parity.py: the random transformers reference and its torch side.
from test_moe_parity import (ATOL, _tokens, _torch_logits,  # noqa: E402
                             check_gradients_and_aux_loss, references)

# The layout (dense, MoE, dense, MoE: every run one layer) and one with longer runs
# (dense, dense, MoE, MoE, dense).
MIXED = {
    'step2': dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[0]),
    'runs': dict(num_hidden_layers=5, decoder_sparse_step=1, mlp_only_layers=[0, 1, 4]),
}
MOE_LAYERS = {'step2': (1, 3), 'runs': (2, 3)}
TINY = TINY_MOE_PRESETS['tiny-qwen3-moe']


@functools.cache
def jitted(model, **options):
  """``model.apply`` with ``options`` as one program (op by op, each forward compiled every
  primitive)."""
  return jax.jit(functools.partial(model.apply, **options))


@pytest.fixture(name='mixed')
def mixed_fixture(references):
  """``get(name) -> (transformers model, ours, directory)`` of ``MIXED[name]``."""
  return lambda name: references('qwen3_moe', **MIXED[name])[1:]


@pytest.mark.parametrize('name', sorted(MIXED))
def test_moe_layers_follow_transformers_rule_and_runs_are_stacked(mixed, name):
  model, ours, _ = mixed(name)
  c = ours.config
  theirs = tuple(i for i, layer in enumerate(model.model.layers)
                 if type(layer.mlp).__name__ == 'Qwen3MoeSparseMoeBlock')
  assert theirs == MOE_LAYERS[name]
  assert tuple(i for i in range(c.num_layers) if c.is_moe_layer(i)) == theirs
  assert c.num_moe_layers == len(theirs)
  _, params = split_module(ours)
  runs = c.layer_runs()
  assert sorted(params) == sorted(('embed', 'final_norm', 'lm_head') + c.stack_names)
  assert [r.first for r in runs] == sorted({0} | {i for i in range(1, c.num_layers)
                                                  if c.is_moe_layer(i) != c.is_moe_layer(i - 1)})
  for run in runs:
    assert all(c.is_moe_layer(i) == run.moe for i in run.layers)
    tree = params[run.name]
    assert ('moe' in tree, 'mlp' in tree) == (run.moe, not run.moe)
    assert {x.shape[0] for x in jax.tree.leaves(tree)} == {run.count}
    if not run.moe:  # the dense layers' MLP is intermediate_size wide
      assert tree['mlp']['w_up'].shape == (run.count, 32, 48)
  axes = split_module(ours)[0].logical_axes()
  assert all(tuple(spec)[0] == LAYERS_AXIS for stack in c.stack_names
             for spec in jax.tree.leaves(axes[stack],
                                         is_leaf=lambda x: isinstance(x, PartitionSpec)))


@pytest.mark.parametrize('name', sorted(MIXED))
def test_logits_match_transformers(mixed, name):
  model, ours, _ = mixed(name)
  tokens = _tokens()
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
  np.testing.assert_allclose(got, _torch_logits(model, tokens), atol=ATOL, rtol=0)


def test_gradients_and_aux_loss_match_transformers(mixed):
  """The aux loss counts the MoE layers' routers only, as transformers' does."""
  model, ours, _ = mixed('step2')
  names = check_gradients_and_aux_loss(model, ours)
  assert 'model.layers.0.mlp.gate_proj.weight' in names
  assert 'model.layers.1.mlp.experts.3.down_proj.weight' in names


def test_export_loads_in_transformers_with_the_same_logits(mixed, tmp_path):
  model, ours, directory = mixed('step2')
  save_pretrained(ours, None, tmp_path / 'export')
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'export').eval()
  assert (reloaded.config.decoder_sparse_step, reloaded.config.mlp_only_layers) == (2, [0])
  assert sorted(hf.SafetensorsCheckpoint(tmp_path / 'export').names) == sorted(
      hf.SafetensorsCheckpoint(directory).names)
  tokens = _tokens(2)
  np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(model, tokens),
                             atol=ATOL, rtol=0)
  assert hf.config_from_hf(hf.config_to_hf(ours.config)) == ours.config


# Recorded on main before stacks were split into runs (seed 0, tokens below): the homogeneous
# stacks' params tree and logits must not move.
HOMOGENEOUS = {
    'moe': (TINY, [[0.631749, 0.54647, -1.209078], [-0.024341, 0.510439, -0.280068],
                   [0.166594, -0.848583, 0.738327]], 493.0302734375),
    'dense': (dataclasses.replace(TINY, family='qwen3', num_layers=3, num_experts=0,
                                  num_experts_per_tok=0, moe_mlp_dim=0, norm_topk_prob=False,
                                  tie_embeddings=True),
              [[1.591346, -0.261147, -1.381045], [1.244738, -1.713557, -0.846508],
               [1.924692, -0.598684, -0.938344]], 444.50091552734375),
}


@pytest.mark.parametrize('name', sorted(HOMOGENEOUS))
def test_a_homogeneous_stack_keeps_its_params_tree_and_logits(name):
  config, first, total = HOMOGENEOUS[name]
  assert len(config.layer_runs()) == 1 and config.stack_names == ('blocks',)
  model, params = create_model(config, seed=0)
  assert sorted(params) == ['blocks', 'embed', 'final_norm'] + (
      [] if config.tie_embeddings else ['lm_head'])
  assert sorted(params['blocks']) == sorted(['attn', 'attn_norm', 'mlp_norm',
                                             'moe' if config.is_moe else 'mlp'])
  assert {x.shape[0] for x in jax.tree.leaves(params['blocks'])} == {config.num_layers}
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 48, (2, 7)), jnp.int32)
  logits = np.asarray(jitted(model)(params, tokens))
  np.testing.assert_allclose(logits[0, :3, :3], first, atol=2e-6)
  np.testing.assert_allclose(np.abs(logits).sum(), total, rtol=1e-6)
  names = [name for _, name, _ in hf.weight_layout(config)]
  assert names[1:4] == ['model.layers.0.self_attn.q_proj.weight',
                        'model.layers.0.self_attn.k_proj.weight',
                        'model.layers.0.self_attn.v_proj.weight']


MIXED_TINY = dataclasses.replace(TINY, num_layers=5, mlp_only_layers=(0, 1, 4))


@pytest.fixture(scope='module')
def tiny_mixed():
  return create_model(MIXED_TINY, seed=0)


def test_routes_count_the_moe_layers_and_replaying_them_changes_nothing(tiny_mixed):
  model, params = tiny_mixed
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, 48, (2, 7)), jnp.int32)
  logits, routes = jitted(model, return_routes=True)(params, tokens)
  assert routes.shape == (2, 7, MIXED_TINY.num_moe_layers, MIXED_TINY.num_experts_per_tok)
  # Each MoE layer's own routes, not another's: layer 3's input differs from layer 2's.
  assert not np.array_equal(routes[:, :, 0], routes[:, :, 1])
  replayed = jitted(model)(params, tokens, routes=routes)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
  # A route of the second MoE layer only (NO_ROUTE elsewhere) moves the tokens it reroutes.
  other = np.full(routes.shape, NO_ROUTE, np.int32)
  other[:, :, 1] = (np.asarray(routes[:, :, 1]) + 1) % MIXED_TINY.num_experts
  assert not np.allclose(np.asarray(jitted(model)(params, tokens, routes=jnp.asarray(other))),
                         np.asarray(logits), atol=1e-4)
  with pytest.raises(AssertionError):  # a routes array per layer is the wrong shape
    jitted(model)(params, tokens, routes=jnp.zeros((2, 7, 5, 2), jnp.int32))


def test_the_engine_forms_compute_the_same_model(tiny_mixed):
  """The engine's XLA:CPU copy (``'unrolled'``, ``'out_in'``: a round trip of the params is
  the identity) and the cached forward (prefill, then one decode step) give the full
  forward's logits and routes; an unrolled model draws the scanned one's weights."""
  model, params = tiny_mixed
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, 48, (2, 7)), jnp.int32)
  logits, routes = jitted(model, return_routes=True)(params, tokens)
  engine = with_weight_layout(model, 'out_in', layer_loop='unrolled')
  moved = to_weight_layout(params, model, engine)
  assert sorted(moved['blocks']) == list(range(MIXED_TINY.num_layers))
  assert ['moe' in moved['blocks'][i] for i in range(5)] == [False, False, True, True, False]
  got, got_routes = jitted(engine, return_routes=True)(moved, tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(logits), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got_routes), np.asarray(routes))
  jax.tree.map(np.testing.assert_array_equal, to_weight_layout(moved, engine, model), params)
  unrolled, unrolled_params = create_model(
      MIXED_TINY.with_execution(layer_loop='unrolled'), seed=0)
  jax.tree.map(np.testing.assert_array_equal,
               to_weight_layout(unrolled_params, unrolled, model), params)
  for form, form_params in ((model, params), (engine, moved)):
    cache = form.init_cache(2, 16)
    _, cache = jitted(form)(form_params, tokens[:, :5], cache=cache)
    step, cache = jitted(form)(form_params, tokens[:, 5:6], cache=cache)
    np.testing.assert_allclose(np.asarray(step[:, 0]), np.asarray(logits[:, 5]), atol=1e-5)


def test_lora_adapts_the_attention_of_every_run(tiny_mixed):
  model, params = tiny_mixed
  config = lora.LoRAConfig(rank=2, alpha=4.0, targets=('q', 'v'))
  lora_model, lora_params = lora.create(model, params, config, seed=1)
  for run in MIXED_TINY.layer_runs():
    attn = lora_params[run.name]['attn']
    assert attn['wq_lora']['a'].shape == (run.count, MIXED_TINY.embed_dim, 2)
  mask = lora.trainable_mask(lora_model)
  assert sum(jax.tree.leaves(mask)) == 2 * 2 * len(MIXED_TINY.layer_runs())
  bumped = jax.tree.map(lambda x: x, lora_params)
  for run in MIXED_TINY.layer_runs():
    b = bumped[run.name]['attn']['wv_lora']['b']
    bumped[run.name]['attn']['wv_lora']['b'] = b + 0.01 * (run.first + 1)
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, 48, (1, 6)), jnp.int32)
  _, merged = lora.merge(lora_model, bumped)
  np.testing.assert_allclose(np.asarray(jitted(model)(merged, tokens)),
                             np.asarray(jitted(lora_model)(bumped, tokens)), atol=1e-5)
  tensors = lora.peft_tensors(lora_model, bumped)
  assert len(tensors) == 2 * 2 * MIXED_TINY.num_layers
  b4 = tensors['base_model.model.model.layers.4.self_attn.v_proj.lora_B.weight']
  np.testing.assert_allclose(b4, 0.01 * 5, rtol=1e-6)  # layer 4 is the third run's first
  # MLP targets adapt the dense runs only (tests/models/test_lora_mixed.py)
  _, mlp_params = lora.create(model, params, lora.LoRAConfig(rank=2, alpha=4.0,
                                                             targets=('q', 'up')), seed=1)
  assert ['w_up_lora' in mlp_params[run.name].get('mlp', {})
          for run in MIXED_TINY.layer_runs()] == [True, False, True]


def test_the_int8_copy_quantises_every_run(tiny_mixed):
  model, params = tiny_mixed
  for form in (model, with_weight_layout(model, 'out_in', layer_loop='unrolled')):
    form_params = to_weight_layout(params, model, form)
    q = jax.jit(functools.partial(quant.quantize_params, model=form))(form_params)
    is_int8 = lambda x: isinstance(x, Int8Weight)
    blocks = [q[name] for name in MIXED_TINY.stack_names] if form is model else list(
        q['blocks'].values())
    for tree in blocks:
      assert is_int8(tree['attn']['wq'])
      mlp = tree.get('mlp') or tree['moe']
      assert all(is_int8(mlp[w]) for w in mlp if w != 'router')
    tokens = jnp.asarray(np.random.RandomState(4).randint(0, 48, (1, 6)), jnp.int32)
    np.testing.assert_allclose(np.asarray(jitted(form)(q, tokens)),
                               np.asarray(jitted(model)(params, tokens)), atol=0.1)


def test_active_params_count_the_idle_experts_of_moe_layers_only():
  idle = (TINY.num_experts - TINY.num_experts_per_tok) * 3 * TINY.embed_dim * TINY.moe_mlp_dim
  assert count_params(MIXED_TINY) - active_params(MIXED_TINY) == 2 * idle


def test_engine_routes_replayed_by_the_objective_flip_nothing(tiny_mixed):
  """R3 on a mixed stack: a float32 engine (its unrolled layers) records one route per MoE
  layer for every token it feeds, and the trainer's objective replaying them flips no
  choice and gives the unreplayed loss and gradients."""
  from rlax_llm.data_types import make_train_batch
  from rlax_llm.loss_spec import LossConfig
  from rlax_llm.sampling_spec import SamplingSpec
  from rlax_llm.trainer.objectives import rl_objective
  from rlax_llm.trainer.scoring import Policy
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / 'benchmarks'))
  import moe_routing_replay  # benchmarks/moe_routing_replay.py
  model, params = tiny_mixed
  rollouts = moe_routing_replay.rollouts(MIXED_TINY, params, prompts=4, prompt_len=5,
                                         new_tokens=6, seed=1, inference_dtype=jnp.float32)
  assert rollouts.completion_routes.shape[2:] == (MIXED_TINY.num_moe_layers,
                                                  MIXED_TINY.num_experts_per_tok)
  batch = jax.tree.map(jnp.asarray, make_train_batch(
      rollouts, np.linspace(-1.0, 1.0, len(rollouts)).astype(np.float32)))
  own = jitted(model, return_routes=True)(params, batch.tokens)[1]
  length = rollouts.prompt_lengths + rollouts.completion_mask.sum(axis=1)
  for i, n in enumerate(length):
    np.testing.assert_array_equal(np.asarray(batch.routes[i, :n - 1]), np.asarray(own[i, :n - 1]))

  @functools.partial(jax.jit, static_argnames='replay')
  def objective(params, replay):
    fn = lambda p: rl_objective(Policy(model, SamplingSpec(temperature=1.0)), LossConfig(), p,
                                batch, None, routing_replay=replay)
    return jax.value_and_grad(fn, has_aux=True)(params)
  (loss, metrics), grads = objective(params, True)
  (plain_loss, _), plain_grads = objective(params, False)
  assert float(metrics['moe/route_flip_fraction']) == 0.0
  np.testing.assert_allclose(loss, plain_loss, atol=1e-6)
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-5), grads, plain_grads)
  assert float(jnp.abs(grads['blocks']['mlp']['w_up']).max()) > 0  # a dense run trains


# One launch of a tiny mixed MoE run (its 4 warm-up and 4 RL steps): minutes on a loaded
# 2-core machine. Its default-run counterpart: the replaying objective above.
@pytest.mark.slow
def test_a_grpo_run_with_r3_on_a_mixed_stack_trains(tmp_path):
  """tests/test_moe_r3.py's smoke run (4 RL steps, a bfloat16 inference copy on the engine's
  unrolled layers) on the issue's layout: every step replays routes, one per MoE layer, and
  the run updates the weights (a step whose groups all tied has zero advantages and no
  gradient)."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from test_moe_r3 import r3_smoke
  from test_resume import read, run_once
  config = r3_smoke()
  with config.unlocked():
    config.model.tiny.update(num_layers=4, decoder_sparse_step=2, mlp_only_layers=(0,))
  summary, params = run_once(config, tmp_path / 'run', None)
  metrics, _ = read(tmp_path / 'run')
  assert summary['steps'] == 4 and len(metrics) == 4
  assert all('moe/route_flip_fraction' in row and np.isfinite(row['loss']) for row in metrics)
  assert any(row['grad_norm'] > 0 for row in metrics)
  assert sorted(k for k in params if k.startswith('blocks')) == [
      'blocks', 'blocks_1', 'blocks_2', 'blocks_3']
  assert 'mlp' in params['blocks'] and 'moe' in params['blocks_3']
