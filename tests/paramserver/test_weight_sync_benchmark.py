"""benchmarks/weight_sync.py at a tiny size: the script runs and reports each path's figures
(the Ray path is slow: actors start in seconds each; run with ``pytest -m slow``)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_benchmark(paths: str) -> dict:
  env = {**os.environ, 'PYTHONPATH': str(ROOT)}
  result = subprocess.run(
      [sys.executable, 'benchmarks/weight_sync.py', '--sizes=tiny', f'--paths={paths}',
       '--lrs=', '--repeats=1', '--memcpy_mb=32'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout[result.stdout.index('{\n'):])


def test_the_local_path_reports_full_and_delta_syncs_and_memcpy():
  report = run_benchmark('local')['transfers']
  assert report['memory']['memcpy_GBps'] > 0 and report['memory_end']['checksum_GBps'] > 0
  fp32, bf16 = report['tiny']['local/float32'], report['tiny']['local/bfloat16']
  assert fp32['full']['bytes'] == fp32['bytes'] == 4 * report['tiny']['params']
  assert fp32['full']['GBps'] > 0 and fp32['full_fp32_vs_memcpy'] > 0
  assert bf16['full']['bytes'] == 2 * report['tiny']['params']
  assert 0.02 < bf16['delta']['changed_fraction'] < 0.03
  assert bf16['delta']['bytes'] < 0.2 * bf16['full']['bytes']


@pytest.mark.slow
def test_the_ray_path_moves_no_weight_byte_through_the_driver():
  report = run_benchmark('ray')['transfers']['tiny']
  for key in ('ray/float32', 'ray/bfloat16', 'ray[object_store]/float32',
              'ray[object_store]/bfloat16'):  # shared-memory slots (the default), object store
    row = report[key]
    assert row['driver']['driver_weight_bytes'] == 0
    assert row['driver']['received_bytes'] < 10_000  # version numbers and timings only
    assert row['full']['bytes'] == row['full_host_params']['bytes'] > 0
  assert report['ray/bfloat16']['delta']['bytes'] < 0.2 * report['ray/bfloat16']['full']['bytes']
