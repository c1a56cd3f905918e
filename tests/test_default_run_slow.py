"""The default run's acceptance figure (slow: minutes; run with ``pytest -m slow``): the
shipped configs/default.py itself, unshortened, gains at least 30 points within 10 minutes.
tests/test_default_run.py is its CI counterpart (a shortened run, at least 20 points)."""

import json
import subprocess
import sys

import pytest
from one_device import ROOT, one_device_env  # tests/one_device.py


@pytest.mark.slow
def test_default_run_improves_heldout_accuracy_by_30_points():
  result = subprocess.run([sys.executable, 'benchmarks/default_run.py', '--seeds=0'], cwd=ROOT,
                          env=one_device_env(), capture_output=True, text=True, timeout=1200)
  report = json.loads(result.stdout)
  run = report['runs'][0]
  assert run['improvement_points'] >= 30.0, report
  assert run['wall_s'] <= 600.0, report
  assert result.returncode == 0
