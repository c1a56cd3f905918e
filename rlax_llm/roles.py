"""Builds each role of a run from a validated config; backends decide where roles run.

The run's task, model and tokenizer (``prepare``), the trainer (``build_trainer``, after the
supervised warm-up: ``warm_trainer``), on-policy distillation's frozen teacher
(``build_teacher``), an inference worker (``build_worker``) and the
devices each takes (``meshes``). Whether the run fits in memory is ``rlax_llm.memory_fit``'s;
the trainer's checkpoints are ``rlax_llm.backends.checkpoints``'; what a worker's process
runs for an environment run's requests is ``rlax_llm.backends.play``'s.

``rlax_llm.config.validate_config`` has checked every field that needs no model file. The
builders here check the rest before any compute (after reading a checkpoint's config and
tokenizer, before the warm-up or the first compilation): every prompt fits
``sampling.max_prompt_len`` (a file-backed task's every record is measured, and one that does
not fit is an error or left out, ``sampling.overlong_prompts``), prompt + completion fit the
model, and the rollout batch fits in memory. Backends (``rlax_llm.backends``) compose these
builders; the Ray backend builds the same roles inside actors.
"""

from __future__ import annotations

import functools
import itertools
import logging
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from rlax_llm import config as config_lib
from rlax_llm import console, memory_fit, warmup_cache
from rlax_llm.data import sft_batch
from rlax_llm.envs import Environment, make_env
from rlax_llm.envs.seeds import env_seeds
from rlax_llm.envs.tool_calls import tool_format_for
from rlax_llm.errors import ConfigError
from rlax_llm.models import from_pretrained, presets
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.decoder_config import DTYPES, DecoderConfig, Execution
from rlax_llm.models.files import hub
from rlax_llm.models.files.tokenizer import HFTokenizer
from rlax_llm.models.model import (
    Model,
    Params,
    abstract_model,
    create_model,
    split_module,
    with_param_dtype,
)
from rlax_llm.models.quant import quantize_params
from rlax_llm.paramserver.publisher import adapter_sync
from rlax_llm.paramserver.receiver import FetchBase
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sharding import role_meshes
from rlax_llm.tasks import Task, make_task
from rlax_llm.tasks.files import FileTask
from rlax_llm.tasks.prompt_length import fit_prompt_length
from rlax_llm.tokenization import CharTokenizer, Tokenizer, encode_prompts
from rlax_llm.trainer.objectives import loss_totals, rl_objective, shared_prefix_scoring
from rlax_llm.trainer.scoring import Policy
from rlax_llm.trainer.teacher import Teacher, check_same_tokenizer
from rlax_llm.trainer.trainer import Bound, Trainer, learning_rate_schedule, make_optimizer
from rlax_llm.trainer.warmup import demo_batch, supervised_warmup

# The architecture fields a checkpoint must share with the preset it is loaded as.
_ARCHITECTURE_FIELDS = ('vocab_size', 'num_layers', 'embed_dim', 'num_heads', 'num_kv_heads',
                        'head_dim', 'mlp_dim', 'tie_embeddings', 'qkv_bias', 'qk_norm',
                        'family', 'num_experts', 'num_experts_per_tok', 'moe_mlp_dim',
                        'norm_topk_prob', 'decoder_sparse_step', 'mlp_only_layers')


def build_task(config: ml_collections.ConfigDict) -> Task:
  """The run's task; an environment run's is its seed stream (``envs.seeds``)."""
  if config.env.name:
    return env_seeds(config)
  return make_task(config.task.to_dict() | {'seed': config.seed})


def env_factory(config: ml_collections.ConfigDict, tokenizer: Tokenizer
                ) -> Callable[[], Environment]:
  """Builds a fresh environment of ``config.env`` per call, its tools in the tool format of
  ``tokenizer``'s checkpoint (``tool_calls.tool_format_for``) unless ``env.tool_format`` names
  one."""
  return functools.partial(make_env, config.env, tool_format_for(tokenizer))


def checkpoint_path(config: ml_collections.ConfigDict) -> pathlib.Path:
  """``model.path`` as a local path (a hub id at ``model.revision`` is fetched into, or read
  from, the hub cache: ``hub.resolve_model_path``), else the packaged checkpoint of the preset
  ``model.name``."""
  m = config.model
  if m.path is not None:
    return hub.resolve_model_path(m.path, m.revision)
  return presets.packaged_checkpoint(m.name)


def build_model(config: ml_collections.ConfigDict, task: Task
                ) -> tuple[Model, Params, Tokenizer]:
  """The policy model, its initial params and its tokenizer.

  ``model.name='tiny'``: a decoder built from ``model.tiny`` with a ``CharTokenizer`` over
  the task's ``charset``, initialised from the seed. A preset name: the checkpoint at
  ``model.path`` (or the packaged one) with its own tokenizer and chat template; its
  architecture must be the preset's. ``'auto'``: the checkpoint at ``model.path``, whatever
  supported architecture its ``config.json`` names.
    ``model.moe_impl`` (a mixture of experts; '' keeps ``Execution``'s default) picks how its
  experts run (``_with_moe_impl``).
  """
  m = config.model
  if m.name == 'tiny':
    if not task.charset:
      raise ConfigError(f'config.model.name=\'tiny\' builds a character-level model from the '
                        f'task\'s charset, but task {task.name!r} has none; use a pretrained '
                        'model.')
    tokenizer = CharTokenizer(task.charset)
    execution = Execution(remat=m.remat, param_dtype=DTYPES[m.param_dtype],
                          dtype=DTYPES[m.dtype], batch_invariant=m.batch_invariant,
                          invariant_rows=m.invariant_rows)
    decoder = DecoderConfig(vocab_size=tokenizer.vocab_size, max_seq_len=m.max_seq_len,
                            execution=execution, **m.tiny.to_dict())
    model, params = create_model(decoder, seed=config.seed)
    return _with_moe_impl(config, model), params, tokenizer
  path = checkpoint_path(config)
  shown = repr(m.path) if m.path is not None else repr(str(path))
  if m.path is not None and path != pathlib.Path(m.path):
    shown += f' (at {str(path)!r})'
  module, tokenizer = from_pretrained(path, dtype=DTYPES[m.dtype],
                                      param_dtype=DTYPES[m.param_dtype], remat=m.remat,
                                      batch_invariant=m.batch_invariant,
                                      invariant_rows=m.invariant_rows,
                                      max_seq_len=m.max_seq_len)
  if tokenizer is None:
    raise _no_tokenizer(shown)
  model, params = split_module(module)
  if m.name == 'auto':
    return _with_moe_impl(config, model), params, tokenizer
  preset = presets.PRESETS[m.name]
  differ = {f: (getattr(model.config, f), getattr(preset, f)) for f in _ARCHITECTURE_FIELDS
            if getattr(model.config, f) != getattr(preset, f)}
  if differ:
    raise ConfigError(
        f'config.model.path={shown} is not a {m.name!r} checkpoint: '
        + ', '.join(f'{f} {a!r} (preset: {b!r})' for f, (a, b) in differ.items())
        + '. Set config.model.name to the checkpoint\'s preset, or to \'auto\' (the '
        'architecture of its config.json).')
  return _with_moe_impl(config, model), params, tokenizer


def _with_moe_impl(config: ml_collections.ConfigDict, model: Model) -> Model:
  """``model`` with ``Execution.moe_impl`` = ``model.moe_impl`` ('': unchanged): how a mixture
  of experts computes its experts in the trainer, and in the engine unless
  ``model.inference_moe_impl`` says otherwise (``inference_model``). The params are the same
  whichever. ConfigError on a dense model with it set (an ``'auto'`` checkpoint's architecture
  is known only here; the tiny model and the presets are refused at validation)."""
  impl = config.model.moe_impl
  if not impl:
    return model
  _require_moe(config, model, 'moe_impl', "a mixture of experts' experts run")
  return abstract_model(model.config.with_execution(moe_impl=impl))


def _require_moe(config: ml_collections.ConfigDict, model: Model, key: str, what: str) -> None:
  """ConfigError when ``model`` is dense but ``config.model.<key>`` (which picks how ``what``)
  is set: on a dense model it would do nothing, which is refused rather than ignored."""
  if not model.config.is_moe:
    raise ConfigError(f'config.model.{key}={config.model[key]!r} picks how {what}, but model '
                      f'{_shown(config.model)} is dense (num_experts=0); set model.{key}=\'\'.')


def check_fits(config: ml_collections.ConfigDict, task: Task, model: Model,
               tokenizer: Tokenizer, *, probe_steps: int = 4, max_probe_prompts: int = 1024
               ) -> dict[str, float]:
  """Checks, before any compute, that the rollout batch fits in memory and prompts fit.

  Encodes every held-out prompt and the first ``probe_steps`` steps' training prompts (at
  most ``max_probe_prompts``) with the model's tokenizer. Returns the memory estimate
  (bytes) it checked.
  Raises ConfigError naming the key to change.
  """
  s = config.sampling
  m = model.config
  if s.max_prompt_len + s.max_new_tokens > m.max_seq_len:
    raise ConfigError(
        f'config.sampling.max_prompt_len ({s.max_prompt_len}) + sampling.max_new_tokens '
        f'({s.max_new_tokens}) exceeds the model\'s max_seq_len ({m.max_seq_len}); shorten '
        'them (or raise model.max_seq_len where the model allows).')
  estimate = memory_fit.rollout_memory_bytes(model.config, config)
  available = memory_fit.available_memory_bytes()
  if estimate['per_device_bytes'] > available:
    raise ConfigError(
        f'the rollout batch needs about {estimate["per_device_bytes"] / 2**30:.2f} GiB per '
        f'device (KV cache {estimate["kv_cache_bytes"] / 2**30:.2f} GiB, params '
        f'{estimate["params_bytes"] / 2**30:.2f} GiB, logits '
        f'{estimate["logits_bytes"] / 2**30:.2f} GiB) but {available / 2**30:.2f} GiB is '
        'available; lower config.rl.prompts_per_step, rl.group_size or '
        'sampling.max_new_tokens, or shard inference wider (config.mesh.inference).')
  probe = itertools.chain(task.eval_prompts(), (task.train_prompt(i) for i in range(
      min(probe_steps * config.rl.prompts_per_step, max_probe_prompts))))
  longest, longest_prompt = 0, None
  for prompt in probe:
    if prompt.messages is not None and tokenizer.chat_template is None:
      raise ConfigError(f'config.task.format={getattr(task, "format", "chat")!r} prompts are '
                        'chat messages but the model\'s tokenizer has no chat template; use '
                        'task.format=plain.')
    try:
      ids = encode_prompts(tokenizer, [prompt])[0]
    except ValueError as e:  # a character outside a tiny model's alphabet (task.charset)
      raise ConfigError(f'task {task.name!r}: prompt {prompt.prompt_id} does not encode with '
                        f'the model\'s tokenizer: {e} (a tiny model\'s alphabet is the task\'s '
                        'charset: make it hold every character of the prompts).') from None
    if len(ids) > longest:
      longest, longest_prompt = len(ids), prompt
  if longest > s.max_prompt_len:
    raise ConfigError(
        f'config.sampling.max_prompt_len={s.max_prompt_len} is too short: prompt '
        f'{longest_prompt.prompt_id} encodes to {longest} tokens with the model\'s tokenizer '
        f'({(longest_prompt.messages or longest_prompt.text)!r}); raise it to at least '
        f'{longest}.')
  return estimate


def fit_prompts(config: ml_collections.ConfigDict, task: Task, tokenizer: Tokenizer) -> int:
  """Measures every prompt of a file-backed ``task`` with ``tokenizer`` against
  ``sampling.max_prompt_len`` and applies ``sampling.overlong_prompts`` ('error' raises
  ConfigError, 'drop' leaves those records out of ``task``: ``tasks.prompt_length``).
  Returns the number left out. Every process holding the run's task calls it with the same
  tokenizer, so each holds the same prompts."""
  return fit_prompt_length(task, tokenizer, config.sampling.max_prompt_len,
                           config.sampling.overlong_prompts)


def load_tokenizer(config: ml_collections.ConfigDict, task: Task) -> Tokenizer:
  """The model's tokenizer alone, without its weights (``build_model``'s third part): for a
  process that needs the prompts a run uses but no model, e.g. the Ray driver."""
  if config.model.name == 'tiny':
    return CharTokenizer(task.charset)
  path = checkpoint_path(config)
  if path.suffix == '.gguf':
    return HFTokenizer.from_gguf(path)
  if not (path / 'tokenizer.json').exists():
    raise _no_tokenizer(repr(str(path)))
  return HFTokenizer.from_directory(path)


def _no_tokenizer(shown: str) -> ConfigError:
  return ConfigError(f'config.model.path={shown} has no tokenizer (tokenizer.json); '
                     'rlax_llm tokenizes with the checkpoint\'s own tokenizer.')


def prepare_task(config: ml_collections.ConfigDict) -> Task:
  """The run's task with ``fit_prompts`` applied, for a process that holds the task but not
  the model (the Ray driver, which owns the prompt stream): loads only the tokenizer, and
  only for a file-backed task (a generated one needs none)."""
  task = build_task(config)
  if isinstance(task, FileTask):
    fit_prompts(config, task, load_tokenizer(config, task))
  return task


def prepare(config: ml_collections.ConfigDict
            ) -> tuple[Task, Model, Params, Tokenizer]:
  """Task, model, initial params and tokenizer, the task's prompts measured
  (``fit_prompts``) and checked to fit (``check_fits``): everything a run needs before its
  first compute. ``config`` must have passed ``validate_config``; the meshes are checked
  against this process's devices first (``check_meshes``)."""
  check_meshes(config)
  path, revision = config.model.path, config.model.revision
  console.phase(f'loading the model {config.model.name}' + (f' from {path}' if path else '')
                + (f' at revision {revision}' if revision else ''))
  task = build_task(config)
  model, params, tokenizer = build_model(config, task)
  fit_prompts(config, task, tokenizer)
  check_fits(config, task, model, tokenizer)
  return task, model, params, tokenizer


def build_trainer(config: ml_collections.ConfigDict, spec: config_lib.RunSpec, model: Model,
                  params: Params, mesh: jax.sharding.Mesh) -> Trainer:
  """The RL trainer: ``spec.loss`` through the rollout policy's transform
  (``spec.sampling``); ``spec`` is ``validate_config(config)``'s result. With ``lora.rank >
  0`` it trains adapters (seeded by ``config.seed``) over the frozen ``params``
  (``models.lora``): its model is then a ``LoRAModel``."""
  rl = config.rl
  trainable = None
  lora = lora_lib.from_config(config)
  if lora is not None:
    model, params = lora_lib.create(model, params, lora, seed=config.seed)
    trainable = lora_lib.trainable_mask(model)
  loss = spec.loss
  policy = Policy(model, spec.sampling)
  optimizer = make_optimizer(learning_rate_schedule(rl.learning_rate, rl.lr_decay_steps),
                             weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm)
  scoring, check = {}, None
  if rl.shared_prefix:  # score only the completions; each group's prompt runs once
    scoring, check = shared_prefix_scoring(config.sampling.max_new_tokens, rl.group_size,
                                           rl.micro_batches)
  gkd = spec.distill if spec.distill.kind == 'gkd' else None  # the trainer's GKD term
  objective = Bound(rl_objective, policy, loss, logprob_chunk=rl.logprob_chunk,
                    gkd=gkd, routing_replay=config.model.routing_replay == 'r3',
                    moe_aux_loss_coef=float(rl.moe_aux_loss_coef), **scoring)
  return Trainer(model, params, optimizer, objective, mesh,
                 reference_params=params if loss.kl_beta > 0 else None,
                 max_nonfinite_updates=rl.max_nonfinite_updates,
                 micro_batches=rl.micro_batches, totals_fn=loss_totals, check_batch=check,
                 trainable=trainable)


def warm_trainer(config: ml_collections.ConfigDict, spec: config_lib.RunSpec, task: Task,
                 model: Model, params: Params, tokenizer: Tokenizer, mesh: jax.sharding.Mesh,
                 checkpointer=None, stop=None) -> tuple[Trainer, dict[str, float]]:
  """The RL trainer (``build_trainer``) from the supervised warm-up's params, and the
  warm-up's metrics. With ``warmup.steps > 0`` and a ``checkpointer`` the warm-up's result is
  restored from it when it holds one; else, with ``warmup.cache`` set, from the cache's entry
  of this warm-up (``rlax_llm.warmup_cache``), copied into the checkpointer; else the warm-up
  runs and is saved to both. ``stop``: the preemption event the warm-up checks between
  steps."""
  w = config.warmup
  restored = (checkpointer.restore_warmup(params)
              if checkpointer is not None and w.steps > 0 else None)
  if restored is not None:
    logging.info('warm-up restored from its checkpoint')
  # Looked up (and later filled) only when the run's own checkpoint holds no warm-up.
  cache_key = (warmup_cache.fingerprint(config, mesh)
               if restored is None and w.steps > 0 and w.cache else None)
  if cache_key is not None:
    restored = warmup_cache.restore(w.cache, cache_key, params)
    if restored is not None:
      console.phase(f'warm-up: restored from warmup.cache ({w.cache}/{cache_key[:12]}...)')
      if checkpointer is not None:  # the run's own copy: a resume never needs the cache
        checkpointer.save_warmup(*restored)
  if restored is not None:
    params, metrics = restored
  else:
    if config.env.name:  # the oracle's episodes, as the episode runner records them
      batches = functools.partial(demo_batch, env_factory(config, tokenizer), tokenizer,
                                  max_turns=config.agent.max_turns or None)
      source = f'{config.env.name!r} oracle episodes'
    else:
      batches = functools.partial(sft_batch, task, tokenizer)
      source = "the task's demonstrations"
    params, metrics = supervised_warmup(
        model, params, batches, mesh, steps=w.steps, batch_size=w.batch_size,
        learning_rate=w.learning_rate, warmup_steps=w.warmup_steps,
        max_nonfinite_updates=config.rl.max_nonfinite_updates, stop=stop, source=source)
    if checkpointer is not None and w.steps > 0:
      checkpointer.save_warmup(params, metrics)
    if cache_key is not None:
      warmup_cache.save(w.cache, cache_key, params, metrics)
  return build_trainer(config, spec, model, params, mesh), metrics


def build_teacher(config: ml_collections.ConfigDict, spec: config_lib.RunSpec, task: Task,
                  student_tokenizer: Tokenizer) -> Teacher | None:
  """On-policy distillation's frozen teacher (``config.teacher``; None when
  ``rl.distill.kind`` is 'off'), loaded once by ``build_model`` from the teacher's
  name/path/revision in ``teacher.dtype`` (a 'tiny' teacher: ``model.tiny``'s architecture
  initialised from ``teacher.seed``), its projections int8 with ``teacher.quant='int8'``.
  Refuses, before any compute, a teacher whose tokenizer is not the student's."""
  if not spec.distill.enabled:
    return None
  t = config.teacher
  teacher_config = ml_collections.ConfigDict(config.to_dict())
  teacher_config.seed = t.seed
  teacher_config.model.update(name=t.name, path=t.path, revision=t.revision, dtype=t.dtype,
                              param_dtype=t.dtype)
  names = {'teacher_name': _shown(t), 'student_name': _shown(config.model)}
  # The tokenizers first: a mismatch is refused before the teacher's weights are read.
  check_same_tokenizer(load_tokenizer(teacher_config, task), student_tokenizer, **names)
  console.phase(f'loading the teacher {t.name}' + (f' from {t.path}' if t.path else ''))
  model, params, tokenizer = build_model(teacher_config, task)
  if t.quant == 'int8':
    params = quantize_params(params, model)
  return Teacher(model, params, tokenizer, student_tokenizer,
                 top_k=spec.distill.top_k if spec.distill.kind == 'gkd' else 0,
                 chunk=config.rl.logprob_chunk, temperature=spec.sampling.temperature,
                 name=names['teacher_name'],
                 student_name=names['student_name'])


def _shown(section: ml_collections.ConfigDict) -> str:
  """A model section (``config.model``, ``config.teacher``) as messages name it."""
  return repr(section.name) + (f' ({section.path!r})' if section.path else '')


def inference_model(config: ml_collections.ConfigDict, model: Model) -> Model:
  """The model as the inference workers hold it: its params in
  ``config_lib.inference_param_dtype(config)`` (``model.inference_param_dtype``, default
  ``model.param_dtype``), e.g. a bfloat16 copy of float32 master weights. The trainer pushes
  its params cast to this model's dtypes (``models.model.cast_params``), once per version.
  A mixture of experts computes its experts as ``model.inference_moe_impl`` says ('': as
  ``model``, the trainer's; ``'ragged'``/``'dense'``: ``Execution.moe_impl``;
  ``'dense_decode'``: ``Execution.decode_moe_impl='dense'``, the decode step dense and
  prefill as the trainer); the params are the same whichever. ConfigError on a dense model
  with it set (an ``'auto'`` checkpoint's architecture is known only here)."""
  model = with_param_dtype(model, DTYPES[config_lib.inference_param_dtype(config)])
  impl = config.model.inference_moe_impl
  if not impl:
    return model
  _require_moe(config, model, 'inference_moe_impl',
               "the engine computes a mixture of experts' experts")
  changes = ({'decode_moe_impl': 'dense'} if impl == 'dense_decode'
             else {'moe_impl': impl, 'decode_moe_impl': ''})
  return abstract_model(model.config.with_execution(**changes))


def build_worker(config: ml_collections.ConfigDict, model: Model, tokenizer: Tokenizer,
                 mesh: jax.sharding.Mesh, fetch_base: FetchBase | None = None
                 ) -> InferenceWorker:
  """An inference worker of ``model`` on ``mesh``, holding the params in the dtype of
  ``inference_model``: it loads and pulls params of that dtype (the trainer's pushes,
  already cast), and samples with an int8 copy of each when ``model.inference_quant='int8'``
  (and an int8 KV cache when ``model.kv_cache_quant='int8'``).
  ``fetch_base``: a run's way to pull the base a LoRA trainer pushes once; given, and with
  adapter-only sync (``publisher.adapter_sync``), the worker pulls adapter versions and
  merges them into that base (``InferenceWorker``'s ``lora``); else it loads whole params."""
  lora = adapter_sync(config) if fetch_base is not None else None
  return InferenceWorker(inference_model(config, model), tokenizer, mesh,
                         max_prompt_len=config.sampling.max_prompt_len,
                         max_new_tokens=config.sampling.max_new_tokens,
                         slots=config.rollout.slots, on_swap=config.rollout.on_swap,
                         quant=config.model.inference_quant,
                         kv_cache_quant=config.model.kv_cache_quant,
                         layer_loop=config.rollout.layer_loop,
                         record_routes=config.model.routing_replay == 'r3',
                         lora=lora, fetch_base=None if lora is None else fetch_base)


def check_meshes(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The meshes ``config.mesh`` resolves to on this process's devices (``role_meshes``),
  checked before any compute against what they split: every batch axis divides by its mesh's
  data x fsdp shards, and batch-invariant 'floor' rows are not split. The checks of a config
  that need JAX's devices (``rlax_llm.config`` stays JAX-free); ConfigError naming the key,
  the value and the fix."""
  with config_lib.naming('mesh.'):
    out = role_meshes(config.mesh.trainer.to_dict(), config.mesh.inference.to_dict(),
                      workers=config.rollout.workers, disjoint=config.mesh.disjoint)
  m = config.model
  data = {'mesh.trainer.data': out['trainer'].shape['data'],
          'mesh.inference.data': out['inference'][0].shape['data']}
  if m.batch_invariant and m.invariant_rows == 'floor' and any(v > 1 for v in data.values()):
    raise ConfigError(
        'config.model.invariant_rows=\'floor\' pads each weight matmul to 64 rows, but a '
        'data-parallel mesh gives each device a slice of them, which may be fewer: '
        + ', '.join(f'{k} resolves to {v}' for k, v in data.items() if v > 1)
        + '; use invariant_rows=\'chunks\' or one data shard per role.')
  checks = [('trainer', out['trainer'], 'rl.prompts_per_step * rl.group_size',
             config.rl.prompts_per_step * config.rl.group_size)]
  if config.warmup.steps > 0:
    checks.append(('trainer', out['trainer'], 'warmup.batch_size', config.warmup.batch_size))
  checks.append(('inference', out['inference'][0], 'rollout.slots', config.rollout.slots))
  for role, mesh, name, size in checks:
    shards = mesh.shape['data'] * mesh.shape['fsdp']
    if size % shards:
      raise ConfigError(
          f'config.mesh.{role}: the batch axis is split over data x fsdp = {shards} devices '
          f'but {name} = {size} does not divide by {shards} (of {jax.device_count()} '
          f'devices); make it a multiple of {shards} or change mesh.{role}.')
  return out


def device_count_text() -> str:
  """'1 device' / 'N devices': this process's JAX device count, for the log."""
  count = jax.device_count()
  return f'{count} device{"s" * (count != 1)}'


def meshes(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``{'trainer': Mesh, 'inference': [Mesh per worker]}``.

  With ``mesh.disjoint`` the trainer takes the first devices and each worker the next ones;
  otherwise every mesh starts at device 0 (roles share the devices).
  """
  out = role_meshes(config.mesh.trainer.to_dict(), config.mesh.inference.to_dict(),
                    workers=config.rollout.workers, disjoint=config.mesh.disjoint)
  logging.info('%s; trainer mesh %s; %d inference mesh(es) %s', device_count_text(),
               dict(out['trainer'].shape), len(out['inference']),
               dict(out['inference'][0].shape))
  return out


def trainer_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The trainer's mesh alone, ``meshes(config)['trainer']`` (the first devices): for a
  trainer's process that runs no inference worker, e.g. one of the Ray trainer actors that
  form one ``jax.distributed`` job (its mesh spans every one of their devices)."""
  mesh = role_meshes(config.mesh.trainer.to_dict(), config.mesh.inference.to_dict(),
                     workers=0)['trainer']
  logging.info('%s; trainer mesh %s', device_count_text(), dict(mesh.shape))
  return mesh
