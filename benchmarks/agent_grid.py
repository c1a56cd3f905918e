"""Benchmark: the grid puzzle, GRPO vs GiGPO, held-out success before and after RL.

Runs ``python -m rlax_llm.launch`` on ``configs/agent.py:grid_small`` (GRPO over episode
returns) and ``configs/agent.py:grid_small_gigpo`` (GiGPO's step-level credit) for each seed,
with the same config otherwise (same steps, batch, warm-up), and prints one JSON object: per
seed and estimator the held-out greedy episode success at the RL starting point (``before``)
and at the end (``after``), the curve (``[[step, success], ...]``, step 0 the starting
point), wall times, the per-step diagnostics of the collapse investigation (``DIAGNOSTICS``:
policy entropy, clip fraction, grad norm, what the credit holds, how episodes ended), and
per estimator the means over seeds.

    .venv/bin/python benchmarks/agent_grid.py --seeds=0,1,2 --parallel=2

``--split=validation`` evaluates on the validation maps (seeds from
``envs.seeds.VALIDATION_SEED_START``, maps disjoint from the held-out ones with the recipe's
``env.split_maps``) instead of the held-out ones: hyper-parameters are picked there.

Extra ``--config.*`` overrides after ``--`` apply to every run (both estimators alike).
``--plot=PATH`` draws each run's held-out curve (one panel per estimator, one line per seed);
``--from_json=PATH`` reads the runs from a JSON this script printed instead of running them
(to draw the plot again).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rlax_llm.envs.seeds import VALIDATION_SEED_START  # noqa: E402  (the repo on the path)

# Estimator -> the configs/agent.py variant that trains with it.
VARIANTS = {'grpo': 'grid_small', 'gigpo': 'grid_small_gigpo'}
# The per-step metrics kept for each run (metrics.jsonl; the credit/* ones are
# losses.credit_metrics'): what the collapse investigation reads.
DIAGNOSTICS = ('episode/success', 'entropy', 'clip_fraction', 'grad_norm',
               'credit/zero_fraction', 'credit/flat_groups', 'credit/abs_mean',
               'credit/singleton_turns', 'credit/step_group_size', 'termination/timeout',
               'termination/context_full', 'episode/turns')
SPLITS = {'held_out': [], 'validation': [f'--config.agent.eval_seed_start={VALIDATION_SEED_START}']}


def read_run(workdir: pathlib.Path) -> dict:
  """The held-out success before / after RL and the curve of one run's workdir (its
  ``summary.json`` and ``metrics.jsonl``)."""
  summary = json.loads((workdir / 'summary.json').read_text())
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  curve = []
  for row in rows:
    if 'eval/start_success' in row:
      curve.append([0, row['eval/start_success']])
    if 'eval/success' in row:
      curve.append([row['step'], row['eval/success']])
  train = [row['episode/success'] for row in rows if 'episode/success' in row]
  steps = [row for row in rows if 'grad_norm' in row]  # the RL steps' rows
  edge = max(1, min(5, len(train) // 2))  # the first and last (up to) 5 steps
  return {
      'before': summary['eval/start_accuracy'],
      'after': summary['eval/final_accuracy'],
      'curve': curve,
      'best': max(s for _, s in curve) if curve else None,
      # The sampled (temperature 1) training episodes' success, mean of the first and of
      # the last steps: a less noisy view than one held-out eval of num_eval episodes.
      'train_success_first_last': ([statistics.fmean(train[:edge]),
                                    statistics.fmean(train[-edge:])] if train else None),
      'steps': summary['steps'],
      # Per RL step, each DIAGNOSTICS metric the run logged (None where a step lacks it),
      # and how many steps had no gradient at all (every group's returns equal).
      'diagnostics': {key: [row.get(key) for row in steps] for key in DIAGNOSTICS
                      if any(key in row for row in steps)},
      'zero_grad_steps': sum(row['grad_norm'] == 0 for row in steps),
      'warmup_s': summary.get('warmup/time_s'),
      'rl_s': summary['time/rl_s'],
  }


def run_one(estimator: str, seed: int, workdir: pathlib.Path, steps: int | None,
            extra: list[str]) -> dict:
  """One ``rlax_llm.launch`` run of ``estimator`` for ``seed``; its ``read_run`` figures."""
  command = [sys.executable, '-m', 'rlax_llm.launch',
             f'--config=configs/agent.py:{VARIANTS[estimator]}', f'--config.seed={seed}',
             f'--workdir={workdir}', *([f'--config.total_steps={steps}'] if steps else []),
             *extra]
  start = time.perf_counter()
  result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  if result.returncode != 0:
    raise SystemExit(f'{estimator} seed {seed} failed ({" ".join(command)}):\n'
                     f'{result.stderr[-3000:]}')
  return {'estimator': estimator, 'seed': seed, **read_run(workdir), 'wall_s': wall,
          'command': ' '.join(command[1:])}


def summarise(runs: list[dict]) -> dict:
  """Per estimator: the mean success before and after over its runs, and the mean gain."""
  means = {}
  for estimator in VARIANTS:
    mine = [r for r in runs if r['estimator'] == estimator]
    if mine:
      before = statistics.fmean(r['before'] for r in mine)
      after = statistics.fmean(r['after'] for r in mine)
      means[estimator] = {'before': before, 'after': after, 'gain': after - before,
                          'seeds': [r['seed'] for r in mine]}
      trains = [r['train_success_first_last'] for r in mine]
      if all(trains):
        means[estimator]['train_success_first_last'] = [
            statistics.fmean(t[i] for t in trains) for i in (0, 1)]
  return means


def plot(result: dict, path: pathlib.Path) -> None:
  """Held-out success against the RL step (step 0: after the warm-up), one panel per
  estimator, one line per seed."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  estimators = [e for e in VARIANTS if any(r['estimator'] == e for r in result['runs'])]
  fig, axes = plt.subplots(1, len(estimators), figsize=(4.5 * len(estimators), 3.6),
                           sharey=True, squeeze=False)
  for ax, estimator in zip(axes[0], estimators):
    for run in (r for r in result['runs'] if r['estimator'] == estimator):
      steps, success = zip(*run['curve'])
      ax.plot(steps, [100 * s for s in success], 'o-', label=f'seed {run["seed"]}')
    ax.set(title=f'{estimator} ({result.get("split", "held_out")} maps)', xlabel='RL step',
           ylabel='greedy success, %')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--estimators', default='grpo,gigpo')
  parser.add_argument('--steps', type=int, default=None, help='total_steps (default: config)')
  parser.add_argument('--parallel', type=int, default=1, help='runs at a time (1 or 2)')
  parser.add_argument('--workdir', default='', help='keep the runs here (default: a tmp dir)')
  parser.add_argument('--split', choices=sorted(SPLITS), default='held_out',
                      help='evaluate on the held-out maps or the validation maps (tuning)')
  parser.add_argument('--plot', default='', help='PNG path, e.g. docs/agent_grid.png')
  parser.add_argument('--from_json', default='',
                      help='read the runs from this JSON (printed by this script) instead')
  parser.add_argument('extra', nargs='*', help='extra --config.* overrides')
  args = parser.parse_args()
  if args.from_json:
    result = json.loads(pathlib.Path(args.from_json).read_text())
    if args.plot:
      plot(result, pathlib.Path(args.plot))
    print(json.dumps(result['means'], indent=2))
    return
  seeds = [int(s) for s in args.seeds.split(',')]
  estimators = args.estimators.split(',')
  unknown = sorted(set(estimators) - set(VARIANTS))
  if unknown:
    parser.error(f'--estimators: unknown {unknown}; valid: {sorted(VARIANTS)}')
  jobs = [(e, s) for s in seeds for e in estimators]
  with tempfile.TemporaryDirectory() as tmp:
    base = pathlib.Path(args.workdir or tmp)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(args.parallel, 2))) as pool:
      runs = list(pool.map(
          lambda job: run_one(*job, base / f'{job[0]}_seed{job[1]}', args.steps,
                              [*SPLITS[args.split], *args.extra]),
          jobs))
    total = time.perf_counter() - start
  result = {
      'benchmark': 'agent_grid',
      'runs': runs,
      'means': summarise(runs),
      'total_wall_s': total,
      'split': args.split,
      'extra': args.extra,
  }
  if args.plot:
    plot(result, pathlib.Path(args.plot))
  print(json.dumps(result, indent=2))


if __name__ == '__main__':
  main()
