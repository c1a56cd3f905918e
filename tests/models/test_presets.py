"""Named model configs: published parameter counts; memory per device without allocation; the
memory plan with LoRA and int8 workers against the arrays those modules build and place."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from smoke_config import smoke_config  # tests/smoke_config.py

from rlax_llm import memory_fit, roles
from rlax_llm.errors import ConfigError
from rlax_llm.models import lora as lora_lib
from rlax_llm.models import presets
from rlax_llm.models.decoder import Decoder
from rlax_llm.models.decoder_config import DecoderConfig, Execution
from rlax_llm.models.kv_cache import KVCache
from rlax_llm.models.model import abstract_model, create_model
from rlax_llm.models.presets import PRESETS, count_params, get_preset, memory_per_device
from rlax_llm.models.quant import PROJECTIONS, QUANT_MODES, quantize_params, quantized_shardings
from rlax_llm.paramserver import ParameterServer
from rlax_llm.sharding import make_mesh, param_shardings
from rlax_llm.trainer.trainer import Trainer, make_optimizer

# Published sizes (model cards), in billions of parameters.
PUBLISHED = {
    'smollm2-135m': 0.1349, 'qwen3-0.6b': 0.596, 'qwen3-1.7b': 1.72, 'qwen3-8b': 8.19,
    'qwen3-32b': 32.76, 'qwen2.5-7b': 7.62, 'llama-3.1-8b': 8.03, 'qwq-32b': 32.76,
    'qwen2.5-0.5b': 0.49, 'qwen2.5-1.5b': 1.54, 'llama-3.2-1b': 1.23,
    'qwen3-30b-a3b': 30.5, 'mixtral-8x7b': 46.7,
}


@pytest.mark.parametrize('name', sorted(PRESETS))
def test_parameter_counts_match_published(name):
  assert count_params(get_preset(name)) / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01)


def test_memory_per_device_shrinks_with_fsdp_and_tensor():
  config = get_preset('qwen3-8b')
  one = memory_per_device(config, make_mesh({'data': 1}, jax.devices()[:1]))
  eight = memory_per_device(config, make_mesh({'fsdp': 4, 'tensor': 2}))
  n = one['num_params']
  assert one['params_bytes'] == pytest.approx(4 * n)  # fp32 master weights, unsharded
  assert one['optimizer_bytes'] == pytest.approx(8 * n)  # AdamW: two fp32 moments
  assert eight['total_bytes'] == pytest.approx(one['total_bytes'] / 8, rel=0.01)
  data_parallel = memory_per_device(config, make_mesh({'data': 8}))
  assert data_parallel['total_bytes'] == pytest.approx(one['total_bytes'])  # replicated


def test_get_config_overrides_and_errors():
  assert get_preset('qwen3-0.6b', max_seq_len=128).max_seq_len == 128
  assert get_preset('qwen3-0.6b', execution=Execution(remat='full')).execution.remat == 'full'
  with pytest.raises(ValueError, match="Unknown model 'gpt5'.*qwen3-8b"):
    get_preset('gpt5')


# The memory plan with LoRA and int8 workers, against the trees those modules really build.
PLAN_MODEL = DecoderConfig(vocab_size=96, num_layers=2, embed_dim=32, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=16,
                           tie_embeddings=False)
ONE = {'data': 1, 'fsdp': 1, 'tensor': 1}
SHARDED = {'data': 2, 'fsdp': 2, 'tensor': 2}  # conftest's 8 CPU devices


def _plan(config, mesh=ONE, **kw):
  return presets.memory_plan(config, mesh, mesh, train_rows=4, train_length=8, slots=2,
                     cache_length=8, **kw)


def _per_device_bytes(tree) -> int:
  """The most bytes any one device holds of the placed arrays of ``tree``."""
  held = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return max(held.values())


@pytest.mark.parametrize('sync', lora_lib.SYNCS)
@pytest.mark.parametrize('param_dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('targets', [lora_lib.TARGETS, ('q', 'v', 'down')])
def test_the_lora_plan_counts_the_adapters_the_module_builds(targets, param_dtype, sync):
  config = PLAN_MODEL.with_execution(param_dtype=param_dtype)
  lora = lora_lib.LoRAConfig(4, 8.0, targets, sync)
  module = lora_lib.add_adapters(Decoder(config, rngs=nnx.Rngs(0)), lora, nnx.Rngs(1))
  adapters = jax.tree.leaves(nnx.state(module, nnx.LoRAParam))
  everything = jax.tree.leaves(nnx.state(module, nnx.Param))
  n = sum(x.size for x in adapters)
  # r * (in + out) per adapted matrix per layer, from the widths by hand.
  d, q, kv, m = 32, 4 * 8, 2 * 8, 64
  sides = {'q': (d, q), 'k': (d, kv), 'v': (d, kv), 'o': (q, d), 'gate': (d, m), 'up': (d, m),
           'down': (m, d)}
  assert n == 2 * sum(4 * sum(sides[t]) for t in targets)
  plan = _plan(config, lora=lora)
  full = _plan(config)
  assert plan.params == sum(x.nbytes for x in everything)  # frozen base + float32 adapters
  assert plan.params == full.params + 4 * n
  assert plan.optimizer == 2 * 4 * n  # AdamW's two float32 moments, adapters only
  assert plan.gradients == 4 * n
  assert _plan(config, lora=lora, micro_batches=2).gradients == 2 * 4 * n  # + accumulator
  assert plan.update == 3 * 4 * n
  if sync == 'merged':
    assert plan.push == full.params  # the merged base the trainer makes for each version
    assert plan.inference_base == 0
  else:  # the adapters are the trainer's own arrays; the base is pushed in its own dtype
    assert plan.push == 0
    assert plan.inference_base == full.inference_params  # the base the workers merge into
  # One [t, N] more per adapted projection (t = 4 rows x 8 tokens) kept by the backward pass.
  itemsize = jnp.dtype(config.execution.dtype).itemsize
  assert plan.activations == full.activations + 2 * 32 * itemsize * sum(
      sides[t][1] for t in targets)
  assert plan.inference_params == full.inference_params  # the workers hold the merged base
  assert plan.inference_bytes == full.inference_bytes + plan.inference_base
  assert full.push == 0 and full.inference_base == 0 and full.optimizer == 2 * 4 * sum(
      x.size for x in jax.tree.leaves(nnx.state(Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)))


def test_the_lora_plan_per_device_matches_the_trainers_placed_arrays():
  """The trainer's real placement on 8 devices: params, adapters and optimizer state."""
  base, params = create_model(PLAN_MODEL, seed=0)
  lora = lora_lib.LoRAConfig(4, 8.0)
  model, params = lora_lib.create(base, params, lora)
  optimizer = make_optimizer(1e-3)
  trainer = Trainer(model, params, optimizer, lambda *a: None, make_mesh(SHARDED),
                    trainable=lora_lib.trainable_mask(model))
  plan = _plan(PLAN_MODEL, SHARDED, lora=lora)
  adapters = [x for path, x in jax.tree_util.tree_leaves_with_path(trainer.params)
              if lora_lib.is_adapter_path(path)]
  assert plan.params == _per_device_bytes(trainer.params)
  assert plan.gradients == _per_device_bytes(adapters)
  # The moments (params-shaped) plus AdamW's replicated step counts, not planned.
  counts = sum(x.nbytes for x in jax.tree.leaves(trainer.opt_state) if x.ndim == 0)
  assert plan.optimizer == _per_device_bytes(trainer.opt_state) - counts


@pytest.mark.parametrize('quant', ['none', 'int8'])
def test_the_kv_cache_plan_is_the_caches_bytes(quant):
  """``kv_cache_bytes`` against a real ``KVCache.init`` (``model.kv_cache_quant``): int8
  blocks and their float32 scales, about a quarter of the float32 cache."""
  config = PLAN_MODEL
  cache = KVCache.init(config, batch=3, max_len=20, block_length=8, quant=quant)
  held = sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v, cache.k_scale, cache.v_scale)))
  planned = presets.kv_cache_bytes(config, slots=3, length=24, quant=quant)  # 3 blocks of 8
  assert planned == held
  if quant == 'int8':
    assert planned < 0.5 * presets.kv_cache_bytes(config, slots=3, length=24)
  with pytest.raises(ConfigError, match=r"kv_cache_quant='int4'; choose one of"):
    presets.kv_cache_bytes(config, slots=3, length=24, quant='int4')


def test_the_qlora_plan_counts_the_int8_base_and_its_dequantised_push():
  """QLoRA (``lora.base_quant='int8'``), the trainer's real placement on 8 devices: the plan's
  params are the int8 projections, their scales, the other base leaves and the adapters as
  placed; its push is the float32 weights ``lora.pushed_base`` dequantises once (new device
  arrays); the int8 base is less than the float32 one, the optimizer state the same."""
  base, params = create_model(PLAN_MODEL, seed=0)
  lora = lora_lib.LoRAConfig(4, 8.0, base_quant='int8')
  model, params = lora_lib.create(base, params, lora)
  trainer = Trainer(model, params, make_optimizer(1e-3), lambda *a: None, make_mesh(SHARDED),
                    trainable=lora_lib.trainable_mask(model))
  plan = _plan(PLAN_MODEL, SHARDED, lora=lora)
  assert plan.params == _per_device_bytes(trainer.params)
  held = {id(x) for x in jax.tree.leaves(trainer.params)}
  pushed_once = lora_lib.pushed_base(model, trainer.params, abstract_model(PLAN_MODEL))
  copies = [x for x in jax.tree.leaves(pushed_once) if id(x) not in held]
  assert copies and plan.push == _per_device_bytes(copies)
  full = _plan(PLAN_MODEL, SHARDED, lora=dataclasses.replace(lora, base_quant='none'))
  assert plan.params < full.params and plan.optimizer == full.optimizer


@pytest.mark.parametrize('inference_dtype', [jnp.float32, jnp.bfloat16])
def test_the_adapter_sync_push_is_the_trainers_own_adapters_and_the_base_cast_once(
    inference_dtype):
  """The trainer's real pushes on 8 devices (``lora.pushed_params`` per version,
  ``lora.pushed_base`` once): only arrays the trainer does not already hold are new device
  memory, and the plan's push is theirs."""
  base, params = create_model(PLAN_MODEL, seed=0)
  lora = lora_lib.LoRAConfig(4, 8.0)
  model, params = lora_lib.create(base, params, lora)
  trainer = Trainer(model, params, make_optimizer(1e-3), lambda *a: None, make_mesh(SHARDED),
                    trainable=lora_lib.trainable_mask(model))
  inference = abstract_model(PLAN_MODEL.with_execution(param_dtype=inference_dtype))
  held = {id(x) for x in jax.tree.leaves(trainer.params)}
  version = lora_lib.pushed_params(model, trainer.params, inference)
  pushed_once = lora_lib.pushed_base(model, trainer.params, inference)
  plan = _plan(PLAN_MODEL, SHARDED, lora=lora, inference_param_dtype=inference_dtype)
  assert all(id(x) in held for x in jax.tree.leaves(version))  # nothing new per version
  assert _per_device_bytes(version) == plan.gradients  # the adapters, as trained
  copies = [x for x in jax.tree.leaves(pushed_once) if id(x) not in held]
  assert plan.push == (_per_device_bytes(copies) if copies else 0)
  if inference_dtype == jnp.float32:
    assert plan.push == 0
  else:  # every base leaf cast to bfloat16: half the float32 base
    assert plan.push == _per_device_bytes(lora_lib.base_tree(trainer.params)) / 2 > 0


@pytest.mark.parametrize('quant', ['none', 'int8'])
def test_an_adapter_sync_worker_holds_the_base_and_the_merged_weights_the_plan_counts(quant):
  """A real worker pulling the base and a version (tests/test_lora_run.py's pattern): on its
  devices the base it merges into and the copy its engine samples with (int8: quantised);
  on its host the adapters alone. The plan and the pre-run fit check count those."""
  config = smoke_config(lora__rank=2, lora__targets='q,v,o,down', model__inference_quant=quant)
  task = roles.build_task(config)
  model, params, tokenizer = roles.build_model(config, task)
  lmodel, params = lora_lib.create(model, params, lora_lib.from_config(config))
  base_server, server = ParameterServer(keep=1), ParameterServer(keep=1)
  base_server.push(0, lora_lib.pushed_base(lmodel, params, model))
  server.push(0, lora_lib.pushed_params(lmodel, params, model))
  mesh = roles.meshes(config)['inference'][0]
  worker = roles.build_worker(config, model, tokenizer, mesh, lambda: base_server.update(0))
  worker.receiver.pull(0, server.update)
  plan = memory_fit.run_memory_plan(model.config, config, ONE, ONE, shared=True)
  assert plan.inference_params == _per_device_bytes(worker.params)
  # pylint: disable-next=protected-access
  assert plan.inference_base == _per_device_bytes(worker.receiver._base)
  assert plan.inference_base == sum(x.nbytes for x in jax.tree.leaves(
      lora_lib.base_tree(params)))  # unquantised, in the workers' dtype
  host = worker.receiver._host_leaves  # pylint: disable=protected-access
  assert sum(x.nbytes for x in host) == sum(
      x.nbytes for x in jax.tree.leaves(lora_lib.adapter_tree(params)))
  assert memory_fit.rollout_memory_bytes(model.config, config)['params_bytes'] == (
      plan.inference_params + plan.inference_base)


def test_the_fit_check_counts_the_int8_copy_as_the_plan_does():
  """``memory_fit.rollout_memory_bytes`` and the plan share ``presets.worker_param_bytes``: the
  int8 copy, whole and per device of a sharded inference mesh."""
  decoder = dataclasses.replace(presets.get_preset('smollm2-135m'), num_layers=2)
  sharded = {'data': 1, 'fsdp': 2, 'tensor': 2}
  estimates, plans = {}, {}
  for quant in QUANT_MODES:
    config = smoke_config(model__inference_quant=quant)
    estimates[quant] = memory_fit.rollout_memory_bytes(decoder, config)
    plans[quant] = memory_fit.run_memory_plan(decoder, config, ONE, ONE, shared=True)
    assert estimates[quant]['params_bytes'] == plans[quant].inference_params
    config.mesh.inference.update(sharded)
    estimate = memory_fit.rollout_memory_bytes(decoder, config)
    unsplit = (estimate['kv_cache_bytes'] + estimate['logits_bytes']) / 2  # over fsdp
    assert estimate['per_device_bytes'] - unsplit == pytest.approx(memory_fit.run_memory_plan(
        decoder, config, ONE, sharded, shared=True).inference_params, rel=1e-12)
  # SmolLM2's projections, 2 layers: 1 byte a weight instead of 4, plus float32 scales.
  weights = 2 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
  channels = 2 * (576 * 2 + 192 * 2 + 1536 * 2 + 576)
  assert estimates['int8']['params_bytes'] == (
      estimates['none']['params_bytes'] - 3 * weights + 4 * channels)


@pytest.mark.parametrize('mesh', [ONE, SHARDED])
@pytest.mark.parametrize('inference_dtype', [jnp.float32, jnp.bfloat16])
def test_the_int8_plan_is_the_quantised_trees_bytes_on_a_worker(mesh, inference_dtype):
  config = PLAN_MODEL.with_execution(param_dtype=inference_dtype)
  model, params = create_model(config, seed=0)
  quantised = quantize_params(params, model)
  shardings = quantized_shardings(
      param_shardings(model.abstract_params(), model.logical_axes(), make_mesh(mesh)), model)
  placed = jax.device_put(quantised, shardings)
  plan = _plan(PLAN_MODEL, mesh, inference_param_dtype=inference_dtype, inference_quant='int8')
  assert plan.inference_params == _per_device_bytes(placed)
  if mesh == ONE:
    assert plan.inference_params == sum(x.nbytes for x in jax.tree.leaves(quantised))
  # One byte per projection weight plus a float32 scale per output channel; the embedding,
  # lm head and norms in the inference dtype.
  projections = [x for p, x in jax.tree_util.tree_leaves_with_path(params)
                 if p[-1].key in PROJECTIONS]
  kept = sum(x.nbytes for p, x in jax.tree_util.tree_leaves_with_path(params)
             if p[-1].key not in PROJECTIONS)
  channels = 2 * (4 * 8 + 2 * 8 + 2 * 8 + 32 + 64 + 64 + 32)  # q k v o gate up down
  if mesh == ONE:
    assert plan.inference_params == sum(x.size for x in projections) + 4 * channels + kept
  with pytest.raises(ConfigError, match="inference_quant='int4'"):
    _plan(PLAN_MODEL, inference_quant='int4')


def test_the_run_plan_reads_lora_and_inference_quant_from_the_config():
  decoder = dataclasses.replace(presets.get_preset('smollm2-135m'), num_layers=2)
  config = smoke_config()
  full = memory_fit.run_memory_plan(decoder, config, ONE, ONE, shared=True)
  config = smoke_config(lora__rank=2, lora__alpha=4.0, lora__targets='q,v',
                        model__inference_quant='int8')
  got = memory_fit.run_memory_plan(decoder, config, ONE, ONE, shared=True)
  # SmolLM2's widths, 2 layers: d = q = 576, kv = 192; rank 2 on q (576 + 576), v (576 + 192).
  adapters = 2 * 2 * ((576 + 576) + (576 + 192))
  assert got.optimizer == 2 * 4 * adapters and got.gradients == 4 * adapters
  assert got.params == full.params + 4 * adapters
  assert got.push == 0  # lora.sync='adapters' (the default), float32 workers
  assert got.inference_base == full.inference_params  # the base, unquantised
  # int8 projections: 1 byte a weight instead of 4, plus a float32 scale per output channel.
  weights = 2 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
  channels = 2 * (576 * 2 + 192 * 2 + 1536 * 2 + 576)
  assert got.inference_params == full.inference_params - 3 * weights + 4 * channels


@pytest.mark.parametrize('mesh, embed_shard, gathered', [
    ({'data': 4, 'fsdp': 1, 'tensor': 1}, 640, 0),  # 576 padded to 5 x 128 lanes
    # FSDP splits the embedding dimension: 144 padded to 256; the table gathered whole.
    ({'data': 1, 'fsdp': 4, 'tensor': 1}, 256, 49152 * 576 * 4),
])
def test_the_tpu_plan_counts_the_embeddings_update_and_fsdps_gathered_table(
    mesh, embed_shard, gathered):
  # SmolLM2-135M's tied 49152 x 576 float32 table, one layer (benchmarks/RESULTS.md,
  # "Compiled for TPU at real depth": six such buffers in the compiled step's temporaries).
  decoder = presets.get_preset('smollm2-135m', num_layers=1)
  terms = presets.tpu_trainer_terms(decoder, mesh)
  assert terms == {'lookup': 6 * 49152 * embed_shard * 4, 'gathered': gathered, 'head': 0}
  cpu = presets.memory_plan(decoder, mesh, ONE, train_rows=8, train_length=60, slots=2,
                            cache_length=8)
  tpu = presets.memory_plan(decoder, mesh, ONE, train_rows=8, train_length=60, slots=2,
                            cache_length=8, platform='tpu')
  assert cpu.lookup == cpu.gathered == 0
  # At one layer the table's update is larger than every param's: it takes the update's place.
  assert terms['lookup'] > tpu.update
  assert tpu.trainer_bytes - cpu.trainer_bytes == pytest.approx(
      terms['lookup'] - max(tpu.activations, tpu.update) + gathered)
  assert "embedding's update" in tpu.table(16 * 2**30)[0]
  # Under LoRA the table is frozen: no update of it.
  lora = presets.memory_plan(decoder, mesh, ONE, train_rows=8, train_length=60, slots=2,
                             cache_length=8, platform='tpu', lora=lora_lib.LoRAConfig(4, 8.0))
  assert lora.lookup == 0 and lora.gathered == gathered


def test_the_tpu_plan_counts_the_log_prob_chunks_backward_under_fsdp():
  # Qwen3-1.7B's step on gsm8k's v5e-8 (fsdp 8, 8 micro-batches of 4 rows of 1024 positions
  # per chip, log-probs 128 at a time, bfloat16 compute): each chunk's backward holds the tied
  # 151,936 x 2,048 table gathered whole in bfloat16, its gradient whole in float32 and that
  # gradient all-reduced in bfloat16 (benchmarks/RESULTS.md, "TPU compile: the 1.7B plan").
  decoder = presets.get_preset('qwen3-1.7b', num_layers=1).with_execution(
      param_dtype=jnp.float32, dtype=jnp.bfloat16, remat='full')
  fsdp = {'data': 1, 'fsdp': 8, 'tensor': 1}
  plan = functools.partial(presets.memory_plan, decoder, trainer_mesh=fsdp, inference_mesh=ONE,
                           train_rows=256, train_length=1024, micro_batches=8, slots=2,
                           cache_length=8, platform='tpu')
  head = 151_936 * 2048 * (4 + 2 + 2)
  assert presets.tpu_trainer_terms(decoder, fsdp, chunked=True)['head'] == head
  chunked = plan(logprob_chunk=128)
  parts = presets.activation_bytes(decoder, rows=4, length=1024, logprob_chunk=128,
                                   platform='tpu')
  # Beside it: the blocks' saved inputs, the chunk's logits and the tied table's lookup
  # gradient; the step's peak is that phase, not the activations with one gathered table.
  assert chunked.head == parts['saved_bytes'] + parts['logits_bytes'] + head + chunked.lookup
  assert chunked.head > max(chunked.activations, chunked.update, chunked.lookup) + \
      chunked.gathered
  assert chunked.trainer_bytes == (chunked.params + chunked.optimizer + chunked.gradients
                                   + chunked.head)
  assert "the log-prob chunks' backward" in chunked.table(16 * 2**30)[0]
  # The whole rows' log-probs at once, the data axis, or XLA:CPU: no such phase.
  assert plan(logprob_chunk=0).head == 0
  assert plan(logprob_chunk=128, trainer_mesh={'data': 8, 'fsdp': 1, 'tensor': 1}).head == 0
  assert plan(logprob_chunk=128, platform='cpu').head == 0
  # Under LoRA the table is frozen: no gradient of it.
  assert plan(logprob_chunk=128, lora=lora_lib.LoRAConfig(4, 8.0)).head == 0


def test_the_plan_refuses_an_unknown_platform():
  with pytest.raises(ConfigError, match=r"platform='gpu'.*choose one of \('cpu', 'tpu'\)"):
    _plan(PLAN_MODEL, platform='gpu')


def test_the_tpu_plan_keeps_one_attention_sized_buffer_per_layer_without_remat():
  # XLA:CPU's step keeps three float32 [rows, heads, T, T] per layer without remat, XLA:TPU's
  # about one (configs/math.py's step on v5e-8); with remat 'full' neither keeps any.
  decoder = presets.get_preset('smollm2-135m', num_layers=2)
  scores = 4 * 2 * 9 * 416 * 416  # float32 [2 rows, 9 heads, 416, 416]
  for remat, fewer in (('none', 2), ('full', 0)):
    config = decoder.with_execution(remat=remat)
    cpu, tpu = (presets.activation_bytes(config, rows=2, length=416, platform=p)
                for p in presets.PLATFORMS)
    assert cpu['saved_bytes'] - tpu['saved_bytes'] == fewer * 2 * scores
    assert cpu['work_bytes'] == tpu['work_bytes'] and cpu['logits_bytes'] == tpu['logits_bytes']
