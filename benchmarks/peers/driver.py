r"""The head-to-head (issue 60): the same GRPO job in rlax_llm, TRL and Tunix, one at a time,
then one evaluator over every side's checkpoints; prints (and saves) one JSON object.

Runs in rlax_llm's virtual environment after ``bash benchmarks/peers/setup.sh``:

    .venv/bin/python benchmarks/peers/driver.py --root=/tmp/peers_h2h            # the study
    .venv/bin/python benchmarks/peers/driver.py --root=/tmp/peers_smoke --steps=2 \
        --save_every=2 --num_eval=16                                              # a smoke run

Steps: (1) ``job.py`` exports the model and writes the job (once, into ``--cache_dir``);
(2) each side's script runs alone, in its own virtual environment, in ``<root>/<side>``
(``--budget_minutes``, one for every side or per side: a side still running then is
stopped, SIGTERM, and keeps the checkpoints it saved); (3) ``evaluate.py`` grades every
checkpoint; (4) the evaluator's consistency check: ``python -m rlax_llm.evaluate`` on the
shipped model and the same prompts must give the evaluator's step-0 accuracy. The JSON
(``<root>/h2h.json``): per side the accuracy curve against steps and wall time, the wall
time to ``--target`` held-out accuracy (or the best reached), rollout and train tokens/s
(steps after the first, which compiles), peak memory, versions; the date, the machine, and
the settings table (every setting that differs). ``--plot=PATH`` draws the curves
(matplotlib). Learning runs and timings are the study only when the machine runs nothing
else.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import common  # noqa: E402

SCRIPTS = {'rlax_llm': 'run_rlax.py', 'trl': 'run_trl.py', 'tunix': 'run_tunix.py'}
OUR_PYTHON = ROOT / '.venv' / 'bin' / 'python'


def python_of(side: str) -> pathlib.Path:
  """The interpreter a side runs with: rlax_llm's venv, or the peer's (setup.sh)."""
  if side == 'rlax_llm':
    return OUR_PYTHON if OUR_PYTHON.exists() else pathlib.Path(sys.executable)
  path = HERE / f'.venv-{side}' / 'bin' / 'python'
  if not path.exists():
    raise SystemExit(f'{path} does not exist: run bash benchmarks/peers/setup.sh {side} first.')
  return path


def run(command: list[str], log: pathlib.Path, budget_s: float | None = None) -> int:
  """Runs ``command`` from the repository root, output to ``log``; past ``budget_s`` it is
  sent SIGTERM (then SIGKILL after 5 minutes). Returns the exit status."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS=os.environ.get('JAX_PLATFORMS',
                                                                             'cpu'))
  with open(log, 'w', encoding='utf-8') as out:
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                               stderr=subprocess.STDOUT)
    try:
      return process.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
      process.send_signal(signal.SIGTERM)
      try:
        return process.wait(timeout=300)
      except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def speeds(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """Rollout and train tokens/s over the steps after the first (which compiles), and the
  first step's seconds; the peak memory."""
  warm = rows[1:] or rows
  rollout_s = sum(r['rollout_s'] for r in warm)
  train_s = sum(r['train_s'] for r in warm)
  return {
      'rollout_tokens_per_s': sum(r['rollout_tokens'] for r in warm) / rollout_s
                              if rollout_s else None,
      'train_tokens_per_s': sum(r['train_tokens'] for r in warm) / train_s if train_s else None,
      'first_step_s': rows[0]['rollout_s'] + rows[0]['train_s'] if rows else None,
      'peak_rss_mb': max((r['peak_rss_mb'] for r in rows), default=None),
      'steps_logged': len(rows),
  }


def time_to(curve: list[dict[str, Any]], target: float) -> dict[str, Any]:
  """The first checkpoint at or above ``target`` accuracy (its step and wall seconds), or
  None and the best accuracy reached with its step and wall seconds."""
  hit = next((c for c in curve if c['accuracy'] >= target), None)
  best = max(curve, key=lambda c: c['accuracy']) if curve else None
  return {'target': target, 'reached': hit is not None,
          'wall_s': hit['wall_s'] if hit else None, 'step': hit['step'] if hit else None,
          'best': best}


def summarise(job: dict[str, Any], root: pathlib.Path, sides: list[str],
              evaluation: dict[str, Any], target: float) -> dict[str, Any]:
  """The study's JSON object (see the module docstring)."""
  out: dict[str, Any] = {
      'benchmark': 'peers_h2h', 'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
      'machine': common.machine(), 'num_eval': evaluation.get('num_eval'),
      'start_accuracy': evaluation.get('start'), 'settings_table': job['table'], 'sides': {}}
  for side in sides:
    run_dir = root / side
    meta = json.loads((run_dir / 'side.json').read_text()) if (
        run_dir / 'side.json').exists() else {}
    curve = evaluation.get(side, [])
    out['sides'][side] = {
        'versions': meta.get('versions'), 'curve': curve,
        'time_to_target': time_to(curve, target),
        **speeds(common.read_jsonl(run_dir / 'log.jsonl'))}
  return out


def consistency(num_eval: int, log: pathlib.Path) -> float | None:
  """rlax_llm's own evaluation (``python -m rlax_llm.evaluate``) of the shipped model on the
  first ``num_eval`` held-out prompts: the evaluator's step 0 must equal it."""
  status = run([str(python_of('rlax_llm')), '-m', 'rlax_llm.evaluate',
                '--config=configs/smollm2.py', f'--config.task.num_eval={num_eval}'], log)
  if status:
    return None
  lines = [l for l in log.read_text().splitlines() if l.startswith('{')]
  return json.loads(lines[-1]).get('eval/accuracy') if lines else None


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  """Held-out accuracy against wall minutes and against steps, one line per side."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for side, data in result['sides'].items():
    curve = data['curve']
    axes[0].plot([c['wall_s'] / 60 for c in curve], [c['accuracy'] for c in curve], 'o-',
                 label=side)
    axes[1].plot([c['step'] for c in curve], [c['accuracy'] for c in curve], 'o-', label=side)
  for ax, xlabel in zip(axes, ('wall minutes (process start)', 'steps')):
    ax.set_xlabel(xlabel)
    ax.set_ylabel('greedy held-out accuracy')
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(f'SmolLM2-135M, 2-digit addition, {result["machine"]["cpu_cores"]} CPU cores '
               f'({result["date"]})')
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)


def per_side(flag: str, spec: str, sides: list[str], default: float | None,
             kind: type = int) -> dict[str, Any]:
  """A per-side flag (``--save_every``, ``--budget_minutes``): one value for every side
  (``'20'``) or ``side=V`` pairs, a side not named keeping ``default``. Values are finite,
  positive ``kind`` (a slower side saves more often, so its curve has points; a side known to
  reach the target early needs a shorter budget)."""
  def value(text: str, what: str) -> Any:
    try:
      out = kind(text)
    except ValueError:
      out = None
    if out is None or not math.isfinite(out) or out <= 0:
      raise SystemExit(f'--{flag}: {what!r} is not a finite, positive {kind.__name__} or '
                       f'side=V with side in {sorted(SCRIPTS)}.')
    return out
  if not spec:
    return dict.fromkeys(sides, default)
  if '=' not in spec:
    return dict.fromkeys(sides, value(spec, spec))
  out = dict.fromkeys(sides, default)
  for pair in spec.split(','):
    side, _, text = pair.partition('=')
    if side not in SCRIPTS:
      raise SystemExit(f'--{flag}: {pair!r} names no side of {sorted(SCRIPTS)}.')
    out[side] = value(text, pair)
  return {side: out[side] for side in sides}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--root', default='/tmp/peers_h2h', help='run directories go here')
  parser.add_argument('--cache_dir', default=None, help='default: job.py\'s')
  parser.add_argument('--sides', default=','.join(SCRIPTS))
  parser.add_argument('--steps', type=int, default=None, help='default: the recipe\'s 240')
  parser.add_argument('--save_every', default='20',
                      help='steps between checkpoints: N for every side, or side=N pairs '
                           '(e.g. rlax_llm=20,trl=10,tunix=10; a side not named keeps 20)')
  parser.add_argument('--budget_minutes', default='',
                      help='wall minutes per side: M for every side, or side=M pairs '
                           '(e.g. rlax_llm=25,trl=45,tunix=45; a side not named has none)')
  parser.add_argument('--num_eval', type=int, default=None, help='default: all 100')
  parser.add_argument('--target', type=float, default=0.8)
  parser.add_argument('--plot', default=None, help='PNG path, e.g. docs/peers_h2h.png')
  args = parser.parse_args()
  root = pathlib.Path(args.root)
  root.mkdir(parents=True, exist_ok=True)
  sides = args.sides.split(',')
  unknown = sorted(set(sides) - set(SCRIPTS))
  if unknown:
    raise SystemExit(f'--sides: unknown {unknown}; choose from {sorted(SCRIPTS)}.')
  for side in sides:
    python_of(side)  # every venv is there before anything runs
  save_every = per_side('save_every', args.save_every, sides, 20)
  budgets = per_side('budget_minutes', args.budget_minutes, sides, None, float)

  job_args = [] if args.cache_dir is None else [f'--cache_dir={args.cache_dir}']
  if run([str(python_of('rlax_llm')), str(HERE / 'job.py'), *job_args], root / 'job.log'):
    raise SystemExit(f'job.py failed; see {root / "job.log"}.')
  job_path = next(l.split()[1] for l in (root / 'job.log').read_text().splitlines()
                  if l.startswith('job: '))
  job = common.read_job(job_path)
  for side in sides:
    command = [str(python_of(side)), str(HERE / SCRIPTS[side]), f'--job={job_path}',
               f'--run_dir={root / side}', f'--save_every={save_every[side]}']
    if args.steps:
      command.append(f'--steps={args.steps}')
    print(f'driver: running {side} ...', flush=True)
    budget = budgets[side]
    status = run(command, root / f'{side}.log', None if budget is None else 60 * budget)
    print(f'driver: {side} exited {status} (log {root / f"{side}.log"})', flush=True)

  eval_json = root / 'evaluation.json'
  eval_args = [f'--job={job_path}', f'--run_dirs={",".join(str(root / s) for s in sides)}',
               f'--output={eval_json}']
  if args.num_eval:
    eval_args.append(f'--num_eval={args.num_eval}')
  print('driver: evaluating every checkpoint ...', flush=True)
  if run([str(python_of('rlax_llm')), str(HERE / 'evaluate.py'), *eval_args],
         root / 'evaluate.log'):
    raise SystemExit(f'evaluate.py failed; see {root / "evaluate.log"}.')
  evaluation = json.loads(eval_json.read_text())
  result = summarise(job, root, sides, evaluation, args.target)
  own = consistency(evaluation['num_eval'], root / 'consistency.log')
  result['evaluator_check'] = {
      'rlax_llm_evaluate_shipped_model': own, 'evaluator_step0': evaluation['start'],
      'equal': own is not None and abs(own - evaluation['start']) < 1e-9}
  if args.plot:
    plot(result, pathlib.Path(args.plot))
    result['plot'] = args.plot
  (root / 'h2h.json').write_text(json.dumps(result, indent=2))
  print(json.dumps(result, indent=2))


if __name__ == '__main__':
  main()
