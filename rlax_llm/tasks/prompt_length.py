"""Prompt lengths in tokens, checked when the task first meets the model's tokenizer.

The inference worker refuses a prompt longer than ``sampling.max_prompt_len`` tokens when it
meets it, which for a file-backed task (``rlax_llm.tasks.files``: local files or a hub
dataset) could be hours into a run. ``fit_prompt_length`` measures every prompt of such a
task before any compute, with the worker's own encoding (``tokenization.encode_prompts``:
chat template, bos and all), and applies ``sampling.overlong_prompts``:

* ``'error'``: a ``ConfigError`` naming how many prompts are too long, the longest length,
  a few of them by record, and both fixes;
* ``'drop'``: those records are left out of the task before its split is built
  (``FileTask.drop_records``), so the held-out prompts and the train stream are a pure
  function of the data, the seed, the tokenizer and ``max_prompt_len``: a resumed run
  (which may not change these keys) drops the same records and its data position points at
  the same prompts.

Generated tasks (arithmetic, countdown, a task class of the user's own) have no finite set
of records to measure; the worker's check is theirs.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

from rlax_llm.errors import ConfigError
from rlax_llm.tasks.files import FileTask
from rlax_llm.tokenization import Tokenizer, encode_prompts

OVERLONG_POLICIES = ('error', 'drop')
# Prompts measured per ``encode_prompts`` call (bounds the id lists held at once).
MEASURE_CHUNK = 8192
# Overlong prompts an error names.
SHOWN = 3


def prompt_lengths(tokenizer: Tokenizer, prompts: list[Any]) -> list[int]:
  """Length in tokens of each prompt as the worker encodes it (``encode_prompts``)."""
  lengths: list[int] = []
  for start in range(0, len(prompts), MEASURE_CHUNK):
    lengths.extend(len(ids) for ids in
                   encode_prompts(tokenizer, prompts[start:start + MEASURE_CHUNK]))
  return lengths


def fit_prompt_length(task: Any, tokenizer: Tokenizer, max_prompt_len: int,
                      overlong_prompts: str) -> int:
  """Checks every prompt of a file-backed ``task`` against ``max_prompt_len`` tokens.

  Args:
    task: the run's task; only a ``FileTask`` is measured (others have no finite record set).
    tokenizer: the model's tokenizer.
    max_prompt_len: ``sampling.max_prompt_len``.
    overlong_prompts: ``sampling.overlong_prompts``, one of ``OVERLONG_POLICIES``.
  Returns the number of records left out (0 unless ``'drop'`` found some; also added to
  ``task.dropped_records``).
  Raises ConfigError for an unknown policy, for overlong prompts under ``'error'``, and when
  ``'drop'`` leaves too few records for the split.
  """
  if overlong_prompts not in OVERLONG_POLICIES:
    raise ConfigError(f'config.sampling.overlong_prompts={overlong_prompts!r} must be one of '
                      f'{OVERLONG_POLICIES}.')
  if not isinstance(task, FileTask):
    return 0
  overlong: dict[str, list[int]] = {}
  shown: list[tuple[int, int, str]] = []  # the longest: (length, -index, where)
  total = longest = 0
  for source, (where, prompts) in task.record_prompts().items():
    total += len(prompts)
    try:
      lengths = prompt_lengths(tokenizer, prompts)
    except ValueError as e:
      raise ConfigError(f'task {task.name!r}: a prompt of {where} does not encode with the '
                        f"model's tokenizer: {e}") from None
    over = [i for i, n in enumerate(lengths) if n > max_prompt_len]
    if over:
      overlong[source] = over
      longest = max(longest, max(lengths[i] for i in over))
      shown = heapq.nlargest(SHOWN, shown + [(lengths[i], -i, where) for i in over])
  count = sum(len(v) for v in overlong.values())
  if not count:
    return 0
  if overlong_prompts == 'error':
    examples = '; '.join(f'record {-i} of {where} ({n} tokens)' for n, i, where in shown)
    raise ConfigError(
        f'{count} of the {total} prompts of task {task.name!r} encode to more than '
        f'config.sampling.max_prompt_len={max_prompt_len} tokens with the model\'s tokenizer '
        f'(the longest: {longest} tokens; e.g. {examples}). Raise sampling.max_prompt_len to '
        f'{longest} (prompt + sampling.max_new_tokens must fit model.max_seq_len), or set '
        "sampling.overlong_prompts='drop' to leave those prompts out of the run.")
  try:
    task.drop_records(overlong)
  except ValueError as e:
    raise ConfigError(f"config.sampling.overlong_prompts='drop': {e}") from None
  logging.warning('left out %d of the %d prompts of task %r: longer than '
                  'sampling.max_prompt_len=%d tokens (the longest: %d tokens; '
                  "sampling.overlong_prompts='drop')", count, total, task.name, max_prompt_len,
                  longest)
  return count


def dropped_metrics(task: Any) -> dict[str, float]:
  """``{'data/overlong_dropped': n}`` for a file-backed task (the records ``'drop'`` left
  out; the run writes it to its summary once), ``{}`` for a generated one."""
  if not isinstance(task, FileTask):
    return {}
  return {'data/overlong_dropped': float(task.dropped_records)}
