"""rlax_llm/distributed.py: config.distributed -> jax.distributed.initialize."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from rlax_llm import distributed
from rlax_llm.config import load_config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _config(**fields):
  config = load_config_file(f'{ROOT / "configs/default.py"}:smoke')
  for key, value in fields.items():
    config.distributed[key] = value
  return config


def test_a_single_process_initialises_nothing():
  assert distributed.settings(_config()) is None
  assert distributed.initialize(_config()) is False


@pytest.mark.parametrize('fields, message', [
    (dict(num_processes=4, process_id=4, coordinator_address='10.0.0.2:8476'),
     r'config.distributed.process_id=4 must be in \[0, 4\)'),
    (dict(num_processes=2, process_id=0, coordinator_address=''),
     r"config.distributed.coordinator_address='' must be HOST:PORT"),
    (dict(num_processes=2, process_id=1, coordinator_address='10.0.0.2'),
     r"coordinator_address='10.0.0.2' must be HOST:PORT"),
    (dict(num_processes=0), r'config.distributed.num_processes=0 must be an int >= 1'),
])
def test_inconsistent_settings_fail_with_the_key_and_the_fix(fields, message):
  with pytest.raises(ValueError, match=message):
    distributed.settings(_config(**fields))


_CHILD = """
import sys
import jax
jax.config.update('jax_platforms', 'cpu')
jax.config.update('jax_num_cpu_devices', 2)
from rlax_llm import distributed
from rlax_llm.config import load_config_file
config = load_config_file(sys.argv[1])
config.distributed.coordinator_address = sys.argv[2]
config.distributed.num_processes = 2
config.distributed.process_id = int(sys.argv[3])
assert distributed.initialize(config)
print(jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count())
"""


def test_two_processes_join_into_one_job_that_sees_every_device():
  """Two CPU processes with 2 devices each: after initialize, each sees 4 devices."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  procs = [subprocess.Popen(
      [sys.executable, '-c', _CHILD, f'{ROOT / "configs/default.py"}:smoke',
       f'127.0.0.1:{port}', str(pid)], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
  outs = [p.communicate(timeout=60) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
  assert sorted(out.split()[-4:] for out, _ in outs) == [['0', '2', '4', '2'],
                                                         ['1', '2', '4', '2']]
