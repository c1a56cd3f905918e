"""Benchmark: every named policy loss on the default run, held-out accuracy before/after.

Runs ``python -m rlax_llm.launch`` on ``configs/default.py`` once per loss (and per M2PO
variant), same seed, and prints one JSON object with each run's RL-start and final held-out
greedy accuracy, its mean training reward over the last 20 steps and its RL wall time. The
reference is GRPO in the same invocation: ``vs_grpo_points`` is each loss's final accuracy
minus GRPO's, in points.

    .venv/bin/python benchmarks/loss_comparison.py [--losses=grpo,m2po] [--steps=200]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlax_llm.losses import LOSSES, M2PO_VARIANTS  # noqa: E402
from rlax_llm.metrics import read_metrics  # noqa: E402


def run(name: str, overrides: list[str], workdir: pathlib.Path) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/default.py',
       f'--workdir={workdir}', *overrides], cwd=ROOT, env=env, capture_output=True, text=True)
  if result.returncode != 0:
    return {'name': name, 'error': result.stderr[-2000:]}
  summary = json.loads((workdir / 'summary.json').read_text())
  rows = read_metrics(workdir / 'metrics.jsonl')
  tail = rows[-20:]
  return {
      'name': name,
      'start_accuracy': summary['eval/start_accuracy'],
      'final_accuracy': summary['eval/final_accuracy'],
      'last20_reward_mean': sum(r['reward/mean'] for r in tail) / len(tail),
      'rl_s': summary['time/rl_s'],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--losses', default=','.join(sorted(LOSSES)))
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  names = args.losses.split(',')
  if 'grpo' not in names:
    names.insert(0, 'grpo')
  jobs = []
  for name in names:
    if name == 'm2po':
      jobs += [(f'm2po/{v}', ['--config.rl.loss=m2po', f'--config.rl.m2po_variant={v}'])
               for v in M2PO_VARIANTS]
    else:
      jobs.append((name, [f'--config.rl.loss={name}']))
  common = [f'--config.total_steps={args.steps}', f'--config.seed={args.seed}']
  with tempfile.TemporaryDirectory() as tmp:
    results = [run(name, overrides + common, pathlib.Path(tmp) / name.replace('/', '_'))
               for name, overrides in jobs]
  grpo = next(r for r in results if r['name'] == 'grpo')
  for r in results:
    if 'final_accuracy' in r and 'final_accuracy' in grpo:
      r['vs_grpo_points'] = 100 * (r['final_accuracy'] - grpo['final_accuracy'])
  print(json.dumps({'benchmark': 'loss_comparison', 'steps': args.steps, 'seed': args.seed,
                    'runs': results}, indent=2))


if __name__ == '__main__':
  main()
