r"""The head-to-head's rlax_llm side: the shipped recipe, through ``python -m rlax_llm.launch``.

Runs in rlax_llm's virtual environment:

    .venv/bin/python benchmarks/peers/run_rlax.py --job=JOB.json --run_dir=DIR \
        [--steps=N] [--save_every=K]

Launches ``configs/smollm2.py`` as a user would (the packaged GGUF, the recipe's settings:
``job['sides']['rlax_llm']`` is read from the same config), with only what the comparison
needs overridden: the steps, Orbax checkpoints every ``save_every`` steps (all kept), and no
in-run evaluation (``eval.every_steps=0``, ``task.num_eval=0``: benchmarks/peers/evaluate.py
grades every side; the held-out split and train stream do not depend on ``num_eval`` up to
250). This process watches the run: a step's ``wall_s`` is when its line reached
``metrics.jsonl``, counted from the launch process's start, and the peak memory is the launch
process's VmHWM (it runs every role in-process). Its timers are rlax_llm's own
(``time/rollout_s``, ``time/train_s``, ``time/rollout_tokens_per_s``). After the run each
checkpoint is exported by ``save_pretrained`` to ``<run_dir>/checkpoint-<step>`` (not timed).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

import common  # noqa: E402  (plain Python, shared by the sides)


def launch_command(workdir: pathlib.Path, steps: int, save_every: int) -> list[str]:
  """The ``rlax_llm.launch`` command line of the run."""
  return [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/smollm2.py',
          f'--workdir={workdir}', f'--config.total_steps={steps}',
          f'--config.checkpoint.every_steps={save_every}', '--config.checkpoint.keep=100000',
          '--config.checkpoint.every_seconds=0', '--config.eval.every_steps=0',
          '--config.task.num_eval=0']


def vm_hwm_mb(pid: int) -> float:
  """Peak resident memory (VmHWM) of process ``pid`` in MB; 0 once it is gone."""
  try:
    for line in pathlib.Path(f'/proc/{pid}/status').read_text().splitlines():
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) / 1024.0
  except (OSError, ValueError):
    pass
  return 0.0


def watch(process: subprocess.Popen, metrics: pathlib.Path, started: float
          ) -> tuple[dict[int, float], float]:
  """Polls the run until it exits: each step's arrival time in ``metrics.jsonl`` (seconds
  since ``started``) and the launch process's peak memory."""
  arrived: dict[int, float] = {}
  peak = 0.0
  while True:
    done = process.poll() is not None
    peak = max(peak, vm_hwm_mb(process.pid))
    for row in common.read_jsonl(metrics) if metrics.exists() else []:
      arrived.setdefault(int(row['step']), time.time() - started)
    if done:
      return arrived, peak
    time.sleep(0.5)


def export_checkpoints(workdir: pathlib.Path, run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
  """Every Orbax checkpoint of the run as a Hugging Face directory (``save_pretrained``)."""
  # pylint: disable=import-outside-toplevel  # jax: after the run, in this process only
  from flax import nnx

  from rlax_llm.checkpoint import read_params
  from rlax_llm.models import from_pretrained, save_pretrained, smollm2_gguf_path
  from rlax_llm.models.model import split_module
  from rlax_llm.workdir import finished_steps
  module, tokenizer = from_pretrained(smollm2_gguf_path())
  model, template = split_module(module)
  steps_dir = workdir / 'checkpoints' / 'steps'
  out = {}
  for step in finished_steps(steps_dir):
    params = read_params(steps_dir / str(step), template)
    path = run_dir / f'checkpoint-{step}'
    save_pretrained(nnx.merge(model.graphdef, params), tokenizer, path)
    out[step] = path
  return out


def main() -> None:
  args, job, s, steps, _ = common.side_run('rlax_llm', __doc__.split('\n')[0])
  run_dir = pathlib.Path(args.run_dir)
  workdir = run_dir / 'workdir'
  import importlib.metadata as md  # pylint: disable=import-outside-toplevel
  versions = {name: md.version(name) for name in ('jax', 'flax', 'optax')}
  versions['rlax_llm'] = subprocess.run(
      ['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD'], capture_output=True,
      text=True).stdout.strip() or 'unknown'
  run_log = common.RunLog(run_dir, 'rlax_llm', versions, s)
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  started = time.time()
  with open(run_dir / 'launch.log', 'w', encoding='utf-8') as log:
    process = subprocess.Popen(launch_command(workdir, steps, args.save_every), cwd=ROOT,
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    # A budget's SIGTERM goes to the run, which saves a checkpoint and exits 0 (then export).
    signal.signal(signal.SIGTERM, lambda *_: process.send_signal(signal.SIGTERM))
    arrived, peak = watch(process, workdir / 'metrics.jsonl', started)
  if process.returncode:
    raise SystemExit(f'the rlax_llm run failed (exit {process.returncode}); see '
                     f'{run_dir / "launch.log"}.')
  prompt_len = sum(len(r['prompt_ids']) for r in job['train_rows']) / len(job['train_rows'])
  trained = s['prompts_per_step'] * s['group_size']
  for row in common.read_jsonl(workdir / 'metrics.jsonl'):
    # Token counts from the run's mean completion length (its metrics give no totals).
    length = row.get('completion/length_mean') or 0.0
    run_log.step(
        row['step'], rollout_s=row['time/rollout_s'], train_s=row['time/train_s'],
        rollout_tokens=round(s['samples_per_step'] * length),
        train_tokens=0 if row.get('update/skipped') else round(trained * (prompt_len + length)),
        reward_mean=float('nan') if row.get('reward/mean') is None else row['reward/mean'],
        wall=arrived[row['step']],
        peak_rss_mb=peak, rollout_tokens_per_s_own=row.get('time/rollout_tokens_per_s'))
  for step, path in export_checkpoints(workdir, run_dir).items():
    run_log.checkpoint(step, path, arrived[step])
  print(f'rlax_llm: {steps} steps in {arrived[max(arrived)]:.0f} s; log in {run_dir}')


if __name__ == '__main__':
  main()
