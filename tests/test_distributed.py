"""rlax_llm/distributed.py: config.distributed -> jax.distributed.initialize, before the launch
validates the config (which builds meshes over jax.devices())."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from rlax_llm import distributed
from rlax_llm.cli import load_config_file

from ports import free_port  # tests/ports.py

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _config(**fields):
  config = load_config_file(f'{ROOT / "configs/default.py"}:smoke')
  for key, value in fields.items():
    config.distributed[key] = value
  return config


def test_without_initialize_nothing_happens():
  assert distributed.settings(_config()) is None
  assert distributed.initialize(_config()) is False
  # initialize alone: every argument left to JAX's discovery (Cloud TPU).
  assert distributed.settings(_config(initialize=True)) == {}


@pytest.mark.parametrize('fields, message', [
    (dict(num_processes=4, process_id=4, coordinator_address='10.0.0.2:8476'),
     r'config.distributed.process_id=4 must be in \[0, num_processes=4\)'),
    (dict(num_processes=2, process_id=0, coordinator_address='10.0.0.2'),
     r"config.distributed.coordinator_address='10.0.0.2' must be HOST:PORT"),
    (dict(num_processes=0), r'config.distributed.num_processes=0 must be an int >= 1'),
])
def test_inconsistent_settings_fail_with_the_key_and_the_fix(fields, message):
  with pytest.raises(ValueError, match=message):
    distributed.settings(_config(initialize=True, **fields))


_CHILD = """
import sys
import jax
jax.config.update('jax_platforms', 'cpu')
jax.config.update('jax_num_cpu_devices', 2)
from rlax_llm import distributed
from rlax_llm.cli import load_config_file
from rlax_llm.config import validate_config
config = load_config_file(sys.argv[1])
config.distributed.initialize = True
config.distributed.coordinator_address = sys.argv[2]
config.distributed.num_processes = 2
config.distributed.process_id = int(sys.argv[3])
assert distributed.initialize(config)
validate_config(config)  # after joining: meshes over all 4 devices
import threading
from rlax_llm import roles
meshes = roles.meshes(config)
# The trainer's mesh spans both processes; each process's inference mesh is its own.
assert {d.process_index for d in meshes['trainer'].devices.flat} == {0, 1}
assert meshes['trainer'].devices.size == 4
assert all(d.process_index == jax.process_index()
           for mesh in meshes['inference'] for d in mesh.devices.flat)
# Refused in a job: disjoint role meshes, a trainer mesh that leaves a process out.
from rlax_llm.sharding import role_meshes
for kwargs, message in ((dict(disjoint=True), 'disjoint=True in a 2-process job'),
                        (dict(), 'leaves out process(es) [1]')):
  try:
    role_meshes({'data': 2}, {'data': 1}, **kwargs)
  except ValueError as e:
    assert message in str(e), e
  else:
    raise AssertionError(kwargs)
# agree: process 0's value everywhere; JobStop: set in process 1 only, seen by both.
assert distributed.agree(10 + jax.process_index()) == 10
event = threading.Event()
stop = distributed.JobStop(event)
assert not stop.is_set()
if jax.process_index() == 1:
  event.set()
assert stop.is_set()
print('JOB', jax.process_index(), jax.process_count(), jax.device_count(),
      jax.local_device_count())
"""


def test_two_processes_join_into_one_job_that_sees_every_device():
  """Two CPU processes with 2 devices each: after initialize, each sees 4 devices; the
  trainer's mesh spans both processes, each inference mesh stays in its process; ``agree``
  and ``JobStop`` give every process the same answer."""
  port = free_port()
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  env.pop('XLA_FLAGS', None)
  procs = [subprocess.Popen(
      [sys.executable, '-c', _CHILD, f'{ROOT / "configs/default.py"}:smoke',
       f'127.0.0.1:{port}', str(pid)], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
  outs = [p.communicate(timeout=60) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
  # Read the child's own words: gloo writes to stdout too ("Expected number of connected
  # peer ranks is : 1"), before or after them, as its connections happen to land.
  jobs = [re.findall(r'JOB (\d+) (\d+) (\d+) (\d+)', out) for out, _ in outs]
  assert sorted(jobs) == [[('0', '2', '4', '2')], [('1', '2', '4', '2')]], outs


def test_the_launch_joins_before_it_validates(tmp_path):
  """One process with distributed.initialize: the launch gets past validation and prints the
  config (jax.distributed.initialize refuses to run once validation has touched devices)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  result = subprocess.run(
      [sys.executable, '-c', 'from rlax_llm import launch; launch.run_cli()',
       '--config=configs/default.py:smoke', '--config.distributed.initialize=true',
       f'--config.distributed.coordinator_address=127.0.0.1:{free_port()}',
       '--config.distributed.num_processes=1', '--config.distributed.process_id=0',
       '--config.total_steps=0', '--config.warmup.steps=0', f'--workdir={tmp_path / "wd"}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'jax.distributed: process 0 of 1' in result.stderr, result.stderr[-2000:]
  assert 'held-out greedy accuracy: RL start' in result.stdout
