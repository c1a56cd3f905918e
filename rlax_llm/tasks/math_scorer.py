"""Final-answer scorers: a completion's final answer against a reference, by math-verify or as
a string.

Every scorer extracts the completion's final answer (``extract_final_answer``: the line after
the last ``####``, the last closed ``\\boxed{}``, else the last number) and the reference's
(``reference_answer``), then compares them; ``SCORERS`` names them (``MathTask``'s ``scorer``):

* ``score_math`` ('math'): plain decimal numbers exactly in rational arithmetic here; anything
  else with ``math-verify`` (numeric and symbolic equivalence) in a pool of worker processes
  (``rlax_llm/_sandbox_child.py math``, guarded and memory-limited like the code sandbox) that
  are killed when an answer is late, so a slow comparison never leaves a verifier thread
  spinning. math-verify reads letters as algebra (``abc`` equals ``cba``, a product), so a
  reference that is not mathematical (``is_mathematical``: only words once normalised, as
  ``Monday``, ``(C)``, ``\\text{odd}``) is compared as ``score_normalised`` does.
* ``score_normalised`` ('normalised'): equal after ``normalise_answer`` (LaTeX text wrappers,
  ``$``, spacing commands, case and repeated whitespace dropped).
* ``score_exact`` ('exact'): equal strings.

math-verify and sympy are imported only in the workers, never in this process.
"""

from __future__ import annotations

import atexit
import fractions
import json
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from rlax_llm import extras, sandbox
from rlax_llm.tasks._util import clean_text

DEFAULT_MATH_TIMEOUT_S = 5.0
# Completions are scanned for their final answer in their last this many characters.
MAX_SCAN_CHARS = 100_000
MAX_ANSWER_CHARS = 256  # a longer extracted final answer scores 0

_NUMBER_RE = re.compile(r'-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)', re.ASCII)
# LaTeX that wraps text or only sets spacing and sizes, dropped by normalise_answer.
_TEXT_WRAPPER_RE = re.compile(
    r'\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mathsf|mbox|boxed)'
    r'\s*\{([^{}]*)\}')
_SPACING_RE = re.compile(r'\\(?:[,;:! ]|q?quad(?![A-Za-z]))|~')
_SIZING_RE = re.compile(r'\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])')
# Words (letters of any script, joined by single spaces, hyphens or apostrophes), optionally
# in parentheses: a reference like this is not mathematical.
_WORDS_RE = re.compile(r"\(?[^\W\d_]+(?:[ '-][^\W\d_]+)*\)?")
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


def has_answer_marker(text: str) -> bool:
  """Whether ``text`` marks a final answer: a ``####`` line or a ``\\boxed``/``\\fbox``."""
  return '####' in text or '\\boxed' in text or '\\fbox' in text


def reference_answer(answer: object) -> str | None:
  """The final answer of a reference: extracted as ``extract_final_answer`` does when it has
  a ``####`` or ``\\boxed`` marker, else the whole text stripped."""
  text = clean_text(answer)
  if text is None:
    return None
  if has_answer_marker(text):
    return extract_final_answer(text)
  text = text.strip()
  return text if text and len(text) <= MAX_ANSWER_CHARS else None


def normalise_answer(text: str) -> str:
  """``text`` without its LaTeX text wrappers (``\\text{..}``, ``\\mathrm{..}``, ``\\boxed{..}``,
  nested too), ``$``, spacing commands (``\\,``, ``\\!``, ``\\quad``, ``~``) and sizing
  (``\\left``, ``\\right``, ``\\big``), ``\\dfrac``/``\\tfrac`` as ``\\frac``, case-folded, with
  whitespace runs as one space (none beside punctuation: ``x + 1`` -> ``x+1``), a final period
  dropped and a lone parenthesised choice unwrapped (``(C)`` -> ``c``)."""
  previous = None
  while previous != text:
    previous, text = text, _TEXT_WRAPPER_RE.sub(r'\1', text)
  text = _SIZING_RE.sub('', _SPACING_RE.sub(' ', text.replace('\\$', '').replace('$', '')))
  text = re.sub(r'\\[dt]frac(?![A-Za-z])', r'\\frac', text)
  text = re.sub(r'\s*([^\w\s])\s*', r'\1', ' '.join(text.split()))
  text = text.casefold().rstrip('.').strip()
  choice = re.fullmatch(r'\(\s*([^\W\d_])\s*\)', text)
  return choice[1] if choice else text


def is_mathematical(reference: str) -> bool:
  """Whether ``score_math`` compares ``reference`` with math-verify: False when, normalised
  (``normalise_answer``), it is only words of letters, optionally in parentheses (``cba``,
  ``Monday``, ``(C)``, ``\\text{no solution}``, ``nan``): math-verify would read those as
  products of variables. Anything with a digit, an operator, a LaTeX command or other
  punctuation is mathematical."""
  return _WORDS_RE.fullmatch(normalise_answer(reference)) is None


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
  markers. A reference that is not mathematical (``is_mathematical``: words) is compared
  after ``normalise_answer``; plain decimal numbers are compared exactly here; anything else
  (fractions, LaTeX, expressions, sets, ...) goes to ``math-verify`` (numeric and symbolic
  equivalence) in a worker process that is killed after ``timeout_s``. Never raises; a
  timeout scores 0.
  """
  try:
    pred, gold = extract_final_answer(completion), reference_answer(answer)
    if pred is None or gold is None:
      return 0.0
    if pred == gold:
      return 1.0
    if not is_mathematical(gold):
      return 1.0 if normalise_answer(pred) == normalise_answer(gold) else 0.0
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


def score_normalised(completion: object, answer: object,
                     timeout_s: float = DEFAULT_MATH_TIMEOUT_S) -> float:
  """1.0 if the final answers of the completion and of ``answer`` (extracted as ``score_math``
  does) are equal after ``normalise_answer``, else 0.0. ``timeout_s`` is unused (the
  comparison is immediate; the signature is ``score_math``'s). Never raises."""
  pred, gold = extract_final_answer(completion), reference_answer(answer)
  if pred is None or gold is None:
    return 0.0
  return 1.0 if normalise_answer(pred) == normalise_answer(gold) else 0.0


def score_exact(completion: object, answer: object,
                timeout_s: float = DEFAULT_MATH_TIMEOUT_S) -> float:
  """1.0 if the final answers of the completion and of ``answer`` (extracted as ``score_math``
  does, surrounding whitespace and a final period dropped) are the same string, else 0.0.
  ``timeout_s`` is unused (the signature is ``score_math``'s). Never raises."""
  pred, gold = extract_final_answer(completion), reference_answer(answer)
  return 1.0 if pred is not None and pred == gold else 0.0


# A final-answer task's scorer by name: f(completion, reference, timeout_s) -> 0.0 or 1.0.
SCORERS: dict[str, Callable[[object, object, float], float]] = {
    'math': score_math, 'normalised': score_normalised, 'exact': score_exact}


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
                         f'install the math extra: {extras.install_command("math")}.')

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
    sandbox.kill_run(self.proc, self.tag)
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
