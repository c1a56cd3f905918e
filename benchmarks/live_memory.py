r"""Where a run's host memory goes: the live JAX arrays after a few RL steps of a recipe, run in
this process, grouped by shape and dtype, and the process's resident memory; prints one JSON
object.

    .venv/bin/python benchmarks/live_memory.py --config=configs/smollm2.py --steps=2

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
import pathlib
import sys
import tempfile

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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/smollm2.py')
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--groups', type=int, default=12, help='largest groups printed')
  args = parser.parse_args()
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
