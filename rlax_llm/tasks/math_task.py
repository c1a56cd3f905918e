"""Math word problems from files or a hub dataset, checked on the final answer by one of the
scorers of ``rlax_llm/tasks/math_scorer.py`` (``score_math`` by default).

Records are JSON objects (JSONL or Parquet files, or a hub dataset's split, docs/tasks.md)
with a question and an answer field. The answer may be a bare final answer (``72``,
``\\frac{5}{6}``) or a worked solution whose final answer follows ``####`` (GSM8K, Cobbe et
al., 2021) or sits in the last ``\\boxed{}`` (MATH, Hendrycks et al., 2021); ``Prompt.answer``
is that final answer. A completion scores 1.0 when its own final answer (after ``####``, the
last ``\\boxed{}``, else the last number) matches it: by default equivalent numerically or
symbolically (``math-verify``), or, for a reference of words, equal as normalised text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlax_llm.tasks import math_scorer
from rlax_llm.tasks._util import check_positive_float, clean_text
from rlax_llm.tasks.base import Prompt
from rlax_llm.tasks.files import FileTask

DEFAULT_INSTRUCTION = ('{question}\nPlease reason step by step, and put your final answer '
                       'within \\boxed{{}}.')
DEFAULT_TEMPLATE = 'Question: {question}\nAnswer:'


class MathTask(FileTask):
  """Final-answer math problems from JSONL/Parquet files or a hub dataset (see the module
  docstring).

  Train prompts have ``prompt_id == index``; eval prompts ``-1 - i``. With
  ``format='chat'`` the user turn is ``instruction`` over ``{question}`` and ``{text}``.
  """

  name = 'math'
  DEFAULT_PATH = 'math_sample.jsonl'
  DEFAULT_TEMPLATE = DEFAULT_TEMPLATE
  DEFAULT_INSTRUCTION = DEFAULT_INSTRUCTION
  TEMPLATE_FIELDS = ('question',)

  def __init__(self, seed: int = 0, path: str | Sequence[str] | None = None,
               eval_path: str | Sequence[str] | None = None, num_eval: int = 4,
               question_field: str = 'question', answer_field: str = 'answer',
               format: str = 'plain', system_prompt: str | None = None,  # pylint: disable=redefined-builtin
               instruction: str | None = None, text_template: str | None = None,
               math_timeout_s: float = math_scorer.DEFAULT_MATH_TIMEOUT_S,
               hf_config: str = '', split: str = 'train', eval_split: str | None = None,
               scorer: str = 'math'):
    """Loads the files (or the hub dataset's splits) and builds the split.

    Args:
      seed: int in ``[0, 2**64)``: fixes the split and the train order.
      path: JSONL/Parquet file(s) or glob(s), or a hub dataset
        ``hf://datasets/ORG/NAME[@REVISION]`` (e.g. ``hf://datasets/openai/gsm8k``); None for
        the bundled sample (``rlax_llm/tasks/data/math_sample.jsonl``, 14 problems).
      eval_path: separate held-out file(s) (e.g. GSM8K's test split); None holds out
        ``num_eval`` records of ``path`` chosen by a seeded hash of the question (a hub
        dataset: takes them from ``eval_split``).
      num_eval: held-out prompts (``eval_path`` or ``eval_split`` given: the first
        ``num_eval`` of those by hash).
      question_field, answer_field: record field names (GSM8K: question/answer; MATH:
        problem/solution).
      format, system_prompt, instruction: as ``ArithmeticTask``; ``instruction`` is a template
        over ``{question}`` and ``{text}`` (default asks for ``\\boxed{}``).
      text_template: the plain-text prompt, a template over ``{question}``.
      math_timeout_s: limit of one math-verify comparison.
      hf_config: a hub dataset's config ('' for its default; GSM8K: 'main').
      split: a hub dataset's train split.
      eval_split: a hub dataset's held-out split; None: ``test`` when it has one, else
        ``num_eval`` records of ``split`` held out; '': held out.
      scorer: 'math' (math-verify; a reference of words is compared as 'normalised'),
        'normalised' (case, whitespace and LaTeX text wrappers ignored) or 'exact'
        (``math_scorer.SCORERS``).
    Raises ValueError for an invalid argument, a missing file, split, config or field, or a
    record without a final answer.
    """
    self.question_field, self.answer_field = question_field, answer_field
    self.math_timeout_s = check_positive_float('MathTask', 'math_timeout_s', math_timeout_s)
    if scorer not in math_scorer.SCORERS:
      raise ValueError(f'MathTask scorer={scorer!r}; choose one of '
                       f'{sorted(math_scorer.SCORERS)}.')
    self.scorer = scorer
    self.verifier_timeout_s = self.math_timeout_s + 25.0  # + a worker's start (sympy import)
    self._setup(seed, path, eval_path, num_eval, format, system_prompt, instruction,
                text_template, hf_config, split, eval_split)

  def score(self, prompt: Prompt, completion: str) -> float:
    """1.0 iff the completion's final answer matches ``prompt.answer`` under the task's
    ``scorer``; never raises."""
    return math_scorer.SCORERS[self.scorer](completion, getattr(prompt, 'answer', None),
                                            self.math_timeout_s)

  def format_ok(self, completion: object) -> bool:
    """Whether the completion marks its final answer (``####`` or a closed ``\\boxed{}``)."""
    text = clean_text(completion)
    if text is None:
      return False
    text = text[-math_scorer.MAX_SCAN_CHARS:]
    return (math_scorer.has_answer_marker(text)
            and math_scorer.extract_final_answer(text) is not None)

  def _required_fields(self) -> tuple[str, ...]:
    return (self.question_field, self.answer_field)

  def _check_record(self, record: Mapping[str, Any]) -> None:
    super()._check_record(record)
    answer = record[self.answer_field]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
      return
    if not isinstance(answer, str) or math_scorer.reference_answer(answer) is None:
      raise ValueError(f'field {self.answer_field!r} has no final answer (a bare answer, '
                       f'"#### answer" or \\boxed{{answer}}): {answer!r:.120}.')

  def _fields(self, record: Mapping[str, Any]) -> dict[str, str]:
    return {'question': record[self.question_field].strip()}

  def _answer(self, record: Mapping[str, Any]) -> str:
    return math_scorer.reference_answer(str(record[self.answer_field]))

  def _demonstration(self, record: Mapping[str, Any]) -> str:
    answer = str(record[self.answer_field]).strip()
    if math_scorer.has_answer_marker(answer):
      return answer
    return f'\\boxed{{{answer}}}'
