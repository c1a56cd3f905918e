"""The recipes' command line: ``python -m launch.recipes RECIPE [options] [--config.KEY=VALUE]``."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

import ml_collections

from launch.recipes import compile as compile_lib
from launch.recipes import manifests, program_report, scripts
from launch.recipes.checks import (check_local, check_ray, check_shipped, memory_check,
                                   run_model, run_teacher_model, teacher_slice,
                                   validate_on_devices)
from launch.recipes.scripts import RAY_OVERRIDES, REMOTE_DIR, ROOT, Raw
from launch.recipes.slices import SLICES, SliceError, SliceType, get_slice, slice_table
from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config
from rlax_llm.errors import ConfigError, RlaxError
from rlax_llm.models import presets

COORDINATOR_PORT = 8476
RAY_REQUIREMENT = 'ray[default]==2.60.0'  # launch/host_setup.sh installs the same
TEACHER_HELP = ('on-policy distillation\'s teacher slice (a config with teacher.enabled): '
                'one host whose chips the teacher actor holds, joining Ray with the resource '
                'rlax_teacher; default: the smallest single-host slice of the inference '
                'generation (the teacher scores on one chip). A --config.ray.teacher_resources '
                'of yours places the teacher instead (then no teacher slice unless this flag '
                'asks for one)')


def _remote_spec(spec: str, ref: str | None, strict: bool) -> tuple[str, list[str]]:
  """``--config`` as the hosts see it (relative to the checkout), and notes about it.

  ``ref``: the git ref copied to the hosts (git archive), whose content is checked; ``None``
  when the hosts get the checkout another way (the GKE image copies the working tree).
  """
  path, sep, variant = spec.partition(':')
  spelled = pathlib.Path(os.path.abspath(path))
  try:
    rel = spelled.resolve().relative_to(ROOT)  # the file git tracks
  except ValueError:
    raise SliceError(f'--config={spec}: the hosts get this checkout ({ROOT}); a config '
                     f'outside it is not copied. Put the file under {ROOT / "configs"}.'
                     ) from None
  try:  # the path as given, links kept (the hosts' copy has them): configs/X.py
    remote = f'{spelled.relative_to(ROOT)}{sep}{variant}'
  except ValueError:
    remote = f'{rel}{sep}{variant}'
  notes = []
  if ref is None:
    return remote, notes
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
  return remote, notes


def _workdir_notes(workdir: str, recipe: str) -> list[str]:
  """Notes on ``--workdir``: a ``gs://`` URL is written directly (``rlax_llm.storage``); a
  relative path lands on each host's disk, and any path in a GKE pod's container."""
  if recipe in ('gke', 'gke-ray') and not workdir.startswith('gs://'):
    return [(f'--workdir={workdir} is inside each pod\'s container (the manifest mounts no '
             'volume): lost when a pod restarts, and not shared between pods; use '
             'gs://BUCKET/... (written directly with the pods\' service account, '
             'launch/gke/README.md), or add a volume every pod mounts there.')]
  if not workdir.startswith(('gs://', '/')):
    return [(f'--workdir={workdir} is relative: it lands in ~/{REMOTE_DIR}/{workdir} on each '
             'host and is lost with the VM; use gs://BUCKET/... (written directly, no mount).')]
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


def _kubernetes(parser: argparse.ArgumentParser) -> None:
  """The GKE recipes' credentials: the pods' Kubernetes service account (Workload Identity)."""
  parser.add_argument('--service-account', default=manifests.SERVICE_ACCOUNT,
                      help='Kubernetes service account the pods run as (serviceAccountName); '
                      'with Workload Identity it acts as a Google service account with read '
                      'and write on the gs:// workdir (launch/gke/README.md)')
  parser.add_argument('--gcp-service-account',
                      help='EMAIL of that Google service account: the manifest then also '
                      'creates the Kubernetes service account, annotated with it '
                      '(iam.gke.io/gcp-service-account)')


def _common(parser: argparse.ArgumentParser, gcloud: bool = True) -> None:
  parser.add_argument('--config', default=str(DEFAULT_CONFIG_PATH),
                      help='config file PATH[:VARIANT] inside this checkout (default: the '
                      'packaged rlax_llm/configs/default.py); --config.KEY=VALUE overrides '
                      'follow it')
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
      prog='python -m launch.recipes', allow_abbrev=False,
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
  p.add_argument('--trainer-tpu-type', required=True,
                 help='slice, e.g. v5p-8 (several hosts: one trainer actor per host)')
  p.add_argument('--inference-tpu-type', required=True, help='slice, e.g. v5e-8')
  p.add_argument('--inference-slices', type=int, default=1)
  p.add_argument('--teacher-tpu-type', help=TEACHER_HELP)
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
  _kubernetes(p)
  p = sub.add_parser('gke-ray', help='a KubeRay RayJob: trainer and inference workers on '
                     'separate GKE TPU node pools', allow_abbrev=False)
  _common(p, gcloud=False)
  p.add_argument('--trainer-tpu-type', required=True,
                 help='slice, e.g. v5p-8 (several hosts: one trainer actor per host)')
  p.add_argument('--inference-tpu-type', required=True, help='slice, e.g. v5e-8')
  p.add_argument('--inference-slices', type=int, default=1)
  p.add_argument('--teacher-tpu-type', help=TEACHER_HELP)
  p.add_argument('--image', required=True,
                 help='container image with this checkout at /app/rlax_llm and Ray '
                 '(launch/gke/Dockerfile with SETUP_FLAGS="--tpu --data --smollm2 --ray")')
  p.add_argument('--ray-version', default=RAY_REQUIREMENT.partition('==')[2],
                 help='rayClusterSpec.rayVersion: the image\'s Ray version')
  p.add_argument('--head-cpu', default='8', help='the head pod\'s CPU request (the driver)')
  p.add_argument('--head-memory', default='32Gi',
                 help='the head pod\'s memory request (host copies of weight versions)')
  p.add_argument('--output', help='also write the manifest to this file')
  _kubernetes(p)
  # Listed here for --help; its own parser and run are serve_tpu_vm's (launch/recipes/__main__).
  sub.add_parser('serve-tpu-vm', add_help=False,
                 help='serve a run\'s checkpoint on a single-host TPU VM (serve-tpu-vm --help)')
  p = sub.add_parser('compile', allow_abbrev=False,
                     help='compile the run\'s programs for its TPU slice(s) on this machine '
                     '(libtpu, no TPU): memory per chip, compile time, a roofline model')
  p.add_argument('--config', default=str(DEFAULT_CONFIG_PATH),
                 help='config file PATH[:VARIANT]; --config.KEY=VALUE overrides follow it')
  p.add_argument('--tpu-type', help='the one slice of a backend=\'local\' run (e.g. v5e-8)')
  p.add_argument('--trainer-tpu-type', help='the trainer\'s slice of a ray run (e.g. v5p-16)')
  p.add_argument('--inference-tpu-type', help='one worker\'s slice of a ray run (e.g. v5e-8)')
  p.add_argument('--inference-slices', type=int, default=1)
  p.add_argument('--teacher-tpu-type', help='the teacher\'s slice of a ray run that distils '
                 '(as the ray recipe\'s flag; default the same); the teacher_score program '
                 'is compiled for its first chip')
  p.add_argument('--programs', default=','.join(compile_lib.PROGRAMS),
                 help=f'comma-separated, of {",".join(compile_lib.PROGRAMS)} (default: all)')
  p.add_argument('--layers', type=int,
                 help='compile the preset with this many layers (a quick check of the '
                 'programs; memory and time are then not the run\'s)')
  p.add_argument('--json', action='store_true', help='print the reports as JSON')
  return parser


def run_compile(opts, overrides: Sequence[str]) -> int:
  """``compile``: checks the config against the slice(s) as the recipes do, then compiles
  its programs there (``compile.compile_run``); exits non-zero, with the numbers, when one
  does not fit."""
  ray = opts.trainer_tpu_type is not None or opts.inference_tpu_type is not None
  if ray == (opts.tpu_type is not None) or (ray and not (opts.trainer_tpu_type
                                                         and opts.inference_tpu_type)):
    raise SliceError('compile takes --tpu-type=SLICE (a backend=\'local\' run) or both '
                     '--trainer-tpu-type and --inference-tpu-type (a backend=\'ray\' run).')
  config = load_config([f'--config={opts.config}', *overrides,
                        *(RAY_OVERRIDES if ray else ())])
  if opts.teacher_tpu_type is not None and not ray:
    raise SliceError(f'--teacher-tpu-type={opts.teacher_tpu_type} is the teacher\'s slice of a '
                     'backend=\'ray\' run; with --tpu-type the teacher scores on the first '
                     'trainer chip: drop the flag.')
  teacher = None
  if ray:
    trainer, inference = get_slice(opts.trainer_tpu_type), get_slice(opts.inference_tpu_type)
    plan = check_ray(config, trainer, inference, opts.inference_slices,
                     teacher_slice(config, opts.teacher_tpu_type, inference))
    shared = False
    # A teacher your ray.teacher_resources place: compiled for an inference host's chip.
    teacher = plan.teacher_slice or inference
  else:
    trainer = inference = get_slice(opts.tpu_type)
    plan = check_local(config, trainer, 'multihost' if trainer.multi_host else 'tpu-vm')
    shared = not config.mesh.disjoint
  plan.notes += validate_on_devices(config, plan.devices)
  model = run_model(config, opts.layers)
  if opts.layers is not None:
    plan.notes.append(f'--layers={opts.layers}: {config.model.name} with {opts.layers} of its '
                      f'{presets.PRESETS[config.model.name].num_layers} layers; the figures '
                      'are not the run\'s.')
  programs = [p.strip() for p in opts.programs.split(',') if p.strip()]
  say = (lambda text: print(f'# {text}', file=sys.stderr, flush=True))
  for line in plan.checked + plan.notes:
    say(line)
  reports = compile_lib.compile_run(config, plan, trainer, inference, shared=shared,
                                    programs=programs, model=model,
                                    log=lambda name: say(f'compiling {name} ...'),
                                    teacher_slice=teacher,
                                    teacher=run_teacher_model(config, opts.layers))
  if opts.json:
    print(json.dumps([r.as_dict() for r in reports], indent=1))
  else:
    print(f'# {config.name}: compiled for trainer {trainer.describe()}'
          + ('' if trainer is inference else f', inference {inference.describe()}')
          + (f', teacher {plan.teacher_slice.describe()}' if plan.teacher_slice else '')
          + '; the step times are the compiler model (FLOPs / peak, bytes / HBM bandwidth), '
          'not a measurement')
    for report in reports:
      print(report.line())
      for note in report.notes:
        print(f'#   {note}')
  program_report.refuse_unless_fits(reports)
  return 0


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
  if opts.recipe == 'compile':
    return run_compile(opts, overrides)
  strict = not opts.dry_run
  spec, notes = _remote_spec(opts.config, getattr(opts, 'ref', None), strict)
  recipe_overrides: list[str] = []
  if opts.recipe in ('ray', 'gke-ray'):
    recipe_overrides = list(RAY_OVERRIDES)
  imported_before = set(sys.modules)
  config = load_config([f'--config={opts.config}', *overrides, *recipe_overrides])
  opts.name = opts.name or _default_name(config)
  if not _NAME.fullmatch(opts.name):
    raise SliceError(f'--name={opts.name!r}: use 1-40 lowercase letters, digits and hyphens, '
                     'starting with a letter (a TPU VM / JobSet name).')
  notes += _workdir_notes(opts.workdir, opts.recipe)
  if opts.recipe in ('ray', 'gke-ray'):
    trainer, inference = get_slice(opts.trainer_tpu_type), get_slice(opts.inference_tpu_type)
    plan = check_ray(config, trainer, inference, opts.inference_slices,
                     teacher_slice(config, opts.teacher_tpu_type, inference))
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
  # What loading and validating the config imported (its task and reward code, what the
  # config file imports) must reach the hosts, as must the task's local data.
  plan.checked.append(check_shipped(
      config, [sys.modules[m] for m in set(sys.modules) - imported_before], ROOT,
      getattr(opts, 'ref', None), pathlib.Path(opts.config.partition(':')[0])))
  memory = memory_check(config, plan, *hbm, shared=shared)
  if memory:
    plan.checked += memory
  else:
    plan.notes.append(f'memory per chip not estimated: model {config.model.name!r} is not a '
                      'named preset (rlax_llm.models.presets.PRESETS).')

  if opts.recipe in ('gke', 'gke-ray'):
    if opts.recipe == 'gke':
      distributed, more = _distributed(
          config, slice_, opts, strict=strict, process_id='$(JOB_COMPLETION_INDEX)',
          coordinator=f'{opts.name}-slice-0-0.{opts.name}:{opts.coordinator_port}')
      plan.notes += more
      manifest = manifests.render_jobset(config, plan, slice_, opts, spec, overrides, distributed)
    else:
      manifest = manifests.render_rayjob(config, plan, trainer, inference, opts, spec, overrides)
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
    recipe = scripts.render_ray(config, plan, trainer, inference, opts, spec, overrides)
  else:
    distributed, more = _distributed(
        config, slice_, opts, strict=strict, process_id='"$PROCESS_ID"',
        coordinator=f'"$COORDINATOR:{getattr(opts, "coordinator_port", COORDINATOR_PORT)}"')
    plan.notes += more
    recipe = scripts.render_tpu_vm(config, plan, slice_, opts, spec, overrides, distributed)
  return print_or_run(recipe.script(opts.dry_run), opts.dry_run)


def print_or_run(script: str, dry_run: bool) -> int:
  """Prints a recipe's ``script``; unless ``dry_run``, runs it with bash (gcloud needed) and
  returns its exit status."""
  sys.stdout.write(script)
  if dry_run:
    return 0
  if not shutil.which('gcloud'):
    raise SliceError('gcloud is not on PATH; install the Google Cloud CLI and run gcloud auth '
                     'login, or pass --dry-run to print the commands.')
  sys.stdout.flush()
  return subprocess.run(['bash', '-c', script], check=False).returncode


def main(argv: Sequence[str] | None = None, command=None) -> None:
  """Runs ``command`` (default: ``run``) on ``argv``; a RlaxError becomes one error line."""
  try:
    status = (command or run)(sys.argv[1:] if argv is None else argv)
  except RlaxError as e:
    raise SystemExit(f'error: {e}') from None
  raise SystemExit(status)


if __name__ == '__main__':
  main()
