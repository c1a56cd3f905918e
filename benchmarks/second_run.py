"""Benchmark: a second run of the same config in one process (a notebook, a sweep, a test
session), against the first: wall and CPU seconds, and how many programs JAX traced, lowered
to MLIR and compiled (``jax.monitoring``'s ``/jax/core/compile/*`` duration events) in each.

Each run is ``local.build_run`` + ``Run.execute()`` (warm-up, RL steps, evaluations) on a
fresh temporary workdir. Roles alike share their jitted programs (``trainer.Trainer``,
``rollout.engine.Engine``, ``trainer.teacher.Teacher``), so the second run should trace,
lower and compile (almost) nothing. Prints one JSON object::

    {"config": ..., "runs": [{"wall_s": ..., "cpu_s": ..., "traced": ..., "lowered": ...,
     "compiled": ..., "trace_s": ..., "lower_s": ..., "compile_s": ...}, ...]}

    .venv/bin/python benchmarks/second_run.py [--config=configs/default.py:smoke
        --runs=2 --total_steps=1 --warmup_steps=4]

Point ``PYTHONPATH`` at another tree to measure that tree (the script uses only
``rlax_llm``'s public API). Set ``JAX_COMPILATION_CACHE_DIR`` to an empty folder for a cold
start: otherwise XLA's persistent cache serves the first run's backend compiles too (it
skips neither tracing nor lowering).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace',
          '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
          '/jax/core/compile/backend_compile_duration': 'compile'}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/default.py:smoke')
  parser.add_argument('--runs', type=int, default=2)
  parser.add_argument('--total_steps', type=int, default=1)
  parser.add_argument('--warmup_steps', type=int, default=4)
  args = parser.parse_args()
  # pylint: disable=import-outside-toplevel  # imported from the tree being measured
  import jax
  from rlax_llm.backends import local
  from rlax_llm.cli import load_config_file
  from rlax_llm.config import run_spec

  counts: collections.Counter = collections.Counter()
  seconds: collections.Counter = collections.Counter()

  def listen(event: str, duration: float, **_) -> None:
    if event in EVENTS:
      counts[EVENTS[event]] += 1
      seconds[EVENTS[event]] += duration

  jax.monitoring.register_event_duration_secs_listener(listen)
  runs = []
  for _ in range(args.runs):
    config = load_config_file(args.config)
    config.total_steps = args.total_steps
    config.warmup.steps = args.warmup_steps
    config.log.tensorboard = False
    config.checkpoint.every_steps = 0
    counts.clear()
    seconds.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as workdir:
      with local.build_run(config, workdir, run_spec(config)) as run:
        run.execute()
    runs.append({'wall_s': round(time.perf_counter() - wall, 2),
                 'cpu_s': round(time.process_time() - cpu, 2),
                 'traced': counts['trace'], 'lowered': counts['lower'],
                 'compiled': counts['compile'],
                 **{f'{name}_s': round(seconds[name], 2)
                    for name in ('trace', 'lower', 'compile')}})
  print(json.dumps({'config': args.config, 'total_steps': args.total_steps,
                    'warmup_steps': args.warmup_steps, 'runs': runs}))


if __name__ == '__main__':
  main()
