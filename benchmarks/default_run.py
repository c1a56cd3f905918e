"""Benchmark: the embedded default run, before/after held-out greedy accuracy.

Runs ``python -m rlax_llm.launch`` on ``configs/default.py`` (optionally for several seeds)
and prints one JSON object: per seed the RL starting point's and the final policy's held-out
greedy accuracy (same seed, same eval set: the reference is measured in the same run), the
improvement in points, and wall times. Exit status 1 if any seed improves by fewer than
``--min_points`` or takes longer than ``--max_wall_s``.

    .venv/bin/python benchmarks/default_run.py --seeds=0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_seed(seed: int, workdir: pathlib.Path, extra: list[str]) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  start = time.perf_counter()
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/default.py',
       f'--config.seed={seed}', f'--workdir={workdir}', *extra],
      cwd=ROOT, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if result.returncode != 0:
    raise SystemExit(f'seed {seed} failed:\n{result.stderr[-3000:]}')
  summary = json.loads((workdir / 'summary.json').read_text())
  return {
      'seed': seed,
      'start_accuracy': summary['eval/start_accuracy'],
      'final_accuracy': summary['eval/final_accuracy'],
      'improvement_points': 100 * summary['eval/improvement'],
      'warmup_s': summary.get('warmup/time_s'),
      'rl_s': summary['time/rl_s'],
      'wall_s': wall,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--min_points', type=float, default=30.0)
  parser.add_argument('--max_wall_s', type=float, default=600.0)
  parser.add_argument('extra', nargs='*', help='extra --config.* overrides')
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(',')]
  with tempfile.TemporaryDirectory() as tmp:
    runs = [run_seed(s, pathlib.Path(tmp) / f'seed{s}', args.extra) for s in seeds]
  ok = all(r['improvement_points'] >= args.min_points and r['wall_s'] <= args.max_wall_s
           for r in runs)
  print(json.dumps({
      'benchmark': 'default_run',
      'runs': runs,
      'min_improvement_points': min(r['improvement_points'] for r in runs),
      'max_wall_s': max(r['wall_s'] for r in runs),
      'criteria': {'min_points': args.min_points, 'max_wall_s': args.max_wall_s},
      'ok': ok,
  }, indent=2))
  sys.exit(0 if ok else 1)


if __name__ == '__main__':
  main()
