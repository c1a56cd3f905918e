"""The real-model path end to end: GRPO on SmolLM2-135M-Instruct (configs/smollm2.py:smoke).

Slow (about 90 s here: the 30-layer model's compilation dominates), so it runs with the
benchmarks (``pytest -m slow``), not in the default test command.
"""

import json
import subprocess
import sys

import pytest
from one_device import ROOT, one_device_env  # tests/one_device.py


@pytest.mark.slow
def test_smollm2_smoke_run(tmp_path):
  # One CPU device, as a user runs it: the suite's 8 fake devices would make the trainer
  # mesh data=8 and replicate the 135M params and their Adam moments 8 times (over 24 GB).
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/smollm2.py:smoke',
       f'--workdir={tmp_path / "wd"}'], cwd=ROOT, env=one_device_env(), capture_output=True,
      text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((tmp_path / 'wd' / 'summary.json').read_text())
  assert summary['steps'] == 2
  assert 0.0 <= summary['eval/final_accuracy'] <= 1.0
