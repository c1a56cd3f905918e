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
  ``console_keys`` present, in that order, with 4 significant digits. Given ``total_steps``
  the line reads ``step 12/200 (6%) | ... | ETA 41s`` (the rate of the steps this process
  has written); on a terminal it rewrites itself in place (``\r``), elsewhere (a log file,
  a notebook, CI) it is one plain line per printed step.

``ledger(step, row)`` appends to ``workdir/ledger.jsonl`` (per step: the prompt ids consumed
and the policy versions trained, so anyone can check nothing was skipped or repeated).
Only JAX process 0 writes (``enabled=None`` decides so); the others' writers do nothing.
Keys ``hist/NAME`` are vector metrics of bin fractions over ``HISTOGRAM_BIN_EDGES[key]``
(the trainer's ``hist/log_ratio``, per-token log pi_theta - log pi_behaviour): TensorBoard
histogram ``NAME``; they are not written to ``metrics.jsonl`` or the console.
``write_rollouts`` adds what scalars cannot show, to TensorBoard: histograms of the
rewards, the advantages and the per-token staleness of a step's rollouts, and every
``text_every`` steps a markdown table of sampled prompts and completions (tag ``samples``).
``write_summary`` writes ``workdir/summary.json`` (the final figures of a run) and prints a
summary table (first, last, min and max of the key metrics over the run, then the summary's
own figures); ``read_metrics`` reads a ``metrics.jsonl`` back. ``MetricsWriter.from_config``
builds a writer from the run config's ``log`` group.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorboardX

from rlax_llm import workdir as workdir_lib
from rlax_llm.losses.diagnostics import LOG_RATIO_BIN_EDGES

METRICS_FILENAME = 'metrics.jsonl'
SUMMARY_FILENAME = 'summary.json'
DEFAULT_CONSOLE_KEYS = ('reward/mean', 'loss', 'eval/accuracy', 'time/step_s')
# Rows of the final summary table (when the run wrote them), in this order.
SUMMARY_TABLE_KEYS = ('reward/mean', 'loss', 'entropy', 'grad_norm', 'staleness/mean',
                      'eval/accuracy', 'time/step_s', 'time/rollout_tokens_per_s')
# Vector metrics: key -> bin edges. ``write`` draws each as a TensorBoard histogram (tag: the
# key without 'hist/'), from bin fractions computed where the data lives (the trainer's step).
HISTOGRAM_BIN_EDGES = {'hist/log_ratio': LOG_RATIO_BIN_EDGES}
TEXT_SAMPLES = 4  # prompts shown per ``samples`` text entry (the first row of each group)

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


def _format_duration(seconds: float) -> str:
  """``41s``, ``3m05s``, ``2h07m``."""
  seconds = max(0, int(round(seconds)))
  if seconds < 60:
    return f'{seconds}s'
  if seconds < 3600:
    return f'{seconds // 60}m{seconds % 60:02d}s'
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'


def _markdown_cell(text: str) -> str:
  return str(text).replace('|', '\\|').replace('\n', '<br>')


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
    total_steps: int | None = None,
    text_every: int = 0,
    tty: bool | None = None,
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
        total_steps: the run's last step; adds progress and an ETA to the console line.
        text_every: ``write_rollouts`` writes sampled completions as text at steps that are
            multiples of this (0: never).
        tty: whether stdout is a terminal (progress rewritten in place); None: ask stdout.
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
    for name, value in (('total_steps', total_steps), ('text_every', text_every)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 0):
        raise ValueError(f'{name} must be an int >= 0, got {value!r}.')
    self._total_steps = total_steps
    self._text_every = text_every
    self._tty = sys.stdout.isatty() if tty is None else tty
    self._progress_start: tuple[int, float] | None = None  # (first step, its time)
    self._line_open = False  # a progress line without its newline is on the terminal
    self._seen: dict[str, list[Scalar]] = {}  # key -> [first, last, min, max]
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

  @classmethod
  def from_config(cls, workdir: str | os.PathLike, config: Any, **kwargs: Any
                  ) -> MetricsWriter:
    """The run's writer: ``config.log`` (``tensorboard``, ``console_every``, ``text_every``)
    and ``config.total_steps`` (for the ETA); ``kwargs`` (e.g. ``resume_step``) go to the
    constructor."""
    log = config.log
    return cls(workdir, tensorboard=log.tensorboard, console_every=log.console_every,
               total_steps=config.total_steps, text_every=log.get('text_every', 0), **kwargs)

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
    binned: dict[str, np.ndarray] = {}
    for key, value in metrics.items():
      if not isinstance(key, str) or not key:
        raise ValueError(f'metric keys must be non-empty strings, got {key!r}.')
      if key == 'step':
        raise ValueError("metric key 'step' is reserved for the step argument; rename the metric.")
      if key.startswith('hist/'):
        binned[key] = self._check_bins(key, value)
      else:
        values[key] = _to_scalar(key, value)

    record = {'step': step, **{k: _json_safe(v) for k, v in values.items()}}
    self._jsonl.write(json.dumps(record, allow_nan=False) + '\n')
    self._jsonl.flush()
    if self._tb is not None:
      for key, value in values.items():
        self._tb.add_scalar(key, value, step)
      for key, fractions in binned.items():
        self._write_binned(step, key, fractions)
    for key, value in values.items():
      if isinstance(value, float) and not math.isfinite(value):
        continue
      seen = self._seen.setdefault(key, [value, value, value, value])
      seen[1], seen[2], seen[3] = value, min(seen[2], value), max(seen[3], value)
    now = time.perf_counter()
    if self._progress_start is None:
      self._progress_start = (step, now)
    if self._console and step % self._console_every == 0:
      self._print_progress(step, values, now)

  def _print_progress(self, step: int, values: Mapping[str, Scalar], now: float) -> None:
    head = f'step {step}'
    if self._total_steps:
      head += f'/{self._total_steps} ({100 * step // self._total_steps}%)'  # 100% only at the end
    parts = [head] + [
      f'{k} {_format_console(values[k])}' for k in self._console_keys if k in values
    ]
    if self._total_steps:
      first_step, first_time = self._progress_start
      remaining = self._total_steps - step
      if step > first_step and remaining > 0:
        eta = (now - first_time) / (step - first_step) * remaining
        parts.append(f'ETA {_format_duration(eta)}')
    line = ' | '.join(parts)
    if self._tty:
      done = self._total_steps is None or step >= self._total_steps
      print('\r\033[K' + line, end='\n' if done else '', flush=True)
      self._line_open = not done
    else:
      print(line, flush=True)

  def _end_line(self) -> None:
    if self._line_open:
      print(flush=True)
      self._line_open = False

  @staticmethod
  def _check_bins(key: str, value: Any) -> np.ndarray:
    if key not in HISTOGRAM_BIN_EDGES:
      raise ValueError(f'metric {key!r}: keys starting with hist/ are binned histograms, and '
                       f'only {sorted(HISTOGRAM_BIN_EDGES)} have bin edges; add its edges to '
                       'rlax_llm.metrics.HISTOGRAM_BIN_EDGES or rename the metric.')
    arr = np.asarray(jax.device_get(value), dtype=np.float64)
    bins = len(HISTOGRAM_BIN_EDGES[key]) - 1
    if arr.shape != (bins,):
      raise ValueError(f'metric {key!r} has shape {arr.shape}; its edges make {bins} bins, so '
                       f'it must be a vector of {bins} bin fractions.')
    return arr

  def _write_binned(self, step: int, key: str, fractions: np.ndarray) -> None:
    """A TensorBoard histogram from bin fractions (moments from the bin centres)."""
    edges = np.asarray(HISTOGRAM_BIN_EDGES[key])
    used = np.flatnonzero(fractions > 0)
    if not used.size or not np.all(np.isfinite(fractions)):
      return
    centres = (edges[:-1] + edges[1:]) / 2
    self._tb.add_histogram_raw(
        key.removeprefix('hist/'), min=float(edges[used[0]]), max=float(edges[used[-1] + 1]),
        num=float(fractions.sum()), sum=float(fractions @ centres),
        sum_squares=float(fractions @ centres**2), bucket_limits=edges[1:].tolist(),
        bucket_counts=fractions.tolist(), global_step=int(step))

  def write_histogram(self, step: int, key: str, values: Any) -> None:
    """A TensorBoard histogram of ``values`` (any shape, flattened; non-finite dropped).

    No-op without TensorBoard or when no finite value is left.
    """
    if self._tb is None:
      return
    arr = np.asarray(jax.device_get(values), dtype=np.float64).ravel()
    arr = arr[np.isfinite(arr)]
    if arr.size:
      self._tb.add_histogram(key, arr, int(step))

  def write_text(self, step: int, key: str, text: str) -> None:
    """A TensorBoard text entry (markdown). No-op without TensorBoard."""
    if self._tb is not None:
      self._tb.add_text(key, text, int(step))

  def write_rollouts(self, step: int, prompts: Sequence[Any], rollouts: Any,
                     advantages: Any = None, staleness: Any = None) -> None:
    """Histograms of one step's rollouts and, every ``text_every`` steps, samples as text.

    Args:
      step: the step (as in ``write``).
      prompts: the batch's prompts (``rlax_llm.tasks.base.Prompt``); row ``i`` of
        ``rollouts`` answers ``prompts[rollouts.group_ids[i]]``.
      rollouts: the scored ``rlax_llm.data_types.Rollouts`` (``rewards`` filled in).
      advantages: float [B'] of the rows trained on, or None (no update this step).
      staleness: int [tokens] of the trained tokens (``trainer version - sampling
        version``), or None.

    Histogram tags: ``reward``, ``advantages``, ``staleness``, ``completion/length``.
    Text tag: ``samples`` (prompt, completion, reward, sampling version of the first row of
    the first ``TEXT_SAMPLES`` groups).
    """
    if self._tb is None:
      return
    self.write_histogram(step, 'reward', rollouts.rewards)
    self.write_histogram(step, 'completion/length', np.sum(rollouts.completion_mask, 1))
    if advantages is not None:
      self.write_histogram(step, 'advantages', advantages)
    if staleness is not None:
      self.write_histogram(step, 'staleness', staleness)
    if self._text_every and step % self._text_every == 0:
      rows = ['| prompt | completion | reward | version |', '| --- | --- | --- | --- |']
      group_ids = np.asarray(rollouts.group_ids)
      for group in sorted(set(group_ids.tolist()))[:TEXT_SAMPLES]:
        i = int(np.flatnonzero(group_ids == group)[0])
        versions = np.asarray(rollouts.versions[i])
        version = int(versions.max()) if versions.size else -1
        reward = 'n/a' if rollouts.rewards is None else f'{float(rollouts.rewards[i]):.3g}'
        rows.append(f'| {_markdown_cell(prompts[group].text)} | '
                    f'{_markdown_cell(rollouts.completions[i])} | {reward} | {version} |')
      self.write_text(step, 'samples', '\n'.join(rows))

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
    if self._console:
      self._end_line()
      print(self.summary_table(content), flush=True)
    return path

  def summary_table(self, summary: Mapping[str, Any] | None = None) -> str:
    """The final table: first / last / min / max of ``SUMMARY_TABLE_KEYS`` as written by
    this writer, then the scalar figures of ``summary``."""
    lines = ['run summary']
    rows = [(k, self._seen[k]) for k in SUMMARY_TABLE_KEYS if k in self._seen]
    if rows:
      width = max(len(k) for k, _ in rows)
      lines.append(f'  {"metric".ljust(width)}  {"first":>10} {"last":>10} {"min":>10} '
                   f'{"max":>10}')
      for key, values in rows:
        lines.append(f'  {key.ljust(width)}  ' + ' '.join(
            f'{_format_console(v):>10}' for v in values))
    scalars = [(k, v) for k, v in (summary or {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if scalars:
      width = max(len(k) for k, _ in scalars)
      lines += [f'  {k.ljust(width)}  {_format_console(v):>10}' for k, v in scalars]
    return '\n'.join(lines)

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
    self._end_line()
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
