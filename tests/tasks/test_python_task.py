"""The python task's scorer: code extraction, score_python's truth table (adversarial
programs included), fuzzing, and no sandbox process left behind."""

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scorer_checks import SURROGATE, timed  # tests/tasks/scorer_checks.py

from rlax_llm.tasks import python_task
from rlax_llm.tasks.python_task import extract_code, score_python

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
  assert extract_code('x' * (python_task.MAX_CODE_CHARS + 1)) is None
  assert extract_code(None) is None


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
def test_fuzz_extract_code_never_raises(completion):
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
