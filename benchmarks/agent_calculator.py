"""Benchmark: the SmolLM2 calculator agent, RL over the plateau of an erring warm-up.

For each seed, runs ``python -m rlax_llm.launch`` on ``configs/agent.py:calculator_erring``
(a supervised warm-up on an oracle whose demonstrations are 60% wrong, then GRPO over episode
returns) and prints one JSON object:

- ``warmup_alone``: held-out greedy episode success after the warm-up alone
  (``total_steps=0``), for each of ``--warmup_alone`` warm-up lengths (default 24 and 48
  steps): how far imitation gets, and whether it gains from running longer;
- ``rl``: the recipe itself (its own warm-up, then RL): success at the RL starting point
  (``before``), at the end (``after``), and the held-out curve;
- per seed ``plateau`` (the best warm-up-alone success), ``gain`` (``after - plateau``, in
  points) and ``met`` (``gain >= --min_points``); the goal is judged per seed.

The runs share one warm-up cache (``warmup.cache``, rlax_llm/warmup_cache.py): the RL run
restores, bit for bit, the warm-up its equal-length warm-up-alone run trained, rather than
training it again (``rl.before`` then equals that run's success, which the JSON checks as
``rl_starts_where_the_warmup_ended``).

    .venv/bin/python benchmarks/agent_calculator.py --seeds=0 --workdir=runs/calculator

Each SmolLM2 run takes 7-20 minutes on 2 cores and peaks at 7-19 GB resident: the runs go
one at a time. With ``--workdir``, a run that already finished there (its ``summary.json``,
not preempted) with the config this study asks for (its ``config.json``; where the warm-up
cache lives may differ) is read, not run again, so an interrupted study resumes where it
stopped (an unfinished one is relaunched there and resumes from its checkpoint); a run there
of another config is cleared and run again.
Extra ``--config.*`` overrides after ``--`` apply to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from agent_grid import read_run  # noqa: E402  (benchmarks/, this script's directory)
from rlax_llm.cli import load_config, load_config_file  # noqa: E402  (the repo on the path)
from rlax_llm.run_config import config_changes  # noqa: E402

CONFIG = 'configs/agent.py:calculator_erring'


def recipe_warmup_steps() -> int:
  """The warm-up length of ``CONFIG``: the RL run's starting point."""
  return int(load_config_file(str(ROOT / CONFIG)).warmup.steps)


def jobs(seed: int, warmup_alone: list[int], base: pathlib.Path) -> list[tuple[str, list[str]]]:
  """``(name, overrides)`` of one seed's runs, in the order they run: the recipe's own
  warm-up length alone first (it fills the warm-up cache), then the RL run (which restores
  it), then the other warm-up lengths."""
  recipe = recipe_warmup_steps()
  ordered = sorted(warmup_alone, key=lambda steps: (steps != recipe, steps))
  runs = [(f'seed{seed}_warmup{steps}',
           ['--config.total_steps=0', f'--config.warmup.steps={steps}']) for steps in ordered]
  rl_at = 1 if ordered and ordered[0] == recipe else 0
  runs.insert(rl_at, (f'seed{seed}_rl', []))
  common = [f'--config.seed={seed}', f'--config.warmup.cache={base / "warmup_cache"}']
  return [(name, common + overrides) for name, overrides in runs]


def another_config(workdir: pathlib.Path, config) -> bool:
  """Whether ``workdir`` holds a run of a config that computes another run than ``config``
  (``run_config.config_changes`` on its ``config.json``; where the warm-up cache lives may
  differ)."""
  saved = workdir / 'config.json'
  return saved.exists() and bool(config_changes(json.loads(saved.read_text()), config,
                                                ('warmup.cache',)))


def finished(workdir: pathlib.Path, config) -> bool:
  """Whether ``workdir`` holds a finished run of ``config`` (a summary that is not a
  preempted one, and not ``another_config``'s)."""
  summary = workdir / 'summary.json'
  return (summary.exists() and not json.loads(summary.read_text()).get('preempted', False)
          and (workdir / 'config.json').exists() and not another_config(workdir, config))


def run_one(name: str, overrides: list[str], workdir: pathlib.Path,
            extra: list[str]) -> dict:
  """One launch (skipped when ``workdir`` already holds it finished, with the same config);
  its ``read_run`` figures and wall time."""
  config_args = [f'--config={ROOT / CONFIG}', *overrides, *extra]
  config = load_config(config_args)
  command = [sys.executable, '-m', 'rlax_llm.launch', *config_args, f'--workdir={workdir}']
  wall = None
  if not finished(workdir, config):
    if another_config(workdir, config):  # cleared; an unfinished run of this one resumes
      shutil.rmtree(workdir)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if result.returncode != 0 or not finished(workdir, config):
      raise SystemExit(f'{name} failed (exit {result.returncode}; {" ".join(command)}):\n'
                       f'{result.stderr[-3000:]}')
  return {**read_run(workdir), 'wall_s': wall, 'command': ' '.join(command[1:])}


def judge(seed: int, runs: dict[str, dict], min_points: float) -> dict:
  """One seed's figures from its runs (``jobs``' names): the warm-up-alone successes, the
  RL run's, the plateau, the gain in points and whether it meets ``min_points``."""
  alone = {int(name.rsplit('warmup', 1)[1]): run['before'] for name, run in runs.items()
           if name.startswith(f'seed{seed}_warmup')}
  rl = runs[f'seed{seed}_rl']
  plateau = max(alone.values()) if alone else rl['before']
  gain = round(100.0 * (rl['after'] - plateau), 2)
  recipe = recipe_warmup_steps()
  return {
      'seed': seed,
      'warmup_alone': {str(steps): alone[steps] for steps in sorted(alone)},
      'rl': {key: rl[key] for key in ('before', 'after', 'best', 'curve', 'steps')},
      'plateau': plateau,
      'gain': gain,
      'met': gain >= min_points,
      # The RL run restored the warm-up its equal-length warm-up-alone run trained (the same
      # bits), so both evaluate the same policy on the same held-out problems.
      'rl_starts_where_the_warmup_ended': (alone[recipe] == rl['before']
                                           if recipe in alone else None),
      'wall_s': {name: run['wall_s'] for name, run in runs.items()},
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--warmup_alone', default='24,48',
                      help='warm-up lengths run alone (total_steps=0), comma separated')
  parser.add_argument('--min_points', type=float, default=20.0,
                      help='the goal: RL this many points over the best warm-up alone')
  parser.add_argument('--workdir', default='',
                      help='keep the runs here and resume finished ones (default: a tmp dir)')
  parser.add_argument('extra', nargs='*', help='extra --config.* overrides')
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(',')]
  warmup_alone = [int(s) for s in args.warmup_alone.split(',') if s]
  if any(steps <= 0 for steps in warmup_alone):
    parser.error(f'--warmup_alone: warm-up lengths must be positive, got {warmup_alone}')
  with tempfile.TemporaryDirectory() as tmp:
    base = pathlib.Path(args.workdir or tmp).resolve()
    start = time.perf_counter()
    per_seed = []
    for seed in seeds:
      runs = {name: run_one(name, overrides, base / name, args.extra)
              for name, overrides in jobs(seed, warmup_alone, base)}
      per_seed.append(judge(seed, runs, args.min_points))
    total = time.perf_counter() - start
  print(json.dumps({
      'benchmark': 'agent_calculator',
      'config': CONFIG,
      'goal': f'RL +{args.min_points:g} points over the best warm-up alone, each seed',
      'met': all(seed['met'] for seed in per_seed),
      'seeds': per_seed,
      'total_wall_s': total,
      'extra': args.extra,
  }, indent=2))


if __name__ == '__main__':
  main()
