"""A run's programs compiled for its Cloud TPU slice on this machine (no TPU, no network).

``python -m launch.recipes compile --tpu-type=v5e-8 --config=...`` (or ``--trainer-tpu-type``
and ``--inference-tpu-type`` for the Ray backend's separate slices) builds, with abstract
params (``jax.ShapeDtypeStruct``: nothing is allocated) and a compile-only description of the
slice's chips (``jax.experimental.topologies.get_topology_desc``, from libtpu), the programs
a run executes, as the run builds them:

- ``trainer_step``: the ``Trainer``'s jitted update as ``roles.build_trainer`` makes it
  (micro-batches, chunked log-probs, remat, the optimizer update, LoRA adapters when on), on
  the trainer mesh, with the params and optimizer state donated;
- ``push``: the trainer's cast of its params to the workers' dtype before each push
  (``models.model.cast_params``, where the params lie); only when the dtypes differ;
- ``prefill`` and ``decode``: the ``Engine``'s prefill of a full batch of the longest prompts
  and its decode step over every slot reading the whole cache, on one worker's mesh, with the
  run's slots, lengths, KV-cache quantisation and weights (``decode_int8``: int8 weights too
  when the run samples with bfloat16 ones, so a run can see what ``inference_quant='int8'``
  would change).
- ``teacher_score``: with on-policy distillation, the teacher's scoring forward
  (``trainer.teacher.Teacher.score``'s jitted program: one batch's token ids in, per-token
  log-probs out, in ``teacher.dtype``, int8 with ``teacher.quant``) on the one chip it
  scores on: the first of its own slice on the Ray backend (``--teacher-tpu-type``), the
  first trainer chip on the local backend.

The transfer of a version to the workers goes through the parameter server's host copy, not
a compiled program.

For each program a ``program_report.ProgramReport`` holds XLA's memory analysis per chip
against the chip's HBM and against the part of ``presets.memory_plan``
(``memory_fit.run_memory_plan``) it stands for, the compile time and a roofline model from
the compiler's cost analysis (launch/recipes/program_report.py).

The tracing runs with ``jax.default_backend()`` reporting ``'tpu'`` (``_as_on_tpu``): the
library picks XLA:CPU-only forms of some products by the default backend, and the programs
compiled here must be the ones a TPU host traces.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from launch.recipes.checks import Plan, run_model, run_teacher_model
from launch.recipes.program_report import (Compiled, ProgramReport, report_of,
                                           s8_dot_lines)
from launch.recipes.slices import SliceError, SliceType
from rlax_llm import config as config_lib
from rlax_llm import memory_fit, roles
from rlax_llm import sharding as sharding_lib
from rlax_llm.data_types import TrainBatch
from rlax_llm.models import lora as lora_lib
from rlax_llm.models import presets
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import abstract_model, cast_params
from rlax_llm.models.quant import quantize_params
from rlax_llm.rollout.engine import Engine
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer import teacher as teacher_lib
from rlax_llm.trainer.scoring import Policy, full_support

PROGRAMS = ('trainer_step', 'push', 'prefill', 'decode', 'decode_int8',
            'teacher_score')
@functools.cache
def tpu_devices(slice_: SliceType) -> tuple[Any, ...]:
  """Compile-only devices of ``slice_``'s chips (``get_topology_desc``), in the order a
  run's ``jax.devices()`` has them. libtpu reads ``TPU_ACCELERATOR_TYPE`` and
  ``TPU_WORKER_HOSTNAMES``; they are set so that it neither probes for a TPU nor asks a
  metadata server. Raises SliceError when libtpu is not installed, and for v4 (see below).
  libtpu describes a 2x4 slice as two hosts of four chips (the single-host v5e-8 and v6e-8
  VMs have the same chips and links); the meshes take the devices in order either way."""
  os.environ['TPU_ACCELERATOR_TYPE'] = slice_.accelerator_type
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  # Compiling uses no chip: other processes may compile at the same time (libtpu otherwise
  # takes /tmp/libtpu_lockfile and refuses a second process).
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    topology = topologies.get_topology_desc(topology_name=slice_.topology, platform='tpu')
  except (RuntimeError, ValueError) as e:
    raise SliceError(f'cannot describe {slice_.name} ({slice_.topology}) for compilation: '
                     f'{str(e).splitlines()[0]}; the TPU compiler comes with libtpu: '
                     "pip install -e '.[tpu]' (jax[tpu] at the version pyproject.toml pins)."
                     ) from None
  devices = tuple(topology.devices)
  if slice_.generation == 'v4' and len(devices) == 2 * slice_.chips:
    raise SliceError(f'{slice_.name}: libtpu\'s compile-only description of {slice_.topology} '
                     f'has {len(devices)} devices, one per TensorCore, while a v4 run\'s JAX '
                     f'sees one (megacore) device per chip ({slice_.chips}); compiling for it '
                     'would not be the run\'s program. Compile for a v5p slice of as many '
                     'chips (the same HBM class, a megacore chip) instead.')
  if len(devices) != slice_.chips:
    raise SliceError(f'{slice_.topology} describes {len(devices)} chips, the slice table '
                     f'{slice_.chips} ({slice_.name}); fix its row in launch/recipes/slices.py.')
  return devices


@contextlib.contextmanager
def _as_on_tpu() -> Iterator[None]:
  """Within: ``jax.default_backend()`` says ``'tpu'`` (read while tracing by
  ``numerics.flips`` and the CPU attention kernel's check)."""
  real = jax.default_backend
  jax.default_backend = lambda: 'tpu'
  try:
    yield
  finally:
    jax.default_backend = real


def _with_shardings(abstract: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def _bytes_per_chip(abstract: Any) -> float:
  """Bytes of ``abstract`` (sharded ``ShapeDtypeStruct`` leaves) on its most loaded chip."""
  return float(sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(abstract)))


def _compile(lower) -> Compiled:
  """Lowers (``_as_on_tpu``) and compiles, timing each."""
  start = time.perf_counter()
  with _as_on_tpu():
    lowered = lower()
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  done = time.perf_counter()
  return Compiled(compiled, lowered_at - start, done - lowered_at, compiled.as_text())


def _train_batch(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> TrainBatch:
  """The run's ``TrainBatch`` (``prompts_per_step x group_size`` rows of prompt + completion
  positions) as sharded ``ShapeDtypeStruct`` leaves, as ``sharding.global_batch`` places it."""
  rows = config.rl.prompts_per_step * config.rl.group_size
  length = config.sampling.max_prompt_len + config.sampling.max_new_tokens
  shape = lambda dtype, *dims: jax.ShapeDtypeStruct(dims, dtype)  # noqa: E731
  batch = TrainBatch(tokens=shape(np.int32, rows, length),
                     loss_mask=shape(np.float32, rows, length),
                     behaviour_logprobs=shape(np.float32, rows, length),
                     support_sizes=shape(np.int32, rows, length),
                     advantages=shape(np.float32, rows), versions=shape(np.int32, rows, length),
                     group_ids=shape(np.int32, rows))
  return _with_shardings(batch, sharding_lib.batch_sharding(mesh, batch))


def compile_trainer(config: ml_collections.ConfigDict, model: DecoderConfig,
                    mesh: jax.sharding.Mesh, slice_: SliceType, *, plan: float | None,
                    beside: float = 0.0) -> tuple[ProgramReport, float]:
  """The trainer's step (``roles.build_trainer`` on abstract params: ``jax.eval_shape``
  runs its placement and optimizer initialisation without allocating), lowered with its
  params, optimizer state, batch and KL reference and compiled for ``mesh``'s chips.
  Returns the report and the bytes per chip the trainer holds between steps (params,
  optimizer state, reference)."""
  spec = config_lib.run_spec(config)
  built = {}

  def build(params):
    trainer = roles.build_trainer(config, spec, abstract_model(model), params, mesh)
    built['trainer'] = trainer
    return trainer.params, trainer.opt_state, trainer.reference_params

  with _as_on_tpu():
    params, opt_state, reference = jax.eval_shape(build, abstract_model(model).abstract_params())
  trainer = built['trainer']
  params = _with_shardings(params, trainer.param_shardings)
  opt_state = _with_shardings(opt_state, trainer.opt_shardings)
  if reference is not None:
    reference = _with_shardings(reference, trainer.param_shardings)
  batch = _train_batch(config, mesh)

  def lower():
    with sharding_lib.activation_sharding(mesh, trainer.rules):
      # The jitted step the Trainer runs (its public step() executes it).
      # pylint: disable-next=protected-access
      return trainer._step.lower(params, opt_state, batch, reference)

  done = _compile(lower)
  tokens = batch.tokens.shape[0] * batch.tokens.shape[1]
  report = report_of('trainer_step', done, slice_, mesh, plan=plan, beside=beside, tokens=tokens,
                   model_flops=6 * presets.active_params(model) * tokens)
  if config.rl.micro_batches > 1:
    report.notes.append(f'{config.rl.micro_batches} micro-batches of '
                        f'{batch.tokens.shape[0] // config.rl.micro_batches} rows')
  resident = _bytes_per_chip((params, opt_state, reference))
  return report, resident


def make_engine(config: ml_collections.ConfigDict, model: DecoderConfig,
                mesh: jax.sharding.Mesh, quant: str) -> Engine:
  """The engine an inference worker of the run builds (``roles.build_worker``: the workers'
  dtype, slots, lengths, KV-cache quantisation, layer loop), with ``quant`` weights and the
  layout and decode attention a TPU host gets (the model's own)."""
  inference = roles.inference_model(config, abstract_model(model))
  run = inference.config.execution
  s = config.sampling
  return Engine(inference, mesh, slots=config.rollout.slots, max_prefill_length=s.max_prompt_len,
                max_decode_length=s.max_new_tokens, pad_id=0, quant=quant,
                kv_cache_quant=config.model.kv_cache_quant, weight_layout=run.weight_layout,
                decode_attention=run.decode_attention, layer_loop=config.rollout.layer_loop)


def _engine_params(engine: Engine) -> Any:
  abstract = engine.model.abstract_params()
  if engine.quant == 'int8':
    abstract = jax.eval_shape(functools.partial(quantize_params, model=engine.model), abstract)
  return _with_shardings(abstract, engine.param_shardings)


def compile_engine_decode(engine: Engine, sampling: SamplingSpec, slice_: SliceType, *,
                          program: str = 'decode', plan: float | None = None,
                          beside: float = 0.0) -> tuple[ProgramReport, str]:
  """``engine``'s decode step over every slot, attending to the whole cache (its largest
  program), with the decode state donated, compiled for ``slice_`` (``engine.mesh`` made of
  ``tpu_devices(slice_)``). Returns the report and the optimized HLO text; with int8 weights
  the report notes how many products take them as ``s8`` operands (``s8_dot_lines``)."""
  params = _engine_params(engine)
  with _as_on_tpu():
    state = _with_shardings(jax.eval_shape(engine.init_decode_state), engine.state_shardings)
  done = _compile(lambda: engine._generate.lower(  # pylint: disable=protected-access
      params, state, spec=sampling, attend=engine.attend_buckets[-1]))
  count = presets.active_params(engine.model.config)
  report = report_of(program, done, slice_, engine.mesh, plan=plan, beside=beside,
                   tokens=engine.slots, model_flops=2 * count * engine.slots)
  hlo = done.hlo
  if engine.quant == 'int8':
    s8 = s8_dot_lines(hlo)
    report.notes.append(f'{len(s8)} dot/convolution(s) take s8 operands'
                        + (f', e.g. {s8[0][:200]}' if s8 else ''))
  return report, hlo


def compile_decode(config: ml_collections.ConfigDict, model: DecoderConfig,
                   mesh: jax.sharding.Mesh, slice_: SliceType, *, quant: str,
                   plan: float | None, beside: float = 0.0) -> tuple[ProgramReport, str]:
  """The run's engine (``make_engine``) with ``quant`` weights: ``compile_engine_decode``
  with the run's sampling transform. The program is ``decode``, or ``decode_int8`` for int8
  weights in a run that samples with float ones."""
  engine = make_engine(config, model, mesh, quant)
  name = 'decode_int8' if quant == 'int8' and config.model.inference_quant != 'int8' else 'decode'
  return compile_engine_decode(engine, config_lib.run_spec(config).sampling, slice_,
                               program=name, plan=plan, beside=beside)


def compile_prefill(config: ml_collections.ConfigDict, model: DecoderConfig,
                    mesh: jax.sharding.Mesh, slice_: SliceType, *, beside: float = 0.0
                    ) -> ProgramReport:
  """The engine's prefill of the most rows it takes at once (``slots`` rounded up to a power
  of two) at its longest bucket (``sampling.max_prompt_len``). ``beside``: what stays held
  meanwhile (the decode state)."""
  engine = make_engine(config, model, mesh, config.model.inference_quant)
  params = _engine_params(engine)
  rows = 1 << (engine.slots - 1).bit_length()
  bucket = engine.prefill_buckets[-1]
  replicated = sharding_lib.replicated(mesh)
  tokens = jax.ShapeDtypeStruct((rows, bucket), np.int32, sharding=replicated)
  lengths = jax.ShapeDtypeStruct((rows,), np.int32, sharding=replicated)
  # pylint: disable-next=protected-access
  done = _compile(lambda: engine._prefill.lower(params, tokens, lengths))
  return report_of('prefill', done, slice_, mesh, plan=None, beside=beside, tokens=rows * bucket,
                 model_flops=2 * presets.active_params(model) * rows * bucket)


def compile_push(config: ml_collections.ConfigDict, model: DecoderConfig,
                 mesh: jax.sharding.Mesh, slice_: SliceType, *, beside: float = 0.0
                 ) -> ProgramReport:
  """The trainer's cast of its params to the workers' dtype before a push
  (``cast_params``, each leaf where it lies), on the trainer mesh."""
  source = abstract_model(model)
  inference = roles.inference_model(config, source)
  shardings = sharding_lib.param_shardings(source.abstract_params(), source.logical_axes(),
                                           mesh)
  params = _with_shardings(source.abstract_params(), shardings)
  push = jax.jit(functools.partial(cast_params, model=inference), out_shardings=shardings)
  done = _compile(lambda: push.lower(params))
  return report_of('push', done, slice_, mesh, plan=None, beside=beside)


def compile_teacher(config: ml_collections.ConfigDict, teacher: DecoderConfig,
                    slice_: SliceType, *, plan: float | None, beside: float = 0.0,
                    where: str = 'the first chip of its own slice') -> ProgramReport:
  """The teacher's scoring program (``trainer.teacher._score_program``, as
  ``roles.build_teacher`` configures it: top-k for GKD, ``rl.logprob_chunk``, the sampling
  temperature) on one batch (``prompts_per_step x group_size`` rows of prompt + completion
  positions), compiled for the first chip of ``slice_``, where ``Teacher`` puts its params.
  ``teacher``: its architecture in ``teacher.dtype`` (``checks.run_teacher_model``);
  ``where``: how the report's note names that chip."""
  spec = config_lib.run_spec(config)
  model = abstract_model(teacher)
  mesh = sharding_lib.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, [tpu_devices(slice_)[0]])
  one = sharding_lib.replicated(mesh)
  abstract = model.abstract_params()
  if config.teacher.quant == 'int8':
    abstract = jax.eval_shape(functools.partial(quantize_params, model=model), abstract)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                        abstract)
  rows = config.rl.prompts_per_step * config.rl.group_size
  length = config.sampling.max_prompt_len + config.sampling.max_new_tokens
  tokens = jax.ShapeDtypeStruct((rows, length), np.int32, sharding=one)
  mask = jax.ShapeDtypeStruct((rows, length), np.float32, sharding=one)
  policy = Policy(model, full_support(SamplingSpec(temperature=spec.sampling.temperature)))
  top_k = spec.distill.top_k if spec.distill.kind == 'gkd' else 0
  # pylint: disable-next=protected-access
  score = teacher_lib._score_program(policy, top_k, config.rl.logprob_chunk)
  done = _compile(lambda: score.lower(params, tokens, mask))
  report = report_of('teacher_score', done, slice_, mesh, plan=plan, beside=beside,
                     tokens=rows * length,
                     model_flops=2 * presets.active_params(teacher) * rows * length)
  report.notes.append(f'the teacher ({config.teacher.name}, {config.teacher.dtype}'
                      + (', int8' if config.teacher.quant == 'int8' else '')
                      + f') on {where}, {slice_.name}: {rows} rows x {length} positions')
  return report


def _devices_of_first_host(devices: Sequence[Any]) -> list[Any]:
  first = min(d.process_index for d in devices)
  return [d for d in devices if d.process_index == first]


def compile_run(config: ml_collections.ConfigDict, plan: Plan, trainer_slice: SliceType,
                inference_slice: SliceType, *, shared: bool,
                programs: Sequence[str] = PROGRAMS, model: DecoderConfig | None = None,
                log=None, teacher_slice: SliceType | None = None,
                teacher: DecoderConfig | None = None) -> list[ProgramReport]:
  """Compiles ``programs`` of the run ``config`` describes for its slices.

  Args:
    config: the run's config (validated).
    plan: the meshes ``checks.check_local`` / ``check_ray`` resolved on the slices.
    trainer_slice, inference_slice: where the trainer and one worker run (the same slice on
      the local backend).
    shared: the roles share chips (local backend without ``mesh.disjoint``): each program's
      ``beside`` then holds the other role's resident bytes.
    programs: which of ``PROGRAMS`` to compile (``push`` only when the workers' dtype
      differs from the trainer's and LoRA is off; ``decode_int8`` only when the run samples
      with float weights and is not batch-invariant).
    model: the architecture (default: ``checks.run_model``, the preset ``config.model.name``
      with the run's dtypes and remat); e.g. fewer layers for a quick check.
    log: optional ``str -> None`` told when each program starts compiling.
    teacher_slice: the slice of the Ray backend's teacher (``plan.teacher_slice``); None: the
      teacher scores on the first trainer chip (local backend), beside what the trainer (and
      a shared worker) holds there.
    teacher: the teacher's architecture (default: ``checks.run_teacher_model``); the program
      ``teacher_score`` is compiled only for a run that distils from a named preset or
      'tiny' teacher.
  Returns:
    One ``ProgramReport`` per program compiled, in ``PROGRAMS`` order.
  """
  unknown = sorted(set(programs) - set(PROGRAMS))
  if unknown:
    raise SliceError(f'unknown program(s) {unknown}; choose from {list(PROGRAMS)}.')
  model = model or run_model(config)
  log = log or (lambda _: None)
  trainer_devices = tpu_devices(trainer_slice)
  inference_devices = (_devices_of_first_host(trainer_devices) if shared and
                       trainer_slice.multi_host else tpu_devices(inference_slice))
  if config.mesh.disjoint:
    inference_devices = trainer_devices[math.prod(plan.trainer_mesh.values()):]
  trainer_mesh = sharding_lib.make_mesh(plan.trainer_mesh, list(trainer_devices))
  worker_mesh = sharding_lib.make_mesh(plan.inference_mesh, list(inference_devices))
  teacher = teacher or run_teacher_model(config)
  memory = memory_fit.run_memory_plan(model, config, plan.trainer_mesh, plan.inference_mesh,
                                      shared=shared, platform='tpu', teacher=teacher)
  workers = memory.workers_per_chip
  lora = lora_lib.from_config(config)
  reports: list[ProgramReport] = []
  # The decode program's arguments (the worker's params and decode state) are what a worker
  # holds; compiled first so the trainer's report can count them beside it.
  decode, worker_held = None, 0.0
  if 'decode' in programs:
    log('decode')
    quant = config.model.inference_quant
    decode, _ = compile_decode(config, model, worker_mesh, inference_slice, quant=quant,
                               plan=memory.inference_bytes / workers)
    worker_held = decode.arguments
  trainer_held = 0.0
  if 'trainer_step' in programs:
    log('trainer_step')
    step, trainer_held = compile_trainer(config, model, trainer_mesh, trainer_slice,
                                         plan=memory.trainer_bytes,
                                         beside=workers * worker_held if shared else 0.0)
    reports.append(step)
  dtypes_differ = config_lib.inference_param_dtype(config) != config.model.param_dtype
  if 'push' in programs and dtypes_differ and lora is None:
    log('push')
    reports.append(compile_push(config, model, trainer_mesh, trainer_slice,
                                beside=(trainer_held + workers * worker_held) if shared
                                else trainer_held))
  if decode is not None:
    decode.beside = (trainer_held + (workers - 1) * worker_held) if shared else 0.0
  if 'prefill' in programs:
    log('prefill')
    engine = make_engine(config, model, worker_mesh, config.model.inference_quant)
    with _as_on_tpu():
      state = _with_shardings(jax.eval_shape(engine.init_decode_state), engine.state_shardings)
    state_bytes = _bytes_per_chip(state)
    reports.append(compile_prefill(
        config, model, worker_mesh, inference_slice,
        beside=state_bytes + ((trainer_held + (workers - 1) * worker_held) if shared else 0.0)))
  if decode is not None:
    reports.append(decode)
  # (A batch-invariant run cannot sample with int8 weights: the Engine refuses them.)
  if ('decode_int8' in programs and config.model.inference_quant != 'int8'
      and not config.model.batch_invariant):
    log('decode_int8')
    int8 = copy.deepcopy(config)
    int8.model.inference_quant = 'int8'
    int8_plan = memory_fit.run_memory_plan(model, int8, plan.trainer_mesh,
                                           plan.inference_mesh, shared=shared, platform='tpu')
    report, _ = compile_decode(config, model, worker_mesh, inference_slice, quant='int8',
                               plan=int8_plan.inference_bytes / workers,
                               beside=(trainer_held + (workers - 1) * worker_held) if shared
                               else 0.0)
    reports.append(report)
  if 'teacher_score' in programs and teacher is not None:
    log('teacher_score')
    if teacher_slice is None:  # the local backend: the first trainer chip
      beside = (trainer_held + workers * worker_held) if shared else trainer_held
      reports.append(compile_teacher(config, teacher, trainer_slice, plan=memory.teacher_bytes,
                                     beside=beside, where='the first trainer chip'))
    else:
      reports.append(compile_teacher(config, teacher, teacher_slice, plan=memory.teacher_bytes))
  return reports
