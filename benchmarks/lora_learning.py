"""Benchmark (slow): LoRA and int8 rollouts against full precision, as learning curves.

Issue 46's learning comparisons, each a set of ``python -m rlax_llm.launch`` runs with the
same budget and seed(s), only the arm's switches differing:

* ``lora``: LoRA (rank 16 on every projection, alpha 32, a higher learning rate, "LoRA
  Without Regret": 30x on SmolLM2, ``configs/smollm2.py:lora``; 10x on the tiny model)
  against the full fine-tune; goal: within ``--max_points`` of its held-out
  greedy accuracy at every evaluation from ``--from_step`` on.
* ``int8``: rollouts sampled from the int8 weight-only copy, with TIS (``int8_tis``: the
  trainer recomputes the fp32 log-probs, each token weighted by ``min(pi_fp32 / pi_int8, 2)``)
  and without any correction (``int8``), and with the recompute but no TIS weight
  (``int8_recompute``: what the recompute alone buys), against fp32 rollouts; the same goal
  for ``int8_tis``, and the measured ``mismatch/*`` metrics of every run.
* ``sync``: LoRA with its adapters sent to the workers in int8 (``lora_int8_sync``,
  ``lora.sync_dtype='int8'``) against LoRA's float32 adapters; the same goal.

``--model=smollm2`` runs ``configs/smollm2.py`` and its ``lora`` / ``int8_tis`` / ``int8``
variants (``--steps`` and ``--eval_every`` shorten every arm alike, the cosine decay scaled
with them); ``--model=tiny`` runs ``configs/default.py`` with the same switches as
command-line overrides (its learning rate 3e-4, so LoRA's is 3e-3). Runs go to
``--root/<model>_<arm>_s<seed>``; a workdir that already holds a finished run
(``summary.json``) is read, not run again, so runs launched by hand with the printed
commands are collected the same way (``--arms`` keeps some arms only, e.g. one arm's
extra seed against its reference). Prints one JSON object: per comparison the commands,
each run's curve (``[step, accuracy]``, step 0 = the RL start), the seed-mean curves, the
per-evaluation differences in points, the mismatch metrics and the goal flags.

    .venv/bin/python benchmarks/lora_learning.py --model=tiny --comparisons=int8 \\
        --seeds=0,1,2 --share_warmup --parallel=3 --root=/tmp/lora_learning
    .venv/bin/python benchmarks/lora_learning.py --model=smollm2 --comparisons=lora \\
        --steps=160 --eval_every=20 --root=/tmp/lora_learning
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlax_llm.metrics import read_metrics

COMPARISONS = {'lora': ('full', ['lora']),
               'int8': ('full', ['int8_tis', 'int8', 'int8_recompute']),
               'sync': ('lora', ['lora_int8_sync'])}
# The switches of each arm on configs/default.py (configs/smollm2.py has them as variants).
TINY_ARMS = {
    'full': [],
    'lora': ['--config.lora.rank=16', '--config.lora.alpha=32.0',
             '--config.rl.learning_rate=0.003'],
    'lora_int8_sync': ['--config.lora.rank=16', '--config.lora.alpha=32.0',
                       '--config.rl.learning_rate=0.003', '--config.lora.sync_dtype=int8'],
    'int8_tis': ['--config.model.inference_quant=int8', '--config.rl.old_logprobs=recompute',
                 '--config.rl.mismatch.enabled=true'],
    'int8': ['--config.model.inference_quant=int8'],
    'int8_recompute': ['--config.model.inference_quant=int8',
                       '--config.rl.old_logprobs=recompute'],
}
# configs/smollm2.py: 240 steps, the learning rate decayed over 176 updates.
SMOLLM2_STEPS, SMOLLM2_DECAY = 240, 176
# Arms whose switches leave the warm-up alone (--share_warmup may start them from full's).
SHARES_WARMUP = ('int8_tis', 'int8', 'int8_recompute')
MISMATCH_KEYS = ('mismatch/kl', 'mismatch/ess_fraction', 'mismatch/p95_abs_dlogp',
                 'mismatch/max_abs_dlogp',
                 'mismatch/weight_mean', 'mismatch/kept_fraction', 'is/ratio_mean')


def command(model: str, arm: str, seed: int, steps: int | None, eval_every: int | None,
            workdir: pathlib.Path, num_eval: int | None = None) -> list[str]:
  """The launch command line of one run (``python -m rlax_llm.launch ...``); ``num_eval``:
  that many held-out problems per evaluation (``task.num_eval``; default: the config's)."""
  if model == 'smollm2':
    config = 'configs/smollm2.py' + ('' if arm == 'full' else f':{arm}')
    flags = []
    if steps is not None:
      decay = round(SMOLLM2_DECAY * steps / SMOLLM2_STEPS)
      flags += [f'--config.total_steps={steps}', f'--config.rl.lr_decay_steps={decay}']
  else:
    config, flags = 'configs/default.py', list(TINY_ARMS[arm])
    if steps is not None:
      flags.append(f'--config.total_steps={steps}')
  if eval_every is not None:
    flags.append(f'--config.eval.every_steps={eval_every}')
  if num_eval is not None:
    flags.append(f'--config.task.num_eval={num_eval}')
  if seed:
    flags.append(f'--config.seed={seed}')
  return [sys.executable, '-m', 'rlax_llm.launch', f'--config={config}', *flags,
          f'--workdir={workdir}']


def read_run(workdir: pathlib.Path) -> dict:
  """One finished run's held-out curve, mismatch metrics (mean and max over its steps) and
  times, from its ``metrics.jsonl`` and ``summary.json``."""
  rows = read_metrics(workdir / 'metrics.jsonl')
  summary = json.loads((workdir / 'summary.json').read_text())
  curve = {0: summary['eval/start_accuracy']}
  for row in rows:
    if row.get('eval/accuracy') is not None:
      curve[row['step']] = row['eval/accuracy']
  mismatch = {}
  for key in MISMATCH_KEYS:
    values = [r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    if values:
      mismatch[key] = {'mean': sum(values) / len(values), 'max': max(values),
                       'steps': len(values)}
  return {'curve': sorted(curve.items()), 'final_accuracy': summary['eval/final_accuracy'],
          'mismatch': mismatch, 'rl_s': summary.get('time/rl_s')}


def mean_curve(runs: list[dict]) -> list[list[float]]:
  """The seed-mean ``[step, accuracy]`` over the evaluation steps every run has."""
  curves = [dict(r['curve']) for r in runs]
  steps = sorted(set.intersection(*(set(c) for c in curves)))
  return [[step, sum(c[step] for c in curves) / len(curves)] for step in steps]


def compare(base: list[list[float]], arm: list[list[float]], from_step: int,
            max_points: float) -> dict:
  """Per evaluation step both curves have: the arm's accuracy minus the base's, in points;
  ``goal_met``: every one from ``from_step`` on within ``max_points`` (both ways), and there
  is at least one."""
  arm_at = dict(arm)
  rows = [{'step': step, 'base': acc, 'arm': arm_at[step],
           'diff_points': round(100 * (arm_at[step] - acc), 6)}
          for step, acc in base if step in arm_at]
  judged = [r['diff_points'] for r in rows if r['step'] >= from_step]
  return {'per_eval': rows, 'judged_evals': len(judged),
          'max_abs_diff_points': max((abs(d) for d in judged), default=None),
          'goal_met': bool(judged) and all(abs(d) <= max_points for d in judged)}


def summarise(runs: dict[str, list[dict]], comparisons: list[str], from_step: int,
              max_points: float) -> dict:
  """The comparisons' results from each arm's runs (one per seed)."""
  out = {}
  means = {arm: mean_curve(rs) for arm, rs in runs.items() if rs}
  for name in comparisons:
    base, arms = COMPARISONS[name]
    if base not in means:
      continue
    result = {}
    for arm in arms:
      if arm not in means:
        continue
      result[arm] = {
          'vs': base, **compare(means[base], means[arm], from_step, max_points),
          'mismatch_by_seed': [r['mismatch'] for r in runs[arm]],
          'base_mismatch_by_seed': [r['mismatch'] for r in runs[base]]}
    out[name] = result
  return out


def share_warmup(base: pathlib.Path, workdir: pathlib.Path, overrides: list[str]) -> bool:
  """Starts ``workdir``'s run from ``base``'s supervised warm-up: copies its
  ``checkpoints/warmup`` and its ``config.json`` with ``overrides`` (``--config.a.b=v``)
  applied, so that launch resumes there at the RL start (``workdir.has_checkpoint``; the
  config check passes as the saved config is the arm's own). The warm-up depends on the
  seed and the warm-up keys alone, none of which an int8 arm changes, so the RL start is the
  one the arm's own warm-up would reach. Returns False (nothing done) when ``base`` has no
  finished warm-up or ``workdir`` exists."""
  source = base / 'checkpoints' / 'warmup'
  if workdir.exists() or not (source / '0').is_dir():
    return False
  config = json.loads((base / 'config.json').read_text())
  for flag in overrides:
    path, value = flag.removeprefix('--config.').split('=', 1)
    *parents, leaf = path.split('.')
    node = config
    for key in parents:
      node = node[key]
    try:
      node[leaf] = json.loads(value)
    except json.JSONDecodeError:
      node[leaf] = value  # a string
  shutil.copytree(source, workdir / 'checkpoints' / 'warmup')
  (workdir / 'config.json').write_text(json.dumps(config, indent=2, sort_keys=True))
  return True


def launch_all(jobs: list[tuple[str, list[str], pathlib.Path]], parallel: int) -> None:
  """Runs each job's command whose workdir holds no finished run, ``parallel`` at a time."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  pending = [job for job in jobs if not (job[2] / 'summary.json').exists()]
  running: list[tuple[str, subprocess.Popen]] = []
  while pending or running:
    while pending and len(running) < parallel:
      name, cmd, workdir = pending.pop(0)
      workdir.parent.mkdir(parents=True, exist_ok=True)
      log = open(workdir.parent / f'{workdir.name}.log', 'w')  # noqa: SIM115 (closed by exit)
      running.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                             stderr=subprocess.STDOUT)))
    time.sleep(1)
    for name, proc in list(running):
      if proc.poll() is not None:
        running.remove((name, proc))
        if proc.returncode != 0:
          raise SystemExit(f'{name} failed (exit {proc.returncode}); its log is beside its '
                           'workdir.')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', choices=('tiny', 'smollm2'), default='tiny')
  parser.add_argument('--comparisons', default='lora,int8')
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--steps', type=int, default=None, help='default: the config\'s')
  parser.add_argument('--eval_every', type=int, default=20)
  parser.add_argument('--num_eval', type=int, default=None,
                      help="held-out problems per evaluation (default: the config's; the "
                           'SmolLM2 recipe has 100, about 6 points of noise per difference; '
                           '250 of its held-out pool: about 3.6)')
  parser.add_argument('--from_step', type=int, default=100)
  parser.add_argument('--max_points', type=float, default=3.0)
  parser.add_argument('--parallel', type=int, default=1, help='runs at once')
  parser.add_argument('--share_warmup', action='store_true',
                      help='tiny: the int8 arms start from the full run\'s warm-up (same '
                           'seed) instead of repeating it')
  parser.add_argument('--root', required=True, help='where the runs\' workdirs go')
  parser.add_argument('--arms', default='',
                      help="only these arms of the comparisons (e.g. 'full,int8_tis'); the "
                           'others are neither run nor compared')
  args = parser.parse_args()
  comparisons = args.comparisons.split(',')
  arms = []
  for name in comparisons:
    base, others = COMPARISONS[name]
    arms += [a for a in (base, *others) if a not in arms]
  if args.arms:
    chosen = args.arms.split(',')
    if unknown := sorted(set(chosen) - set(arms)):
      parser.error(f'--arms={args.arms}: {", ".join(unknown)} not in the arms of '
                   f'--comparisons={args.comparisons} ({", ".join(arms)})')
    arms = [a for a in arms if a in chosen]
  root = pathlib.Path(args.root)
  seeds = [int(s) for s in args.seeds.split(',')]
  workdir = lambda arm, seed: root / f'{args.model}_{arm}_s{seed}'
  jobs = {(arm, seed): (f'{arm}/s{seed}', command(args.model, arm, seed, args.steps,
                                                  args.eval_every, workdir(arm, seed),
                                                  args.num_eval),
                        workdir(arm, seed))
          for seed in seeds for arm in arms}
  start = time.perf_counter()
  if args.share_warmup and args.model == 'tiny':
    # The full runs first (they make the warm-ups), then every other arm.
    launch_all([jobs[('full', s)] for s in seeds], args.parallel)
    shared = {f'{arm}/s{seed}': share_warmup(workdir('full', seed), workdir(arm, seed),
                                             TINY_ARMS[arm])
              for seed in seeds for arm in arms if arm in SHARES_WARMUP}
  else:
    shared = {}
  launch_all([jobs[(arm, seed)] for seed in seeds for arm in arms], args.parallel)
  runs = {arm: [{'seed': seed, **read_run(workdir(arm, seed))} for seed in seeds]
          for arm in arms}
  print(json.dumps({
      'benchmark': 'lora_learning', 'model': args.model, 'seeds': args.seeds,
      'steps': args.steps, 'eval_every': args.eval_every,
      'goal': {'from_step': args.from_step, 'max_points': args.max_points},
      'commands': {name: ' '.join(['python', *cmd[1:]]) for name, cmd, _ in jobs.values()},
      'warmup_shared_from_full': shared, 'wall_s': time.perf_counter() - start,
      'runs': runs, 'mean_curves': {arm: mean_curve(rs) for arm, rs in runs.items()},
      'comparisons': summarise(runs, comparisons, args.from_step, args.max_points),
  }, indent=2))


if __name__ == '__main__':
  main()
