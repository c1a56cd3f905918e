"""Benchmark (slow): on-policy distillation against GRPO on SmolLM2-135M, 2-digit addition
(issue 63, "the result that makes the feature worth having").

Three arms, seed 0, the recipe's 100 held-out prompts evaluated greedily every 10 steps, each
one ``python -m rlax_llm.launch`` in ``<workdir>/<arm>``, run one after another:

* ``grpo``: the shipped GRPO recipe (``configs/smollm2.py``, 240 steps). Its final checkpoint,
  exported by ``python -m rlax_llm.export`` to ``<workdir>/teacher``, is the teacher of the
  other two arms, and its curve is the "GRPO alone" arm of the comparison.
* ``distill``: ``configs/distill.py`` with ``--config.teacher.path=<workdir>/teacher``: the
  student (SmolLM2-135M-Instruct as shipped) trains on the per-token reverse-KL advantage
  ``log pi_teacher - log pi_student`` alone (docs/losses.md "On-policy distillation").
* ``distill_reward``: ``configs/distill.py:reward``, the same plus the task's group advantage.

The distillation arms run ``--distill_steps`` each; the default (0) is the steps the GRPO arm
took to reach the target (all its steps when it did not): twice the most the goal allows, so
an arm that meets it shows the margin, and one that needs more than that would miss it
anyway (the launch has no clean early stop, so an arm runs its budget).

This process watches each launch as the head-to-head does (``benchmarks/peers/run_rlax.py``'s
``watch``): a step's wall time is when its line reached ``metrics.jsonl``, counted from the
launch process's start (model loading, compilation, the teacher's loading and scoring
included), and the peak memory is the launch process's VmHWM (every role runs in it). The
teacher's own training (the ``grpo`` arm) is not counted in the distillation arms. Per arm:
the held-out accuracy against steps and against wall seconds, the steps and wall seconds to
``--target`` (the first evaluation at or above it; "not reached" with the best otherwise),
rollout tokens/s (the median over steps of rlax_llm's ``time/rollout_tokens_per_s``), train
tokens/s (the median over updates of trained rows x mean completion length / ``time/train_s``:
the sampled tokens an update trains on, per second), peak RSS, the final accuracy, and the
machine's mean 1-minute load average over the arm (other processes slow its wall time).

The goal (``judge``): distillation reaches the target in at most half of GRPO's steps and at
most half of its wall time, judged for ``distill`` and ``distill_reward`` each.

Checkpoints: each arm saves only its final step (``checkpoint.every_steps`` = its steps,
``every_seconds=0``: a SmolLM2 checkpoint with its Adam moments is 1.4 GiB); the teacher's is
deleted once exported, the distillation arms' once the arm is read. An arm already in
``--output`` (or whose workdir holds a finished, watched run) is not run again; an unfinished
one is started over.

    .venv/bin/python benchmarks/distill_study.py [--workdir=runs/distill_study]
        [--output=runs/distill_study/study.json] [--plot=docs/distill_study.png]
        [--distill_steps=0] [--no_run] [--set=--config.KEY=VALUE ...]
        [--distill_set=--config.KEY=VALUE ...]

Tuning the distillation arms against the same teacher: ``--distill_set`` overrides reach the
distillation arms only, so with the same ``--workdir`` and another ``--output`` the finished
``grpo`` arm (the teacher) is read back and only the distillation arms run again. An arm's
workdir is reused only when it holds a finished run of the same config arguments (kept in its
watcher's record), so a changed ``--set`` or ``--distill_set`` reruns it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks' / 'peers'))
sys.path.insert(1, str(ROOT))
from run_rlax import watch  # noqa: E402  (the head-to-head's launch watcher)

from rlax_llm.storage import write_text_atomic  # noqa: E402

ARMS = ('grpo', 'distill', 'distill_reward')
CONFIGS = {'grpo': 'configs/smollm2.py', 'distill': 'configs/distill.py',
           'distill_reward': 'configs/distill.py:reward'}
DISTILL_ARMS = ('distill', 'distill_reward')
WATCH_FILE = 'watch.json'  # the watcher's record, beside the launch's files in the arm's workdir


def arm_steps(arm: str, args: argparse.Namespace) -> int:
  """The RL steps of ``arm`` (``args.distill_steps`` resolved: see ``distill_budget``)."""
  return args.grpo_steps if arm == 'grpo' else args.distill_steps


def distill_budget(args: argparse.Namespace, grpo: dict) -> int:
  """Each distillation arm's steps: ``--distill_steps``, or when 0 the steps the GRPO arm
  (``grpo``: its ``read_arm`` figures) took to reach the target, all its steps when it did
  not."""
  if args.distill_steps:
    return args.distill_steps
  return max(1, grpo['steps_to_target'] or args.grpo_steps)


def launch_flags(arm: str, args: argparse.Namespace, teacher: pathlib.Path) -> list[str]:
  """The ``rlax_llm.launch`` config arguments of ``arm`` (``teacher``: the exported GRPO
  checkpoint the distillation arms load)."""
  steps = arm_steps(arm, args)
  flags = [f'--config={CONFIGS[arm]}', f'--config.seed={args.seed}',
           f'--config.total_steps={steps}',
           # Only the final step is saved (1.4 GiB with the moments): learning is unchanged.
           f'--config.checkpoint.every_steps={steps}', '--config.checkpoint.every_seconds=0',
           '--config.checkpoint.keep=1']
  if arm in DISTILL_ARMS:
    flags += [f'--config.teacher.path={teacher}', *args.set, *args.distill_set]
  else:
    flags += args.set
  return flags


def _round(value: float) -> float:
  return float(f'{value:.5g}') if math.isfinite(value) else value


def reach(points: Sequence[Sequence[float]], target: float) -> float | None:
  """The x of the first ``[x, accuracy]`` point whose accuracy is ``>= target`` (None when
  none is)."""
  return next((x for x, acc in points if acc >= target), None)


def read_arm(workdir: pathlib.Path, target: float) -> dict | None:
  """A finished, watched arm's figures from its workdir (None when it has not finished, or
  stopped early: a SIGTERM'd launch exits 0 with a ``preempted`` summary).

  Returns ``start``/``final`` held-out accuracy, ``curve`` ([step, accuracy] of every
  evaluation, step 0 the start) and ``wall_curve`` ([wall seconds, accuracy]; the start's
  point is when step 1 began: its line's arrival less its ``time/step_s``), ``steps`` and
  ``wall_s`` to ``target`` (None when not reached), ``best``/``best_step``, the token rates,
  ``peak_rss_mib``, ``total_wall_s`` (the last step's arrival), the summary's times and
  ``flags``, the launch's config arguments (None in a record from before they were kept).
  """
  summary_path, watch_path = workdir / 'summary.json', workdir / WATCH_FILE
  if not (summary_path.exists() and watch_path.exists()):
    return None
  summary = json.loads(summary_path.read_text())
  if summary.get('preempted'):  # stopped by a signal before its last step: not finished
    return None
  watched = json.loads(watch_path.read_text())
  arrived = {int(k): v for k, v in watched['arrived'].items()}
  config = json.loads((workdir / 'config.json').read_text())
  group = config['rl']['group_size']
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()
          if line.strip()]
  start_wall = arrived[rows[0]['step']] - rows[0]['time/step_s']
  curve = [[0, _round(summary['eval/start_accuracy'])]]
  wall_curve = [[round(start_wall, 1), _round(summary['eval/start_accuracy'])]]
  for r in rows:
    if 'eval/accuracy' in r:
      curve.append([r['step'], _round(r['eval/accuracy'])])
      wall_curve.append([round(arrived[r['step']], 1), _round(r['eval/accuracy'])])
  best_step, best = max(curve, key=lambda p: (p[1], -p[0]))
  rollout_rates = [r['time/rollout_tokens_per_s'] for r in rows]
  train_rates = [r['rollout/trained_groups'] * group * r['completion/length_mean']
                 / r['time/train_s'] for r in rows
                 if not r.get('update/skipped') and r['time/train_s'] > 0]
  return {'start': summary['eval/start_accuracy'], 'final': summary['eval/final_accuracy'],
          'steps': summary['steps'], 'curve': curve, 'wall_curve': wall_curve,
          'steps_to_target': reach(curve, target), 'wall_s_to_target': reach(wall_curve, target),
          'best': best, 'best_step': best_step,
          'rollout_tokens_per_s': _round(statistics.median(rollout_rates)),
          'train_tokens_per_s': _round(statistics.median(train_rates)) if train_rates else 0.0,
          'peak_rss_mib': round(watched['peak_rss_mib'], 1),
          'load_mean': watched.get('load_mean'),
          'total_wall_s': round(max(arrived.values()), 1),
          'rl_s': round(summary['time/rl_s'], 1), 'total_s': round(summary['time/total_s'], 1),
          'flags': watched.get('flags')}


def _launch(command: list[str], flags: list[str], workdir: pathlib.Path,
            log_path: pathlib.Path) -> None:
  """Runs ``python -m rlax_llm.launch`` watched, writing the watcher's record (with
  ``flags``, the arm's config arguments) into the workdir (the arm counts as finished once it
  is there)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  loads, stop = [], threading.Event()

  def sample_load():  # the 1-minute load average every 10 s while the arm runs
    while not stop.wait(10.0):
      loads.append(os.getloadavg()[0])

  sampler = threading.Thread(target=sample_load, daemon=True)
  sampler.start()
  started = time.time()
  with open(log_path, 'w', encoding='utf-8') as log:
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    previous = signal.signal(signal.SIGTERM, lambda *_: process.send_signal(signal.SIGTERM))
    try:
      arrived, peak = watch(process, workdir / 'metrics.jsonl', started)
    finally:
      signal.signal(signal.SIGTERM, previous)
      stop.set()
  if process.returncode:
    raise SystemExit(f'the launch in {workdir} failed (exit {process.returncode}); its log: '
                     f'{log_path}')
  (workdir / WATCH_FILE).write_text(json.dumps({
      'arrived': arrived, 'peak_rss_mib': peak, 'flags': flags,
      'load_mean': round(statistics.fmean(loads), 2) if loads else None}))


def export_teacher(grpo: pathlib.Path, out: pathlib.Path) -> None:
  """Exports the GRPO arm's final checkpoint to ``out`` (a Hugging Face directory), then
  deletes the checkpoint; nothing to do when ``out`` holds an export already."""
  if (out / 'config.json').exists():
    return
  with open(out.with_suffix('.log'), 'w', encoding='utf-8') as log:
    result = subprocess.run(
        [sys.executable, '-m', 'rlax_llm.export', f'--checkpoint={grpo}', f'--out={out}',
         '--overwrite'], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log,
        stderr=subprocess.STDOUT)
  if result.returncode or not (out / 'config.json').exists():
    raise SystemExit(f'exporting the teacher from {grpo} to {out} failed (exit '
                     f'{result.returncode}); its log: {out.with_suffix(".log")}')
  shutil.rmtree(grpo / 'checkpoints', ignore_errors=True)


def run_arm(arm: str, args: argparse.Namespace, root: pathlib.Path) -> dict:
  """Runs one arm (or reads it back when its workdir holds a finished run of the same
  config arguments) and returns ``read_arm``'s figures; after the ``grpo`` arm, exports the
  teacher."""
  workdir, teacher = root / arm, root / 'teacher'
  flags = launch_flags(arm, args, teacher)
  done = read_arm(workdir, args.target)
  if done is None or done['flags'] != flags:
    if arm in DISTILL_ARMS and not (teacher / 'config.json').exists():
      raise SystemExit(f'{arm} needs the teacher exported to {teacher}: run the grpo arm '
                       'first (the study runs the arms in order).')
    if workdir.exists():  # an unfinished or unwatched run, or another config's: start over
      shutil.rmtree(workdir)
    if arm == 'grpo':  # a new teacher: the previous one's export goes with its run
      shutil.rmtree(teacher, ignore_errors=True)
    workdir.mkdir(parents=True)
    command = [sys.executable, '-m', 'rlax_llm.launch', *flags, f'--workdir={workdir}']
    _launch(command, flags, workdir, workdir.with_suffix('.log'))
    done = read_arm(workdir, args.target)
    if done is None:
      raise SystemExit(f'{arm} exited 0 unfinished (no summary.json, or a preempted one, in '
                       f'{workdir}); rerun the study to start the arm over.')
  if arm == 'grpo':
    export_teacher(workdir, teacher)
  else:
    shutil.rmtree(workdir / 'checkpoints', ignore_errors=True)
  return done


def judge(arms: dict[str, dict], target: float) -> dict:
  """The issue's goal for each distillation arm against the ``grpo`` arm: it reaches
  ``target`` in at most half of GRPO's steps AND at most half of GRPO's wall seconds.

  ``pending`` while either arm is missing; ``missed`` when the distillation arm never
  reached the target. When GRPO never reached it, its whole run (steps, wall) stands for its
  time to the target (a lower bound) and ``grpo_reached`` says so.
  """
  out = {}
  grpo = arms.get('grpo')
  for arm in DISTILL_ARMS:
    run = arms.get(arm)
    if grpo is None or run is None:
      out[arm] = {'status': 'pending'}
      continue
    grpo_reached = grpo['steps_to_target'] is not None
    grpo_steps = grpo['steps_to_target'] if grpo_reached else grpo['steps']
    grpo_wall = grpo['wall_s_to_target'] if grpo_reached else grpo['total_wall_s']
    steps, wall = run['steps_to_target'], run['wall_s_to_target']
    steps_ok = steps is not None and steps <= grpo_steps / 2
    wall_ok = wall is not None and wall <= grpo_wall / 2
    out[arm] = {'status': 'met' if steps_ok and wall_ok else 'missed', 'target': target,
                'steps': steps, 'grpo_steps': grpo_steps, 'steps_met': steps_ok,
                'wall_s': wall, 'grpo_wall_s': grpo_wall, 'wall_met': wall_ok,
                'grpo_reached': grpo_reached}
  return out


LABELS = {'grpo': 'GRPO alone (the teacher)', 'distill': 'distillation (reverse KL)',
          'distill_reward': 'distillation + reward'}


def plot(result: dict, path: pathlib.Path) -> None:
  """Held-out greedy accuracy against RL steps and against wall minutes, one line per
  finished arm, the target dashed."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for arm in ARMS:
    run = result['arms'].get(arm)
    if run is None:
      continue
    axes[0].plot(*zip(*[(s, 100 * a) for s, a in run['curve']]), marker='.', label=LABELS[arm])
    axes[1].plot(*zip(*[(w / 60, 100 * a) for w, a in run['wall_curve']]), marker='.',
                 label=LABELS[arm])
  for ax, xlabel in zip(axes, ('RL step', 'wall minutes since the launch started')):
    ax.axhline(100 * result['settings']['target'], color='grey', linestyle='--', linewidth=1)
    ax.set(xlabel=xlabel, ylabel='held-out greedy accuracy (%)', ylim=(0, 100))
    ax.grid(alpha=0.3)
    if ax.lines[1:]:
      ax.legend(fontsize=8, loc='lower right')
  fig.suptitle('SmolLM2-135M, 2-digit addition, seed 0: GRPO vs on-policy distillation',
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--output', type=pathlib.Path,
                      default=ROOT / 'runs' / 'distill_study' / 'study.json',
                      help='the study JSON, rewritten after every arm; resumed from')
  parser.add_argument('--workdir', type=pathlib.Path, default=None,
                      help="where the arms' runs and the teacher go (default: <output dir>/runs)")
  parser.add_argument('--plot', type=pathlib.Path, default=None, help='a PNG of the curves')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--grpo_steps', type=int, default=240,
                      help="the GRPO arm's steps (the shipped recipe's 240)")
  parser.add_argument('--distill_steps', type=int, default=0,
                      help="each distillation arm's steps (at most --grpo_steps); 0: the steps "
                           'the GRPO arm took to reach --target')
  parser.add_argument('--target', type=float, default=0.8,
                      help='the held-out accuracy the goal times (0.8: 80%%)')
  parser.add_argument('--no_run', action='store_true',
                      help='run no arm: print (and plot) what --output holds so far')
  parser.add_argument('--set', action='append', default=[], metavar='--config.KEY=VALUE',
                      help='an extra launch override for every arm (repeatable; e.g. a tiny '
                           "wiring check); part of the study's settings")
  parser.add_argument('--distill_set', action='append', default=[],
                      metavar='--config.KEY=VALUE',
                      help='an extra launch override for the distillation arms only (tuning '
                           'them against the same teacher: e.g. --config.rl.learning_rate=5e-5,'
                           " --config.rl.distill.kind=gkd); part of their settings")
  args = parser.parse_args(argv)
  for flag in ('set', 'distill_set'):
    bad = [s for s in getattr(args, flag) if not s.startswith('--config.') or '=' not in s]
    if bad:
      parser.error(f'--{flag} takes --config.KEY=VALUE launch overrides, got {bad}')
  if args.grpo_steps <= 0 or not 0 <= args.distill_steps <= args.grpo_steps:
    parser.error(f'--grpo_steps={args.grpo_steps} must be > 0 and --distill_steps='
                 f'{args.distill_steps} in [0, --grpo_steps] (0: GRPO\'s steps to the target): '
                 'distillation gets no more steps than GRPO.')
  if not 0 < args.target <= 1:
    parser.error(f'--target={args.target} is an accuracy: give one in (0, 1].')
  return args


def settings(args: argparse.Namespace) -> dict:
  """The study's settings (every arm's, in the output JSON)."""
  return {'seed': args.seed, 'grpo_steps': args.grpo_steps,
          'distill_steps': args.distill_steps, 'target': args.target, 'set': list(args.set),
          'distill_set': list(args.distill_set)}


def arm_settings(study_settings: dict, arm: str) -> dict:
  """What ``arm``'s figures depend on, from the study's ``settings``: the ``grpo`` arm (the
  teacher) on all but ``distill_steps`` and ``distill_set``, a distillation arm on all. A
  finished arm is reused when these are the same, so a new ``--distill_steps`` or
  ``--distill_set`` reruns the distillation arms only."""
  keys = ['seed', 'grpo_steps', 'target', 'set']
  if arm != 'grpo':
    keys += ['distill_steps', 'distill_set']
  # A study from before --distill_set was kept had none.
  return {k: study_settings.get(k, [] if k == 'distill_set' else None) for k in keys}


def load_previous(path: pathlib.Path, expected: dict) -> dict[str, dict]:
  """The arms already in ``path`` (none when it does not exist) that were run with the
  settings ``expected`` gives them (``arm_settings``); those of other settings are left out,
  to be run again, and refused when the teacher's own differ."""
  if not path.exists():
    return {}
  previous = json.loads(path.read_text())
  kept = {}
  for arm, figures in previous.get('arms', {}).items():
    if arm_settings(previous['settings'], arm) == arm_settings(expected, arm):
      kept[arm] = figures
    elif arm == 'grpo':
      raise SystemExit(f'{path} holds a study whose teacher was run with settings '
                       f'{arm_settings(previous["settings"], arm)}, not '
                       f'{arm_settings(expected, arm)}; pass another --output (and --workdir) '
                       'for these settings.')
  return kept


def study(args: argparse.Namespace,
          run: Callable[[str, argparse.Namespace, pathlib.Path], dict] = run_arm) -> dict:
  """Runs every missing arm in ``ARMS`` order (none with ``args.no_run``), rewriting
  ``args.output`` after each, and returns the whole study (``run``: one arm's figures,
  ``run_arm`` unless a test's)."""
  root = args.workdir or args.output.parent / 'runs'
  expected = settings(args)
  arms = load_previous(args.output, expected)

  def result() -> dict:
    return {'benchmark': 'distill_study', 'settings': expected, 'workdir': str(root),
            'finished': [a for a in ARMS if a in arms], 'arms': arms,
            'goals': judge(arms, args.target)}

  args.output.parent.mkdir(parents=True, exist_ok=True)
  for arm in ARMS:
    if arm in arms or args.no_run:
      continue
    if arm == 'grpo':
      arms[arm] = run(arm, args, root)
    else:  # the budget resolved (GRPO's steps to the target by default)
      steps = distill_budget(args, arms['grpo'])
      arms[arm] = run(arm, argparse.Namespace(**{**vars(args), 'distill_steps': steps}), root)
    write_text_atomic(args.output, json.dumps(result()))
    print(f'{arm}: start {arms[arm]["start"]:.3f} final {arms[arm]["final"]:.3f} '
          f'(to {args.target:g}: step {arms[arm]["steps_to_target"]}, '
          f'{arms[arm]["wall_s_to_target"]} s; {arms[arm]["total_wall_s"]:.0f} s in all)',
          file=sys.stderr, flush=True)
  return result()


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  out = study(args)
  if args.plot is not None:
    plot(out, args.plot)
  print(json.dumps(out))


if __name__ == '__main__':
  main()
