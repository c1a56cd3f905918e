"""Benchmark (slow): M2PO's staleness claim in miniature. GRPO, GRPO + TIS and M2PO trained
on batches exactly ``s`` policy versions old, s in {0, 16, 64, 256}, 3 seeds each.

The claim (Zheng et al., "M2PO: Second-moment trust policy optimization", arXiv 2510.01161,
Table 1): at staleness 256 plain GRPO falls well below on-policy training (50.7 -> 40.1 on
the paper's benchmark average) while M2PO stays at the on-policy level (51.3).

Staleness ``s`` is the deterministic schedule ``(j, k) = (1, s + 1)``: batch ``i`` is sampled
with the params after step ``max(0, i - s)`` (so with s = 256 the first 256 updates all train
on the initial policy's samples), every batch exactly ``s`` versions old once the pipeline is
full, as in the paper; every run is reproducible.

The task (``TASK_FLAGS``) is chosen so that on-policy GRPO keeps improving for the whole
budget: the default 2-layer model (``configs/default.py``) and its supervised warm-up on
imperfect demonstrations (no-carry answers at rate 0.6), then RL on **3-digit addition**
(``a + b`` with ``a, b`` in [0, 999]; 9-token prompts) with 8 prompts x 8 samples per update
at lr 1e-5, for 800 updates (about three times the largest staleness). The default run's
2-digit addition saturates (99% by step 200 at every staleness), which left nothing for
staleness to take away. On this task on-policy GRPO (seed 0) goes 29% -> 61.5% (step 200) ->
71% (400) -> 75% (600) -> 78% (800) held-out greedy accuracy: still rising at the end (the
other seeds level off earlier: seed 1 at 85% from step 500, seed 2, whose warm-up leaves 15%,
at 30-32% from step 400; RESULTS.md says what that does to the finals). Two
pilots were dropped (benchmarks/LAB_NOTES.md): lr 5e-5 rises too fast (70.5% by step 60), and
3-digit ``+-`` leaves the warm-up at 1.5% with no reward to learn from.

Losses (``LOSSES``):

* ``grpo``: ratios against the behaviour log-probs, PPO clip 0.2 (the paper's GRPO baseline);
* ``grpo_tis``: decoupled PPO: ratios against the trainer's recomputed log-probs, staleness
  corrected by truncated importance weights (``rl.mismatch``: token TIS, threshold 2);
* ``m2po``: the paper's variant, tau 0.04.

Each cell (loss, staleness, seed) is one ``python -m rlax_llm.launch`` in
``<workdir>/<loss>-s<s>-seed<seed>``; cells run one after another, the most informative first
(``cell_order``), and each finished cell is written to ``--output`` at once, so an interrupted
study resumes where it stopped: a cell already in the output JSON (or whose workdir holds a
finished run) is not run again. The supervised warm-up of a seed is run once and reused by
that seed's other cells (its checkpoint is copied to ``<workdir>/warmup/seed<seed>``).

The JSON printed at the end (and kept in ``--output``) holds per cell the start and final
held-out greedy accuracy, the eval curve and, per RL step, the series in ``SERIES`` (M2PO's
masked-token fraction, the clip fraction, the importance-ratio statistics against the
behaviour/proximal log-probs, reward and staleness); per (loss, staleness) the finals of the
seeds, their mean and spread; and the issue's two goals judged (``judge``).

**RL seeds** (``--rl_seeds=0,1,2``). ``config.seed`` fixes the model init, the warm-up and its
result, the prompt stream and the held-out problems, so the spread over ``--seeds`` is mostly
the warm-up's (on this task seed 2's warm-up leaves 15% and plateaus at 30%, seeds 0 and 1
reach 78-85%), not RL's. With ``--rl_seeds`` every cell runs on the warm-up of the first
``--seeds`` seed and only ``rl.seed`` varies: the seed of the RL batches' sampling keys (the
prompt stream and evaluation stay on ``config.seed``: the cells differ in their samples
alone). Cells are ``<loss>-s<s>-seed<warm-up seed>-rl<rl seed>``; the spread judged (and
plotted) is the RL seeds' and ``paired_gaps`` pair cells of one RL seed. A cell whose RL seed
is its warm-up seed is launched without ``rl.seed`` (``launch_flags``): it is the ``--seeds``
study's cell of that seed bit for bit, so linking that finished workdir in as
``<loss>-s<s>-seed0-rl0`` reuses it instead of running it again (as the first ``--rl_seeds``
study did, from the ``--seeds`` study's workdir; its warm-up checkpoint copied to
``<workdir>/warmup/seed0``).

    .venv/bin/python benchmarks/staleness_study.py [--output=runs/staleness_study/study.json]
        [--plot=docs/staleness_study.png] [--seeds=0,1,2] [--rl_seeds=0,1,2]
        [--staleness=0,16,64,256] [--no_run]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rlax_llm.cli import load_config  # noqa: E402  (after the repository joins the path)
from rlax_llm.storage import write_text_atomic  # noqa: E402

# The non-saturating task (see the docstring). max_prompt_len 9: '999-999=' and BOS.
TASK_FLAGS = ('--config.task.max_operand=999', '--config.task.operations=+',
              '--config.sampling.max_prompt_len=9', '--config.rl.prompts_per_step=8')
LOSSES = {
    'grpo': (),
    'grpo_tis': ('--config.rl.old_logprobs=recompute', '--config.rl.mismatch.enabled=true',
                 '--config.rl.mismatch.mode=truncate', '--config.rl.mismatch.threshold=2.0'),
    'm2po': ('--config.rl.loss=m2po',),
}
# Per-step metrics kept for every cell (the trainer's names; absent ones are skipped).
SERIES = ('reward/mean', 'staleness/mean', 'clip_fraction', 'm2po/masked_fraction',
          'm2po/m2_before', 'm2po/m2_after', 'is/ratio_mean', 'is/ratio_min', 'is/ratio_max',
          'is/m2', 'mismatch/kl', 'mismatch/ess_fraction', 'mismatch/kept_fraction',
          'mismatch/weight_mean', 'entropy')
# The two losses whose ordering is the claim; the others run last.
MAIN_LOSSES = ('grpo', 'm2po')


def cell_key(loss: str, staleness: int, seed: int, rl_seed: int | None = None) -> str:
  """The name of a cell in the output JSON and of its workdir: ``grpo-s256-seed0`` (warm-up
  and RL on ``config.seed``), ``grpo-s256-seed0-rl1`` (warm-up seed 0, ``rl.seed`` 1)."""
  return f'{loss}-s{staleness}-seed{seed}' + ('' if rl_seed is None else f'-rl{rl_seed}')


def cell_keyer(args: argparse.Namespace) -> Callable[[str, int, int], str]:
  """``(loss, staleness, varied seed) -> cell key`` of the study's mode: the varied seed is
  ``config.seed`` (``--seeds``), or with ``--rl_seeds`` the RL seed on the warm-up of the
  first ``--seeds`` seed."""
  if args.rl_seeds is None:
    return cell_key
  return lambda loss, s, rl_seed: cell_key(loss, s, args.seeds[0], rl_seed)


def varied_seeds(args: argparse.Namespace) -> list[int]:
  """The seeds whose spread the study judges by: ``--rl_seeds``, else ``--seeds``."""
  return args.seeds if args.rl_seeds is None else args.rl_seeds


def cell_order(losses: Sequence[str], staleness: Sequence[int], seeds: Sequence[int]
               ) -> list[tuple[str, int, int]]:
  """Every (loss, staleness, seed) cell, the most informative first.

  Tiers: GRPO and M2PO at the smallest and largest staleness on the first seed (the claim on
  one seed), then on the other seeds, then GRPO and M2PO at the middle staleness values, then
  the other losses (GRPO + TIS). Within a tier: by seed, staleness, then loss as given.
  """
  lo, hi = min(staleness), max(staleness)

  def tier(cell):
    loss, s, seed = cell
    if loss not in MAIN_LOSSES:
      return 3
    if s not in (lo, hi):
      return 2
    return 0 if seed == seeds[0] else 1

  cells = [(loss, s, seed) for seed in seeds for s in staleness for loss in losses]
  return sorted(cells, key=tier)  # stable: the seed, staleness, loss order within a tier


def launch_flags(loss: str, staleness: int, seed: int, args: argparse.Namespace,
                 rl_seed: int | None = None) -> list[str]:
  """The ``rlax_llm.launch`` config arguments of one cell. ``rl_seed`` (``rl.seed``) is
  passed only when it differs from ``seed``: a cell whose RL seed is its warm-up seed has the
  flags of the ``config.seed`` cell, so it is that run, bit for bit."""
  rl = [] if rl_seed is None or rl_seed == seed else [f'--config.rl.seed={rl_seed}']
  return ['--config=configs/default.py', *TASK_FLAGS, f'--config.seed={seed}', *rl,
          f'--config.total_steps={args.steps}', f'--config.rl.learning_rate={args.lr}',
          f'--config.eval.every_steps={args.eval_every}', '--config.staleness.j=1',
          f'--config.staleness.k={staleness + 1}', '--config.log.tensorboard=false',
          f'--config.log.console_every={args.eval_every}',
          # Checkpoints on (for the warm-up's, reused across a seed's cells) but no step save
          # before the last one.
          f'--config.checkpoint.every_steps={args.steps + 1}',
          '--config.checkpoint.every_seconds=0', *LOSSES[loss], *args.set]


def _round(value: float) -> float:
  return float(f'{value:.5g}') if math.isfinite(value) else value


def read_run(workdir: pathlib.Path) -> dict | None:
  """A finished run's figures from its workdir (None when it has not finished, or was
  preempted: its summary says so).

  Returns ``start``/``final`` (held-out greedy accuracy before and after RL), ``curve``
  ([step, accuracy] of every evaluation, step 0 the start), ``series`` (per name in
  ``SERIES`` the value at every RL step), ``max_staleness`` and ``rl_s`` (RL wall seconds).
  """
  summary_path = workdir / 'summary.json'
  if not summary_path.exists():
    return None
  summary = json.loads(summary_path.read_text())
  if summary.get('preempted'):  # stopped by a signal before total_steps: not finished
    return None
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()
          if line.strip()]
  train = [r for r in rows if 'reward/mean' in r]
  series = {name: [_round(r[name]) for r in train] for name in SERIES
            if train and all(name in r for r in train)}
  curve = [[0, _round(summary['eval/start_accuracy'])]]
  curve += [[r['step'], _round(r['eval/accuracy'])] for r in rows if 'eval/accuracy' in r]
  return {'start': summary['eval/start_accuracy'], 'final': summary['eval/final_accuracy'],
          'steps': summary['steps'], 'curve': curve, 'series': series,
          'max_staleness': max((r['staleness/max'] for r in train), default=0),
          'rl_s': round(summary['time/rl_s'], 1), 'total_s': round(summary['time/total_s'], 1)}


def run_cell(loss: str, staleness: int, seed: int, args: argparse.Namespace,
             root: pathlib.Path, rl_seed: int | None = None) -> dict:
  """Runs one cell (or reads it back when its workdir holds a finished run) and returns
  ``read_run``'s figures. The seed's warm-up checkpoint is reused when one is stored;
  ``rl_seed``: the cell's ``rl.seed`` (None: ``seed``)."""
  name = cell_key(loss, staleness, seed, rl_seed)
  workdir = root / name
  done = read_run(workdir)
  if done is not None:
    return done
  if workdir.exists():  # an unfinished or preempted run: start over
    shutil.rmtree(workdir)
  flags = launch_flags(loss, staleness, seed, args, rl_seed)
  warmup = root / 'warmup' / f'seed{seed}'
  run_warmup = workdir / 'checkpoints' / 'warmup'
  workdir.mkdir(parents=True)
  if warmup.exists():
    # The workdir of this cell's run preempted right after its warm-up: the launch resumes
    # from the warm-up (a checkpointed workdir needs its run's config.json, as launch writes).
    shutil.copytree(warmup, run_warmup)
    (workdir / 'config.json').write_text(
        load_config(flags).to_json_best_effort(indent=2, sort_keys=True))
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  with open(workdir.with_suffix('.log'), 'w') as log:
    result = subprocess.run(
        [sys.executable, '-m', 'rlax_llm.launch', *flags, f'--workdir={workdir}'], cwd=ROOT,
        env=env, stdout=log, stderr=subprocess.STDOUT)
  if result.returncode != 0:
    raise SystemExit(f'{name} failed (exit {result.returncode}); '
                     f'its log: {workdir.with_suffix(".log")}')
  if not warmup.exists() and run_warmup.exists():
    shutil.copytree(run_warmup, warmup)
  shutil.rmtree(workdir / 'checkpoints', ignore_errors=True)  # the final step's: not needed
  figures = read_run(workdir)
  if figures is None:
    raise SystemExit(f'{name} exited 0 but left no finished run in {workdir} (no '
                     'summary.json, or a preempted one); run the study again to redo it.')
  return figures


def aggregate(cells: dict[str, dict], losses: Sequence[str], staleness: Sequence[int],
              seeds: Sequence[int], key: Callable[[str, int, int], str] = cell_key) -> dict:
  """Per loss and staleness: the finals of the seeds that finished (``None`` for the others),
  their mean and spread (max - min) in accuracy; ``curve_means``, each finished seed's mean
  accuracy over its evaluations after step 0 (the area under the curve, which also sees how
  late a cell got there), and their mean; run means of the step series (M2PO's masked
  fraction, the clip fraction, the ratio statistics); ``complete`` when every seed
  finished. ``seeds``: the varied seeds, ``key``: a cell's key from (loss, staleness, seed)
  (``cell_keyer``; with ``--rl_seeds`` the seeds are RL seeds and the spread theirs)."""
  table = {}
  for loss in losses:
    for s in staleness:
      runs = [cells.get(key(loss, s, seed)) for seed in seeds]
      done = [r for r in runs if r is not None]
      if not done:
        continue
      finals = [r['final'] for r in done]
      curve_means = [statistics.fmean(acc for step, acc in r['curve'] if step > 0)
                     for r in done]
      means = {}
      for name in SERIES:
        values = [v for r in done for v in r['series'].get(name, [])]
        if values:
          means[name] = _round(statistics.fmean(values))
      table.setdefault(loss, {})[str(s)] = {
          'finals': [None if r is None else r['final'] for r in runs],
          'mean': statistics.fmean(finals), 'spread': max(finals) - min(finals),
          'curve_means': curve_means, 'curve_mean': statistics.fmean(curve_means),
          'start_mean': statistics.fmean(r['start'] for r in done),
          'complete': len(done) == len(seeds), 'series_means': means}
  return table


def judge(table: dict, staleness: Sequence[int]) -> dict:
  """The issue's goals at the largest staleness ``hi`` against on-policy GRPO (s = 0).

  The seed spread of a comparison is the larger max - min of its two cells' finals.
  * ``grpo_falls``: met when GRPO's mean at ``hi`` is below on-policy GRPO's by more than it;
  * ``m2po_holds``: met when M2PO's mean at ``hi`` is not below on-policy GRPO's by more than
    it (above counts as holding: the paper's M2PO at 256 is above on-policy).
  A goal is ``pending`` while one of its cells lacks a seed. Not judged, beside it:
  ``curve_mean_gap``, the same difference in the mean accuracy over the curve, and
  ``paired_gaps``, the difference seed by seed (a seed fixes the warm-up and the held-out
  problems, so the seed spread holds differences between seeds that a pair cancels). With
  ``--rl_seeds`` the table's seeds are RL seeds on one warm-up: the spread is the RL phase's
  own (sampling) noise and the pairs share the RL seed.
  """
  lo, hi = min(staleness), max(staleness)
  on_policy = table.get('grpo', {}).get(str(lo))
  out = {}
  for goal, loss in (('grpo_falls', 'grpo'), ('m2po_holds', 'm2po')):
    cell = table.get(loss, {}).get(str(hi))
    if on_policy is None or cell is None or not (on_policy['complete'] and cell['complete']):
      out[goal] = {'status': 'pending'}
      continue
    gap = cell['mean'] - on_policy['mean']
    spread = max(on_policy['spread'], cell['spread'])
    met = gap < -spread if goal == 'grpo_falls' else gap >= -spread
    out[goal] = {'status': 'met' if met else 'missed', 'gap': gap, 'spread': spread,
                 'on_policy_mean': on_policy['mean'], f'{loss}_s{hi}_mean': cell['mean'],
                 'curve_mean_gap': cell['curve_mean'] - on_policy['curve_mean'],
                 'paired_gaps': [a - b for a, b in zip(cell['finals'], on_policy['finals'])]}
  return out


# The token fractions the losses take out of the gradient, plotted per step.
REMOVED = (('m2po', 'm2po/masked_fraction', 'M2PO masked-token fraction'),
           ('grpo', 'clip_fraction', 'GRPO clipped-token fraction'))


def plot(result: dict, path: pathlib.Path) -> None:
  """Held-out accuracy curves (mean over the finished seeds: RL seeds with ``--rl_seeds``)
  per loss, one line per staleness, then per step the fraction of tokens M2PO masks and
  GRPO's clip removes (seed mean, 20-step running mean)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  losses, staleness = result['losses'], result['staleness']
  # (No 'rl_seeds' in a study JSON from before --rl_seeds.)
  mode = argparse.Namespace(seeds=result['seeds'], rl_seeds=result.get('rl_seeds'))
  seeds, key = varied_seeds(mode), cell_keyer(mode)
  what = 'seeds' if mode.rl_seeds is None else f'RL seeds, warm-up seed {mode.seeds[0]}'
  panels = len(losses) + len(REMOVED)
  fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6))

  def finished(loss, s):
    return [result['cells'][k] for seed in seeds if (k := key(loss, s, seed)) in result['cells']]

  def close(ax, title, ylabel):
    ax.set(title=title, xlabel='RL step', ylabel=ylabel)
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
    else:
      ax.text(0.5, 0.5, 'no cell finished yet', ha='center', transform=ax.transAxes)

  for ax, loss in zip(axes, losses):
    for color, s in enumerate(staleness):  # one colour per staleness in every panel
      runs = finished(loss, s)
      if runs:
        steps = [p[0] for p in runs[0]['curve']]
        mean = [statistics.fmean(r['curve'][i][1] for r in runs) for i in range(len(steps))]
        ax.plot(steps, [100 * m for m in mean], label=f's = {s} ({len(runs)} {what})',
                color=f'C{color}')
    close(ax, loss, 'held-out greedy accuracy (%)')
  for ax, (loss, name, title) in zip(axes[len(losses):], REMOVED):
    for color, s in enumerate(staleness):  # one colour per staleness in every panel
      runs = [r['series'][name] for r in finished(loss, s) if name in r['series']]
      if runs:
        mean = [statistics.fmean(v) for v in zip(*runs)]
        smooth = [statistics.fmean(mean[max(0, i - 19):i + 1]) for i in range(len(mean))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=f's = {s}', color=f'C{color}')
    close(ax, title, 'fraction of tokens')
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _ints(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(',')]
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected comma-separated integers, got {text!r}') from None
  if any(v < 0 for v in values) or len(set(values)) != len(values):
    raise argparse.ArgumentTypeError(f'expected distinct integers >= 0, got {text!r}')
  return values


def _losses(text: str) -> list[str]:
  names = text.split(',')
  unknown = [n for n in names if n not in LOSSES]
  if unknown or len(set(names)) != len(names):
    raise argparse.ArgumentTypeError(f'--losses={text!r}: expected distinct names from '
                                     f'{", ".join(LOSSES)}')
  return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--output', type=pathlib.Path,
                      default=ROOT / 'runs' / 'staleness_study' / 'study.json',
                      help='the study JSON, rewritten after every cell; resumed from')
  parser.add_argument('--workdir', type=pathlib.Path, default=None,
                      help='where the cells\' runs go (default: <output dir>/runs)')
  parser.add_argument('--plot', type=pathlib.Path, default=None, help='a PNG of the curves')
  parser.add_argument('--seeds', type=_ints, default=[0, 1, 2],
                      help='config.seed of the cells (with --rl_seeds: the first is the '
                           'warm-up seed of every cell)')
  parser.add_argument('--rl_seeds', type=_ints, default=None,
                      help='vary rl.seed (the RL sampling keys) on the warm-up of the first '
                           '--seeds seed instead of config.seed; the spread judged is theirs')
  parser.add_argument('--staleness', type=_ints, default=[0, 16, 64, 256])
  parser.add_argument('--losses', type=_losses, default=list(LOSSES))
  parser.add_argument('--steps', type=int, default=800)
  parser.add_argument('--lr', type=float, default=1e-5)
  parser.add_argument('--eval_every', type=int, default=50)
  parser.add_argument('--no_run', action='store_true',
                      help='run no cell: print (and plot) what --output holds so far')
  parser.add_argument('--set', action='append', default=[], metavar='--config.KEY=VALUE',
                      help='an extra launch override for every cell (repeatable), e.g. the '
                           "paper's settings; part of the study's settings")
  args = parser.parse_args(argv)
  bad = [s for s in args.set if not s.startswith('--config.') or '=' not in s]
  if bad:
    parser.error(f'--set takes --config.KEY=VALUE launch overrides, got {bad}')
  if args.steps <= 0 or args.eval_every <= 0 or args.lr <= 0:
    parser.error(f'--steps={args.steps}, --eval_every={args.eval_every} and --lr={args.lr} '
                 'must be > 0')
  return args


def settings(args: argparse.Namespace) -> dict:
  """What every cell's figures depend on besides (loss, staleness, seed): a resumed study
  must have the same, or its cells would mix two experiments."""
  out = {'task_flags': list(TASK_FLAGS), 'steps': args.steps, 'lr': args.lr,
         'eval_every': args.eval_every, 'set': list(args.set)}
  if args.rl_seeds is not None:  # (absent otherwise: the older studies' JSON still re-reads)
    out['warmup_seed'] = args.seeds[0]
  return out


def load_previous(path: pathlib.Path, expected: dict) -> dict[str, dict]:
  """The cells already in ``path`` (none when it does not exist); refuses another study's."""
  if not path.exists():
    return {}
  previous = json.loads(path.read_text())
  if previous.get('settings') != expected:
    raise SystemExit(f'{path} holds a study with settings {previous.get("settings")}, not '
                     f'{expected}; pass another --output (and --workdir) for these settings.')
  return previous.get('cells', {})


def study(args: argparse.Namespace,
          run: Callable[..., dict] = run_cell) -> dict:
  """Runs every missing cell in ``cell_order`` (none with ``args.no_run``), rewriting
  ``args.output`` after each, and returns the whole study (``run``: one cell's figures,
  ``run_cell`` unless a test's; with ``--rl_seeds`` called with ``rl_seed=``)."""
  root = args.workdir or args.output.parent / 'runs'
  expected = settings(args)
  cells = load_previous(args.output, expected)
  seeds, key = varied_seeds(args), cell_keyer(args)
  order = cell_order(args.losses, args.staleness, seeds)

  def result() -> dict:
    table = aggregate(cells, args.losses, args.staleness, seeds, key)
    mode = {} if args.rl_seeds is None else {'rl_seeds': args.rl_seeds}
    return {'benchmark': 'staleness_study', 'settings': expected, 'losses': args.losses,
            'staleness': args.staleness, 'seeds': args.seeds, **mode,
            'order': [key(*c) for c in order],
            'finished': sum(key(*c) in cells for c in order), 'cells_total': len(order),
            'table': table, 'goals': judge(table, args.staleness), 'cells': cells}

  args.output.parent.mkdir(parents=True, exist_ok=True)
  for loss, s, seed in order:
    name = key(loss, s, seed)
    if name in cells or args.no_run:
      continue
    cells[name] = (run(loss, s, seed, args, root) if args.rl_seeds is None
                   else run(loss, s, args.seeds[0], args, root, rl_seed=seed))
    write_text_atomic(args.output, json.dumps(result()))
    print(f'{name}: start {cells[name]["start"]:.3f} final {cells[name]["final"]:.3f} '
          f'({cells[name]["total_s"]:.0f} s)', file=sys.stderr, flush=True)
  return result()


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  out = study(args)
  if args.plot is not None:
    plot(out, args.plot)
  print(json.dumps(out))


if __name__ == '__main__':
  main()
