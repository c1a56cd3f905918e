"""benchmarks/profile_step.py: its HLO parsing on a known module, and a tiny run's figures."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip('peft')  # benchmarks/lora.py, whose step it profiles, imports it

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'benchmarks'))

HLO = """HloModule jit_step

%fused_dot (p0: f32[4,8], p1: bf16[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = bf16[8,2]{1,0} parameter(1)
  %convert.1 = f32[8,2]{1,0} convert(%p1)
  ROOT %dot.3 = f32[4,2]{1,0} dot(%p0, %convert.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0.1: f32[4,2]) -> f32[4,2] {
  %p0.1 = f32[4,2]{1,0} parameter(0)
  ROOT %add.2 = f32[4,2]{1,0} add(%p0.1, %p0.1)
}

ENTRY %main.9 (x: f32[4,8], w: bf16[8,2]) -> f32[4,2] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = bf16[8,2]{1,0} parameter(1)
  %fusion.7 = f32[4,2]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  ROOT %fusion.8 = f32[4,2]{1,0} fusion(%fusion.7), kind=kLoop, calls=%fused_add
}
"""


def test_hlo_instructions_and_summary():
  """A fusion holding a dot counts as a dot, another stays a fusion; loops are left out of
  the operations' time (their bodies are traced themselves), unknown names show as '?'."""
  import profile_step  # pylint: disable=import-outside-toplevel
  instructions = profile_step.hlo_instructions(HLO)
  assert instructions['fusion.7'] == ('dot', 'f32[4,2]{1,0}')
  assert instructions['fusion.8'] == ('fusion', 'f32[4,2]{1,0}')
  assert instructions['dot.3'] == ('dot', 'f32[4,2]{1,0}')
  assert instructions['convert.1'][0] == 'convert'
  instructions['while.1'] = ('while', '(s32[])')
  times = [('fusion.7', 3.0), ('fusion.8', 1.0), ('fusion.7', 1.0), ('while.1', 9.0),
           ('gone.2', 0.5)]
  out = profile_step.summarise(times, instructions, top=2)
  assert out['ops_s'] == 5.5 and out['control_flow_s'] == 9.0
  assert out['dot_fraction'] == pytest.approx(4.0 / 5.5)
  assert out['by_opcode'] == {'dot': 4.0, 'fusion': 1.0, '?': 0.5}
  assert out['ops_matched'] == 4 and out['ops_traced'] == 5
  assert out['top'][0] == {'op': 'fusion', 'opcode': 'dot', 'shape': 'f32[4,2]{1,0}',
                           'count': 2, 'seconds': 4.0}
  assert len(out['top']) == 2


def run(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, str(ROOT / 'benchmarks' / 'profile_step.py'), '--model=tiny',
       '--batch=4', '--length=8', '--micro_batches=2', '--rank=4', '--top=5', *flags],
      check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT)))


def test_tiny_lora_step_profile():
  """Every traced operation is found in the compiled program (the names agree), the opcode
  times add up to the total, and the matmuls are a real share of a LoRA step."""
  result = run()
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout)
  assert out['mode'] == 'lora rank 4' and out['step_s'] > 0
  assert out['ops_traced'] > 100 and out['ops_matched'] == out['ops_traced']
  assert sum(out['by_opcode'].values()) == pytest.approx(out['ops_s'], rel=1e-3, abs=1e-5)
  # A timed share: 0.19-0.21 alone under the tests' compile flags (0.40-0.45 at XLA's
  # defaults), 0.066 once in the whole suite's load, where the fusions' times stretch most.
  assert 0.02 < out['dot_fraction'] <= 1.0
  seconds = [row['seconds'] for row in out['top']]
  assert len(seconds) == 5 and seconds == sorted(seconds, reverse=True)


def test_full_with_a_bfloat16_base_is_refused(monkeypatch, capsys):
  """Refused before the model loads."""
  import profile_step  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sys, 'argv', ['profile_step.py', '--full', '--dtype=bfloat16'])
  monkeypatch.setattr(profile_step, 'load', lambda name: pytest.fail('loaded the model'))
  with pytest.raises(SystemExit) as exit_info:
    profile_step.main()
  assert exit_info.value.code == 2
  assert '--dtype=bfloat16 is for the LoRA step' in capsys.readouterr().err
