r"""Where a run's host memory goes: the live JAX arrays after a few RL steps of a recipe, run in
this process, grouped by shape and dtype, and the process's resident memory; prints one JSON
object.

    .venv/bin/python benchmarks/live_memory.py --config=configs/smollm2.py --steps=2
    .venv/bin/python benchmarks/live_memory.py --config=configs/smollm2.py --steps=22 \
        --launch --checkpoint_every=20

``--step_memory``: the recipe's update compiled for its batch (``rl.prompts_per_step *
rl.group_size`` rows of ``sampling.max_prompt_len + sampling.max_new_tokens`` tokens), XLA's
memory analysis in MiB (``temp``: the step's temporaries, beside the donated params and
moments); ``--set=--config.model.remat=none`` (repeatable) overrides the config first.

``--launch``: the recipe run as the head-to-head runs it (benchmarks/peers/run_rlax.py:
``python -m rlax_llm.launch``, in-run evaluation off, Orbax checkpoints every
``--checkpoint_every`` steps, all kept), its resident memory read from /proc every 0.5 s:
``peak_rss_mib`` is the launch process's VmHWM at the end, ``per_step`` the highest VmRSS seen
while each step ran (step ``n``: from step ``n - 1``'s metrics line to step ``n``'s; the first
includes the load and the first compiles), and ``metrics`` each step's loss, gradient norm and
mean reward, to check that a change leaves the learning as it was.

Checkpoints, evaluation and held-out prompts are off (they are not what is measured). Each
group is ``[MiB, arrays, shape, dtype]``, largest first: a parameter-shaped group counted
``n`` times is ``n`` copies of that weight (trainer params, optimizer moments, the parameter
server's versions, the engine's copy). ``vm_hwm_mib`` is the peak resident memory of the
process (compilation included), ``vm_rss_mib`` what it holds at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def status_mib() -> dict[str, float]:
  """VmHWM and VmRSS of this process in MiB (Linux /proc)."""
  out = {}
  for line in pathlib.Path('/proc/self/status').read_text().splitlines():
    key, _, value = line.partition(':')
    if key in ('VmHWM', 'VmRSS'):
      out[key.lower().replace('vm', 'vm_') + '_mib'] = int(value.split()[0]) / 1024
  return out


def launch_peaks(config: str, steps: int, checkpoint_every: int) -> dict:
  """Runs ``config`` through ``python -m rlax_llm.launch`` (see the module docstring) and
  returns its peak resident memory, the highest per step and each step's learning figures."""
  with tempfile.TemporaryDirectory() as workdir:
    metrics = pathlib.Path(workdir) / 'metrics.jsonl'
    command = [sys.executable, '-m', 'rlax_llm.launch', f'--config={config}',
               f'--workdir={workdir}', f'--config.total_steps={steps}',
               f'--config.checkpoint.every_steps={checkpoint_every}',
               '--config.checkpoint.keep=100000', '--config.checkpoint.every_seconds=0',
               '--config.eval.every_steps=0', '--config.task.num_eval=0']
    log = pathlib.Path(workdir) / 'launch.log'
    with log.open('w') as out:
      process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                 stdout=out, stderr=subprocess.STDOUT)
    per_step, hwm = collections.defaultdict(float), 0.0
    status = pathlib.Path(f'/proc/{process.pid}/status')
    while process.poll() is None:
      done = sum(1 for _ in metrics.open()) if metrics.exists() else 0
      try:
        for line in status.read_text().splitlines():
          key, _, value = line.partition(':')
          if key == 'VmRSS':
            per_step[done + 1] = max(per_step[done + 1], int(value.split()[0]) / 1024)
          elif key == 'VmHWM':
            hwm = max(hwm, int(value.split()[0]) / 1024)
      except (OSError, ValueError):
        pass
      time.sleep(0.5)
    if process.returncode:
      raise SystemExit(f'the run failed (exit {process.returncode}):\n'
                       f'{log.read_text()[-3000:]}')
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  return {'benchmark': 'live_memory', 'config': config, 'steps': steps,
          'checkpoint_every': checkpoint_every, 'peak_rss_mib': hwm,
          'per_step': {step: round(mib) for step, mib in sorted(per_step.items())
                       if step <= steps},
          'metrics': [[r['step'], r.get('loss'), r.get('grad_norm'), r.get('reward/mean')]
                      for r in rows]}


def step_memory(config) -> dict:
  """XLA's memory analysis of ``config``'s compiled update step, in MiB (see the module
  docstring); nothing runs."""
  # pylint: disable=import-outside-toplevel  # jax and the library: after argument parsing
  import numpy as np

  from rlax_llm import roles
  from rlax_llm import sharding as sharding_lib
  from rlax_llm.config import validate_config
  from rlax_llm.data_types import TrainBatch
  spec = validate_config(config)
  _, model, params, _ = roles.prepare(config)
  trainer = roles.build_trainer(config, spec, model, params, roles.meshes(config)['trainer'])
  del params
  rows = config.rl.prompts_per_step * config.rl.group_size
  length = config.sampling.max_prompt_len + config.sampling.max_new_tokens
  ints, floats = np.zeros((rows, length), np.int32), np.zeros((rows, length), np.float32)
  batch = sharding_lib.global_batch(
      TrainBatch(tokens=ints, loss_mask=floats, behaviour_logprobs=floats, support_sizes=ints,
                 advantages=np.zeros(rows, np.float32), versions=ints,
                 group_ids=np.zeros(rows, np.int32)), trainer.mesh, trainer.rules)
  with sharding_lib.activation_sharding(trainer.mesh, trainer.rules):
    analysis = trainer._step.lower(  # pylint: disable=protected-access
        trainer.params, trainer.opt_state, batch, trainer.reference_params
    ).compile().memory_analysis()
  return {'rows': rows, 'length': length, 'remat': config.model.remat,
          **{name: getattr(analysis, f'{name}_size_in_bytes') / 2**20
             for name in ('argument', 'output', 'alias', 'temp')}}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/smollm2.py')
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--groups', type=int, default=12, help='largest groups printed')
  parser.add_argument('--launch', action='store_true',
                      help='run the recipe through rlax_llm.launch, reading its memory')
  parser.add_argument('--checkpoint_every', type=int, default=20, help='with --launch')
  parser.add_argument('--step_memory', action='store_true',
                      help="compile the recipe's update and print its memory analysis")
  parser.add_argument('--set', action='append', default=[], metavar='--config.KEY=VALUE',
                      help='with --step_memory: a config override, as rlax_llm.launch takes '
                      'it (repeatable), e.g. --config.model.remat=none')
  args = parser.parse_args()
  bad = [s for s in args.set if not s.startswith('--config.') or '=' not in s]
  if bad:
    parser.error(f'--set takes --config.KEY=VALUE overrides, got {bad}')
  if args.step_memory:
    from rlax_llm.cli import load_config  # pylint: disable=import-outside-toplevel
    config = load_config([f'--config={args.config}', *args.set])
    print(json.dumps({'benchmark': 'live_memory', 'config': args.config, 'set': args.set,
                      'step_memory_mib': step_memory(config)}))
    return
  if args.launch:
    print(json.dumps(launch_peaks(args.config, args.steps, args.checkpoint_every)))
    return
  # pylint: disable=import-outside-toplevel
  import jax
  from rlax_llm.backends import build_run
  from rlax_llm.cli import load_config_file
  from rlax_llm.config import validate_config
  config = load_config_file(args.config)
  config.total_steps = args.steps
  config.checkpoint.every_steps = 0
  config.checkpoint.every_seconds = 0
  config.eval.every_steps = 0
  config.task.num_eval = 0
  with tempfile.TemporaryDirectory() as workdir:
    with build_run(config, workdir, validate_config(config)) as run:
      run.execute()
      size, count = collections.Counter(), collections.Counter()
      for array in jax.live_arrays():
        key = (tuple(array.shape), str(array.dtype))
        size[key] += array.nbytes
        count[key] += 1
      result = {
          'benchmark': 'live_memory', 'config': args.config, 'steps': args.steps,
          'live_arrays_mib': sum(size.values()) / 2**20,
          'groups': [[b / 2**20, count[k], list(k[0]), k[1]]
                     for k, b in size.most_common(args.groups)],
          **status_mib()}
  print(json.dumps(result))


if __name__ == '__main__':
  main()
