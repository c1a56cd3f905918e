"""On-policy distillation resumes exactly: a distillation run stopped by preemption (the stop
event a SIGTERM sets, ``checkpoint.PreemptionGuard``; tests/test_resume.py's ``Preempt``) and
relaunched in the same workdir equals the uninterrupted run: the same per-step metrics
(``distill/`` included) and bit-identical params. The teacher is frozen and reloaded from its
config (nothing of it is checkpointed), and it scores each batch in the controller's
deterministic order, so the resumed steps see the same scores.

Tiny student and teacher (``model.name='tiny'``, the teacher from its own seed), no warm-up,
three RL steps with a checkpoint every step and an async (2, 2) schedule."""

import jax
import numpy as np
import pytest

from smoke_config import smoke_config
from test_resume import Preempt, comparable, run_once

from rlax_llm.metrics import read_metrics

STEPS = 3


def _config(**fields):
  return smoke_config(**(dict(
      total_steps=STEPS, warmup__steps=0, rl__distill__kind='reverse_kl',
      rl__distill__with_reward=False, teacher__enabled=True, rl__learning_rate=3e-3,
      log__tensorboard=False, log__console_every=100, eval__every_steps=0,
      checkpoint__every_steps=1, checkpoint__every_seconds=0.0, staleness__j=2,
      staleness__k=2) | fields))


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('distill_reference')
  summary, params = run_once(_config(), workdir, None)
  assert summary['steps'] == STEPS and not summary['preempted']
  return params, comparable(read_metrics(workdir / 'metrics.jsonl'))


def test_distillation_preempted_after_step_one_resumes_exactly(reference, tmp_path):
  # With no warm-up the run checks the stop event once per RL step: set at the first check,
  # it stops after step 1 (saving that step); the relaunch trains steps 2 and 3.
  first, _ = run_once(_config(), tmp_path, Preempt(1))
  assert first['preempted'] and first['steps'] == 1
  summary, params = run_once(_config(), tmp_path, None)
  assert summary['steps'] == STEPS and not summary['preempted']
  ref_params, ref_metrics = reference
  metrics = comparable(read_metrics(tmp_path / 'metrics.jsonl'))
  assert [row['step'] for row in metrics] == list(range(1, STEPS + 1))  # no step twice
  assert all('distill/reverse_kl' in row for row in metrics)
  assert metrics == ref_metrics
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
