"""What every side's script of the head-to-head shares: the job, its rows, the run log.

Plain Python (no rlax_llm, JAX or torch), imported by ``run_rlax.py`` (rlax_llm's venv),
``run_trl.py`` (.venv-trl) and ``run_tunix.py`` (.venv-tunix) alike, so that every side logs
the same records the same way:

* ``<run_dir>/log.jsonl``, one line per training step: ``step``, ``wall_s`` (seconds since the
  side's process started: imports, model load and compilation included, as a user waits for
  them), ``rollout_s`` and ``train_s`` (the step's sampling and update), ``rollout_tokens``
  (completion tokens sampled) and ``train_tokens`` (prompt + completion tokens the update
  ran on, padding excluded), ``reward_mean``, ``peak_rss_mb`` (the process's and its
  children's peak resident memory so far).
* ``<run_dir>/checkpoints.jsonl``, one line per saved Hugging Face checkpoint: ``step``,
  ``wall_s`` and its ``path`` (a directory rlax_llm's loader reads).
* ``<run_dir>/side.json``: the side's name, library versions and settings.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent


def process_started() -> float:
  """The ``time.time()`` at which this process started (from /proc; now where that is
  unavailable), so ``wall_s`` counts the imports too."""
  try:
    ticks = int(pathlib.Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()[19])
    uptime = float(pathlib.Path('/proc/uptime').read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError):
    return time.time()


STARTED = process_started()


def wall_s() -> float:
  """Seconds since this process started."""
  return time.time() - STARTED


def peak_rss() -> float:
  """Peak resident memory of this process plus that of its waited-for children, in MB."""
  own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  return (own + children) / 1024.0  # ru_maxrss is in KiB on Linux


def read_job(path: str | os.PathLike) -> dict[str, Any]:
  """``job.json`` (benchmarks/peers/job.py) with its ``train`` and ``eval`` rows loaded."""
  job = json.loads(pathlib.Path(path).read_text())
  for split in ('train', 'eval'):
    with open(job[split], encoding='utf-8') as handle:
      job[f'{split}_rows'] = [json.loads(line) for line in handle if line.strip()]
  return job


def machine() -> dict[str, Any]:
  """The machine a run ran on: CPU cores, RAM, platform, Python."""
  try:
    mem_kb = int(next(line.split()[1] for line in open('/proc/meminfo', encoding='utf-8')
                      if line.startswith('MemTotal:')))
  except (OSError, StopIteration, ValueError):
    mem_kb = 0
  return {'cpu_cores': os.cpu_count(), 'ram_gb': round(mem_kb / 2**20, 1),
          'platform': platform.platform(), 'python': sys.version.split()[0]}


class RunLog:
  """Appends a side's ``log.jsonl`` and ``checkpoints.jsonl`` in ``run_dir`` (see the module
  docstring) and writes its ``side.json``."""

  def __init__(self, run_dir: str | os.PathLike, side: str, versions: dict[str, str],
               settings: dict[str, Any]):
    self.dir = pathlib.Path(run_dir)
    self.dir.mkdir(parents=True, exist_ok=True)
    for name in ('log.jsonl', 'checkpoints.jsonl'):
      (self.dir / name).write_text('')
    (self.dir / 'side.json').write_text(json.dumps(
        {'side': side, 'versions': versions, 'settings': settings, 'machine': machine(),
         'date': time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, indent=2))

  def _append(self, name: str, row: dict[str, Any]) -> None:
    with open(self.dir / name, 'a', encoding='utf-8') as handle:
      handle.write(json.dumps(row) + '\n')

  def step(self, step: int, *, rollout_s: float, train_s: float, rollout_tokens: int,
           train_tokens: int, reward_mean: float, wall: float | None = None,
           peak_rss_mb: float | None = None, **extra: Any) -> None:
    """One training step's record (``wall``: its end in ``wall_s`` seconds, default now;
    ``peak_rss_mb``: default this process's and its children's; ``extra``: more fields)."""
    self._append('log.jsonl', {
        'step': int(step), 'wall_s': wall_s() if wall is None else wall,
        'rollout_s': float(rollout_s), 'train_s': float(train_s),
        'rollout_tokens': int(rollout_tokens), 'train_tokens': int(train_tokens),
        'reward_mean': float(reward_mean),
        'peak_rss_mb': peak_rss() if peak_rss_mb is None else peak_rss_mb, **extra})

  def checkpoint(self, step: int, path: str | os.PathLike, wall: float | None = None) -> None:
    """A saved Hugging Face checkpoint of ``step`` at ``path``, reached at ``wall``."""
    self._append('checkpoints.jsonl', {'step': int(step),
                                       'wall_s': wall_s() if wall is None else wall,
                                       'path': str(path)})


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  """A JSON-lines file's rows ([] when it does not exist)."""
  path = pathlib.Path(path)
  if not path.is_file():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def save_steps(steps: int, every: int) -> list[int]:
  """The steps after which a side saves a checkpoint: every ``every`` steps and the last."""
  if every <= 0:
    return [steps]
  return sorted({*range(every, steps + 1, every), steps})


def side_run(side: str, description: str
             ) -> tuple[argparse.Namespace, dict[str, Any], dict[str, Any], int, list]:
  """A side script's command line read (``--job``, ``--run_dir``, ``--steps``: default the
  job's, ``--save_every``): ``(args, job, settings, steps, rows)``, ``settings`` the side's
  (``job['sides'][side]``) and ``rows`` the train rows the steps take, in order."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--job', required=True, help='job.json (benchmarks/peers/job.py)')
  parser.add_argument('--run_dir', required=True)
  parser.add_argument('--steps', type=int, default=None, help="default: the job's steps")
  parser.add_argument('--save_every', type=int, default=20, help='checkpoint every N steps')
  args = parser.parse_args()
  job = read_job(args.job)
  settings = job['sides'][side]
  steps = args.steps or settings['steps']
  need = steps * settings['prompts_per_step']
  rows = job['train_rows'][:need]
  if len(rows) < need:
    raise SystemExit(f'the job holds {len(rows)} train prompts, {steps} steps need {need}; '
                     f'write it with job.py --num_train={need}.')
  return args, job, settings, steps, rows
