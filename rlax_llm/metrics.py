"""A run's metrics, written to every output by one ``MetricsWriter``.

``MetricsWriter.write(step, metrics)`` checks one step's scalars once and hands them to one
small writer per output:

* ``MetricsFile``: ``workdir/metrics.jsonl``, one JSON object ``{"step": step, **metrics}``
  per call, flushed after every line so a crash loses nothing already written (on ``gs://``
  each line is composed into the object: ``rlax_llm.storage.AppendLog``). Non-finite
  floats (NaN, +-inf) are written as JSON ``null``, because strict JSON has no literal for
  them; TensorBoard and the console get the actual value.
* ``rlax_llm.tensorboard_writer.TensorBoardWriter``: TensorBoard event files in ``workdir``,
  one scalar per key (tag = key); keys ``hist/NAME`` are vector metrics of bin fractions,
  drawn as histograms and not written to ``metrics.jsonl`` or the console;
  ``MetricsWriter.write_rollouts`` adds histograms and sampled completions of a step's
  rollouts.
* ``rlax_llm.console.ConsoleProgress``: the progress line on stdout
  (``step 12/200 (6%) | reward/mean 0.41 | ... | ETA 41s``) and the summary table.
* ``LedgerFile``: ``MetricsWriter.ledger(step, row)`` appends to ``workdir/ledger.jsonl``
  (per step: the prompt ids consumed and the policy versions trained, so anyone can check
  nothing was skipped or repeated).
* ``SummaryFile``: ``MetricsWriter.write_summary`` writes ``workdir/summary.json`` (the
  final figures of a run) and the console prints the summary table.

A resumed run passes ``resume_step`` (the restored checkpoint's step): rows after it are cut
from ``metrics.jsonl`` and ``ledger.jsonl`` first (and TensorBoard purges them), so no step
appears twice. Only JAX process 0 writes (``enabled=None`` decides so); the others' writers do
nothing. ``MetricsWriter.from_config`` builds a writer from the run config's ``log`` group;
``read_metrics`` reads a ``metrics.jsonl`` back. The workdir may be a local path or a
``gs://`` URL: every file goes through ``rlax_llm.storage``.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm import storage
from rlax_llm import workdir as workdir_lib
from rlax_llm.console import DEFAULT_CONSOLE_KEYS, ConsoleProgress
from rlax_llm.tensorboard_writer import TensorBoardWriter, check_bins

METRICS_FILENAME = 'metrics.jsonl'
SUMMARY_FILENAME = 'summary.json'

Scalar = int | float


def _to_scalar(key: str, value: Any) -> Scalar:
  """Python int (ints and bools) or float (floating types) from a 0-d numeric value."""
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, int):
    return value
  if isinstance(value, float):
    return value
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    arr = np.asarray(jax.device_get(value))
    if arr.ndim != 0:
      raise ValueError(
        f'metric {key!r} has shape {arr.shape}, but metrics must be scalars (0-d); '
        'reduce it first, e.g. with .mean(), or log each element under its own key.'
      )
    if arr.dtype == np.bool_ or jnp.issubdtype(arr.dtype, jnp.integer):
      return int(arr)
    if jnp.issubdtype(arr.dtype, jnp.floating):
      return float(arr)
    raise ValueError(
      f'metric {key!r} has dtype {arr.dtype}; metrics must be real numbers (bool, int '
      'or float). Log the real and imaginary parts under separate keys.'
    )
  raise ValueError(
    f'metric {key!r} has value {value!r} of type {type(value).__name__}; metrics must be '
    'numbers (int, float, numpy scalar or 0-d numpy/JAX array).'
  )


def _json_safe(value: Scalar) -> Scalar | None:
  """``value``, or ``None`` for non-finite floats (strict JSON has no NaN/inf)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _summary_value(key: str, value: Any) -> Any:
  """Recursively converts a summary value to JSON-safe Python (non-finite floats -> None)."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, Mapping):
    return {str(k): _summary_value(f'{key}/{k}', v) for k, v in value.items()}
  if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) > 0:
    return [_summary_value(key, v) for v in np.asarray(jax.device_get(value))]
  if isinstance(value, (list, tuple)):
    return [_summary_value(key, v) for v in value]
  return _json_safe(_to_scalar(key, value))


class JsonlFile:
  """An append-only JSON-lines file, each line durable as it is written
  (``rlax_llm.storage.AppendLog``: flushed locally, composed into the object on ``gs://``).

  ``resume_step``: a resumed run's restored step; rows of later steps are cut first.
  """

  def __init__(self, path: storage.Path, resume_step: int | None = None):
    if resume_step is not None:
      workdir_lib.truncate_rows(path, resume_step)
    self._log = storage.AppendLog(path)

  def append(self, row: Mapping[str, Any], *, allow_nan: bool = True) -> None:
    """One line, ``row`` as JSON (``allow_nan=False``: NaN or inf raises ValueError)."""
    self._log.append(json.dumps(row, allow_nan=allow_nan) + '\n')

  def flush(self) -> None:
    """Nothing to do: each line is written through as it is appended."""

  def close(self) -> None:
    """Closes the file."""
    self._log.close()


class MetricsFile(JsonlFile):
  """``metrics.jsonl``: ``{"step": step, **values}`` per step, non-finite floats as null."""

  def write(self, step: int, values: Mapping[str, Scalar]) -> None:
    """One step's checked scalars."""
    self.append({'step': step, **{k: _json_safe(v) for k, v in values.items()}},
                allow_nan=False)


class LedgerFile(JsonlFile):
  """``ledger.jsonl``: ``{"step": step, **row}`` per step (JSON-safe values)."""

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    """One step's row."""
    self.append({'step': int(step), **row})


class SummaryFile:
  """``summary.json``: the final figures of a run, pretty JSON, replaced atomically."""

  def __init__(self, path: storage.Path):
    self.path = path

  def write(self, content: Mapping[str, Any]) -> None:
    """Writes ``content`` (JSON-safe: ``_summary_value``'s output); atomic, so a reader never
    sees a half-written summary."""
    storage.write_text_atomic(self.path, json.dumps(content, indent=2, allow_nan=False) + '\n')


class MetricsWriter:
  """Writes per-step metrics to every output of a run (module docstring).

  Example::

      with MetricsWriter(workdir) as writer:
          writer.write(step, {"reward/mean": 0.41, "loss": loss})
          writer.write_summary({"final/accuracy": 0.83})
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    tensorboard: bool = True,
    console: bool = True,
    console_every: int = 1,
    console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
    total_steps: int | None = None,
    text_every: int = 0,
    tty: bool | None = None,
    resume_step: int | None = None,
    enabled: bool | None = None,
  ):
    """Opens the outputs, creating ``workdir`` if it is missing.

    Args:
        workdir: run directory (a local path or a ``gs://`` URL); holds ``metrics.jsonl``, ``ledger.jsonl``, ``summary.json``
            and the TensorBoard event files.
        tensorboard: also write TensorBoard event files.
        console: also print a progress line to stdout.
        console_every: print the progress line for steps that are multiples of this (>= 1).
        console_keys: metric keys shown on the progress line, in this order, when present.
        total_steps: the run's last step; adds progress and an ETA to the console line.
        text_every: ``write_rollouts`` writes sampled completions as text at steps that are
            multiples of this (0: never).
        tty: whether stdout is a terminal (progress rewritten in place); None: ask stdout.
        resume_step: a resumed run's restored step: rows of later steps are removed from
            ``metrics.jsonl`` and ``ledger.jsonl`` and purged from TensorBoard.
        enabled: write anything at all (default: only on JAX process 0).
    """
    progress = ConsoleProgress(every=console_every, keys=console_keys,
                               total_steps=total_steps, tty=tty)  # checks its arguments
    for name, value in (('total_steps', total_steps), ('text_every', text_every)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 0):
        raise ValueError(f'{name} must be an int >= 0, got {value!r}.')
    self._workdir = storage.path(workdir)
    self._enabled = jax.process_index() == 0 if enabled is None else enabled
    self._console = progress if console and self._enabled else None
    self._summary = SummaryFile(self._workdir / SUMMARY_FILENAME)
    self._closed = not self._enabled  # a disabled writer is born closed and writes nothing
    self._metrics = self._ledger = self._tb = None
    if not self._enabled:
      return
    if not storage.is_gcs(self._workdir):  # an object store has no directories to make
      self._workdir.mkdir(parents=True, exist_ok=True)
    self._metrics = MetricsFile(self._workdir / METRICS_FILENAME, resume_step)
    self._ledger = LedgerFile(self._workdir / workdir_lib.LEDGER_FILENAME, resume_step)
    self._tb = (TensorBoardWriter(self._workdir, text_every=text_every, resume_step=resume_step)
                if tensorboard else None)

  @classmethod
  def from_config(cls, workdir: str | os.PathLike, config: Any, **kwargs: Any
                  ) -> MetricsWriter:
    """The run's writer: ``config.log`` (``tensorboard``, ``console_every``, ``text_every``)
    and ``config.total_steps`` (for the ETA); ``kwargs`` (e.g. ``resume_step``) go to the
    constructor."""
    log = config.log
    return cls(workdir, tensorboard=log.tensorboard, console_every=log.console_every,
               total_steps=config.total_steps, text_every=log.text_every, **kwargs)

  @property
  def workdir(self) -> storage.Path:
    """The run directory."""
    return self._workdir

  @property
  def metrics_path(self) -> storage.Path:
    """Path of ``metrics.jsonl``."""
    return self._workdir / METRICS_FILENAME

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(
        f'MetricsWriter for {str(self._workdir)!r} is closed; create a new one to write.'
      )

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records one step's scalars.

    Args:
        step: the step the metrics belong to (int; used as TensorBoard's global step).
        metrics: key -> scalar: Python int/float/bool, numpy scalar, or 0-d numpy/JAX
            array. Bools are stored as 0/1. Keys are TensorBoard tags (``"reward/mean"``).
            Keys ``hist/NAME``: bin fractions (``rlax_llm.tensorboard_writer.check_bins``).

    Raises:
        ValueError: ``step`` is not an int, a key is not a non-empty string or is
            ``"step"``, or a value is not a real numeric scalar. Nothing is written then.
        RuntimeError: the writer is closed.
    """
    if not self._enabled:
      return
    self._check_open()
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
      raise ValueError(f'step must be an int, got {step!r} of type {type(step).__name__}.')
    step = int(step)
    values: dict[str, Scalar] = {}
    binned: dict[str, np.ndarray] = {}
    for key, value in metrics.items():
      if not isinstance(key, str) or not key:
        raise ValueError(f'metric keys must be non-empty strings, got {key!r}.')
      if key == 'step':
        raise ValueError("metric key 'step' is reserved for the step argument; rename the metric.")
      if key.startswith('hist/'):
        binned[key] = check_bins(key, value)
      else:
        values[key] = _to_scalar(key, value)
    self._metrics.write(step, values)
    if self._tb is not None:
      self._tb.write(step, values, binned)
    if self._console is not None:
      self._console.write(step, values)

  def write_rollouts(self, step: int, prompts: Sequence[Any], rollouts: Any,
                     advantages: Any = None, staleness: Any = None) -> None:
    """TensorBoard histograms and samples of one step's rollouts
    (``TensorBoardWriter.write_rollouts``); nothing without TensorBoard."""
    if self._tb is not None:
      self._tb.write_rollouts(step, prompts, rollouts, advantages, staleness)

  def ledger(self, step: int, row: Mapping[str, Any]) -> None:
    """Appends ``{"step": step, **row}`` (JSON-safe values) to ``ledger.jsonl``, flushed."""
    if not self._enabled:
      return
    self._check_open()
    self._ledger.write(step, row)

  def write_summary(self, metrics: Mapping[str, Any]) -> storage.Path:
    """Writes ``workdir/summary.json`` (pretty JSON), replacing any earlier summary, and
    prints the summary table.

    Args:
        metrics: key -> scalar, string, None, or nested mappings / sequences / arrays of
            those. Non-finite floats become ``null``. May be called after ``close``.

    Returns:
        The path of ``summary.json``.
    """
    if not isinstance(metrics, Mapping):
      raise ValueError(f'summary must be a mapping of key -> value, got {type(metrics).__name__}.')
    content = _summary_value('summary', metrics)
    if self._enabled:
      self._summary.write(content)
      if self._console is not None:
        self._console.print_summary(content)
    return self._summary.path

  def flush(self) -> None:
    """Flushes ``metrics.jsonl`` and the TensorBoard events to disk."""
    if self._closed:
      return
    self._metrics.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes every output. Idempotent."""
    if self._closed:
      return
    self._closed = True
    if self._console is not None:
      self._console.end_line()
    self._metrics.close()
    self._ledger.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads a ``metrics.jsonl`` back.

  Args:
      path: the ``metrics.jsonl`` file, or a workdir that contains one (a local path or a
          ``gs://`` URL).

  Returns:
      One dict per line, in file order (``null`` -> ``None`` for non-finite values).

  Raises:
      FileNotFoundError: there is no such file.
      ValueError: a line is not a JSON object; the message gives the file and line number.
  """
  path = storage.path(path)
  if path.is_dir():
    path = path / METRICS_FILENAME
  try:
    text = storage.read_text(path)
  except (FileNotFoundError, IsADirectoryError):
    raise FileNotFoundError(
      f'no metrics file at {str(path)!r}; pass a metrics.jsonl file or the workdir of a '
      'run that wrote one.'
    ) from None
  records = []
  for lineno, line in enumerate(io.StringIO(text, newline=None), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}:{lineno} is not valid JSON ({e}): {line[:200]!r}') from e
    if not isinstance(record, dict):
      raise ValueError(f'{path}:{lineno} is not a JSON object: {line[:200]!r}')
    records.append(record)
  return records
