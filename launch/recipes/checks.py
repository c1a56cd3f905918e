"""A config checked against Cloud TPU slices: role meshes, ``validate_config``, memory."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import pathlib
import shutil
import site
import subprocess
import sysconfig
import types
from collections.abc import Iterable, Mapping

import jax
import ml_collections
from jax._src import xla_bridge

from launch.recipes.slices import (SLICES, SliceError, SliceType, get_slice,
                                   smallest_single_host, with_chips)
from rlax_llm import hub_check, memory_fit, roles
from rlax_llm.config import validate_config
from rlax_llm.models import presets
from rlax_llm.models.decoder_config import DTYPES, DecoderConfig
from rlax_llm.models.files import hub
from rlax_llm.sharding import mesh_shape
from rlax_llm.tasks.files import DATA_DIR
from rlax_llm.tasks.hub_datasets import is_hub_url

# Chips a Ray TPU actor can be given on one host (ray._private.accelerators.tpu).
RAY_TPU_CHIP_OPTIONS = (1, 2, 4, 8)


def _fmt(axes: Mapping[str, int]) -> str:
  return '{' + ', '.join(f'{k}: {v}' for k, v in axes.items()) + '}'


def _resolve(config: ml_collections.ConfigDict, role: str, devices: int, where: str
             ) -> dict[str, int]:
  axes = config.mesh[role].to_dict()
  try:
    return mesh_shape(axes, devices)
  except ValueError as e:
    raise SliceError(f'config.mesh.{role}={_fmt(axes)} does not fit {where}: '
                     f'{str(e).rstrip(".")}; change '
                     f'mesh.{role} (-1 on one axis takes the remaining chips) or the slice.'
                     ) from None


@dataclasses.dataclass
class Plan:
  """What a recipe checked and will launch.

  Attributes:
    devices: the devices the launch process sees (``validate_config`` runs with as many).
    checked: one line per check that passed (printed as comments).
    notes: warnings (printed as comments; they do not stop a dry run).
    resources: the Ray resources each actor asks for (ray recipe only).
    trainer_processes: the trainer actors, one per host of the trainer slice (ray recipe).
    trainer_mesh, inference_mesh: the role meshes' axis sizes on the slice (one worker's).
    teacher_slice: on-policy distillation's teacher slice (ray recipes; ``teacher_slice``):
      None without a teacher, or when ``config.ray.teacher_resources`` places it.
    teacher_hbm_gib: HBM per chip where the teacher scores (its slice's, or the slice its
      resources name); None: not on a TPU chip, or no teacher.
  """
  devices: int
  trainer_processes: int = 1
  trainer_mesh: dict[str, int] = dataclasses.field(default_factory=dict)
  inference_mesh: dict[str, int] = dataclasses.field(default_factory=dict)
  checked: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  resources: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
  teacher_slice: SliceType | None = None
  teacher_hbm_gib: float | None = None


def check_local(config: ml_collections.ConfigDict, slice_: SliceType, recipe: str) -> Plan:
  """Checks a ``backend='local'`` config against one slice (every host runs the launch).

  Without ``mesh.disjoint`` the roles share the slice: the trainer mesh must span all of its
  chips and each inference mesh fits in one host's chips (on several hosts each process runs
  its workers on its own chips, ``sharding.role_meshes``). With ``mesh.disjoint`` (one host
  only: in one ``jax.distributed`` job every host takes part in every program) the trainer
  takes the first chips and each of ``rollout.workers`` workers the next ones; together they
  must use every chip.
  """
  if config.backend != 'local':
    what = ('renders a JobSet for backend \'local\' (gke-ray renders a KubeRay RayJob for '
            'backend \'ray\')' if recipe == 'gke' else
            "runs every role in one process per host (backend 'local')")
    raise SliceError(f'config.backend={config.backend!r}: the {recipe} recipe {what}; use the '
                     "ray recipe (launch/ray) for backend 'ray', or pass "
                     '--config.backend=local.')
  chips = slice_.chips
  where = f'{slice_.name} ({chips} chips on {slice_.hosts} host(s))'
  trainer = _resolve(config, 'trainer', chips, where)
  used = math.prod(trainer.values())
  plan = Plan(devices=chips, trainer_mesh=trainer)
  workers = config.rollout.workers
  if config.mesh.disjoint and slice_.multi_host:
    raise SliceError(
        f'config.mesh.disjoint=True on {where}: on several hosts every host takes part in the '
        'trainer\'s steps and runs its inference workers on its own chips, so the roles '
        'cannot have disjoint chips in one job; set --config.mesh.disjoint=false (the roles '
        'take turns on every chip), or put trainer and inference on separate slices with the '
        'ray recipe (launch/ray).')
  if config.mesh.disjoint:
    offset = used
    inference = {}
    for worker in range(workers):
      if offset >= chips:
        raise SliceError(
            f'config.mesh.disjoint=True: the trainer ({used} chips) and the {worker} '
            f'inference worker(s) before worker {worker} use all {chips} chips of {where}; '
            'lower config.rollout.workers or the mesh sizes, or pick a bigger slice.')
      inference = _resolve(config, 'inference', chips - offset,
                           f'the {chips - offset} chips of {where} left for worker {worker}')
      offset += math.prod(inference.values())
    if offset != chips:
      raise SliceError(
          f'config.mesh.disjoint=True: the trainer ({_fmt(trainer)}, {used} chips) and '
          f'{workers} worker(s) of {_fmt(inference)} use {offset} of the {chips} chips of '
          f'{where}; size them to use every chip (e.g. -1 on one axis of mesh.inference '
          f'with one worker), or pick a slice with {offset} chips ({with_chips(offset)}).')
    plan.inference_mesh = inference
    plan.checked.append(f'mesh.trainer {_fmt(trainer)} = chips 0-{used - 1}; {workers} '
                        f'worker(s) of mesh.inference {_fmt(inference)} on chips {used}-'
                        f'{chips - 1} (disjoint)')
  else:
    if used != chips:
      raise SliceError(
          f'config.mesh.trainer={_fmt(config.mesh.trainer.to_dict())} is {used} chips but '
          f'{where} has {chips}: without mesh.disjoint the trainer mesh spans the whole '
          'slice; set one axis to -1 (e.g. --config.mesh.trainer.data=-1) or use a slice '
          f'with {used} chips ({with_chips(used)}).')
    per_host = chips // slice_.hosts
    inference = _resolve(config, 'inference', per_host, where if not slice_.multi_host else
                         f'the {per_host} chips of one host of {where} (each host runs its '
                         'workers on its own chips)')
    size = math.prod(inference.values())
    plan.inference_mesh = inference
    plan.checked.append(f'mesh.trainer {_fmt(trainer)} = all {chips} chips; {workers} '
                        f'worker(s) of mesh.inference {_fmt(inference)} = {size} chip(s) '
                        'each, shared with the trainer'
                        + (', on every host' if slice_.multi_host else ''))
  return plan


def teacher_slice(config: ml_collections.ConfigDict, tpu_type: str | None,
                  inference: SliceType) -> SliceType | None:
  """The slice the ray recipes give on-policy distillation's teacher (``--teacher-tpu-type``).

  With ``config.teacher.enabled``: ``tpu_type`` when given, else the single-host slice of
  the inference slice's generation with the fewest chips (``slices.smallest_single_host``:
  the teacher scores on one chip, ``trainer.teacher.Teacher``, so more chips buy nothing;
  a teacher too big for one chip needs a generation with more HBM per chip, or int8).
  A ``config.ray.teacher_resources`` of the user's (the config or
  ``--config.ray.teacher_resources``) places the teacher itself: no slice unless
  ``tpu_type`` asks for one. Raises SliceError for ``tpu_type`` without a teacher.
  """
  if not config.teacher.enabled:
    if tpu_type is not None:
      raise SliceError(f'--teacher-tpu-type={tpu_type} but the config has no teacher '
                       f'(config.teacher.enabled=False, rl.distill.kind='
                       f'{config.rl.distill.kind!r}); drop the flag, or distil (e.g. '
                       '--config=configs/distill.py).')
    return None
  if tpu_type is not None:
    return get_slice(tpu_type)
  if config.ray.teacher_resources.to_dict():
    return None
  return smallest_single_host(inference.generation)


def _check_teacher(config: ml_collections.ConfigDict, plan: Plan, teacher: SliceType | None,
                   trainer: SliceType, inference: SliceType) -> None:
  """The teacher's part of ``check_ray``: its actor holds every chip of one host of its
  slice (``rlax_teacher``, one unit per chip), or the user's ``ray.teacher_resources``
  place it; sets ``plan.teacher_hbm_gib`` (where it scores) and ``plan.resources``."""
  mine = config.ray.teacher_resources.to_dict()
  if not config.teacher.enabled or (teacher is None and not mine):
    return  # no teacher; or none placed, which validate_config refuses naming the override
  if teacher is not None:
    if teacher.multi_host:
      single = smallest_single_host(teacher.generation)
      raise SliceError(
          f'--teacher-tpu-type={teacher.name} has {teacher.hosts} hosts, but the teacher '
          'actor uses the chips of one host (it scores on one chip); use a single-host slice, '
          f'e.g. --teacher-tpu-type={single.name}.')
    chips = teacher.chips_per_host
    plan.teacher_slice, plan.teacher_hbm_gib = teacher, teacher.hbm_gib
    if mine:
      plan.notes.append(
          f'config.ray.teacher_resources={mine} is yours and is kept (the recipe passes none); '
          f'the teacher slice {teacher.name} joins Ray with {{"rlax_teacher": {chips}}}, so '
          'name that resource in yours for the teacher to land there.')
    else:
      plan.resources['teacher'] = {'TPU': chips, 'rlax_teacher': chips}
      config.ray.teacher_resources = ml_collections.ConfigDict(plan.resources['teacher'])
    plan.checked.append(
        f'teacher actor: one host of {teacher.describe()} of its own, joining Ray with '
        f'{{"rlax_teacher": {chips}}}; it scores on its first chip (trainer.teacher.Teacher)')
    return
  where = ('rlax_inference' in mine and inference) or ('rlax_trainer' in mine and trainer)
  if where:
    plan.teacher_hbm_gib = where.hbm_gib
  elif 'TPU' in mine:
    plan.teacher_hbm_gib = min(trainer.hbm_gib, inference.hbm_gib)
  plan.notes.append(
      f'config.ray.teacher_resources={mine} is yours: it places the teacher and the recipe '
      'adds no teacher slice (pass --teacher-tpu-type=SLICE for one of its own)'
      + ('' if plan.teacher_hbm_gib is not None else
         '; it asks for no TPU, so it scores on a CPU host and its memory is not checked '
         'against HBM') + '.')


def check_ray(config: ml_collections.ConfigDict, trainer: SliceType, inference: SliceType,
              inference_slices: int, teacher: SliceType | None = None) -> Plan:
  """Checks a config for the ray backend: the trainer on its slice, workers on others.

  The Ray backend (``rlax_llm/backends/ray.py``) runs each inference worker as one actor and
  the trainer as one actor per host of its slice (``ray.trainer_processes``; several form one
  ``jax.distributed`` job, ordered by the hosts' TPU worker ids); an actor's JAX sees the
  chips Ray gave it on its host. So each trainer actor asks for all of its host's chips, the
  trainer mesh uses every chip of the trainer slice, and ``ray.trainer_processes`` is the
  slice's host count (set by the recipe); each worker gets as many chips as its inference
  mesh (1, 2, 4 or 8, dividing a host); and because a worker (and a one-host trainer)
  builds all role meshes over its own chips (``rlax_llm.roles.meshes``) and the driver
  validates the config over the trainer's chips, each mesh must also fit the other role's
  chips. Sets ``config.ray.trainer_resources`` and ``worker_resources`` to the plan's, as the
  recipe's driver flags will. ``teacher``: on-policy distillation's teacher slice
  (``teacher_slice``), one host whose chips the teacher actor holds: ``ray.teacher_resources``
  becomes ``{'TPU': chips, 'rlax_teacher': chips}`` unless the config sets its own.
  """
  if inference_slices < 1:
    raise SliceError(f'--inference-slices={inference_slices} must be >= 1.')
  if config.mesh.disjoint:
    raise SliceError('config.mesh.disjoint=True: on the ray backend every role is an actor '
                     'with chips of its own, so roles never share a mesh; pass '
                     '--config.mesh.disjoint=false.')
  singles = ', '.join(s.name for s in SLICES.values() if not s.multi_host)
  processes = config.ray.trainer_processes
  if processes not in (1, trainer.hosts):
    raise SliceError(
        f'config.ray.trainer_processes={processes}, but --trainer-tpu-type={trainer.name} has '
        f'{trainer.hosts} host(s): the trainer runs one actor per host of its slice (each with '
        f'all of its host\'s chips); leave ray.trainer_processes at 1 (the recipe sets it to '
        f'{trainer.hosts}) or pass --config.ray.trainer_processes={trainer.hosts}.')
  if inference.multi_host:
    same = [s.name for s in SLICES.values() if not s.multi_host
            and s.name.split('-')[0] == inference.name.split('-')[0]
            and s.chips == inference.chips_per_host]
    hint = (f'--inference-tpu-type={same[0]} --inference-slices='
            f'{inference_slices * inference.hosts}' if same else f'a single-host type ({singles})')
    raise SliceError(
        f'--inference-tpu-type={inference.name} has {inference.hosts} hosts, but a worker '
        'actor uses the chips of one host, and the hosts of a multi-host slice form one TPU '
        'system that the TPU runtime brings up across all of them; use single-host slices '
        f'instead: {hint}.')
  t_chips, t_host = trainer.chips, trainer.chips_per_host
  t_where = (f'the trainer slice ({trainer.name}, {t_chips} chips on {trainer.hosts} hosts)'
             if trainer.multi_host else f'the trainer host ({trainer.name}, {t_chips} chips)')
  t_mesh = _resolve(config, 'trainer', t_chips, t_where)
  if math.prod(t_mesh.values()) != t_chips:
    actors = (f'the {trainer.hosts} trainer actors (one per host) get all {t_chips} chips'
              if trainer.multi_host else f'the trainer actor gets all {t_chips} chips')
    raise SliceError(
        f'config.mesh.trainer={_fmt(config.mesh.trainer.to_dict())} is '
        f'{math.prod(t_mesh.values())} chips but {actors} of {trainer.name}; set one axis to '
        '-1 (e.g. --config.mesh.trainer.data=-1).')
  per_host = inference.chips_per_host
  i_where = f'one {inference.name} host ({per_host} chips)'
  i_mesh = _resolve(config, 'inference', per_host, i_where)
  w_chips = math.prod(i_mesh.values())
  if w_chips not in RAY_TPU_CHIP_OPTIONS or per_host % w_chips:
    raise SliceError(
        f'config.mesh.inference={_fmt(config.mesh.inference.to_dict())} is {w_chips} chips '
        f'per worker; Ray gives a TPU actor {list(RAY_TPU_CHIP_OPTIONS)} chips of one host '
        f'and {inference.name} hosts have {per_host}; make the inference mesh a size that '
        f'divides {per_host}.')
  for role, chips, who in (('trainer', w_chips, 'an inference worker'),
                           ('inference', t_chips, 'the trainer')):
    try:
      mesh_shape(config.mesh[role].to_dict(), chips)
    except ValueError as e:
      raise SliceError(
          f'config.mesh.{role}={_fmt(config.mesh[role].to_dict())} does not fit the {chips} '
          f'chips of {who} ({str(e).rstrip(".")}): on the ray backend every actor builds all '
          'role meshes over its own chips (rlax_llm.roles.meshes); use -1 on one axis of '
          f'mesh.{role} so it fits both.') from None
  slots = per_host // w_chips
  capacity = inference_slices * inference.hosts * slots
  workers = config.rollout.workers
  if workers > capacity:
    need = math.ceil(workers / (inference.hosts * slots))
    raise SliceError(
        f'config.rollout.workers={workers} needs {workers} x {w_chips} chips, but '
        f'{inference_slices} x {inference.name} hold {capacity} worker(s) ({inference.hosts} '
        f'host(s) x {slots} per host); lower rollout.workers, pass --inference-slices={need}, '
        'or pick a bigger inference slice.')
  plan = Plan(devices=t_chips, trainer_processes=trainer.hosts, trainer_mesh=t_mesh,
              inference_mesh=i_mesh)
  plan.resources = {'trainer': {'TPU': t_host, 'rlax_trainer': t_host},
                    'worker': {'TPU': w_chips, 'rlax_inference': w_chips}}
  if trainer.multi_host:
    plan.checked.append(
        f'{trainer.hosts} trainer actors (ray.trainer_processes={trainer.hosts}), one per host '
        f'of {trainer.name} with its {t_host} chips, ordered by TPU worker id: mesh.trainer '
        f'{_fmt(t_mesh)} = all {t_chips} chips (one jax.distributed job)')
  else:
    plan.checked.append(f'trainer actor: mesh.trainer {_fmt(t_mesh)} = the {t_chips} chips of '
                        f'{trainer.name}')
  plan.checked.append(f'{workers} worker actor(s): mesh.inference {_fmt(i_mesh)} = {w_chips} '
                      f'chip(s) each; {inference_slices} x {inference.name} hold {capacity}')
  if workers < capacity:
    plan.notes.append(f'{capacity - workers} worker slot(s) ({(capacity - workers) * w_chips} '
                      f'chips) stay idle; --config.rollout.workers={capacity} uses them.')
  for role in ('trainer', 'worker'):
    before = config.ray[f'{role}_resources'].to_dict()
    if before and before != plan.resources[role]:
      plan.notes.append(f'config.ray.{role}_resources={before} is replaced by '
                        f'{plan.resources[role]} (the recipe places the actors).')
    # As the driver will run it (scripts.ray_driver_overrides passes these), so that what
    # validate_config checks against the actors' resources (a distillation teacher with none
    # while the others ask for TPU) is refused by the dry run, not by the launched driver.
    config.ray[f'{role}_resources'] = ml_collections.ConfigDict(plan.resources[role])
  _check_teacher(config, plan, teacher, trainer, inference)
  return plan


def validate_on_devices(config: ml_collections.ConfigDict, devices: int) -> list[str]:
  """``validate_config`` as the launch on ``devices`` chips will run it; returns notes.

  JAX gets ``devices`` CPU devices, so this must run before anything in the process
  initialises a JAX backend (``python -m launch.recipes`` does). A ``model.path``
  that is not on this machine (a path on the hosts, ``gs://``) is checked on the hosts; a
  Hugging Face hub id (``ORG/NAME``) and a hub dataset (``hf://``) are checked on the hub when
  it is reachable (``rlax_llm.hub_check``: exist at their revision; no weights downloaded)
  and fetched on the hosts; offline, a note says they were not verified.
  """
  if not xla_bridge.backends_are_initialized():
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', devices)
  if jax.device_count() != devices:
    raise RuntimeError(f'JAX already runs with {jax.device_count()} devices, not {devices}; '
                       'validate in a fresh process (python -m launch.recipes ...).')
  notes = []
  checked = copy.deepcopy(config)
  path = checked.model.get('path')
  if path is not None and hub.is_hub_id(path):
    revision = checked.model.get('revision') or 'its default branch'
    notes.append(f'config.model.path={path!r} is a Hugging Face hub id (not a path here): '
                 f'each host fetches it ({revision}) into its hub cache or reads it from there '
                 '(HF_HUB_OFFLINE=1); a host where it is a local path reads that instead.')
  elif path is not None and not pathlib.Path(path).exists():
    checked.model.path = os.devnull
    notes.append(f'config.model.path={path!r} is not on this machine: it must exist on every '
                 'host (checked there by the launch).')
  online, lines = hub_check.verify(config)
  notes += lines
  validate_config(checked, read_hub=online)
  roles.check_meshes(checked)  # the meshes on the launch's devices (roles.prepare's first check)
  return notes


def run_model(config: ml_collections.ConfigDict, num_layers: int | None = None
              ) -> DecoderConfig:
  """The preset ``config.model.name`` with the run's dtypes and remat (``num_layers``: that
  many of its layers instead, for a quick compile). Raises SliceError for a model that is not
  a named preset (its architecture is in its checkpoint)."""
  name = config.model.name
  if name not in presets.PRESETS:
    raise SliceError(f'config.model.name={name!r} is not a named preset '
                     f'({sorted(presets.PRESETS)}); the architecture is then known only from '
                     'its checkpoint.')
  preset = presets.get_preset(name, **({} if num_layers is None else
                                        {'num_layers': num_layers}))
  return preset.with_execution(param_dtype=DTYPES[config.model.param_dtype],
                               dtype=DTYPES[config.model.dtype], remat=config.model.remat)


def run_teacher_model(config: ml_collections.ConfigDict, num_layers: int | None = None
                      ) -> DecoderConfig | None:
  """On-policy distillation's teacher as ``memory_fit.teacher_model`` names it (a preset in
  ``teacher.dtype``; a 'tiny' teacher: the student's architecture), with ``num_layers``
  layers instead when given; None without a teacher or for one known only from its
  checkpoint (``teacher.name='auto'``)."""
  student = (presets.get_preset(config.model.name,
                                **({} if num_layers is None else {'num_layers': num_layers}))
             if config.model.name in presets.PRESETS else None)
  if config.teacher.name == 'tiny' and student is None:
    return None
  teacher = memory_fit.teacher_model(config, student)
  if teacher is None or num_layers is None or config.teacher.name == 'tiny':
    return teacher
  preset = presets.get_preset(config.teacher.name, num_layers=num_layers)
  return preset.with_execution(param_dtype=teacher.execution.param_dtype,
                               dtype=teacher.execution.dtype)


def memory_check(config: ml_collections.ConfigDict, plan: Plan, trainer_hbm: float,
                 inference_hbm: float, shared: bool) -> list[str] | None:
  """The memory plan per chip against HBM (GiB per chip); returns its lines.

  ``rlax_llm.memory_fit.run_memory_plan`` on the meshes ``plan`` resolved: the trainer's
  params (the master copy), AdamW state, gradients, KL reference and activations; each
  worker's params (in ``model.inference_param_dtype``), KV cache and logits. ``shared``: the
  roles share chips (local backend without ``mesh.disjoint``), so the two add up. XLA's
  scratch space and fragmentation are not counted: above ``memory_fit.HEADROOM`` of a chip's
  HBM a warning line (naming the keys that make room) ends the lines. The plan is XLA:TPU's
  (``platform='tpu'``: what ``python -m launch.recipes compile`` holds its programs against).
  Named presets only: returns ``None`` for another model. Raises SliceError naming the keys
  that shrink it when a chip's HBM is too small. On the ray backend a distillation teacher
  is a row of its own against ``plan.teacher_hbm_gib`` (``check_ray``: its slice's chip); one
  too big for it is refused naming ``--teacher-tpu-type``; one on a CPU host has no row.
  """
  name = config.model.name
  if name not in presets.PRESETS:
    return None
  model = run_model(config)
  memory = memory_fit.run_memory_plan(model, config, plan.trainer_mesh, plan.inference_mesh,
                                      shared=shared, platform='tpu')
  trainer_bytes, inference_bytes = trainer_hbm * 2**30, inference_hbm * 2**30
  teacher_bytes = None if plan.teacher_hbm_gib is None else plan.teacher_hbm_gib * 2**30
  on_host = teacher_bytes is None  # an apart teacher placed on a CPU host: no HBM row
  rows = memory.needs(trainer_bytes, inference_bytes, teacher_bytes, teacher_on_host=on_host)
  lines = memory.table(trainer_bytes, inference_bytes, teacher_bytes, teacher_on_host=on_host)
  warnings = []
  for chips, need, hbm in rows:
    band = memory_fit.fit_band(need, hbm)
    if band == 'over' and chips == 'teacher':
      raise SliceError(_teacher_too_big(config, plan, need, hbm, lines))
    if band == 'over':
      raise SliceError(
          f'memory: the {chips} chips need {need / 2**30:.2f} GiB each for {name} but a chip '
          f'has {hbm / 2**30:g} GiB of HBM ({"; ".join(lines)}); {memory_fit.SHRINK_HINT}.')
    if band == 'tight':
      warnings.append('memory: warning: ' + memory_fit.tight_warning(f'the {chips} chips',
                                                                    need, hbm))
  return [f'memory plan per chip ({name}): {line}' for line in lines] + warnings


def _teacher_too_big(config: ml_collections.ConfigDict, plan: Plan, need: float, hbm: float,
                     lines: list[str]) -> str:
  """The refusal of a teacher whose scoring does not fit one chip where it runs (``lines``:
  the memory plan's, of which the teacher's are quoted)."""
  teacher_lines = [line for line in lines if line.startswith('teacher')]
  roomy = max((s for s in SLICES.values() if not s.multi_host), key=lambda s: s.hbm_gib)
  where = (f'a chip of its slice {plan.teacher_slice.name} (--teacher-tpu-type)'
           if plan.teacher_slice is not None else
           f'a chip where config.ray.teacher_resources={config.ray.teacher_resources.to_dict()} '
           'places it')
  return (f'memory: the teacher ({config.teacher.name}, {config.teacher.dtype}) needs '
          f'{need / 2**30:.2f} GiB on the one chip it scores on, but {where} has '
          f'{hbm / 2**30:g} GiB of HBM ({"; ".join(teacher_lines)}); give it a slice with more '
          f'HBM per chip, e.g. --teacher-tpu-type={roomy.name} ({roomy.hbm_gib:g} GiB), or '
          'shrink it: --config.teacher.quant=int8, --config.teacher.dtype=bfloat16, or '
          'log-probs in chunks (--config.rl.logprob_chunk=128).')


def _library_dirs() -> tuple[pathlib.Path, ...]:
  """Where installed packages and the standard library live (the hosts install their own)."""
  dirs = {sysconfig.get_paths()[k] for k in ('stdlib', 'platstdlib', 'purelib', 'platlib')}
  dirs.update(site.getsitepackages() + [site.getusersitepackages()])
  return tuple({p for d in dirs for p in (pathlib.Path(d), pathlib.Path(d).resolve())})


def _committed(root: pathlib.Path, ref: str) -> set[str]:
  """The files of git ref ``ref`` of the checkout ``root`` (what git archive copies), as
  paths relative to it."""
  listing = subprocess.run(['git', '-C', str(root), 'ls-tree', '-r', '--name-only', '-z', ref],
                           capture_output=True, text=True, check=False)
  if listing.returncode:
    raise SliceError(f'--ref={ref}: git ls-tree in {root} failed ({listing.stderr.strip()}); '
                     'pass a ref of this checkout.')
  return set(listing.stdout.split('\0')) - {''}


def _data_paths(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
  """``(key, path)`` of every local data path of the task (``task.path``, ``task.eval_path``,
  any ``task.*_path``; each entry of a list): neither a hub dataset nor a bundled file name."""
  out = []
  for field, value in config.task.items():
    if field != 'path' and not field.endswith('_path'):
      continue
    for entry in value if isinstance(value, (list, tuple)) else [value]:
      if not isinstance(entry, str) or not entry or is_hub_url(entry):
        continue
      if os.sep not in entry and (DATA_DIR / entry).is_file():
        continue  # a bundled file, in the package the hosts install
      out.append((f'config.task.{field}', entry))
  return out


def check_shipped(config: ml_collections.ConfigDict, modules: Iterable[types.ModuleType],
                  root: pathlib.Path, ref: str | None,
                  config_file: pathlib.Path | None = None) -> str:
  """Refuses what the run needs but the hosts would not get: the hosts get the files of git
  ref ``ref`` of the checkout ``root`` (``git archive``; ``ref=None``: the whole working tree,
  as the GKE image copies it) plus the packages their setup installs.

  ``modules``: those loading and validating the config imported (a task or reward class by
  import path, what a config file imports). One under ``root`` must be committed at ``ref``
  (an untracked file is not archived) and import by its path from ``root`` (the launch runs
  there with no ``PYTHONPATH``); one elsewhere that is not an installed package or the
  standard library is only on this machine's ``PYTHONPATH``. A task's local data path
  (``_data_paths``) must be a file of ``ref`` given relative to the checkout (the launch runs
  in the hosts' copy of it), or a hub dataset. ``config_file``: the ``--config`` file, which
  ml_collections loads as a module too and the recipes check as the config. Returns the line
  saying what was checked.

  Raises:
    SliceError: every such module or path, each with its fix.
  """
  problems = []
  library = _library_dirs()
  committed = _committed(root, ref) if ref is not None and shutil.which('git') else None

  def under(path: pathlib.Path, base: pathlib.Path) -> bool:
    return path.is_relative_to(base) or path.resolve().is_relative_to(base.resolve())

  for module in sorted(modules, key=lambda m: m.__name__):
    file = getattr(module, '__file__', None)
    if not file:
      continue
    path = pathlib.Path(file).absolute()
    if any(under(path, d) for d in library) or (
        config_file is not None and path.resolve() == config_file.resolve()):
      continue
    if not under(path, root):
      problems.append(
          f'the config imports {module.__name__} from {path}, outside {root}: the hosts get '
          'only this checkout and the packages their setup installs; move the module into the '
          'checkout and commit it, or make it a package installed on every host.')
      continue
    rel = path.resolve().relative_to(root.resolve())
    parts = rel.with_suffix('').parts
    if (parts[:-1] if parts[-1] == '__init__' else parts) != tuple(module.__name__.split('.')):
      problems.append(
          f'the config imports {module.__name__} from {rel}, found through this machine\'s '
          'PYTHONPATH: the launch on the hosts runs in the root of their copy of the checkout '
          f'with no PYTHONPATH, where {module.__name__} does not import; move the module to '
          'the checkout\'s root (or into a package there) and name it by its path from the '
          'root.')
    elif committed is not None and rel.as_posix() not in committed:
      problems.append(f'the config imports {module.__name__} from {rel}, which is not committed '
                      f'at {ref}: git archive does not copy it to the hosts; git add {rel} and '
                      'commit it.')
  for key, value in _data_paths(config):
    glob_ = any(c in value for c in '*?[')
    path = pathlib.Path(os.path.expanduser(value))
    if path.is_absolute():
      where = ('inside this checkout, but the hosts\' copy is elsewhere (~/rlax_llm): give it '
               f'relative to the checkout ({path.relative_to(root)})' if under(path, root) else
               'on this machine only: commit the data into the checkout and give its path '
               'relative to it, or publish it as a hub dataset (hf://datasets/ORG/NAME)')
      problems.append(f'{key}={value!r} is {where}.')
    elif committed is not None and not glob_ and path.as_posix() not in committed:
      problems.append(f'{key}={value!r} is not a file committed at {ref} in {root} (the launch '
                      'reads it relative to the hosts\' copy of the checkout); commit it there, '
                      'or use a hub dataset (hf://datasets/ORG/NAME).')
  if problems:
    raise SliceError(' '.join(problems))
  return ('the hosts get what the config imports and reads: '
          + (f'committed at {ref}' if committed is not None else 'in the checkout'))
