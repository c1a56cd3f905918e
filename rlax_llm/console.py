"""The terminal: what a user sees while a run or an evaluation works, and nothing else.

* ``setup_logging()``, called once by each entry point (``python -m rlax_llm.launch``,
  ``python -m rlax_llm.evaluate``) before any JAX work: phase lines on stderr, INFO records
  without absl's ``I1204 21:30:48.348357 1400... file.py:12]`` prefix (warnings keep it),
  and these records dropped, each matched exactly because none is for a user:

  - jax's ``Unable to initialize backend 'tpu': ... Failed to open libtpu.so`` (logger
    ``jax._src.xla_bridge``) on a machine without TPU devices (no ``/dev/accel*`` or
    ``/dev/vfio/<n>``); on a TPU host it stays, since there it explains a CPU fallback;
  - the supervised warm-up's progress every 50 steps (40 lines in the default run); its
    phase line and its last line (``warmup step N/N``, the warm-up's result) stay;
  - Orbax's INFO and DEBUG records (dozens per checkpoint save; its warnings stay);
  - libtpu's start-up errors (``could not determine TPU worker hostnames``, printed by the
    library itself, not a logger) where libtpu is installed (the ``tpu`` and ``test`` extras)
    but the machine has no TPU chips: there, with ``JAX_PLATFORMS`` unset and no GPU plugin
    installed, ``JAX_PLATFORMS`` is set to ``cpu`` (no TPU backend can come up without chips;
    jax would load libtpu, let it print, then fall back to the CPU anyway). Set
    ``JAX_PLATFORMS`` yourself to choose otherwise.

* ``phase(text)``: one line on stderr when a phase that takes noticeable time starts
  (loading the model, the warm-up, an evaluation, compiling the first RL step), logged at
  INFO to the ``rlax_llm.phase`` logger, so a library user's logging configuration decides
  whether it shows; ``setup_logging`` shows it as ``rlax_llm: <text>``.
* ``ConsoleProgress``: one of ``rlax_llm.metrics.MetricsWriter``'s outputs, the per-step
  progress line on stdout and the run's summary table.

Imports no JAX: the entry points set the console up before the heavy imports.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import absl.logging  # noqa: F401  (defines the showprefixforinfo flag set below)
from absl import flags

DEFAULT_CONSOLE_KEYS = ('reward/mean', 'loss', 'eval/accuracy', 'time/step_s')
# Rows of the final summary table (when the run wrote them), in this order.
SUMMARY_TABLE_KEYS = ('reward/mean', 'loss', 'entropy', 'grad_norm', 'staleness/mean',
                      'eval/accuracy', 'time/step_s', 'time/rollout_tokens_per_s')
PHASE_LOGGER = 'rlax_llm.phase'
_PHASE_PREFIX = 'rlax_llm: '

Scalar = int | float


# ------------------------------------------------------------------------------ log records


def phase(text: str) -> None:
  """Announces a phase that takes noticeable time (one line; see the module docstring)."""
  logging.getLogger(PHASE_LOGGER).info(text)


def _has_tpu_devices() -> bool:
  """Whether this machine has TPU chips (device files of the TPU driver, v2-v6)."""
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def _cpu_where_no_accelerator() -> None:
  """``JAX_PLATFORMS=cpu`` where libtpu is installed but no TPU chip or GPU plugin is present
  and the user chose nothing (module docstring)."""
  if ('JAX_PLATFORMS' in os.environ or 'JAX_FORCE_TPU_INIT' in os.environ
      or _has_tpu_devices() or importlib.util.find_spec('libtpu') is None):
    return
  if (importlib.util.find_spec('jax_plugins') is not None  # jax[cuda], jax[rocm]
      or importlib.metadata.entry_points(group='jax_plugins')):
    return
  os.environ['JAX_PLATFORMS'] = 'cpu'
  if 'jax' in sys.modules:  # imported already: its config read the variable at import
    sys.modules['jax'].config.update('jax_platforms', 'cpu')


def _tpu_backend_missing(record: logging.LogRecord) -> bool:
  return (record.getMessage().startswith("Unable to initialize backend 'tpu'")
          and not _has_tpu_devices())


def _warmup_progress(record: logging.LogRecord) -> bool:
  """``warmup step 50/2000 | ...`` (``rlax_llm.trainer.warmup``), but not the last one."""
  return (record.levelno == logging.INFO and isinstance(record.msg, str)
          and record.msg.startswith('warmup step ') and len(record.args or ()) >= 2
          and record.args[0] != record.args[1])


def _orbax_chatter(record: logging.LogRecord) -> bool:
  return record.levelno < logging.WARNING and '/orbax/' in record.pathname


class _Drop(logging.Filter):
  """Drops the records ``drop`` picks; passes the rest."""

  def __init__(self, drop: Callable[[logging.LogRecord], bool]):
    super().__init__()
    self.drop = drop

  def filter(self, record: logging.LogRecord) -> bool:
    return not self.drop(record)


# Logger -> what is dropped from it (a filter acts on the records its logger creates).
_DROPPED = {
    'jax._src.xla_bridge': _tpu_backend_missing,
    '': _warmup_progress,  # rlax_llm logs through the root logger (logging.info)
    'absl': _orbax_chatter,  # Orbax logs through absl's logger
}


class _PhaseHandler(logging.StreamHandler):
  """Phase lines on stderr; on a terminal each first clears the line it lands on (a
  progress line rewritten in place may be open there)."""

  def format(self, record: logging.LogRecord) -> str:
    clear = '\r\033[K' if getattr(self.stream, 'isatty', lambda: False)() else ''
    return f'{clear}{_PHASE_PREFIX}{record.getMessage()}'


def setup_logging() -> None:
  """Sets up the console of a command-line run (module docstring). Idempotent."""
  _cpu_where_no_accelerator()
  for name, drop in _DROPPED.items():
    logger = logging.getLogger(name)
    if not any(isinstance(f, _Drop) and f.drop is drop for f in logger.filters):
      logger.addFilter(_Drop(drop))
  phases = logging.getLogger(PHASE_LOGGER)
  if not any(isinstance(h, _PhaseHandler) for h in phases.handlers):
    phases.addHandler(_PhaseHandler(sys.stderr))
  phases.setLevel(logging.INFO)
  phases.propagate = False  # shown once, by its own handler
  logging.getLogger('absl').setLevel(logging.INFO)
  # absl's handler (app.run installs it) prints INFO records without the prefix.
  flags.FLAGS.set_default('showprefixforinfo', False)


# ------------------------------------------------------------------------- progress line


def _format_value(value: Scalar) -> str:
  """A metric as the console shows it: ints as they are, floats to 4 significant digits."""
  return str(value) if isinstance(value, int) else f'{value:.4g}'


def format_metrics(values: Mapping[str, Any]) -> str:
  """Metrics as one console line: ``eval/accuracy 0.25, eval/pass@k 0.5`` (numbers as the
  progress line shows them, anything else as it prints)."""
  return ', '.join(f'{k} {_format_value(v) if isinstance(v, (int, float)) else v}'
                   for k, v in values.items())


def _format_duration(seconds: float) -> str:
  """``41s``, ``3m05s``, ``2h07m``."""
  seconds = max(0, int(round(seconds)))
  if seconds < 60:
    return f'{seconds}s'
  if seconds < 3600:
    return f'{seconds // 60}m{seconds % 60:02d}s'
  return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'


class ConsoleProgress:
  """The progress line on stdout and the run's summary table.

  ``step 12 | reward/mean 0.41 | loss -0.013 | time/step_s 0.21`` for the ``keys`` present,
  in that order, with 4 significant digits, for steps that are multiples of ``every``. Given
  ``total_steps`` the line reads ``step 12/200 (6%) | ... | ETA 41s`` (the rate of the steps
  this process has written); on a terminal (``tty``) it rewrites itself in place (``\\r``),
  elsewhere (a log file, a notebook, CI) it is one plain line per printed step. Every
  written value counts toward the summary table (first, last, min and max).

  Args:
    every: print the line for steps that are multiples of this (an int >= 1).
    keys: metric keys shown, in this order, when present.
    total_steps: the run's last step (adds progress and an ETA), or None.
    tty: whether stdout is a terminal; None: ask stdout.
  """

  def __init__(self, *, every: int = 1, keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
               total_steps: int | None = None, tty: bool | None = None):
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
      raise ValueError(f'console_every must be an int >= 1, got {every!r}; use console=False '
                       'to turn the progress line off.')
    if isinstance(keys, str):
      raise ValueError(f'console_keys must be a sequence of keys, got the string {keys!r}; '
                       f'write ({keys!r},) for a single key.')
    self._every = every
    self._keys = tuple(keys)
    self._total_steps = total_steps
    self._tty = sys.stdout.isatty() if tty is None else tty
    self._start: tuple[int, float] | None = None  # (first step, its time)
    self._line_open = False  # a progress line without its newline is on the terminal
    self._seen: dict[str, list[Scalar]] = {}  # key -> [first, last, min, max]

  def write(self, step: int, values: Mapping[str, Scalar]) -> None:
    """Counts one step's checked scalars and prints the line when ``step`` is due."""
    for key, value in values.items():
      if isinstance(value, float) and not math.isfinite(value):
        continue
      seen = self._seen.setdefault(key, [value, value, value, value])
      seen[1], seen[2], seen[3] = value, min(seen[2], value), max(seen[3], value)
    now = time.perf_counter()
    if self._start is None:
      self._start = (step, now)
    if step % self._every == 0:
      self._print(step, values, now)

  def _print(self, step: int, values: Mapping[str, Scalar], now: float) -> None:
    head = f'step {step}'
    if self._total_steps:
      head += f'/{self._total_steps} ({100 * step // self._total_steps}%)'  # 100% only at the end
    parts = [head] + [f'{k} {_format_value(values[k])}' for k in self._keys if k in values]
    if self._total_steps:
      first_step, first_time = self._start
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

  def end_line(self) -> None:
    """Ends a progress line left open on a terminal."""
    if self._line_open:
      print(flush=True)
      self._line_open = False

  def print_summary(self, summary: Mapping[str, Any]) -> None:
    """Ends any open line and prints ``summary_table(summary)``."""
    self.end_line()
    print(self.summary_table(summary), flush=True)

  def summary_table(self, summary: Mapping[str, Any] | None = None) -> str:
    """The final table: first / last / min / max of ``SUMMARY_TABLE_KEYS`` as written, then
    the scalar figures of ``summary``."""
    lines = ['run summary']
    rows = [(k, self._seen[k]) for k in SUMMARY_TABLE_KEYS if k in self._seen]
    if rows:
      width = max(len(k) for k, _ in rows)
      lines.append(f'  {"metric".ljust(width)}  {"first":>10} {"last":>10} {"min":>10} '
                   f'{"max":>10}')
      for key, values in rows:
        lines.append(f'  {key.ljust(width)}  ' + ' '.join(f'{_format_value(v):>10}'
                                                          for v in values))
    scalars = [(k, v) for k, v in (summary or {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if scalars:
      width = max(len(k) for k, _ in scalars)
      lines += [f'  {k.ljust(width)}  {_format_value(v):>10}' for k, v in scalars]
    return '\n'.join(lines)
