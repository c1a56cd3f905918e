"""Verifiers: score completions with a task's reward function, never crashing or blocking the run.

A verifier that raises, hangs past its timeout, returns something that is not a real number,
or returns a value that is not finite once converted to float32 (``1e300`` overflows to inf)
gives reward 0 and a counted, logged error (docs/architecture.md "Roles"); the controller logs
the count as ``verifier/errors``. So a reward that reaches the advantages is always a finite
float32.

Scoring runs in a verifier pool: daemon threads, each completion with its own timeout (the
task's ``verifier_timeout_s`` attribute, else ``DEFAULT_TIMEOUT_S``). A thread stuck past its
timeout is abandoned (Python threads cannot be killed) and replaced, so the batch always
finishes; the verifiers below keep their own slow work in killable subprocesses so that an
abandoned thread is never left spinning: ``score_python`` runs code in ``rlax_llm.sandbox``
and ``score_math`` runs ``math-verify`` in a pool of worker processes that are killed when an
answer is late.

Public scoring functions (never raise, return a float in [0, 1]):
  ``score_math(completion, answer)``: final-answer equivalence (math-verify).
  ``score_python(completion, tests)``: fraction of unit tests a program passes in the sandbox.
"""

from __future__ import annotations

import atexit
import dataclasses
import fractions
import json
import logging
import numbers
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlax_llm import sandbox

if TYPE_CHECKING:  # the tasks import this module; at run time only annotations name them
  from rlax_llm.tasks.base import Prompt, Task

DEFAULT_TIMEOUT_S = 30.0  # per completion, when the task has no `verifier_timeout_s`
DEFAULT_MATH_TIMEOUT_S = 5.0
DEFAULT_PYTHON_TIMEOUT_S = 10.0
# Completions are scanned for their final answer in their last this many characters.
MAX_SCAN_CHARS = 100_000
MAX_ANSWER_CHARS = 256  # a longer extracted final answer scores 0
MAX_CODE_CHARS = 200_000  # a longer program scores 0


def _default_workers() -> int:
  return max(4, 2 * (os.cpu_count() or 1))


# ------------------------------------------------------------------------- rewards, pool


def as_reward(value: object) -> float | None:
  """``value`` as a finite float32-representable reward, or None if it is not one.

  Accepts Python and numpy real numbers (bools count as 0/1); rejects strings, None,
  complex numbers, arrays, NaN, +-inf and values that overflow float32.
  """
  if not isinstance(value, (numbers.Real, np.bool_)) or isinstance(value, np.ndarray):
    return None
  with np.errstate(over='ignore', invalid='ignore'):
    reward = np.float32(value)
  return float(reward) if np.isfinite(reward) else None


@dataclasses.dataclass
class _Job:
  index: int
  started: float | None = None
  done: bool = False
  abandoned: bool = False
  value: object = None
  error: BaseException | None = None


def run_with_timeouts(fn: Callable[[int], object], count: int, timeout_s: float,
                      max_workers: int | None = None) -> list[tuple[str, object]]:
  """Calls ``fn(i)`` for ``i in range(count)`` on up to ``max_workers`` daemon threads.

  Each call may run ``timeout_s`` seconds from its start; a late call is abandoned (its thread
  is replaced; it ends on its own when ``fn`` returns). Returns one outcome per index:
  ``('ok', value)``, ``('error', exception)`` or ``('timeout', None)``. Never raises for
  anything ``fn`` does.
  """
  if not timeout_s > 0:
    raise ValueError(f'timeout_s must be > 0 seconds, got {timeout_s!r}.')
  jobs = [_Job(i) for i in range(count)]
  pending = list(reversed(jobs))
  cond = threading.Condition()

  def worker():
    while True:
      with cond:
        if not pending:
          return
        job = pending.pop()
        job.started = time.monotonic()
      try:
        value, error = fn(job.index), None
      except BaseException as e:  # pylint: disable=broad-except
        value, error = None, e
      with cond:
        if job.abandoned:
          return  # a replacement thread has taken this one's place
        job.value, job.error, job.done = value, error, True
        cond.notify_all()

  def spawn():
    threading.Thread(target=worker, name='verifier', daemon=True).start()

  for _ in range(min(count, max_workers or _default_workers())):
    spawn()
  with cond:
    while True:
      now = time.monotonic()
      running = [j for j in jobs if j.started is not None and not j.done and not j.abandoned]
      for job in running:
        if now - job.started >= timeout_s:
          job.abandoned = True
          spawn()
      if all(j.done or j.abandoned for j in jobs):
        break
      deadlines = [j.started + timeout_s - now for j in running if not j.abandoned]
      cond.wait(timeout=min(deadlines + [0.5]) + 1e-3)
  outcomes = []
  for job in jobs:
    if job.abandoned:
      outcomes.append(('timeout', None))
    elif job.error is not None:
      outcomes.append(('error', job.error))
    else:
      outcomes.append(('ok', job.value))
  return outcomes


def score_completions(task: Task, prompts: Sequence[Prompt], completions: Sequence[str], *,
                      timeout_s: float | None = None, max_workers: int | None = None
                      ) -> tuple[np.ndarray, int]:
  """Rewards for aligned ``prompts[i]``/``completions[i]``, scored in the verifier pool.

  timeout_s: per-completion limit; None takes ``task.verifier_timeout_s`` if the task has
    one, else ``DEFAULT_TIMEOUT_S``.
  max_workers: pool threads; None takes ``task.verifier_workers`` if set, else
    ``max(4, 2 * cpu_count)``.
  Returns ``(rewards float32 [B], number of errors)``; see the module docstring for what
  counts as an error.
  """
  if len(prompts) != len(completions):
    raise ValueError(f'{len(prompts)} prompts but {len(completions)} completions; they must '
                     'be aligned one to one.')
  if timeout_s is None:
    timeout_s = float(getattr(task, 'verifier_timeout_s', DEFAULT_TIMEOUT_S))
  if max_workers is None:
    max_workers = getattr(task, 'verifier_workers', None)
  name = getattr(task, 'name', type(task).__name__)
  outcomes = run_with_timeouts(lambda i: task.score(prompts[i], completions[i]),
                               len(prompts), timeout_s, max_workers)
  rewards = np.zeros(len(prompts), np.float32)
  errors = 0
  for i, (kind, value) in enumerate(outcomes):
    prompt_id = getattr(prompts[i], 'prompt_id', None)
    if kind == 'timeout':
      logging.error('Verifier of task %r took longer than %.1f s on prompt %r; reward 0.',
                    name, timeout_s, prompt_id)
      errors += 1
      continue
    if kind == 'error':
      logging.error('Verifier of task %r raised on prompt %r', name, prompt_id,
                    exc_info=(type(value), value, value.__traceback__))
      errors += 1
      continue
    reward = as_reward(value)
    if reward is None:
      logging.warning('Verifier of task %r returned %r for prompt %r: not a finite real '
                      'number in float32; reward 0.', name, value, prompt_id)
      errors += 1
      continue
    rewards[i] = reward
  return rewards, errors


def score_rollouts(task: Task, prompts: Sequence[Prompt], rollouts):
  """Scores ``rollouts`` (rows of group ``g`` answer ``prompts[g]``); returns them with
  ``rewards`` and ``verifier_errors`` filled in.

  Raises ValueError if a row's ``prompt_id`` is not its prompt's (the worker and the
  controller disagree about which prompt a row answers).
  """
  expanded = [prompts[g] for g in rollouts.group_ids]
  ids = np.asarray([p.prompt_id for p in expanded])
  if not np.array_equal(ids, rollouts.prompt_ids):
    raise ValueError(f'rollout prompt ids {rollouts.prompt_ids.tolist()} do not match the '
                     f'prompts of their groups {ids.tolist()}.')
  rewards, errors = score_completions(task, expanded, rollouts.completions)
  return dataclasses.replace(rollouts, rewards=rewards, verifier_errors=errors)


# ------------------------------------------------------------------------------- text

_SURROGATE_RE = re.compile('[\ud800-\udfff]')


def clean_text(text: object) -> str | None:
  """``text`` as valid UTF-8-encodable str (lone surrogates become U+FFFD), or None if it is
  not a str."""
  if not isinstance(text, str):
    return None
  try:
    text.encode('utf-8')
    return text
  except UnicodeEncodeError:
    return _SURROGATE_RE.sub('\ufffd', text)


# ------------------------------------------------------------------------------- math

_NUMBER_RE = re.compile(r'-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)', re.ASCII)
_PLAIN_NUMBER_RE = re.compile(r'-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?', re.ASCII)


def _boxed_content(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with nested braces, or of
  ``\\boxed x`` (up to the next space or ``$``); None if there is none or it is unclosed."""
  start = max(text.rfind('\\boxed'), text.rfind('\\fbox'))
  if start < 0:
    return None
  i = start + (6 if text.startswith('\\boxed', start) else 5)
  while i < len(text) and text[i] == ' ':
    i += 1
  if i < len(text) and text[i] != '{':
    match = re.match(r'[^\s$]+', text[i:])
    return match[0] if match else None
  depth = 0
  for j in range(i, len(text)):
    if text[j] == '{':
      depth += 1
    elif text[j] == '}':
      depth -= 1
      if depth == 0:
        return text[i + 1:j]
  return None


def extract_final_answer(completion: object) -> str | None:
  """The final answer a completion states, or None. Never raises.

  In order: the line after the last ``####`` (GSM8K), the last ``\\boxed{...}`` (MATH; nested
  braces; an unclosed one, as in a truncated reply, is no answer), else the last number
  (ASCII digits). Only the last ``MAX_SCAN_CHARS`` characters are read; an answer longer
  than ``MAX_ANSWER_CHARS`` counts as none.
  """
  text = clean_text(completion)
  if text is None:
    return None
  text = text[-MAX_SCAN_CHARS:]
  marker = text.rfind('####')
  if marker >= 0:
    answer = text[marker + 4:].strip().split('\n', 1)[0].strip()
  elif '\\boxed' in text or '\\fbox' in text:
    answer = _boxed_content(text)  # None when unclosed: a truncated answer is no answer
  else:
    last = None
    for last in _NUMBER_RE.finditer(text):
      pass
    answer = last[0] if last is not None else None
  if answer is None:
    return None
  answer = answer.strip().rstrip('.').strip()
  if not answer or len(answer) > MAX_ANSWER_CHARS:
    return None
  return answer


def reference_answer(answer: object) -> str | None:
  """The final answer of a reference: extracted as ``extract_final_answer`` does when it has
  a ``####`` or ``\\boxed`` marker, else the whole text stripped."""
  text = clean_text(answer)
  if text is None:
    return None
  if '####' in text or '\\boxed' in text or '\\fbox' in text:
    return extract_final_answer(text)
  text = text.strip()
  return text if text and len(text) <= MAX_ANSWER_CHARS else None


def _plain_number(text: str) -> fractions.Fraction | None:
  """A decimal number with optional thousands commas (``-1,234.5``), exactly; else None."""
  text = text.strip().lstrip('$').strip()
  if len(text) > 64 or _PLAIN_NUMBER_RE.fullmatch(text) is None:
    return None
  return fractions.Fraction(text.replace(',', ''))


def score_math(completion: object, answer: object,
               timeout_s: float = DEFAULT_MATH_TIMEOUT_S) -> float:
  """1.0 if the completion's final answer equals the reference ``answer``, else 0.0.

  The final answer is extracted with ``extract_final_answer`` (``####``, last ``\\boxed{}``,
  last number); ``answer`` may be a bare final answer or a worked solution with one of those
  markers. Plain decimal numbers are compared exactly here; anything else (fractions, LaTeX,
  expressions, sets, ...) goes to ``math-verify`` (numeric and symbolic equivalence) in a
  worker process that is killed after ``timeout_s``. Never raises; a timeout scores 0.
  """
  try:
    pred, gold = extract_final_answer(completion), reference_answer(answer)
    if pred is None or gold is None:
      return 0.0
    if pred == gold:
      return 1.0
    pred_number, gold_number = _plain_number(pred), _plain_number(gold)
    if pred_number is not None and gold_number is not None:
      if pred_number == gold_number:
        return 1.0
      if pred_number.denominator == 1 and gold_number.denominator == 1:
        return 0.0
    return 1.0 if _MATH_WORKERS.verify(gold, pred, timeout_s) else 0.0
  except Exception:  # pylint: disable=broad-except
    logging.exception('score_math failed; reward 0.')
    return 0.0


class _MathWorker:
  """One ``_sandbox_child.py math`` process."""

  def __init__(self, startup_timeout_s: float):
    self.root = tempfile.mkdtemp(prefix='rlax-math-')
    self.tag = os.urandom(16).hex()
    config = {'root': self.root, 'guard': True,
              'limits': {'RLIMIT_AS': (2 << 30, 2 << 30), 'RLIMIT_CORE': (0, 0)}}
    self.proc = subprocess.Popen(
        [sys.executable, '-I', '-B', str(sandbox.CHILD_PATH), 'math', json.dumps(config)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        cwd=self.root, start_new_session=True,
        env={'PATH': '/usr/bin:/bin', 'HOME': self.root, 'TMPDIR': self.root,
             'LANG': 'C.UTF-8', sandbox.TAG_VARIABLE: self.tag})
    self._buffer = b''
    line = self._read_line(time.monotonic() + startup_timeout_s)
    reply = json.loads(line) if line else {'ready': False, 'error': 'no reply at startup'}
    if not reply.get('ready'):
      self.close()
      raise RuntimeError(f'the math-verify worker did not start: {reply.get("error")}; '
                         "install it with `pip install math-verify`.")

  def ask(self, gold: str, pred: str, timeout_s: float) -> bool | None:
    """math-verify's verdict, or None if it is late or the worker died.

    The worker's own limit (math-verify's parse and verify timeouts, which answer False) is
    a backstop one second past this deadline: with equal limits the two raced, and under
    load the worker's "False" could arrive first, a timeout that was neither counted nor
    followed by the kill.
    """
    request = json.dumps({'gold': gold, 'pred': pred, 'timeout': timeout_s + 1.0}) + '\n'
    try:
      self.proc.stdin.write(request.encode('utf-8', 'surrogatepass'))
      self.proc.stdin.flush()
    except OSError:
      return None
    line = self._read_line(time.monotonic() + timeout_s)
    if line is None:
      return None
    try:
      return bool(json.loads(line)['ok'])
    except (ValueError, KeyError, TypeError):
      return None

  def _read_line(self, deadline: float) -> bytes | None:
    fd = self.proc.stdout.fileno()
    while b'\n' not in self._buffer:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return None
      ready, _, _ = select.select([fd], [], [], remaining)
      if ready:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
          return None
        self._buffer += chunk
    line, self._buffer = self._buffer.split(b'\n', 1)
    return line

  def close(self) -> None:
    sandbox._kill_run(self.proc, self.tag)  # pylint: disable=protected-access
    for stream in (self.proc.stdin, self.proc.stdout):
      try:
        stream.close()
      except OSError:
        pass
    shutil.rmtree(self.root, ignore_errors=True)


class _MathWorkers:
  """A pool of math-verify worker processes: started on demand, reused, killed when late."""

  def __init__(self, size: int, startup_timeout_s: float = 60.0):
    self.size, self.startup_timeout_s = size, startup_timeout_s
    self._reset()

  def _reset(self) -> None:
    self._pid = os.getpid()
    self._cond = threading.Condition()
    self._idle: list[_MathWorker] = []
    self._count = 0
    self.unavailable: str | None = None
    self.timeouts = 0

  def verify(self, gold: str, pred: str, timeout_s: float) -> bool:
    if os.getpid() != self._pid:
      self._reset()  # a forked child must not share its parent's workers
    if self.unavailable is not None:
      return False
    worker = self._acquire(time.monotonic() + timeout_s + self.startup_timeout_s)
    if worker is None:
      return False
    verdict = worker.ask(gold, pred, timeout_s)
    with self._cond:
      if verdict is None:
        self.timeouts += 1
        self._count -= 1
      else:
        self._idle.append(worker)
      self._cond.notify()
    if verdict is None:
      logging.warning('math-verify gave no answer within %.1f s for %.80r; worker killed, '
                      'reward 0.', timeout_s, pred)
      worker.close()
    return bool(verdict)

  def _acquire(self, deadline: float) -> _MathWorker | None:
    with self._cond:
      while not self._idle and self._count >= self.size:
        if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
          return None
      if self._idle:
        return self._idle.pop()
      self._count += 1
    try:
      return _MathWorker(self.startup_timeout_s)
    except Exception as e:  # pylint: disable=broad-except
      with self._cond:
        self._count -= 1
        self._cond.notify()
        if 'did not start' in str(e):
          self.unavailable = str(e)
      logging.error('score_math: %s Answers are compared as plain numbers only.', e)
      return None

  def close(self) -> None:
    with self._cond:
      idle, self._idle = self._idle, []
      self._count -= len(idle)
    for worker in idle:
      worker.close()


_MATH_WORKERS = _MathWorkers(size=max(1, min(4, os.cpu_count() or 1)))
atexit.register(_MATH_WORKERS.close)


# ----------------------------------------------------------------------------- python

_FENCE_RE = re.compile(r'```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)', re.DOTALL)


def extract_code(completion: object) -> str | None:
  """The program in a completion: the last ```python fenced block (an unclosed one runs to
  the end), else the last fenced block of any language, else the whole text. None if the
  completion is not a str or the program is longer than ``MAX_CODE_CHARS``."""
  text = clean_text(completion)
  if text is None:
    return None
  blocks = _FENCE_RE.findall(text)
  python = [code for lang, code in blocks if lang.lower() in ('python', 'py', 'python3')]
  code = python[-1] if python else (blocks[-1][1] if blocks else text)
  return code if len(code) <= MAX_CODE_CHARS else None


def score_python(completion: object, tests: Sequence[str] | str,
                 timeout_s: float = DEFAULT_PYTHON_TIMEOUT_S, *, setup: str = '',
                 partial: bool = True, config: sandbox.SandboxConfig | None = None) -> float:
  """Fraction of ``tests`` the completion's program passes in the sandbox (``partial=False``:
  1.0 only if all pass), 0.0 if the run does not report success. Never raises.

  tests: Python statements run one by one after the program in its namespace (e.g.
    ``'assert add(1, 2) == 3'``); a test passes when it raises nothing. A single str is one
    test program.
  timeout_s: wall and CPU limit of the run (when ``config`` is None; else ``config``'s).
  setup: code run before the program (imports the tests need).
  """
  try:
    code = extract_code(completion)
    if code is None:
      return 0.0
    tests = [tests] if isinstance(tests, str) else list(tests)
    if config is None:
      config = sandbox.SandboxConfig(wall_s=timeout_s, cpu_s=timeout_s)
    result = sandbox.run_python(code, tests, setup=clean_text(setup) or '', config=config)
    if not result.reported:
      return 0.0
    if partial:
      return result.fraction
    return 1.0 if result.passed == result.total else 0.0
  except Exception:  # pylint: disable=broad-except
    logging.exception('score_python failed; reward 0.')
    return 0.0
