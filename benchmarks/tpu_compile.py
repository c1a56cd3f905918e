"""Every recipe's programs compiled for its Cloud TPU slice on this CPU machine (libtpu).

For each recipe (a config and the slice(s) it is sized for) this compiles, with
``launch.recipes.compile.compile_run``, the trainer's step, the trainer's cast before a push,
the engine's prefill and its decode step (with the run's weights, and with int8 ones) as the
run builds them, and prints JSON: per program the compiled GiB per chip (arguments,
temporaries, outputs) against the chip's HBM and ``presets.memory_plan``'s figure for the same
part, the compile time, and the roofline step time, tokens/s per chip and MFU from the
compiler's FLOPs and bytes accessed, each loop's body counted once per trip
(``program_report.loop_counted_costs``; ``compiler_model``: a model from the compiler's
counts, not a measurement). Needs the TPU compiler: ``pip install -e '.[tpu]'`` (or ``.[test]``).

    PYTHONPATH=. python benchmarks/tpu_compile.py [--recipes=NAME,...] [--programs=...]
        [--layers=N] [--moe_impl=ragged|dense] [--set=KEY=VALUE ...]

``--layers`` compiles each preset with that many layers (a quick look; memory and time are
then not the run's). Without it every program compiles at the model's real depth: the
trainer's layer stack and the engine's are scans, so compile time does not grow with depth.
``--moe_impl`` compiles a mixture of experts with that ``Execution.moe_impl`` (default: the
model's, ``'ragged'``) in the trainer and the engine alike; ``--set`` overrides a config leaf
of every recipe (``--set rollout.layer_loop=unrolled``: the engine's layers unrolled; ``--set
model.inference_moe_impl=dense_decode``: the engine's experts computed apart from the
trainer's, ``roles.inference_model``, named in each recipe's JSON).
Recipes (``RECIPES``): the shipped SmolLM2, math and GSM8K configs on v5e-8, a four-host
v5e-16, and the 8B/32B recipes (configs/gsm8k_large.py) on their trainer and inference
slices.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launch.recipes import checks  # noqa: E402
from launch.recipes import compile as compile_lib  # noqa: E402
from launch.recipes.slices import get_slice  # noqa: E402
from rlax_llm.cli import load_config  # noqa: E402

# name -> (config, trainer slice, inference slice: None on the local backend, one slice).
RECIPES = {
    'smollm2': ('configs/smollm2.py', 'v5e-8', None),
    'smollm2_smoke': ('configs/smollm2.py:smoke', 'v5e-8', None),
    'smollm2_int8': ('configs/smollm2.py:int8', 'v5e-8', None),
    'gsm8k_qwen2.5-0.5b': ('configs/gsm8k.py:Qwen2.5-0.5B-Instruct', 'v5e-8', None),
    'gsm8k_qwen3-1.7b': ('configs/gsm8k.py:Qwen3-1.7B', 'v5e-8', None),
    'gsm8k_qwen3-0.6b_v5e-16': ('configs/gsm8k.py:Qwen3-0.6B', 'v5e-16', None),
    'math': ('configs/math.py', 'v5e-8', None),
    'gsm8k_large_qwen3-8b': ('configs/gsm8k_large.py:Qwen3-8B', 'v5p-16', 'v5e-8'),
    'gsm8k_large_qwen3-32b': ('configs/gsm8k_large.py:Qwen3-32B', 'v5p-64', 'v5p-8'),
    'gsm8k_large_qwen3-30b-a3b': ('configs/gsm8k_large.py:Qwen3-30B-A3B', 'v5p-32', 'v5p-8'),
}


def compile_recipe(name: str, programs, layers: int | None, moe_impl: str | None = None,
                   overrides: tuple[str, ...] = ()) -> dict:
  """One recipe's reports as JSON-ready dicts (``moe_impl``: a mixture of experts' experts
  computed so, ``Execution.moe_impl``; None: the model's; ``overrides``: ``KEY=VALUE``
  config leaves)."""
  spec, trainer_type, inference_type = RECIPES[name]
  ray = inference_type is not None
  config = load_config([f'--config={ROOT / spec}', *(['--config.backend=ray'] if ray else []),
                        *(f'--config.{item}' for item in overrides)])
  trainer = get_slice(trainer_type)
  inference = get_slice(inference_type) if ray else trainer
  if ray:
    plan = checks.check_ray(config, trainer, inference, inference_slices=1)
  else:
    plan = checks.check_local(config, trainer, 'multihost' if trainer.multi_host else 'tpu-vm')
  model = checks.run_model(config, layers)
  if moe_impl is not None:
    model = model.with_execution(moe_impl=moe_impl)
  start = time.perf_counter()
  reports = compile_lib.compile_run(config, plan, trainer, inference,
                                    shared=not ray and not config.mesh.disjoint,
                                    programs=programs, model=model)
  return {'recipe': name, 'config': spec, 'trainer_slice': trainer.name,
          'inference_slice': inference.name, 'layers': layers,
          **({'moe_impl': model.execution.moe_impl,
              'inference_moe_impl': config.model.inference_moe_impl} if model.is_moe else {}),
          **({'set': list(overrides)} if overrides else {}),
          'wall_s': round(time.perf_counter() - start, 1),
          'programs': [r.as_dict() for r in reports]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--recipes', default=','.join(RECIPES))
  parser.add_argument('--programs', default=','.join(compile_lib.PROGRAMS))
  parser.add_argument('--layers', type=int, default=None)
  parser.add_argument('--moe_impl', default=None, help="a mixture of experts' Execution.moe_impl")
  parser.add_argument('--set', action='append', default=[], help='KEY=VALUE: a config leaf')
  args = parser.parse_args()
  programs = args.programs.split(',')
  out = {'benchmark': 'tpu_compile', 'kind': 'compiled for TPU on a CPU host; step times are '
         'the compiler model (FLOPs / peak, bytes accessed / HBM bandwidth)', 'recipes': []}
  for name in args.recipes.split(','):
    out['recipes'].append(compile_recipe(name, programs, args.layers, args.moe_impl,
                                          tuple(args.set)))
    print(json.dumps(out['recipes'][-1]), file=sys.stderr, flush=True)  # progress
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  main()
