"""Python programming problems from files, checked by running unit tests in the sandbox.

Records are JSON objects (JSONL or Parquet files, or a hub dataset's split, docs/tasks.md): a
problem statement, a list of unit tests (Python statements such as ``assert add(1, 2) == 3``,
MBPP-style, Austin et al., 2021), an optional setup (imports the tests need) and an optional
reference solution (for demonstrations). The task's scorer, ``score_python`` (here), takes a
completion's program (its last ```python block, else the whole text; ``extract_code``) and runs
it in ``rlax_llm.sandbox`` with the tests; the reward is the fraction of tests passed
(``partial_credit=True``) or 1/0.
``Prompt.answer`` is JSON ``{"tests": [...], "setup": "..."}``: what the scorer needs, so a
prompt scores on its own.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_llm import sandbox
from rlax_llm.tasks._util import check_int, check_positive_float, clean_text
from rlax_llm.tasks.base import Prompt
from rlax_llm.tasks.files import FileTask

DEFAULT_PYTHON_TIMEOUT_S = 10.0
MAX_CODE_CHARS = 200_000  # a longer program scores 0
DEFAULT_INSTRUCTION = ('{question}\nYour code should pass these tests:\n{tests}\nReply with '
                       'the complete solution in one ```python code block.')
DEFAULT_TEMPLATE = '"""{question}\n{tests}\n"""\n'

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


class PythonTask(FileTask):
  """Code problems with unit tests from JSONL/Parquet files (see the module docstring).

  The prompt shows the statement and the first ``shown_tests`` tests. Train prompts have
  ``prompt_id == index``; eval prompts ``-1 - i``.
  """

  name = 'python'
  DEFAULT_PATH = 'python_sample.jsonl'
  DEFAULT_TEMPLATE = DEFAULT_TEMPLATE
  DEFAULT_INSTRUCTION = DEFAULT_INSTRUCTION
  TEMPLATE_FIELDS = ('question', 'tests')

  def __init__(self, seed: int = 0, path: str | Sequence[str] | None = None,
               eval_path: str | Sequence[str] | None = None, num_eval: int = 2,
               question_field: str = 'prompt', tests_field: str = 'tests',
               setup_field: str = 'setup', solution_field: str = 'solution',
               shown_tests: int = 1, partial_credit: bool = True,
               timeout_s: float = DEFAULT_PYTHON_TIMEOUT_S,
               test_timeout_s: float = 3.0, memory_mb: int = 1024,
               format: str = 'chat', system_prompt: str | None = None,  # pylint: disable=redefined-builtin
               instruction: str | None = None, text_template: str | None = None,
               hf_config: str = '', split: str = 'train', eval_split: str | None = None):
    """Loads the files and builds the split.

    Args:
      seed: int in ``[0, 2**64)``: fixes the split and the train order.
      path: JSONL/Parquet file(s) or glob(s), or a hub dataset
        (``hf://datasets/ORG/NAME[@REVISION]``); None for the bundled sample
        (``rlax_llm/tasks/data/python_sample.jsonl``, 10 problems).
      eval_path: separate held-out file(s); None holds out ``num_eval`` records of ``path``
        (a hub dataset: its ``eval_split``).
      num_eval: held-out prompts.
      hf_config, split, eval_split: a hub dataset's config ('' for its default), train split
        and held-out split (None: ``test`` when it has one, else held out; '' held out), as
        ``MathTask`` (MBPP: ``hf_config='full'``).
      question_field, tests_field, setup_field, solution_field: record field names (MBPP:
        text, test_list, test_setup_code, code). ``setup`` and ``solution`` are optional.
      shown_tests: how many tests the prompt shows (they name the function to write).
      partial_credit: reward = fraction of tests passed; False: 1.0 only if all pass.
      timeout_s: wall and CPU limit of one sandboxed run; test_timeout_s: of one test.
      memory_mb: the run's address-space limit (at most 2048 by default policy; raise
        deliberately).
      format, system_prompt, instruction, text_template: as ``MathTask``; templates over
        ``{question}`` and ``{tests}`` (the shown tests, one per line).
    Raises ValueError for an invalid argument, file or record.
    """
    owner = 'PythonTask'
    self.question_field, self.tests_field = question_field, tests_field
    self.setup_field, self.solution_field = setup_field, solution_field
    self.shown_tests = check_int(owner, 'shown_tests', shown_tests, 0)
    if not isinstance(partial_credit, bool):
      raise ValueError(f'{owner} partial_credit must be a bool, got {partial_credit!r}.')
    self.partial_credit = partial_credit
    self.timeout_s = check_positive_float(owner, 'timeout_s', timeout_s)
    self.test_timeout_s = check_positive_float(owner, 'test_timeout_s', test_timeout_s)
    self.memory_mb = check_int(owner, 'memory_mb', memory_mb, 64)
    self.sandbox_config = sandbox.SandboxConfig(
        wall_s=self.timeout_s, cpu_s=self.timeout_s, memory_bytes=self.memory_mb << 20,
        test_timeout_s=self.test_timeout_s)
    self.verifier_timeout_s = self.timeout_s + 20.0
    self._setup(seed, path, eval_path, num_eval, format, system_prompt, instruction,
                text_template, hf_config, split, eval_split)

  def score(self, prompt: Prompt, completion: str) -> float:
    """Fraction of the prompt's tests the completion passes (or 1/0); never raises."""
    try:
      spec = json.loads(prompt.answer)
      tests, setup = spec['tests'], spec.get('setup', '')
    except Exception:  # pylint: disable=broad-except
      return 0.0
    return score_python(completion, tests, self.timeout_s, setup=setup,
                        partial=self.partial_credit, config=self.sandbox_config)

  def format_ok(self, completion: object) -> bool:
    """Whether the completion holds a closed ```python code block."""
    text = clean_text(completion)
    if text is None:
      return False
    start = text.rfind('```python')
    return start >= 0 and text.find('```', start + 9) >= 0

  def _required_fields(self) -> tuple[str, ...]:
    return (self.question_field, self.tests_field)

  def _optional_fields(self) -> tuple[str, ...]:
    return (self.setup_field, self.solution_field)

  def _check_record(self, record: Mapping[str, Any]) -> None:
    super()._check_record(record)
    tests = record[self.tests_field]
    if (not isinstance(tests, (list, tuple)) or not tests
        or not all(isinstance(t, str) and t.strip() for t in tests)):
      raise ValueError(f'field {self.tests_field!r} must be a non-empty list of Python '
                       f'statements (str), got {tests!r:.120}.')
    for field in (self.setup_field, self.solution_field):
      if record.get(field) is not None and not isinstance(record[field], str):
        raise ValueError(f'field {field!r} must be a str when present, got '
                         f'{type(record[field]).__name__}.')

  def _fields(self, record: Mapping[str, Any]) -> dict[str, str]:
    tests = list(record[self.tests_field])[:self.shown_tests]
    return {'question': record[self.question_field].strip(), 'tests': '\n'.join(tests)}

  def _answer(self, record: Mapping[str, Any]) -> str:
    return json.dumps({'tests': list(record[self.tests_field]),
                       'setup': record.get(self.setup_field) or ''})

  def _demonstration(self, record: Mapping[str, Any]) -> str:
    solution = record.get(self.solution_field)
    if not solution:
      raise ValueError(f'PythonTask: the record {record[self.question_field]!r:.60} has no '
                       f'{self.solution_field!r} field, so it has no demonstration; add '
                       'reference solutions or skip the warm-up (warmup.steps=0).')
    return f'```python\n{solution.rstrip()}\n```'
