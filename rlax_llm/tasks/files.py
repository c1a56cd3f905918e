"""File-backed problem sets: one loader (JSONL and Parquet) and one split, shared by the math
and python tasks.

``load_records(paths, required, fields)`` reads records (dicts) from ``.jsonl``/``.json`` files
(one JSON object per line; ``.gz`` allowed) and ``.parquet`` files (through ``pyarrow``,
imported only for Parquet, with an error saying how to install it when it is missing; only the
``fields`` columns are read). ``paths`` may be one path, a glob, or a list of them; the schema
of each task is in docs/tasks.md. A task's ``path`` may instead name a dataset on the Hugging
Face hub, ``hf://datasets/ORG/NAME[@REVISION]`` (``rlax_llm/tasks/hub_datasets.py`` fetches the
files of its splits). Records are held in memory, at most ``MAX_RECORDS`` of them.

``FileSplit`` holds a seeded train / eval split of the records: the eval split is either a
separate file set or the ``num_eval`` records with the smallest seeded hash of their key (the
question text), so it is independent of file order; every train record whose key is an eval
key is dropped (duplicates never leak). Train position ``index`` maps to epoch
``index // n`` and a seeded permutation of the ``n`` train records per epoch, computed once per
epoch: ``train_record(index)`` is O(1) amortised and random access.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import pathlib
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from rlax_llm import extras
from rlax_llm.extras import PARQUET_SUFFIXES
from rlax_llm.tasks._util import check_format, check_int, stable_hash
from rlax_llm.tasks.base import Prompt, chat_messages
from rlax_llm.tasks.hub_datasets import HubDataset, is_hub_url

DATA_DIR = pathlib.Path(__file__).with_name('data')
JSONL_SUFFIXES = ('.jsonl', '.json', '.jsonl.gz', '.json.gz')
# Records are Python dicts of the task's fields, about 1-3 KB each for a math or code problem
# (GSM8K's 7.5k train records: ~15 MB; MATH's 12.5k: ~40 MB), so a million is a few GB: a
# larger data set needs a streaming reader, which this is not.
MAX_RECORDS = 1_000_000


def resolve_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[pathlib.Path]:
  """Files named by ``paths`` (a path, a glob, or a list of them), in the order given (globs
  sorted). A bare file name that does not exist is looked up in the bundled data directory.
  Raises ValueError when something matches no file."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  if not isinstance(paths, Sequence) or not paths:
    raise ValueError(f'data path must be a path, a glob or a non-empty list of them, got '
                     f'{paths!r}.')
  found: list[pathlib.Path] = []
  for entry in paths:
    if not isinstance(entry, (str, os.PathLike)):
      raise ValueError(f'data path entries must be str, got {type(entry).__name__}: {entry!r}.')
    text = os.path.expanduser(os.fspath(entry))
    if any(c in text for c in '*?['):
      matches = sorted(glob.glob(text, recursive=True))
      if not matches:
        raise ValueError(f'data path glob {text!r} matches no file.')
      found.extend(pathlib.Path(m) for m in matches)
    elif os.path.isfile(text):
      found.append(pathlib.Path(text))
    elif os.sep not in text and (DATA_DIR / text).is_file():
      found.append(DATA_DIR / text)
    else:
      raise ValueError(f'data file {text!r} does not exist (bundled files: '
                       f'{sorted(p.name for p in DATA_DIR.glob("*.jsonl"))}).')
  return found


def load_records(paths: str | os.PathLike | Sequence[str | os.PathLike],
                 required: Sequence[str] = (), fields: Sequence[str] | None = None
                 ) -> list[dict[str, Any]]:
  """All records of ``paths`` in order; each must be a JSON object / table row holding the
  ``required`` fields. ``fields``: the fields a record keeps (those present; None: all), so
  unused columns take no memory (Parquet does not read them).

  Raises ValueError naming the file (and line) of a bad record or a table lacking a column
  (listing those it has), or past ``MAX_RECORDS`` records; MissingExtra (an ImportError)
  naming the data extra when Parquet needs ``pyarrow`` and it is missing.
  """
  records: list[dict[str, Any]] = []
  for path in resolve_paths(paths):
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
      rows = _read_parquet(path, required, fields, MAX_RECORDS - len(records))
    elif name.endswith(JSONL_SUFFIXES):
      rows = _read_jsonl(path)
    else:
      raise ValueError(f'{path}: unknown data file type; use one of '
                       f'{JSONL_SUFFIXES + PARQUET_SUFFIXES}.')
    for where, row in rows:
      missing = [f for f in required if f not in row]
      if missing:
        raise ValueError(f'{path}{where}: record lacks field(s) {missing}; it has '
                         f'{sorted(row)}. Set the task\'s *_field options to the names your '
                         'data uses.')
      if len(records) >= MAX_RECORDS:
        raise ValueError(_too_many(paths))
      records.append(row if fields is None else {f: row[f] for f in fields if f in row})
  if not records:
    raise ValueError(f'no records in {paths!r}.')
  return records


def _too_many(paths) -> str:
  return (f'{paths!r} hold more than MAX_RECORDS={MAX_RECORDS} records, which the file tasks '
          'keep in memory; use a subset (a glob over some of its files).')


def _read_jsonl(path: pathlib.Path):
  opener = gzip.open if path.name.lower().endswith('.gz') else open
  with opener(path, 'rt', encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); '
                         'each line must be one JSON object.') from None
      if not isinstance(row, dict):
        raise ValueError(f'{path}:{number}: a line must be a JSON object, got '
                         f'{type(row).__name__}.')
      yield f':{number}', row


def _read_parquet(path: pathlib.Path, required: Sequence[str], fields: Sequence[str] | None,
                  room: int):
  """Rows of a Parquet file (only the ``fields`` columns), after checking its schema holds
  ``required`` and its row count fits in ``room``."""
  pq = extras.require('pyarrow.parquet', f'reading the Parquet file {path}')
  with pq.ParquetFile(path) as table:
    names = table.schema_arrow.names
    missing = [f for f in required if f not in names]
    if missing:
      raise ValueError(f'{path}: the table lacks column(s) {missing}; it has {names}. Set the '
                       "task's *_field options to the names your data uses.")
    if table.metadata.num_rows > room:
      raise ValueError(_too_many(path))
    columns = None if fields is None else [f for f in names if f in fields]
    number = 0
    for batch in table.iter_batches(columns=columns):
      for row in batch.to_pylist():
        yield f' row {number}', row
        number += 1


class FileSplit:
  """A seeded train / eval split of file records (see the module docstring)."""

  def __init__(self, records: Sequence[Mapping[str, Any]], key: Callable[[Mapping], str],
               seed: int, num_eval: int, eval_records: Sequence[Mapping] | None = None,
               owner: str = 'task'):
    self.seed = seed
    keys = [key(r) for r in records]
    if eval_records is not None:
      if num_eval > len(eval_records):
        raise ValueError(f'{owner}: num_eval={num_eval} but the held-out files (or split) '
                         f'hold only {len(eval_records)} records; lower num_eval.')
      eval_order = sorted(range(len(eval_records)),
                          key=lambda i: stable_hash('eval', seed, key(eval_records[i])))
      self.eval = [eval_records[i] for i in eval_order[:num_eval]]
      eval_keys = {key(r) for r in self.eval}
      self.train = [r for r, k in zip(records, keys) if k not in eval_keys]
    else:
      order = sorted(range(len(records)), key=lambda i: (stable_hash('split', seed, keys[i]), i))
      eval_keys: set[str] = set()
      self.eval = []
      for i in order:
        if len(self.eval) >= num_eval:
          break
        if keys[i] not in eval_keys:
          eval_keys.add(keys[i])
          self.eval.append(records[i])
      self.train = [r for r, k in zip(records, keys) if k not in eval_keys]
      if len(self.eval) < num_eval:
        raise ValueError(f'{owner}: num_eval={num_eval} but the data holds only '
                         f'{len(self.eval)} distinct problems; lower num_eval.')
    if not self.train:
      raise ValueError(f'{owner}: no train records left after holding out {len(self.eval)} '
                       f'for eval ({len(records)} records); lower num_eval or add data.')
    self._lock = threading.Lock()
    self._permutations: dict[int, np.ndarray] = {}

  def train_record(self, index: int) -> Mapping[str, Any]:
    """The train record at stream position ``index`` (each epoch a seeded permutation)."""
    epoch, position = divmod(index, len(self.train))
    with self._lock:
      permutation = self._permutations.get(epoch)
      if permutation is None:
        rng = np.random.default_rng([stable_hash('epoch', self.seed, epoch)])
        permutation = rng.permutation(len(self.train))
        if len(self._permutations) >= 4:
          self._permutations.pop(next(iter(self._permutations)))
        self._permutations[epoch] = permutation
    return self.train[int(permutation[position])]


class FileTask:
  """Base of the file-backed tasks: loading, the split, prompts; subclasses define the
  record's answer, its demonstration and ``score``.

  Subclasses set ``name``, ``DEFAULT_PATH``, ``DEFAULT_TEMPLATE`` (plain text),
  ``DEFAULT_INSTRUCTION`` (chat) and ``question_field`` (the record field holding the problem,
  which keys the split), and implement ``_required_fields``, ``_fields(record)`` (the
  template fields), ``_answer(record)`` and ``_demonstration(record)``; they may extend
  ``_check_record`` and name the optional fields they read (``_optional_fields``).
  """

  name = 'file'
  question_field: str = 'question'
  DEFAULT_PATH: str = ''
  DEFAULT_TEMPLATE: str = '{question}'
  DEFAULT_INSTRUCTION: str = '{question}'
  TEMPLATE_FIELDS: tuple[str, ...] = ('question',)

  def _setup(self, seed: int, path, eval_path, num_eval: int, format: str,  # pylint: disable=redefined-builtin
             system_prompt: str | None, instruction: str | None,
             text_template: str | None, hf_config: str = '', split: str = 'train',
             eval_split: str | None = None) -> None:
    """Checks the common arguments, reads the records (files, or a hub dataset's splits:
    ``hf_config``, ``split``, ``eval_split``, see ``_read``) and builds the split."""
    owner = type(self).__name__
    self.seed = check_int(owner, 'seed', seed, 0, (1 << 64) - 1)
    self.num_eval = check_int(owner, 'num_eval', num_eval, 0)
    instruction = self.DEFAULT_INSTRUCTION if instruction is None else instruction
    text_template = self.DEFAULT_TEMPLATE if text_template is None else text_template
    example = {f: 'x' for f in self.TEMPLATE_FIELDS}
    check_format(owner, format, system_prompt, instruction, **example, text='x')
    try:
      text_template.format(**example)
    except (AttributeError, KeyError, IndexError, ValueError) as e:
      raise ValueError(f'{owner} text_template={text_template!r} is not a str.format template '
                       f'over {{{"}, {".join(self.TEMPLATE_FIELDS)}}}: {e!r}.') from None
    self.format, self.system_prompt = format, system_prompt
    self.instruction, self.text_template = instruction, text_template
    self.path = self.DEFAULT_PATH if path is None else path
    self.eval_path = eval_path
    (records, train_where), (eval_records, eval_where) = self._read(hf_config, split,
                                                                    eval_split)
    for where, rows in ((train_where, records), (eval_where, eval_records or [])):
      for i, row in enumerate(rows):
        try:
          self._check_record(row)
        except ValueError as e:
          raise ValueError(f'{owner}: record {i} of {where}: {e}') from None
    # The records as read, per source, before the split: ``drop_records`` rebuilds from them.
    self._sources = {'train': (train_where, records)}
    if eval_records is not None:
      self._sources['held_out'] = (eval_where, eval_records)
    self.dropped_records = 0
    self.split = FileSplit(records, self._key, self.seed, self.num_eval, eval_records, owner)

  def record_prompts(self) -> dict[str, tuple[str, list[Prompt]]]:
    """The prompt of every record as read, before the split: ``{source: (where, prompts)}``
    for ``'train'`` (``path``'s records, or its split ``split``) and, when the held-out
    records have a source of their own (``eval_path`` or ``eval_split``), ``'held_out'``.
    A prompt's id is its record's index in its source; ``where`` names the source as errors
    do (``path='...' split 'train'``)."""
    return {source: (where, [self._make_prompt(i, r) for i, r in enumerate(rows)])
            for source, (where, rows) in self._sources.items()}

  def drop_records(self, dropped: Mapping[str, Collection[int]]) -> None:
    """Leaves the records ``dropped[source]`` (indices into ``record_prompts()[source]``) out
    of the task and rebuilds the split from the rest, as if they had never been read: the
    held-out prompts and the train stream are then a pure function of the data, the seed
    and ``dropped``. Adds their number to ``dropped_records``. Raises ValueError when too
    few records remain for the split (naming ``num_eval``)."""
    owner = type(self).__name__
    unknown = sorted(set(dropped) - set(self._sources))
    if unknown:
      raise ValueError(f'{owner}.drop_records: unknown source(s) {unknown}; the task has '
                       f'{sorted(self._sources)}.')
    kept = {}
    count = 0
    for source, (where, rows) in self._sources.items():
      leave_out = set(dropped.get(source, ()))
      count += len(leave_out)
      kept[source] = (where, [r for i, r in enumerate(rows) if i not in leave_out])
    eval_records = kept['held_out'][1] if 'held_out' in kept else None
    try:
      split = FileSplit(kept['train'][1], self._key, self.seed, self.num_eval, eval_records,
                        owner)
    except ValueError as e:
      raise ValueError(f'{e} ({count} record(s) were left out before the split.)') from None
    self._sources, self.split = kept, split
    self.dropped_records += count

  def _read(self, hf_config: str, split: str, eval_split: str | None):
    """``((records, where), (eval records or None, where))`` of ``self.path`` and
    ``self.eval_path``.

    A hub dataset (``path='hf://datasets/ORG/NAME[@REVISION]'``) gives its config
    ``hf_config`` ('' for its default) and its split ``split``; the held-out records come from
    ``eval_path`` (files), else its split ``eval_split``: None for ``test`` when the config
    has one (and it is not ``split``), '' to hold out ``num_eval`` records of ``split``.
    Files take none of the three (their held-out records come from ``eval_path`` or are held
    out). Sets ``hf_config``, ``train_split``, ``eval_split`` (resolved) and ``dataset``.
    """
    owner = type(self).__name__
    if not isinstance(hf_config, str):
      raise ValueError(f'{owner} hf_config must be a str (\'\' for the default), got '
                       f'{hf_config!r}.')
    if not isinstance(split, str) or not split:
      raise ValueError(f'{owner} split must be a split name, got {split!r}.')
    if eval_split is not None and not isinstance(eval_split, str):
      raise ValueError(f'{owner} eval_split must be a split name, \'\' or None, got '
                       f'{eval_split!r}.')
    if is_hub_url(self.eval_path):
      raise ValueError(f'{owner} eval_path={self.eval_path!r}: eval_path takes files; a hub '
                       "dataset's held-out split is its eval_split (with path=hf://...).")
    required = self._required_fields()
    fields = required + self._optional_fields()
    self.hf_config, self.train_split, self.eval_split, self.dataset = '', split, '', None
    if not is_hub_url(self.path):
      if hf_config or split != 'train' or eval_split:
        raise ValueError(f'{owner} hf_config={hf_config!r}, split={split!r}, '
                         f'eval_split={eval_split!r} choose the parts of a hub dataset '
                         f'(path=\'hf://datasets/ORG/NAME\'), but path={self.path!r} names '
                         "files; leave them at '', 'train', None (eval_path takes held-out "
                         'files).')
      eval_records = (None if self.eval_path is None
                      else load_records(self.eval_path, required, fields))
      return ((load_records(self.path, required, fields), f'path={self.path!r}'),
              (eval_records, f'eval_path={self.eval_path!r}'))
    self.dataset = HubDataset(self.path, hf_config, JSONL_SUFFIXES + PARQUET_SUFFIXES)
    self.hf_config = self.dataset.config
    records = load_records(self.dataset.split_files(split), required, fields)
    where = f'path={self.path!r} split {split!r}'
    if self.eval_path is not None:
      if eval_split:
        raise ValueError(f'{owner} eval_path={self.eval_path!r} and eval_split={eval_split!r} '
                         'both name the held-out records; give one.')
      return ((records, where), (load_records(self.eval_path, required, fields),
                                 f'eval_path={self.eval_path!r}'))
    if eval_split is None:
      eval_split = 'test' if 'test' in self.dataset.splits and split != 'test' else ''
    self.eval_split = eval_split
    eval_records = (load_records(self.dataset.split_files(eval_split), required, fields)
                    if eval_split else None)
    return (records, where), (eval_records, f'path={self.path!r} split {eval_split!r}')

  def __repr__(self) -> str:
    hub = ''
    if self.dataset is not None:
      hub = (f', hf_config={self.hf_config!r}, split={self.train_split!r}, '
             f'eval_split={self.eval_split!r}, revision={self.dataset.revision!r}')
    return (f'{type(self).__name__}(seed={self.seed}, path={self.path!r}{hub}, '
            f'eval_path={self.eval_path!r}, num_eval={self.num_eval}, format={self.format!r})')

  @property
  def charset(self) -> None:
    """None: file-backed text needs a pretrained model's tokenizer."""
    return None

  def train_prompt(self, index: int) -> Prompt:
    """The train prompt at stream position ``index >= 0`` (a pure function of seed, index)."""
    index = check_int(type(self).__name__, 'index', index, 0, (1 << 64) - 1)
    return self._make_prompt(index, self.split.train_record(index))

  def eval_prompts(self) -> list[Prompt]:
    """The held-out prompts (ids ``-1 - i``), fixed for the seed and the files."""
    return [self._make_prompt(-1 - i, r) for i, r in enumerate(self.split.eval)]

  def sft_example(self, index: int) -> tuple[str, str]:
    """(prompt text, the record's reference solution) of train position ``index``."""
    return self.train_prompt(index).text, self._demonstration(
        self.split.train_record(index))

  def _make_prompt(self, prompt_id: int, record: Mapping[str, Any]) -> Prompt:
    fields = self._fields(record)
    text = self.text_template.format(**fields)
    messages = None
    if self.format == 'chat':
      messages = chat_messages(self.instruction.format(**fields, text=text), self.system_prompt)
    return Prompt(prompt_id=prompt_id, text=text, answer=self._answer(record),
                  messages=messages)

  # Subclass hooks.
  def _required_fields(self) -> tuple[str, ...]:
    raise NotImplementedError

  def _optional_fields(self) -> tuple[str, ...]:
    """Fields a record may have and the task reads (kept when present)."""
    return ()

  def _check_record(self, record: Mapping[str, Any]) -> None:
    """Raises ValueError for a record the task cannot use: here, one whose question is not a
    non-empty str; subclasses extend it to their own fields."""
    question = record[self.question_field]
    if not isinstance(question, str) or not question.strip():
      raise ValueError(f'field {self.question_field!r} must be a non-empty str, got '
                       f'{question!r:.80}.')

  def _key(self, record: Mapping[str, Any]) -> str:
    """The record's identity for the split hash: its question."""
    return record[self.question_field]

  def _fields(self, record: Mapping[str, Any]) -> dict[str, str]:
    raise NotImplementedError

  def _answer(self, record: Mapping[str, Any]) -> str:
    raise NotImplementedError

  def _demonstration(self, record: Mapping[str, Any]) -> str:
    raise NotImplementedError
