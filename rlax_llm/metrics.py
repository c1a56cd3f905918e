"""Run metrics: ``metrics.jsonl``, TensorBoard scalars and a console progress line.

``MetricsWriter.write(step, metrics)`` records one step's scalars in three places:

* ``workdir/metrics.jsonl``: one JSON object ``{"step": step, **metrics}`` per call, flushed
  after every line so a crash loses nothing already written. A resumed run passes
  ``resume_step`` (the restored checkpoint's step): rows after it are cut first (and
  TensorBoard purges them), so no step appears twice. Non-finite floats (NaN, +-inf) are written as JSON
  ``null``, because strict JSON has no literal for them; TensorBoard and the console get the
  actual value.
* TensorBoard event files in ``workdir`` (``tensorboardX``), one scalar per key, tag = key.
* stdout: ``step 12 | reward/mean 0.41 | loss -0.013 | time/step_s 0.21`` for the
  ``console_keys`` present, in that order, with 4 significant digits.

``ledger(step, row)`` appends to ``workdir/ledger.jsonl`` (per step: the prompt ids consumed
and the policy versions trained, so anyone can check nothing was skipped or repeated).
Only JAX process 0 writes (``enabled=None`` decides so); the others' writers do nothing.
``write_summary`` writes ``workdir/summary.json`` (the final figures of a run), and
``read_metrics`` reads a ``metrics.jsonl`` back.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorboardX

from rlax_llm import workdir as workdir_lib

METRICS_FILENAME = 'metrics.jsonl'
SUMMARY_FILENAME = 'summary.json'
DEFAULT_CONSOLE_KEYS = ('reward/mean', 'loss', 'eval/accuracy', 'time/step_s')

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


def _format_console(value: Scalar) -> str:
  return str(value) if isinstance(value, int) else f'{value:.4g}'


class MetricsWriter:
  """Writes per-step scalar metrics to ``metrics.jsonl``, TensorBoard and the console.

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
    resume_step: int | None = None,
    enabled: bool | None = None,
  ):
    """Opens the writers, creating ``workdir`` if it is missing.

    Args:
        workdir: run directory; holds ``metrics.jsonl``, ``summary.json`` and the
            TensorBoard event files.
        tensorboard: also write TensorBoard event files.
        console: also print a progress line to stdout.
        console_every: print the progress line for steps that are multiples of this (>= 1).
        console_keys: metric keys shown on the progress line, in this order, when present.
        resume_step: a resumed run's restored step: rows of later steps are removed from
            ``metrics.jsonl`` and ``ledger.jsonl`` and purged from TensorBoard.
        enabled: write anything at all (default: only on JAX process 0).
    """
    if isinstance(console_every, bool) or not isinstance(console_every, int) or (console_every < 1):
      raise ValueError(
        f'console_every must be an int >= 1, got {console_every!r}; use console=False '
        'to turn the progress line off.'
      )
    if isinstance(console_keys, str):
      raise ValueError(
        f'console_keys must be a sequence of keys, got the string {console_keys!r}; '
        f'write ({console_keys!r},) for a single key.'
      )
    self._workdir = pathlib.Path(workdir)
    self._enabled = jax.process_index() == 0 if enabled is None else enabled
    self._console = console
    self._console_every = console_every
    self._console_keys = tuple(console_keys)
    self._closed = not self._enabled  # a disabled writer is born closed and writes nothing
    self._jsonl = self._ledger = self._tb = None
    if not self._enabled:
      return
    self._workdir.mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
      for name in (METRICS_FILENAME, workdir_lib.LEDGER_FILENAME):
        workdir_lib.truncate_rows(self._workdir / name, resume_step)
    self._jsonl = open(self._workdir / METRICS_FILENAME, 'a', encoding='utf-8')
    self._ledger = open(self._workdir / workdir_lib.LEDGER_FILENAME, 'a', encoding='utf-8')
    self._tb = (tensorboardX.SummaryWriter(
        logdir=str(self._workdir),
        purge_step=None if resume_step is None else resume_step + 1) if tensorboard else None)

  @property
  def workdir(self) -> pathlib.Path:
    """The run directory."""
    return self._workdir

  @property
  def metrics_path(self) -> pathlib.Path:
    """Path of ``metrics.jsonl``."""
    return self._workdir / METRICS_FILENAME

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records one step's scalars.

    Args:
        step: the step the metrics belong to (int; used as TensorBoard's global step).
        metrics: key -> scalar: Python int/float/bool, numpy scalar, or 0-d numpy/JAX
            array. Bools are stored as 0/1. Keys are TensorBoard tags (``"reward/mean"``).

    Raises:
        ValueError: ``step`` is not an int, a key is not a non-empty string or is
            ``"step"``, or a value is not a real numeric scalar. Nothing is written then.
        RuntimeError: the writer is closed.
    """
    if not self._enabled:
      return
    if self._closed:
      raise RuntimeError(
        f'MetricsWriter for {str(self._workdir)!r} is closed; create a new one to write.'
      )
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
      raise ValueError(f'step must be an int, got {step!r} of type {type(step).__name__}.')
    step = int(step)
    values: dict[str, Scalar] = {}
    for key, value in metrics.items():
      if not isinstance(key, str) or not key:
        raise ValueError(f'metric keys must be non-empty strings, got {key!r}.')
      if key == 'step':
        raise ValueError("metric key 'step' is reserved for the step argument; rename the metric.")
      values[key] = _to_scalar(key, value)

    record = {'step': step, **{k: _json_safe(v) for k, v in values.items()}}
    self._jsonl.write(json.dumps(record, allow_nan=False) + '\n')
    self._jsonl.flush()
    if self._tb is not None:
      for key, value in values.items():
        self._tb.add_scalar(key, value, step)
    if self._console and step % self._console_every == 0:
      parts = [f'step {step}'] + [
        f'{k} {_format_console(values[k])}' for k in self._console_keys if k in values
      ]
      print(' | '.join(parts), flush=True)

  def ledger(self, step: int, row: Mapping[str, Any]) -> None:
    """Appends ``{"step": step, **row}`` (JSON-safe values) to ``ledger.jsonl``, flushed."""
    if not self._enabled:
      return
    if self._closed:
      raise RuntimeError(f'MetricsWriter for {str(self._workdir)!r} is closed.')
    self._ledger.write(json.dumps({'step': int(step), **row}) + '\n')
    self._ledger.flush()

  def write_summary(self, metrics: Mapping[str, Any]) -> pathlib.Path:
    """Writes ``workdir/summary.json`` (pretty JSON), replacing any earlier summary.

    Args:
        metrics: key -> scalar, string, None, or nested mappings / sequences / arrays of
            those. Non-finite floats become ``null``. May be called after ``close``.

    Returns:
        The path of ``summary.json``.
    """
    if not isinstance(metrics, Mapping):
      raise ValueError(f'summary must be a mapping of key -> value, got {type(metrics).__name__}.')
    content = _summary_value('summary', metrics)
    path = self._workdir / SUMMARY_FILENAME
    if not self._enabled:
      return path
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(json.dumps(content, indent=2, allow_nan=False) + '\n', encoding='utf-8')
    os.replace(tmp, path)  # atomic: a reader never sees a half-written summary
    return path

  def flush(self) -> None:
    """Flushes ``metrics.jsonl`` and the TensorBoard events to disk."""
    if self._closed:
      return
    self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes every writer. Idempotent."""
    if self._closed:
      return
    self._closed = True
    self._jsonl.close()
    self._ledger.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads a ``metrics.jsonl`` back.

  Args:
      path: the ``metrics.jsonl`` file, or a workdir that contains one.

  Returns:
      One dict per line, in file order (``null`` -> ``None`` for non-finite values).

  Raises:
      FileNotFoundError: there is no such file.
      ValueError: a line is not a JSON object; the message gives the file and line number.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / METRICS_FILENAME
  if not path.is_file():
    raise FileNotFoundError(
      f'no metrics file at {str(path)!r}; pass a metrics.jsonl file or the workdir of a '
      'run that wrote one.'
    )
  records = []
  with open(path, encoding='utf-8') as f:
    for lineno, line in enumerate(f, start=1):
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
