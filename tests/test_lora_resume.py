"""LoRA's SIGTERM resume in the CI run: a LoRA run (adapter-only sync, the default) SIGTERMed
through ``python -m rlax_llm.launch`` and relaunched equals the uninterrupted one bit for bit
(per-step metrics, ledger, the final checkpoint's params, adapters included).

The cheap counterpart of ``tests/test_lora_run.py``'s slow launch test, with its helpers and
``tests/test_resume.py``'s: 3 RL steps instead of 5, and the reference runs in this process
while the relaunch runs.
"""

import signal

import jax
from test_lora_run import LORA
from test_resume import (
  _final_params,
  _launch,
  _wait_for_rows,
  assert_same_params,
  read,
  run_once,
  smoke,
)

STEPS = 3


def test_a_lora_run_sigtermed_and_relaunched_equals_the_uninterrupted_one(tmp_path):
  workdir = tmp_path / 'run'
  extra = ('--config.lora.rank=2', f'--config.lora.targets={LORA["lora__targets"]}',
           f'--config.total_steps={STEPS}')
  proc = _launch(workdir, *extra)
  _wait_for_rows(workdir, 1, proc, timeout=240)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-3000:]
  assert 'preempted after step' in out, out[-3000:]
  assert read(workdir)[0] and len(read(workdir)[0]) < STEPS, 'the signal came too late'
  proc = _launch(workdir, *extra)
  config = smoke(steps=STEPS)
  config.lora.rank, config.lora.targets = 2, LORA['lora__targets']
  summary, ref_params = run_once(config, tmp_path / 'reference', None)  # meanwhile
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == 0, out[-3000:]
  assert summary['steps'] == STEPS
  assert read(workdir) == read(tmp_path / 'reference')
  final = _final_params(workdir)
  assert_same_params(final, ref_params)
  assert any('_lora' in jax.tree_util.keystr(path)  # the checkpoint holds the adapters
             for path, _ in jax.tree_util.tree_flatten_with_path(final)[0])
