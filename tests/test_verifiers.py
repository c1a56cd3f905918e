"""The verifier role: the pool with per-completion timeouts, never-raising scoring with counted
errors, and score_rollouts."""

import dataclasses
import logging
import time

import numpy as np
import pytest
from scored_rows import Rows  # tests/scored_rows.py

from rlax_llm.tasks import ArithmeticTask, Prompt
from rlax_llm.verifiers import run_with_timeouts, score_completions, score_rollouts


class _SlowTask(ArithmeticTask):
  """'hang' sleeps far past any timeout; 'boom' raises; 'exit' raises SystemExit."""

  verifier_timeout_s = 0.5

  def score(self, prompt, completion):
    if completion == 'hang':
      time.sleep(30)
    if completion == 'boom':
      raise RuntimeError('verifier crashed')
    if completion == 'exit':
      raise SystemExit(0)
    return super().score(prompt, completion)


def test_hanging_and_crashing_verifiers_give_zero_and_are_counted(caplog):
  task = _SlowTask(num_eval=4)
  prompt = Prompt(prompt_id=7, text='1+2=', answer='3')
  completions = ['3', 'hang', 'boom', '4', 'exit', '3'] + ['hang'] * 10
  start = time.monotonic()
  with caplog.at_level(logging.ERROR):
    rewards, errors = score_completions(task, [prompt] * len(completions), completions,
                                        max_workers=4)
  elapsed = time.monotonic() - start
  assert elapsed < 3.5, elapsed  # 11 hangs on 4 threads: a few timeouts in a row, never 30 s
  np.testing.assert_array_equal(rewards, [1, 0, 0, 0, 0, 1] + [0] * 10)
  assert rewards.dtype == np.float32
  assert errors == 13  # 11 timeouts, a crash, an exit
  assert 'took longer than 0.5 s on prompt 7' in caplog.text
  assert 'raised on prompt 7' in caplog.text


def test_run_with_timeouts_order_and_outcomes():
  def fn(i):
    if i == 2:
      raise ValueError('two')
    if i == 3:
      time.sleep(5)
    return i * 10
  outcomes = run_with_timeouts(fn, 5, timeout_s=0.3, max_workers=2)
  assert outcomes[0] == ('ok', 0) and outcomes[1] == ('ok', 10) and outcomes[4] == ('ok', 40)
  assert outcomes[2][0] == 'error' and str(outcomes[2][1]) == 'two'
  assert outcomes[3] == ('timeout', None)
  assert run_with_timeouts(fn, 0, timeout_s=1.0) == []
  with pytest.raises(ValueError, match='timeout_s must be > 0'):
    run_with_timeouts(fn, 1, timeout_s=0)


def test_score_rollouts_fills_rewards_and_errors():
  task = _SlowTask(num_eval=4)
  prompts = [Prompt(0, '1+2=', '3'), Prompt(1, '2+2=', '4')]
  rows = Rows(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1]), ['3', 'boom', '4', 'hang'])
  scored = score_rollouts(task, prompts, rows)
  np.testing.assert_array_equal(scored.rewards, [1, 0, 1, 0])
  assert scored.verifier_errors == 2
  with pytest.raises(ValueError, match='do not match'):
    score_rollouts(task, prompts, dataclasses.replace(rows, prompt_ids=np.array([0, 1, 1, 1])))
