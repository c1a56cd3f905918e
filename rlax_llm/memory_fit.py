"""Whether a run fits in memory: its memory estimates and the checks made before any compute.

``rollout_memory_bytes`` is a lower bound of one rollout batch on the inference mesh (what
``roles.check_fits`` checks once the model is read); ``run_memory_plan`` is the run's
``presets.memory_plan`` (trainer and workers, per chip) from its config and meshes, and
``check_plan_fits`` refuses a run whose plan does not fit before the trainer and the workers
are built (the local backend calls it once the meshes are resolved). Both compare against
``available_memory_bytes``: an accelerator's limit, or the host's available RAM on CPU.
The Cloud TPU recipes (``launch/recipes``) size their slices with ``run_memory_plan``.

A plan or a compiled program against a chip's HBM falls in one of three bands
(``fit_band``), the same in the recipes' dry run, the TPU-compile report and a run's own
check on a TPU: it fits with headroom (at most ``HEADROOM`` of HBM), fits above it (a
warning naming the keys that make room: XLA's scratch space and fragmentation are not in a
plan), or does not fit (refused).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import ml_collections

from rlax_llm import config as config_lib
from rlax_llm.errors import ConfigError
from rlax_llm.models import lora as lora_lib
from rlax_llm.models import presets
from rlax_llm.models.decoder_config import DTYPES, DecoderConfig

HEADROOM = 0.8  # of a chip's HBM; above it a plan fits only with a warning
# What makes room on a TPU slice, for every refusal and warning of the memory bands.
SHRINK_HINT = ('shard more (config.mesh.trainer.fsdp, config.mesh.inference.tensor), save '
               'activations (config.model.remat=full, config.rl.micro_batches, '
               'config.rl.logprob_chunk), lower config.rollout.slots or the sampling lengths, '
               'or pick a bigger slice')


def fit_band(need: float, hbm: float) -> str:
  """``'fits'`` (``need <= HEADROOM * hbm``), ``'tight'`` (above that, at most ``hbm``) or
  ``'over'`` (more than ``hbm``); ``need`` and ``hbm`` in the same unit."""
  if need > hbm:
    return 'over'
  return 'tight' if need > HEADROOM * hbm else 'fits'


def tight_warning(where: str, need: float, hbm: float) -> str:
  """The warning of the ``'tight'`` band (bytes in, GiB out)."""
  return (f'{where} need {need / 2**30:.2f} GiB each, {100 * need / hbm:.0f}% of the '
          f'{hbm / 2**30:g} GiB of HBM (above {100 * HEADROOM:.0f}%: XLA\'s scratch space and '
          f'fragmentation are not counted, so it may not fit); to make room: {SHRINK_HINT}.')


def rollout_memory_bytes(model: DecoderConfig, config: ml_collections.ConfigDict
                         ) -> dict[str, float]:
  """A lower-bound estimate of one rollout batch's device memory on the inference mesh.

  KV cache ``2 * layers * B * (P + N) * kv_heads * head_dim`` in the compute dtype, or int8
  plus scales with ``model.kv_cache_quant='int8'`` (``presets.kv_cache_bytes``), the params
  a worker keeps (``presets.worker_param_bytes``,
  as the memory plan counts them: in the workers' dtype, ``inference_model``; quantised with
  ``model.inference_quant='int8'``; with LoRA's adapter-only sync the base beside the merged
  weights), and a few ``[B, vocab]`` float32 logit buffers, with the batch split over the
  mesh's ``data * fsdp`` devices and the params placed by the sharding rules. Returns
  ``{'kv_cache_bytes', 'params_bytes', 'logits_bytes'}`` of the whole batch and model, and
  ``'per_device_bytes'``.
  """
  batch = config.rl.prompts_per_step * config.rl.group_size
  length = config.sampling.max_prompt_len + config.sampling.max_new_tokens
  kv = presets.kv_cache_bytes(model, slots=batch, length=length,
                              quant=config.model.kv_cache_quant)
  logits = 4 * batch * model.vocab_size * 4
  sizes = {k: (v if v > 0 else 1) for k, v in config.mesh.inference.items()}
  inference = model.with_execution(
      param_dtype=DTYPES[config_lib.inference_param_dtype(config)])
  def params_on(mesh: dict[str, int]) -> float:
    held = presets.worker_param_bytes(inference, mesh, quant=config.model.inference_quant,
                                      lora=lora_lib.from_config(config))
    return held['params'] + held['base']
  params = params_on({axis: 1 for axis in sizes})
  batch_shards = sizes['data'] * sizes['fsdp']
  per_device = (kv + logits) / batch_shards + params_on(sizes)
  return {'kv_cache_bytes': float(kv), 'params_bytes': float(params),
          'logits_bytes': float(logits), 'per_device_bytes': float(per_device)}


def teacher_model(config: ml_collections.ConfigDict, student: DecoderConfig
                  ) -> DecoderConfig | None:
  """The architecture of on-policy distillation's teacher (``config.teacher``) in its
  ``teacher.dtype``, as far as the config names it: a 'tiny' teacher has the tiny student's
  (``student``), a preset name its preset's; None without distillation or for ``'auto'``
  (known only from its checkpoint: the local backend passes the loaded one)."""
  t = config.teacher
  if not t.enabled or t.name not in ('tiny', *presets.PRESETS):
    return None
  arch = student if t.name == 'tiny' else presets.get_preset(t.name)
  return arch.with_execution(param_dtype=DTYPES[t.dtype], dtype=DTYPES[t.dtype])


def teacher_memory_bytes(teacher: DecoderConfig, config: ml_collections.ConfigDict
                         ) -> dict[str, float]:
  """The teacher's bytes on its device (``trainer.teacher.Teacher``: one device, the first):
  ``'params'``, its params in ``teacher.dtype`` (``teacher.quant='int8'``: int8 projections
  and their scales, ``presets.worker_param_bytes``), and ``'scoring'``, one batch's forward
  with no backward pass: one block in flight and the float32 logits and log-softmax of
  ``rl.logprob_chunk`` positions (all with 0) of every row (``presets.activation_bytes``'
  ``work`` and two of its three logits buffers)."""
  one = {'data': 1, 'fsdp': 1, 'tensor': 1}
  params = presets.worker_param_bytes(teacher, one, quant=config.teacher.quant)['params']
  rl, s = config.rl, config.sampling
  act = presets.activation_bytes(teacher, rows=rl.prompts_per_step * rl.group_size,
                                 length=s.max_prompt_len + s.max_new_tokens,
                                 logprob_chunk=rl.logprob_chunk)
  return {'params': float(params),
          'scoring': float(act['work_bytes'] + act['logits_bytes'] * 2 / 3)}


def run_memory_plan(model: DecoderConfig, config: ml_collections.ConfigDict,
                    trainer_mesh: dict[str, int], inference_mesh: dict[str, int], *,
                    shared: bool, platform: str = 'cpu',
                    teacher: DecoderConfig | None = None) -> presets.MemoryPlan:
  """``presets.memory_plan`` of a run: its batch, lengths, micro-batches, KV-cache slots,
  workers, the workers' params dtype (``model.inference_param_dtype``) and quantisation
  (``model.inference_quant``), LoRA adapters (``lora``) and KL reference from ``config``; the
  meshes resolved (``sharding.mesh_shape``). ``shared``: the trainer and the
  workers share chips (the local backend without ``mesh.disjoint``; every worker's mesh then
  starts at the first chip). ``platform``: whose compiled trainer step the plan follows
  (``presets.PLATFORMS``: ``'tpu'`` for a TPU's XLA:TPU, else ``'cpu'``). With
  distillation the teacher (``teacher_memory_bytes`` of ``teacher``, or of ``teacher_model``
  when None: an ``'auto'`` teacher is then not counted) counts on the first chip, or on
  ``backend='ray'`` on a row of its own (``MemoryPlan.teacher_apart``: its actor's chip,
  ``ray.teacher_resources``)."""
  rl, s = config.rl, config.sampling
  length = s.max_prompt_len + s.max_new_tokens
  plan = presets.memory_plan(
      model, trainer_mesh, inference_mesh,
      inference_param_dtype=DTYPES[config_lib.inference_param_dtype(config)],
      train_rows=rl.prompts_per_step * rl.group_size,
      train_length=length, micro_batches=rl.micro_batches, logprob_chunk=rl.logprob_chunk,
      slots=config.rollout.slots, cache_length=length,
      workers_per_chip=config.rollout.workers if shared else 1, shared=shared,
      reference=(rl.kl_beta or 0) > 0, lora=lora_lib.from_config(config),
      inference_quant=config.model.inference_quant,
      kv_cache_quant=config.model.kv_cache_quant, platform=platform)
  teacher = teacher or teacher_model(config, model)
  if teacher is None:
    return plan
  held = teacher_memory_bytes(teacher, config)
  return dataclasses.replace(plan, teacher_params=held['params'],
                             teacher_scoring=held['scoring'],
                             teacher_apart=config.backend == 'ray')


def available_memory_bytes() -> float:
  """Memory one device can use: the accelerator's limit, or the host's available RAM (CPU)."""
  device = jax.local_devices()[0]  # multi-host: another host's device has no stats here
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and 'bytes_limit' in stats:
    return float(stats['bytes_limit'])
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  return float(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES'))


def check_plan_fits(config: ml_collections.ConfigDict, model: DecoderConfig,
                    meshes: dict[str, Any], *, held_bytes: float = 0.0,
                    teacher: DecoderConfig | None = None) -> presets.MemoryPlan:
  """Checks, before the trainer and the workers are built, that the run's memory plan
  (``run_memory_plan`` on the resolved ``meshes``, ``roles.meshes``: the trainer's params,
  optimizer state, gradients and activations, and every worker's params, KV cache and
  logits) fits in memory: per chip against an accelerator's limit (``needs``), or, on CPU,
  where every device is the host's memory, the sum over the devices each role uses against
  the host's available memory plus ``held_bytes`` (what the process already holds that the
  plan counts again: the loaded params). The plan is a lower bound of a process's memory on
  CPU (XLA's scratch, the compiled programs, host copies and Python are not in it), so a run
  it refuses could not have run. ``teacher``: the loaded teacher's architecture
  (``run_memory_plan``; its params, already loaded, belong in ``held_bytes`` on CPU).
  Returns the plan; raises ConfigError naming what to change.
  """
  trainer_mesh, inference = meshes['trainer'], meshes['inference']
  shared = not config.mesh.disjoint
  platform = jax.devices()[0].platform
  plan = run_memory_plan(model, config, dict(trainer_mesh.shape), dict(inference[0].shape),
                         shared=shared, platform='tpu' if platform == 'tpu' else 'cpu',
                         teacher=teacher)
  available = available_memory_bytes()
  if platform == 'cpu':
    trainer_devices = trainer_mesh.devices.size
    inference_devices = sum(mesh.devices.size for mesh in inference)
    # Shared meshes start at the first device: each worker's mesh on the trainer's devices.
    need = (plan.trainer_bytes * trainer_devices
            + (plan.inference_bytes / plan.workers_per_chip) * inference_devices
            + plan.teacher_bytes)
    rows = [('the host (every CPU device)', need, available + held_bytes)]
  else:
    rows = plan.needs(available)
  for where, need, have in rows:
    band = fit_band(need, have)
    if band == 'tight' and platform != 'cpu':  # the host's RAM has no HBM headroom to keep
      logging.warning('memory: %s', tight_warning(f'the {where} chips', need, have))
    if band == 'over':
      raise ConfigError(
          f'the run needs at least {need / 2**30:.2f} GiB on {where} but '
          f'{have / 2**30:.2f} GiB is available (memory plan per device: '
          f'{"; ".join(plan.table(have)[:2])}); raise config.rl.micro_batches, set '
          'config.model.remat=full or config.rl.logprob_chunk (e.g. 128), train LoRA adapters '
          '(config.lora.rank), shorten sampling.max_new_tokens, or shard wider '
          '(config.mesh.trainer.fsdp).')
  return plan
