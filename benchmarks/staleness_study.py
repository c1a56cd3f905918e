"""Benchmark (slow): final accuracy and steps to a target accuracy, GRPO vs GRPO+TIS vs M2PO,
at staleness 0, 4, 16, 64, over 3 seeds.

Staleness ``s`` is the asynchronous schedule ``(j, k) = (1, s + 1)``: batch ``i`` is sampled
with the params after step ``i - s`` (deterministic, so every run is reproducible). The task is
the default run's 2-digit addition with a learning rate low enough that on-policy GRPO does
not saturate in its first steps (``--lr``). Losses:

* ``grpo``: ratios against the behaviour log-probs, PPO clip 0.2;
* ``grpo_tis``: decoupled PPO: ratios against the trainer's recomputed log-probs, staleness
  corrected by truncated importance weights (``rl.mismatch``: token TIS, threshold 2);
* ``m2po``: the paper's variant, tau 0.04.

Runs ``python -m rlax_llm.launch`` for every combination and prints one JSON object with,
per loss and staleness, the final held-out accuracy (mean and each seed) and the first step
at which the evaluated accuracy reached ``--target``.

    .venv/bin/python benchmarks/staleness_study.py [--seeds=0,1,2] [--staleness=0,4,16,64]
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
LOSSES = {
    'grpo': [],
    'grpo_tis': ['--config.rl.old_logprobs=recompute', '--config.rl.mismatch.enabled=true',
                 '--config.rl.mismatch.mode=truncate', '--config.rl.mismatch.threshold=2.0'],
    'm2po': ['--config.rl.loss=m2po'],
}


def run(loss: str, staleness: int, seed: int, args, workdir: pathlib.Path) -> dict:
  flags = [f'--config.seed={seed}', f'--config.total_steps={args.steps}',
           f'--config.rl.learning_rate={args.lr}', f'--config.eval.every_steps={args.eval_every}',
           '--config.staleness.j=1', f'--config.staleness.k={staleness + 1}',
           '--config.log.tensorboard=false', '--config.log.console_every=1000', *LOSSES[loss]]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/default.py', *flags,
       f'--workdir={workdir}'], cwd=ROOT, env=env, capture_output=True, text=True)
  if result.returncode != 0:
    raise SystemExit(f'{loss} staleness {staleness} seed {seed} failed:\n'
                     f'{result.stderr[-3000:]}')
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  evals = [(r['step'], r['eval/accuracy']) for r in rows if 'eval/accuracy' in r]
  reached = next((step for step, acc in evals if acc >= args.target), None)
  return {'start': rows[-1]['eval/start_accuracy'], 'final': rows[-1]['eval/final_accuracy'],
          'steps_to_target': reached, 'max_staleness': max(r['staleness/max'] for r in rows),
          'curve': evals}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--staleness', default='0,4,16,64')
  parser.add_argument('--losses', default=','.join(LOSSES))
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--lr', type=float, default=5e-5)
  parser.add_argument('--eval_every', type=int, default=20)
  parser.add_argument('--target', type=float, default=0.9)
  args = parser.parse_args()
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    for loss in args.losses.split(','):
      for staleness in [int(s) for s in args.staleness.split(',')]:
        runs = [run(loss, staleness, int(seed), args,
                    pathlib.Path(tmp) / f'{loss}-{staleness}-{seed}')
                for seed in args.seeds.split(',')]
        finals = [r['final'] for r in runs]
        out.setdefault(loss, {})[str(staleness)] = {
            'final_mean': sum(finals) / len(finals), 'finals': finals,
            'start_mean': sum(r['start'] for r in runs) / len(runs),
            'steps_to_target': [r['steps_to_target'] for r in runs],
            'max_staleness_seen': max(r['max_staleness'] for r in runs),
            'curves': [r['curve'] for r in runs]}
        print(json.dumps({loss: {staleness: {k: v for k, v in out[loss][str(staleness)].items()
                                             if k != 'curves'}}}), flush=True)
  print(json.dumps({'benchmark': 'staleness_study', 'steps': args.steps, 'lr': args.lr,
                    'target': args.target, 'results': out}, indent=2))


if __name__ == '__main__':
  main()
