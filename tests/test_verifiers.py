"""Verifiers: score_math, score_python, the verifier pool with per-completion timeouts, and
fuzzing (never raises, always returns within its timeout)."""

import dataclasses
import logging
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlax_llm import verifiers
from rlax_llm.tasks import ArithmeticTask, Prompt
from rlax_llm.verifiers import (
    extract_code, extract_final_answer, reference_answer, run_with_timeouts, score_completions,
    score_math, score_python, score_rollouts)
from scored_rows import Rows  # tests/scored_rows.py

SURROGATE = '\ud800'


def timed(fn, *args, limit, **kwargs):
  start = time.monotonic()
  value = fn(*args, **kwargs)
  elapsed = time.monotonic() - start
  assert elapsed < limit, f'{elapsed:.2f} s > {limit} s'
  assert isinstance(value, float) and 0.0 <= value <= 1.0
  return value


# ------------------------------------------------------------------------- extraction


@pytest.mark.parametrize('completion, expected', [
    ('so the total is 5.\n#### 72', '72'),
    ('#### 1,000.', '1,000'),
    ('#### \n', None),
    ('\\boxed{\\frac{1}{2}} then \\boxed{\\frac{3}{4}}', '\\frac{3}{4}'),
    ('\\boxed{\\sqrt{\\frac{a}{b}}}', '\\sqrt{\\frac{a}{b}}'),
    ('\\boxed 7 apples', '7'),
    ('\\boxed{12', None),  # unclosed (truncated): no answer, not the last number
    ('\\fbox{3}', '3'),
    ('I think 3, no 4.5 is it.', '4.5'),
    ('the answer is -17', '-17'),
    ('no numbers here', None),
    ('\u0669\u0665', None),  # Arabic-Indic digits are not numbers here
    ('9' * 300, None),  # longer than MAX_ANSWER_CHARS
    ('x' * 2_000_000 + ' 42', '42'),
    (f'abc{SURROGATE} #### 4', '4'),
    (None, None), (42, None), (b'42', None),
])
def test_extract_final_answer(completion, expected):
  assert extract_final_answer(completion) == expected


def test_reference_answer_takes_the_marker_or_the_whole_text():
  assert reference_answer('Natalia sold 48/2 = 24 clips.\n#### 72') == '72'
  assert reference_answer('so $x = \\boxed{6}$.') == '6'
  assert reference_answer(' \\frac{5}{6} ') == '\\frac{5}{6}'
  assert reference_answer('') is None and reference_answer(None) is None


# ------------------------------------------------------------------------- score_math


@pytest.mark.parametrize('completion, answer, reward', [
    ('#### 72', '72', 1.0),
    ('The answer is 72.', 'steps...\n#### 72', 1.0),
    ('#### 72.0', '72', 1.0),
    ('#### 1,000', '1000', 1.0),
    ('#### 73', '72', 0.0),
    ('\\boxed{\\frac{1}{2}}', '0.5', 1.0),
    ('\\boxed{1/2}', '\\frac{1}{2}', 1.0),
    ('\\boxed{\\dfrac{5}{6}}', '\\frac{5}{6}', 1.0),
    ('\\boxed{2\\sqrt{2}}', '\\sqrt{8}', 1.0),
    ('\\boxed{(x+1)^2}', 'x^2+2x+1', 1.0),
    ('\\boxed{\\frac{1}{3}}', '\\frac{1}{2}', 0.0),
    ('\\boxed{5}', '\\boxed{5\\sqrt{2}}', 0.0),
    # Adversarial: huge numbers, overflow, NaN, non-ASCII digits, invalid UTF-8, no answer.
    ('#### ' + '9' * 200, '9' * 200, 1.0),
    ('#### ' + '9' * 200, '1', 0.0),
    ('#### 1e400', '5', 0.0),
    ('#### 1e400', 'inf', 0.0),
    ('#### nan', 'nan', 1.0),  # the same text; no float parsing decides this
    ('#### NaN', '5', 0.0),
    ('\u0669\u0665', '95', 0.0),
    ('#### \u0669\u0665', '95', 0.0),
    (f'#### 4{SURROGATE}', '4', 0.0),
    (f'{SURROGATE} #### 4', '4', 1.0),
    ('', '4', 0.0),
    (None, '4', 0.0),
    ('#### 4', None, 0.0),
    ('#### 4', 4, 0.0),
])
def test_score_math_truth_table(completion, answer, reward):
  assert timed(score_math, completion, answer, limit=30.0) == reward


def test_score_math_megabytes_of_text_is_fast():
  assert timed(score_math, 'blah ' * 1_000_000 + '#### 12', '12', limit=2.0) == 1.0
  assert timed(score_math, '(' * 3_000_000, '12', limit=2.0) == 0.0
  assert timed(score_math, '\\boxed{' * 500_000, '12', limit=2.0) == 0.0


def test_score_math_slow_expression_is_cut_at_its_timeout():
  score_math('\\boxed{2}', '\\frac{4}{2}', timeout_s=10.0)  # warm a worker up
  before = verifiers._MATH_WORKERS.timeouts  # pylint: disable=protected-access
  reward = timed(score_math, '\\boxed{10^{10^{10}}}', '3', timeout_s=1.0, limit=4.0)
  assert reward == 0.0
  assert verifiers._MATH_WORKERS.timeouts == before + 1  # pylint: disable=protected-access
  # The killed worker is replaced: the next answer is still checked.
  assert timed(score_math, '\\boxed{\\frac{6}{4}}', '1.5', limit=30.0) == 1.0


def test_math_verify_is_not_imported_in_this_process():
  """Checked in a fresh interpreter (other tests import torch, which imports sympy)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  code = ('import sys; from rlax_llm.verifiers import score_math; '
          "r = score_math('\\\\boxed{\\\\frac{1}{2}}', '0.5'); "
          "print(r, 'math_verify' in sys.modules, 'sympy' in sys.modules)")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True, timeout=60).stdout.split()
  assert out == ['1.0', 'False', 'False'], out


# ----------------------------------------------------------------------- score_python

ADD_TESTS = ['assert add(1, 2) == 3', 'assert add(-1, 1) == 0', 'assert add(2, 2) == 4']


@pytest.mark.parametrize('completion, reward', [
    ('```python\ndef add(a, b):\n  return a + b\n```', 1.0),
    ('Here:\n```py\ndef add(a, b):\n  return a + b\n```\nDone.', 1.0),
    ('def add(a, b):\n  return a + b\n', 1.0),  # no fence: the whole text
    ('```python\ndef add(a, b):\n  return a + b\n', 1.0),  # unclosed fence (truncated reply)
    ('```python\ndef add(a, b):\n  return 3\n```', 1 / 3),
    ('```python\ndef add(a, b): return a - b\n```\n```python\ndef add(a, b): return a + b\n```',
     1.0),  # the last python block
    ('```text\nnot code\n```\n```python\ndef add(a, b):\n  return a + b\n```', 1.0),
    ('def add(a, b) return a + b', 0.0),
    ('I cannot solve this.', 0.0),
    ('', 0.0),
    (None, 0.0),
    # Adversarial programs.
    ('import sys\nsys.exit(0)\ndef add(a, b):\n  return a + b', 0.0),
    ('import os\nos._exit(0)', 0.0),
    ('__import__("os").system("echo pwned")\ndef add(a, b):\n  return a + b', 0.0),
    ('def add(a, b):\n  return a + b\nwhile True:\n  pass', 0.0),
    ('import socket\nsocket.create_connection(("127.0.0.1", 22))\n'
     'def add(a, b):\n  return a + b', 0.0),
    ('def add(a, b):\n  print("x" * 10_000_000)\n  return a + b', 1.0),
    (f'def add(a, b):\n  return a + b  # {SURROGATE}', 1.0),  # surrogates become U+FFFD
    ('x = 10**10**10', 0.0),
])
def test_score_python_truth_table(completion, reward):
  value = timed(score_python, completion, ADD_TESTS, timeout_s=2.0, limit=6.0)
  assert value == pytest.approx(reward)


def test_score_python_all_or_nothing_single_program_and_setup():
  code = 'def add(a, b):\n  return 3'
  assert score_python(code, ADD_TESTS, partial=False) == 0.0
  assert score_python('def add(a, b):\n  return a + b', ADD_TESTS, partial=False) == 1.0
  assert score_python('x = 2', 'assert x == 2\nassert x * 2 == 4') == 1.0
  assert score_python('def f():\n  return math.pi', ['assert f() > 3'], setup='import math') \
      == 1.0
  assert score_python('x = 1', 'not a list of tests', timeout_s=2.0) == 0.0


def test_extract_code():
  assert extract_code('```python\na = 1\n```') == 'a = 1\n'
  assert extract_code('```\nb = 2\n```') == 'b = 2\n'
  assert extract_code('plain') == 'plain'
  assert extract_code('x' * (verifiers.MAX_CODE_CHARS + 1)) is None
  assert extract_code(None) is None


# ------------------------------------------------------------------------ the pool


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


# ------------------------------------------------------------------------------ fuzz

_FUZZ_TEXT = st.one_of(
    st.text(max_size=60),
    st.text(alphabet='0123456789.,-+/^{}\\$#() eE', max_size=40),
    st.builds(lambda s: '#### ' + s, st.text(max_size=30)),
    st.builds(lambda s: '\\boxed{' + s + '}', st.text(alphabet='0123456789+-*/^{}()x\\frac',
                                                      max_size=30)),
    st.sampled_from(['1e400', '-1e400', 'nan', 'inf', '\u0669', SURROGATE, '9' * 5000,
                     '\\boxed{' * 50, '}' * 50, '#' * 100]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=_FUZZ_TEXT, answer=st.sampled_from(['72', '\\frac{1}{2}', '#### 5', 'x+1']))
def test_fuzz_score_math_never_raises_and_is_bounded(completion, answer):
  timed(score_math, completion, answer, timeout_s=2.0, limit=30.0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=st.one_of(
    st.text(max_size=80),
    st.builds(lambda s: f'```python\n{s}\n```', st.text(max_size=80)),
    st.sampled_from(['while True: pass', 'import os\nos.fork()', 'raise SystemExit',
                     'print(1/0)', 'def add(a, b): return a + b'])))
def test_fuzz_score_python_never_raises_and_is_bounded(completion):
  timed(score_python, completion, ADD_TESTS, timeout_s=1.5, limit=8.0)


@settings(max_examples=200, deadline=None)
@given(completion=st.text(max_size=200))
def test_fuzz_extractors_never_raise(completion):
  answer = extract_final_answer(completion)
  assert answer is None or (isinstance(answer, str) and len(answer) <= verifiers.MAX_ANSWER_CHARS)
  code = extract_code(completion)
  assert code is None or isinstance(code, str)


def test_score_python_leaves_no_sandbox_process_behind():
  score_python('import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\n',
               ['assert True'], timeout_s=2.0)
  time.sleep(0.1)
  leftovers = []
  for pid in os.listdir('/proc'):
    if pid.isdigit():
      try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
          if b'RLAX_SANDBOX_TAG=' in f.read():
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
              if b' math' not in f.read().replace(b'\0', b' '):
                leftovers.append(pid)
      except OSError:
        pass
  assert leftovers == []
