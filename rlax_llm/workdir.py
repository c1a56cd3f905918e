"""The run directory: unique default names, the files a run leaves, what a resume finds.

A workdir is a local path or a ``gs://`` URL; every file goes through ``rlax_llm.storage``.
A run claims its workdir before writing anything (``rlax_llm.workdir_claim``); this module
knows what the directory holds:

* ``default_workdir(name)`` creates ``runs/<name>-<YYYYmmdd-HHMMSS>-<6 hex digits>`` with an
  exclusive ``mkdir``, retrying with a new suffix on a collision, so two runs started in the
  same second (in different processes, or on different hosts sharing ``runs/``) never get the
  same directory.
* A workdir whose ``metrics.jsonl`` already holds step rows is a run to *resume* when it
  holds a checkpoint (``has_checkpoint``; ``rlax_llm.checkpoint`` restores it) and is refused
  otherwise (by the claim); ``existing_steps`` and ``has_checkpoint`` decide this. A workdir
  left by a run that died before its first step is claimable.
* ``truncate_rows`` cuts ``metrics.jsonl``/``ledger.jsonl`` back to the restored step, so
  after a resume no step appears twice.
* ``finished_steps`` lists the complete Orbax steps of a checkpoint directory.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import secrets
from typing import Any

from rlax_llm import storage

METRICS_FILENAME = 'metrics.jsonl'  # the same name as rlax_llm.metrics (no jax import here)
LEDGER_FILENAME = 'ledger.jsonl'  # per step: prompt ids consumed and policy versions
CHECKPOINT_DIRNAME = 'checkpoints'  # rlax_llm.checkpoint writes here
# Orbax on GCS writes a step in place and adds this file last (locally it renames a
# temporary directory instead): a gs:// step without it is a save still running or cut off.
ORBAX_COMMIT_FILENAME = 'commit_success.txt'
_SUFFIX_BYTES = 3  # 6 hex digits after the timestamp of a default workdir
_MAX_NAME_ATTEMPTS = 100


def _new_suffix() -> str:
  return secrets.token_hex(_SUFFIX_BYTES)


def default_workdir(name: str, root: str | os.PathLike = 'runs') -> pathlib.Path:
  """Creates and returns a new, empty run directory ``root/<name>-<YYYYmmdd-HHMMSS>-<hex>``.

  The directory is created with an exclusive ``mkdir`` (it fails if the name exists), and a
  collision is retried with a new random suffix, so the name is unique even for runs started
  in the same second by different processes; uniqueness does not rely on the suffix being
  random. ``root`` is created if needed.

  Args:
    name: the run's name (``config.name``); one path component, not empty.
    root: the directory that holds runs.

  Returns:
    The created directory. Pass it to ``claim`` before writing into it.

  Raises:
    ValueError: ``name`` is empty or contains a path separator.
    FileExistsError: no free name after many attempts (not expected in practice).
  """
  if not name or name in ('.', '..') or '/' in name or (os.altsep and os.altsep in name):
    raise ValueError(f'run name {name!r} cannot be a directory name: it must be one '
                     "non-empty path component without '/'; set config.name to e.g. 'default'.")
  root = pathlib.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  for _ in range(_MAX_NAME_ATTEMPTS):
    path = root / f'{name}-{stamp}-{_new_suffix()}'
    try:
      path.mkdir()
    except FileExistsError:
      continue
    return path
  raise FileExistsError(f'could not create a new run directory {name}-{stamp}-* under {root} '
                        f'in {_MAX_NAME_ATTEMPTS} attempts; pass --workdir explicitly.')


def existing_steps(workdir: str | os.PathLike) -> int:
  """How many steps ``workdir/metrics.jsonl`` records: the number of distinct ``step`` values.

  A row counts when it is a complete line (ends with a newline) holding a JSON object with a
  ``step`` key. A torn last line (a crash mid-write) and lines that do not parse are skipped,
  never raised. Steps replayed after a resume appear twice in the file and count once.

  Returns:
    0 when ``metrics.jsonl`` is absent or holds no complete step row.
  """
  try:
    data = storage.read_bytes(storage.path(workdir) / METRICS_FILENAME)
  except FileNotFoundError:
    return 0
  rows, _ = _json_lines(data)
  return len({json.dumps(row['step']) for _, row in rows
              if isinstance(row, dict) and 'step' in row})


def _json_lines(data: bytes) -> tuple[list[tuple[bytes, Any]], bytes]:
  """The complete lines of JSON-lines ``data`` (each with its newline) with their parsed value
  (None where the line does not parse), and the torn last line (``b''`` when ``data`` ends
  with a newline): how ``metrics.jsonl`` and ``ledger.jsonl`` are read after a crash."""
  *lines, torn = data.split(b'\n')
  rows = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:
      row = None
    rows.append((line + b'\n', row))
  return rows, torn


def finished_steps(directory: str | os.PathLike) -> list[int]:
  """The steps under ``directory`` (a ``checkpoints/steps`` or ``checkpoints/warmup``
  directory) whose saves finished, oldest first, read from the listing alone: locally Orbax
  writes a step under a temporary name and renames it when complete; on ``gs://`` it writes
  the step in place and ``ORBAX_COMMIT_FILENAME`` last."""
  directory = storage.path(directory)
  steps = sorted(int(name) for name in storage.listdir(directory) if name.isdigit())
  if storage.is_gcs(directory):
    steps = [s for s in steps
             if ORBAX_COMMIT_FILENAME in storage.listdir(directory / str(s))]
  return steps


def has_checkpoint(workdir: str | os.PathLike) -> bool:
  """Whether ``workdir`` holds a complete checkpoint to resume from: a finished step
  (``checkpoints/steps/<int>/``) or the warm-up's result (``checkpoints/warmup/0/``); a save
  that was interrupted does not count (``finished_steps``)."""
  root = storage.path(workdir) / CHECKPOINT_DIRNAME
  return bool(finished_steps(root / 'steps')) or 0 in finished_steps(root / 'warmup')


def truncate_rows(path: str | os.PathLike, last_step: int) -> int:
  """Rewrites the JSON-lines file ``path`` keeping rows whose ``step`` is at most
  ``last_step`` (and rows without a step), dropping a torn last line; atomic. Returns how many
  rows were dropped (0 when the file is absent)."""
  try:
    rows, torn = _json_lines(storage.read_bytes(path))
  except FileNotFoundError:
    return 0
  kept = [line for line, row in rows if row is not None and not (
      isinstance(row, dict) and isinstance(row.get('step'), int) and row['step'] > last_step)]
  dropped = len(rows) - len(kept) + bool(torn)
  if dropped:
    storage.write_text_atomic(path, b''.join(kept).decode('utf-8'))
  return dropped
