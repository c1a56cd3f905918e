"""The memory plan of a mixture of experts (``presets.memory_plan``, ``activation_bytes``): the
published parameter counts (total and active), the experts' weights split over the data axis
(``expert -> data``), and the activations of k experts per token, the router and the ragged
path's sorted copies against a hand calculation; a stack mixing dense and MoE layers counted
layer by layer, ``moe_impl='blocked'``'s padded rows, and those two against XLA:CPU's
compiled step. The plan against XLA:CPU's compiled homogeneous MoE step is in
tests/test_configs_real_sizes.py, against XLA:TPU's Qwen3-30B-A3B step in
tests/test_tpu_compile.py."""

import dataclasses
import pathlib
import sys

import jax.numpy as jnp
import pytest

from rlax_llm.models import lora as lora_lib
from rlax_llm.models import moe, presets

# Model cards: Qwen3-30B-A3B "30.5B in total and 3.3B activated"; Mixtral-8x7B 46.7B, 12.9B
# active per token. Our counts to the parameter: 30,532,122,624 and 46,702,792,704.
PUBLISHED = {'qwen3-30b-a3b': (30.53, 3.3), 'mixtral-8x7b': (46.70, 12.9)}
ONE = {'data': 1, 'fsdp': 1, 'tensor': 1}


def _expert_params(config) -> int:
  """The experts' and the routers' parameters: every leaf with an ``expert`` axis."""
  return config.num_layers * config.num_experts * config.embed_dim * (
      3 * config.moe_mlp_dim + 1)


@pytest.mark.parametrize('name', sorted(PUBLISHED))
def test_total_and_active_parameters_match_the_model_cards(name):
  config = presets.get_preset(name)
  total, active = PUBLISHED[name]
  assert presets.count_params(config) / 1e9 == pytest.approx(total, abs=0.005)
  assert presets.active_params(config) / 1e9 == pytest.approx(active, rel=0.02)
  dense = presets.get_preset('qwen3-8b')
  assert presets.active_params(dense) == presets.count_params(dense)


def test_the_experts_weights_are_split_over_the_data_axis():
  """Expert parallelism: the experts' weights (and the routers' ``[embed, experts]``), their
  gradients and AdamW moments divide by the data axis (and fsdp: the embedding dimension of
  each expert); the other weights only by fsdp (data-parallel copies)."""
  config = presets.get_preset('qwen3-30b-a3b')
  experts = _expert_params(config)
  rest = presets.count_params(config) - experts
  for mesh, expert_split, rest_split in (({'data': 4, 'fsdp': 1, 'tensor': 1}, 4, 1),
                                         ({'data': 4, 'fsdp': 4, 'tensor': 1}, 16, 4),
                                         ({'data': 1, 'fsdp': 8, 'tensor': 1}, 8, 8)):
    plan = presets.memory_plan(config, mesh, ONE, train_rows=16, train_length=8, slots=1,
                               cache_length=8)
    expected = 4 * (experts / expert_split + rest / rest_split)
    assert plan.params == pytest.approx(expected, rel=1e-3), mesh
    assert plan.optimizer == pytest.approx(2 * expected, rel=1e-3)
    assert plan.gradients == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize('impl', ['ragged', 'dense'])
@pytest.mark.parametrize('remat', ['none', 'dots', 'full'])
def test_moe_activations_count_the_router_k_experts_and_the_sorted_copies(impl, remat):
  """A hand calculation of what one MoE layer keeps per token beyond the same block with no
  MLP: bfloat16 compute, 16 experts of width 64, k = 2, hidden 128, split over tensor 2."""
  config = presets.TINY_MOE_PRESETS['tiny-qwen3-moe']
  config = dataclasses.replace(config, embed_dim=128, num_experts=16, num_experts_per_tok=2,
                               moe_mlp_dim=128).with_execution(
                                   dtype=jnp.bfloat16, remat=remat, moe_impl=impl)
  d, e, k, f = 128, 16, 2, 64  # f: 128 over tensor 2
  rows, length = 4, 16
  got = presets.activation_bytes(config, rows=rows, length=length, tensor=2, platform='tpu')
  dense = presets.activation_bytes(
      dataclasses.replace(config, family='qwen3', num_experts=0, num_experts_per_tok=0,
                          moe_mlp_dim=0, mlp_dim=2 * 32), rows=rows, length=length, tensor=2,
      platform='tpu')
  # the dense model's MLP part: 4 mlp + d ('none'), 2 mlp + d ('dots'), 0 ('full'), mlp 32
  dense_mlp = {'none': 4 * 32 + d, 'dots': 2 * 32 + d, 'full': 0}[remat]
  moe_mlp = {
      ('ragged', 'none'): e * (1 + 4 / 2) + k * (3 * d + 4 * f) + d,
      ('ragged', 'dots'): e + d,
      ('dense', 'none'): e * (1 + 4 / 2) + 7 * e * f + e + d,
      ('dense', 'dots'): e * (2 + 3 * f) + d,
  }.get((impl, remat), 0)
  tokens, layers, itemsize = rows * length, config.num_layers, 2
  saved = got['saved_bytes'] - dense['saved_bytes']
  assert saved == pytest.approx(layers * tokens * itemsize * (moe_mlp - dense_mlp))
  # one block in flight, as without remat
  none_moe = (e * 3 + k * (3 * d + 4 * f) + d if impl == 'ragged'
              else e * 3 + 7 * e * f + e + d)
  assert got['work_bytes'] - dense['work_bytes'] == pytest.approx(
      tokens * itemsize * (none_moe - (4 * 32 + d)))
  # XLA:CPU's ragged_dot: the masked copies [experts, rows, in] of the three products
  cpu = presets.activation_bytes(config, rows=rows, length=length, tensor=2, platform='cpu')
  copies = (2 if remat == 'none' else 3) * k * e * (2 * d + f) if impl == 'ragged' else 0
  assert cpu['work_bytes'] - got['work_bytes'] == pytest.approx(tokens * itemsize * copies)
  assert got['logits_bytes'] == dense['logits_bytes']


def test_the_dense_fallback_plans_every_expert_on_every_token():
  """At Qwen3-30B-A3B's widths (128 experts of 768, k = 8, hidden 2048; 32 heads and 4 kv
  heads of 128) without remat, the dense fallback keeps 5.2x the ragged path's activations:
  the plan says why 'dense' is for tiny models."""
  config = presets.get_preset('qwen3-30b-a3b').with_execution(dtype=jnp.bfloat16)
  ragged = presets.activation_bytes(config, rows=1, length=256)
  dense = presets.activation_bytes(config.with_execution(moe_impl='dense'), rows=1, length=256)
  d, e, k, f, q, kv = 2048, 128, 8, 768, 32 * 128, 4 * 128
  attention = 4 * d + 3 * q + 4 * kv
  per_token = {'ragged': attention + 3 * e + k * (3 * d + 4 * f) + d,
               'dense': attention + 3 * e + 7 * e * f + e + d}
  scores = 4 * 32 * 256 * 256  # one float32 attention-sized buffer, 3 kept on XLA:CPU
  for got, impl in ((ragged, 'ragged'), (dense, 'dense')):
    assert got['saved_bytes'] == 48 * (256 * 2 * per_token[impl] + 3 * scores)
  assert dense['saved_bytes'] / ragged['saved_bytes'] == pytest.approx(5.16, abs=0.01)


def test_expert_parallel_activations_count_the_dispatch_buffers():
  """Dispatched over 4 devices (``moe.expert_parallel_experts``), a ragged MoE layer keeps
  ``k 3 d + 4 k (2 d + 4 f)`` per token (sorted, returned and unsorted copies; the rows
  received for the local experts and their products, sized for every source's rows) in
  place of ``k (3 d + 4 f)``, and works on its 16 / 4 experts gathered whole and their
  gradients; ``memory_plan`` dispatches over data where data splits the experts."""
  config = presets.TINY_MOE_PRESETS['tiny-qwen3-moe']
  config = dataclasses.replace(config, embed_dim=128, num_experts=16, num_experts_per_tok=2,
                               moe_mlp_dim=128).with_execution(dtype=jnp.bfloat16)
  d, e, k, f, parts = 128, 16, 2, 64, 4  # f: 128 over tensor 2
  rows, length, itemsize = 4, 16, 2
  tokens = rows * length
  one, four = (presets.activation_bytes(config, rows=rows, length=length, tensor=2,
                                        platform='tpu', experts=n) for n in (1, parts))
  per_token = k * 3 * d + parts * k * (2 * d + 4 * f) - k * (3 * d + 4 * f)
  assert four['saved_bytes'] - one['saved_bytes'] == pytest.approx(
      config.num_layers * tokens * itemsize * per_token)
  assert four['work_bytes'] - one['work_bytes'] == pytest.approx(
      tokens * itemsize * per_token + 2 * 3 * (e // parts) * d * f * itemsize)
  plan = lambda mesh: presets.memory_plan(  # noqa: E731
      config, mesh, ONE, train_rows=16, train_length=length, slots=1, cache_length=8,
      platform='tpu')
  expected = presets.activation_bytes(config, rows=1, length=length, platform='tpu',
                                      experts=parts)['total_bytes']
  assert plan({'data': parts, 'fsdp': 4, 'tensor': 1}).activations == expected
  assert plan({'data': 1, 'fsdp': 16, 'tensor': 1}).activations == presets.activation_bytes(
      config, rows=1, length=length, platform='tpu')['total_bytes']


def test_an_int8_worker_copy_counts_the_experts_at_one_byte_and_their_scales():
  """``worker_param_bytes(quant='int8')`` of Qwen3-30B-A3B's bfloat16 copy, one device: the
  experts and the attention's projections at one byte a weight plus a float32 scale per
  output channel (the experts': per layer, expert and channel), the rest (embedding, lm head,
  norms, routers) at two bytes."""
  config = presets.get_preset('qwen3-30b-a3b').with_execution(param_dtype=jnp.bfloat16)
  c = config
  experts = c.num_layers * c.num_experts * 3 * c.embed_dim * c.moe_mlp_dim
  expert_scales = c.num_layers * c.num_experts * (2 * c.moe_mlp_dim + c.embed_dim)
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  attention = c.num_layers * 2 * c.embed_dim * (q + kv)
  attention_scales = c.num_layers * (q + 2 * kv + c.embed_dim)
  rest = presets.count_params(config) - experts - attention
  got = presets.worker_param_bytes(config, ONE, quant='int8')
  assert got['params'] == experts + attention + 4 * (expert_scales + attention_scales) + 2 * rest
  bf16 = presets.worker_param_bytes(config, ONE)['params']
  assert bf16 == 2 * presets.count_params(config)
  assert 0.5 < got['params'] / bf16 < 0.52  # the embedding and lm head stay bfloat16


# Mixed stacks and 'blocked' (issue 62): a small Qwen3-MoE layout, hidden 128, 8 experts of
# width 128, top-2, dense layers' MLP 256, a 512-word vocabulary.
SMALL = dict(vocab_size=512, num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2,
             head_dim=32, max_seq_len=128, tie_embeddings=False, family='qwen3_moe',
             qk_norm=True, mlp_dim=256, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=128,
             norm_topk_prob=True)


def _dense_twin(config, layers):
  """``config``'s dense layers alone: ``layers`` of them, the same widths."""
  return dataclasses.replace(config, family='qwen3', num_layers=layers, num_experts=0,
                             num_experts_per_tok=0, moe_mlp_dim=0, norm_topk_prob=False,
                             decoder_sparse_step=1, mlp_only_layers=())


@pytest.mark.parametrize('impl', ['ragged', 'dense', 'blocked'])
@pytest.mark.parametrize('remat', ['none', 'dots', 'full'])
def test_a_mixed_stack_counts_its_moe_layers_as_moe_and_its_dense_layers_as_dense(impl, remat):
  """``decoder_sparse_step=2, mlp_only_layers=[0]`` over 4 layers (dense, MoE, dense, MoE):
  the saved activations are those of 2 MoE layers plus 2 dense ones, one block in flight the
  larger kind's; the params, gradients and AdamW moments the two kinds' weights."""
  config = dataclasses.replace(presets.DecoderConfig(**SMALL), num_layers=4,
                               decoder_sparse_step=2, mlp_only_layers=(0,)).with_execution(
                                   moe_impl=impl, remat=remat)
  assert config.num_moe_layers == 2
  act = lambda c: presets.activation_bytes(c, rows=4, length=16, platform='tpu')  # noqa: E731
  mixed, moe, dense = act(config), act(dataclasses.replace(
      config, num_layers=2, decoder_sparse_step=1, mlp_only_layers=())), act(
          _dense_twin(config, 2))
  assert mixed['saved_bytes'] == pytest.approx(moe['saved_bytes'] + dense['saved_bytes'])
  assert mixed['work_bytes'] == max(moe['work_bytes'], dense['work_bytes'])
  everywhere = dataclasses.replace(config, decoder_sparse_step=1, mlp_only_layers=())
  assert (mixed['saved_bytes'] != act(everywhere)['saved_bytes']) == (remat != 'full')
  experts = 2 * 8 * 128 * (3 * 128 + 1)  # 2 MoE layers' experts and routers
  mlps = 2 * 3 * 128 * 256  # 2 dense MLPs
  params = presets.count_params(_dense_twin(config, 4)) - 4 * 3 * 128 * 256
  assert presets.count_params(config) == params + experts + mlps
  plan = presets.memory_plan(config, ONE, ONE, train_rows=4, train_length=16, slots=1,
                             cache_length=8)
  assert plan.params == 4 * presets.count_params(config)
  assert (plan.gradients, plan.optimizer) == (plan.params, 2 * plan.params)


@pytest.mark.parametrize('remat', ['none', 'dots', 'full'])
def test_blocked_activations_count_the_padded_rows(remat):
  """A hand calculation of what a ``'blocked'`` MoE layer keeps per token beyond the same
  block with no MLP (``moe._blocked_experts``): 64 tokens, k = 2 over 16 experts, so blocks of
  ``B = 8`` rows (``moe.block_rows``: the mean 8 rows per expert), ``(128 + 16 x 7) // 8 = 30``
  blocks, ``P = 240`` padded rows; without remat the rows twice (the masked gather and its
  blocks), their gate and up products, the k outputs gathered back and the output; with
  'dots' the router's logits, the rows and their products (the custom backward's
  residuals)."""
  config = presets.TINY_MOE_PRESETS['tiny-qwen3-moe']
  config = dataclasses.replace(config, embed_dim=128, num_experts=16, num_experts_per_tok=2,
                               moe_mlp_dim=128).with_execution(
                                   dtype=jnp.bfloat16, remat=remat, moe_impl='blocked')
  d, e, k, f, rows, length, tokens = 128, 16, 2, 64, 4, 16, 64  # f: 128 over tensor 2
  assert moe.block_rows(tokens * k, e) == 8
  padded = 240
  got = presets.activation_bytes(config, rows=rows, length=length, tensor=2, platform='tpu')
  dense = presets.activation_bytes(dataclasses.replace(_dense_twin(config, 2), mlp_dim=2 * 32),
                                   rows=rows, length=length, tensor=2, platform='tpu')
  dense_mlp = {'none': 4 * 32 + d, 'dots': 2 * 32 + d, 'full': 0}[remat]
  moe_mlp = {'none': e * (1 + 4 / 2) + padded / tokens * (2 * d + 2 * f) + k * d + d,
             'dots': e + padded / tokens * (d + 2 * f) + d, 'full': 0}[remat]
  itemsize = 2
  assert got['saved_bytes'] - dense['saved_bytes'] == pytest.approx(
      2 * tokens * itemsize * (moe_mlp - dense_mlp))
  # one block in flight, and the backward's cotangents of the padded rows and their outputs
  none_moe = e * 3 + padded / tokens * (2 * d + 2 * f) + k * d + d
  assert got['work_bytes'] - dense['work_bytes'] == pytest.approx(
      tokens * itemsize * (none_moe - (4 * 32 + d)) + 2 * padded * d * itemsize)
  # no masked copies on XLA:CPU (those are jax's ragged_dot's)
  cpu = presets.activation_bytes(config, rows=rows, length=length, tensor=2, platform='cpu')
  assert cpu['work_bytes'] == got['work_bytes']
  assert got['saved_bytes'] < presets.activation_bytes(
      config.with_execution(moe_impl='dense'), rows=rows, length=length, tensor=2,
      platform='tpu')['saved_bytes'] or remat == 'full'


def test_lora_mlp_targets_add_their_products_on_the_dense_layers_only():
  """On a mixed stack the ``gate, up, down`` adapters are on the dense layers alone
  (``lora.add_adapters``): their products count there, and their params and optimizer
  state are the dense runs' adapters."""
  config = dataclasses.replace(presets.DecoderConfig(**SMALL), num_layers=3,
                               mlp_only_layers=(0,))
  attention, mlp = (lora_lib.LoRAConfig(4, 8.0, targets) for targets in
                    (('q',), ('q', 'gate', 'up', 'down')))
  act = lambda lora: presets.activation_bytes(config, rows=4, length=16, lora=lora)  # noqa: E731
  tokens, itemsize = 64, 4
  assert act(mlp)['saved_bytes'] - act(attention)['saved_bytes'] == (
      1 * tokens * itemsize * (256 + 256 + 128))  # one dense layer: gate, up (mlp), down (d)
  plan = lambda lora: presets.memory_plan(  # noqa: E731
      config, ONE, ONE, train_rows=4, train_length=16, slots=1, cache_length=8, lora=lora)
  assert plan(mlp).optimizer - plan(attention).optimizer == 2 * 4 * (
      1 * 4 * (128 + 256) * 3)  # one dense layer's three MLP adapters, rank 4, two moments


# XLA:CPU's compiled train step (tests/test_configs_real_sizes.py) against the plan, 8 rows of
# 128, float32. Measured (plan / compiled): 'blocked' over 2 MoE layers 0.96 ('none'), 0.92
# ('dots'), 1.00 ('full'), and at test_configs_real_sizes.py's wider MoE (hidden 256, 16
# experts of 256) 0.96, 0.92, 1.08; before the plan counted 'blocked' as itself it counted
# it as 'dense': 1.42-2.05 of the compiled. The mixed stack of a dense layer and a run of two
# MoE layers: 'ragged' 1.03, 'blocked' 0.95, 'dense' 0.99 ('full': ragged 0.96); with every
# layer counted as MoE 1.06, 1.85 and 1.15. A stack of one-layer runs (dense, MoE: XLA's scan
# of one layer is straight-line code) compiles to less than the plan: 1.12 ('blocked') to
# 1.36 ('dense') of it, on the safe side.
COMPILED_PLANS = [('blocked', 'none', ()), ('blocked', 'dots', ()),
                  ('ragged', 'none', (0,)), ('blocked', 'none', (0,))]


@pytest.mark.parametrize('impl, remat, mlp_only', COMPILED_PLANS)
def test_the_planned_step_is_within_15_percent_of_the_compiled_one(impl, remat, mlp_only):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from smoke_config import smoke_config  # tests/smoke_config.py
  from test_configs_real_sizes import _compiled_step_bytes
  decoder = dataclasses.replace(presets.DecoderConfig(**SMALL), num_layers=3 if mlp_only else 2,
                                mlp_only_layers=mlp_only).with_execution(moe_impl=impl,
                                                                         remat=remat)
  config = smoke_config(rl__prompts_per_step=2, rl__group_size=4,
                        sampling__max_prompt_len=64, sampling__max_new_tokens=64)
  plan = presets.memory_plan(decoder, ONE, ONE, train_rows=8, train_length=128, slots=1,
                             cache_length=1)
  compiled = _compiled_step_bytes(decoder, config)
  assert plan.trainer_bytes == pytest.approx(compiled, rel=0.15), (plan, compiled)


@pytest.mark.parametrize('tokens', [1, 7, 64, 1024])
def test_the_plans_blocked_rows_are_the_layouts(tokens):
  """The plan counts the padded rows the 'blocked' path lays its pairs over (one formula,
  ``moe.num_blocks``, read by both)."""
  config = presets.TINY_MOE_PRESETS['tiny-qwen3-moe']
  k, e = config.num_experts_per_tok, config.num_experts
  experts = jnp.arange(tokens * k, dtype=jnp.int32).reshape(tokens, k) % e
  block = moe.block_rows(tokens * k, e)
  _, token, _, _ = moe._block_layout(experts, e, block)
  assert presets._blocked_rows(config, tokens) == token.shape[0]
