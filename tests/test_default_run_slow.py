"""The default run's acceptance figure (slow: minutes; run with ``pytest -m slow``)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_default_run_improves_heldout_accuracy_by_30_points():
  result = subprocess.run([sys.executable, 'benchmarks/default_run.py', '--seeds=0'], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
  report = json.loads(result.stdout)
  run = report['runs'][0]
  assert run['improvement_points'] >= 30.0, report
  assert run['wall_s'] <= 600.0, report
  assert result.returncode == 0
