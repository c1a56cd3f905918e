#!/usr/bin/env python3
"""Plots a run from its workdir's metrics.jsonl: the README's results figure.

    python scripts/plot_run.py runs/default-... --output docs/results_default.png

Three panels against the RL step: the mean reward of the training samples; the held-out
greedy accuracy at each evaluation (step 0 and a dashed line: the RL starting point); the mean
staleness of the trained tokens. The title names the config (``config.json``) and the
before -> after accuracy (``summary.json``) when the workdir has them. Rows of a step that
appears twice (a resumed run) count once: the last one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import matplotlib  # pylint: disable=wrong-import-position

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

from rlax_llm.metrics import read_metrics  # pylint: disable=wrong-import-position

REQUIRED = ('reward/mean', 'staleness/mean')


def load(workdir: pathlib.Path) -> tuple[list[dict], dict, dict]:
  """(rows, one per step in step order; config; summary) of ``workdir``."""
  rows = {r['step']: r for r in read_metrics(workdir)}
  if not rows:
    raise ValueError(f'{workdir / "metrics.jsonl"} has no rows; the run wrote no step yet.')
  rows = [rows[s] for s in sorted(rows)]
  missing = [k for k in REQUIRED if not any(r.get(k) is not None for r in rows)]
  if missing:
    raise ValueError(f'{workdir / "metrics.jsonl"} has no {missing}; is it the metrics.jsonl of '
                     'an rlax_llm run?')
  read = lambda name: (json.loads((workdir / name).read_text())  # noqa: E731
                       if (workdir / name).is_file() else {})
  return rows, read('config.json'), read('summary.json')


def plot(workdir: pathlib.Path, output: pathlib.Path) -> None:
  rows, config, summary = load(workdir)
  steps = [r['step'] for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  axes[0].plot(steps, [r.get('reward/mean') for r in rows])
  axes[0].set(xlabel='RL step', ylabel='mean reward (training samples)', ylim=(-0.02, 1.02))
  evals = [(r['step'], r['eval/accuracy']) for r in rows if r.get('eval/accuracy') is not None]
  start = summary.get('eval/start_accuracy')
  if start is not None:
    evals.insert(0, (0, start))  # the RL starting point, before the first update
  if evals:
    axes[1].plot(*zip(*evals), marker='o', label='held-out greedy accuracy')
  if start is not None:
    axes[1].axhline(start, color='gray', ls='--', label='RL starting point')
  axes[1].set(xlabel='RL step', ylabel='accuracy', ylim=(-0.02, 1.02))
  axes[1].legend(loc='lower right')
  axes[2].plot(steps, [r.get('staleness/mean') for r in rows])
  axes[2].set(xlabel='RL step', ylabel='mean staleness (versions)')
  title = config.get('name', workdir.name)
  if config:
    title += (f": {config['rl']['loss']}, (j, k) = ({config['staleness']['j']}, "
              f"{config['staleness']['k']}), seed {config['seed']}")
  if start is not None and summary.get('eval/final_accuracy') is not None:
    title += f"; accuracy {start:.3f} -> {summary['eval/final_accuracy']:.3f}"
  fig.suptitle(title)
  fig.tight_layout()
  output.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(output, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('workdir', type=pathlib.Path, help='a run directory (has metrics.jsonl)')
  parser.add_argument('--output', type=pathlib.Path, default=None,
                      help='PNG to write (default: WORKDIR/results.png)')
  args = parser.parse_args(argv)
  output = args.output or args.workdir / 'results.png'
  try:
    plot(args.workdir, output)
  except (FileNotFoundError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(output)
  return 0


if __name__ == '__main__':
  sys.exit(main())
