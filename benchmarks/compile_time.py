"""Benchmark: compile time of the trainer's GRPO step and of the engine's decode step, the
scanned layer stack (this tree) against the stack before it (a git ref), same run.

Each (tree, program) pair runs in a fresh subprocess with ``PYTHONPATH`` set to that tree's
root and an empty ``JAX_COMPILATION_CACHE_DIR``, so nothing is reused across them. The
earlier tree is a ``git worktree add --detach`` of ``--ref`` (default: the merge base of
``HEAD`` and ``main``), removed at the end. For each program it records tracing and lowering
(``jit(...).lower``), XLA compilation (``.compile()``) and, from the same process, the
median time of a step run after a warm-up. Prints one JSON object::

    {"ref": ..., "model": ..., "train": {"scanned": {...}, "unrolled": {...},
     "compile_ratio": scanned / unrolled, ...},
     "decode": {"scan": {"scanned": ..., "unrolled": ..., ...}, "unrolled": {...}}}

    .venv/bin/python benchmarks/compile_time.py [--model=smollm2-135m --batch=8 --length=256
        --slots=32 --prompt=64 --new=192 --steps=3 --layer_loop=both]

The train step is ``benchmarks/train_step.py``'s (GRPO objective, AdamW, chunked log-probs,
``--remat``), the decode step ``Engine.generate``'s program over ``--slots`` slots reading the
whole cache. Weights are random (their values do not change the cost). ``--layer_loop``: the
engine's layer loop in this tree (``Engine(layer_loop=...)``): ``'scan'``, ``'unrolled'``,
``'auto'`` (the engine's choice) or ``'both'`` (default: ``decode`` then holds one comparison
per loop); the earlier tree's engine always runs its own way (before ``layer_loop`` existed:
its per-layer blocks). "scanned" in a comparison names this tree, "unrolled" the earlier one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRAMS = ('train', 'decode')
# A tiny architecture for quick runs and the benchmark's test.
TINY = dict(vocab_size=256, num_layers=4, embed_dim=64, num_heads=4, num_kv_heads=2,
            head_dim=16, mlp_dim=128)


def model_config(name: str, max_seq_len: int, remat: str):
  """The ``DecoderConfig`` of preset ``name`` (or ``'tiny'``) at ``max_seq_len``."""
  # pylint: disable=import-outside-toplevel  # imported from the tree being measured
  from rlax_llm.models import presets
  from rlax_llm.models.decoder_config import DecoderConfig
  base = DecoderConfig(**TINY) if name == 'tiny' else presets.PRESETS[name]
  return dataclasses.replace(base, max_seq_len=max_seq_len).with_execution(remat=remat)


def _median_step(run, steps: int) -> float:
  """The median wall time of ``steps`` calls of ``run()`` (each blocks on its result)."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure_train(args) -> dict[str, float]:
  """Lowering and compile seconds of the trainer's jitted GRPO step, and its step time."""
  # pylint: disable=import-outside-toplevel,protected-access
  import functools

  import jax
  from train_step import train_batch

  from rlax_llm import losses
  from rlax_llm.models.model import create_model
  from rlax_llm.sampling_spec import SamplingSpec
  from rlax_llm.sharding import make_mesh
  from rlax_llm.trainer import objectives
  from rlax_llm.trainer.scoring import Policy
  from rlax_llm.trainer.trainer import Trainer, make_optimizer

  config = model_config(args.model, args.length, args.remat)
  model, params = create_model(config, seed=0)
  batch = train_batch(args.batch, args.length, config.vocab_size)
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  objective = functools.partial(objectives.rl_objective, Policy(model, SamplingSpec()),
                                losses.LossConfig(loss='grpo').resolve(),
                                logprob_chunk=args.logprob_chunk)
  trainer = Trainer(model, params, make_optimizer(1e-6), objective, mesh,
                    totals_fn=objectives.loss_totals)
  start = time.perf_counter()
  lowered = trainer._step.lower(trainer.params, trainer.opt_state, batch, None)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  compiled_at = time.perf_counter()
  temp = int(compiled.memory_analysis().temp_size_in_bytes)
  trainer.step(batch)  # warm-up (its own jit call)
  step = _median_step(lambda: trainer.step(batch), args.steps)
  return {'lower_s': lowered_at - start, 'compile_s': compiled_at - lowered_at,
          'step_s': step, 'tokens_per_s': args.batch * args.length / step, 'temp_bytes': temp}


def measure_decode(args) -> dict[str, float]:
  """Lowering and compile seconds of the engine's decode step, and its step time."""
  # pylint: disable=import-outside-toplevel,protected-access
  import jax

  from rlax_llm.models.model import create_model
  from rlax_llm.rollout.engine import Engine
  from rlax_llm.sampling_spec import SamplingSpec
  from rlax_llm.sharding import make_mesh

  config = model_config(args.model, args.prompt + args.new, 'none')
  model, params = create_model(config, seed=0)
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  loop = {} if args.layer_loop == 'auto' else {'layer_loop': args.layer_loop}
  engine = Engine(model, mesh, slots=args.slots, max_prefill_length=args.prompt,
                  max_decode_length=args.new, pad_id=0, **loop)
  placed = engine.place_params(params)
  state = engine.init_decode_state()
  spec = SamplingSpec(1.0)
  start = time.perf_counter()
  lowered = engine._generate.lower(placed, state, spec=spec, attend=engine.attend_buckets[-1])
  lowered_at = time.perf_counter()
  lowered.compile()
  compiled_at = time.perf_counter()
  held = {'state': state}

  def step():
    held['state'], result = engine.generate(placed, held['state'], spec)
    jax.block_until_ready(result)
  step()  # warm-up (its own jit call)
  seconds = _median_step(step, args.steps)
  return {'lower_s': lowered_at - start, 'compile_s': compiled_at - lowered_at,
          'step_s': seconds, 'tokens_per_s': args.slots / seconds,
          'layer_loop': getattr(engine, 'layer_loop', 'unrolled (no layer_loop)')}


def child_command(program: str, args) -> list[str]:
  """The command line of one measuring subprocess."""
  return [sys.executable, __file__, f'--child={program}', f'--model={args.model}',
          f'--batch={args.batch}', f'--length={args.length}', f'--remat={args.remat}',
          f'--logprob_chunk={args.logprob_chunk}', f'--slots={args.slots}',
          f'--prompt={args.prompt}', f'--new={args.new}', f'--steps={args.steps}',
          f'--layer_loop={args.layer_loop}']


def run_child(program: str, tree: pathlib.Path, args) -> dict[str, float]:
  """``program`` measured in a fresh process importing ``rlax_llm`` from ``tree``, with an
  empty persistent compilation cache (``args.layer_loop``: one loop, or ``'auto'``)."""
  with tempfile.TemporaryDirectory(prefix='compile_cache_') as cache:
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PLATFORMS=os.environ.get('JAX_PLATFORMS', 'cpu'))
    out = subprocess.run(child_command(program, args), check=True, capture_output=True,
                         text=True, env=env, cwd=tree)
  return json.loads(out.stdout.strip().splitlines()[-1])


def merge_base(ref: str = 'main') -> str:
  """The commit where ``HEAD`` left ``ref``."""
  return subprocess.run(['git', '-C', str(ROOT), 'merge-base', 'HEAD', ref], check=True,
                        capture_output=True, text=True).stdout.strip()


def add_worktree(ref: str, where: pathlib.Path) -> pathlib.Path:
  """A detached ``git worktree`` of ``ref`` at ``where`` (removed by ``remove_worktree``)."""
  subprocess.run(['git', '-C', str(ROOT), 'worktree', 'add', '--detach', str(where), ref],
                 check=True, capture_output=True, text=True)
  return where


def remove_worktree(where: pathlib.Path) -> None:
  subprocess.run(['git', '-C', str(ROOT), 'worktree', 'remove', '--force', str(where)],
                 check=True, capture_output=True, text=True)


def compare(scanned: dict, unrolled: dict) -> dict:
  """Both trees' figures for one program and the scanned / unrolled ratios."""
  return {'scanned': scanned, 'unrolled': unrolled,
          'compile_ratio': scanned['compile_s'] / unrolled['compile_s'],
          'lower_and_compile_ratio': ((scanned['lower_s'] + scanned['compile_s'])
                                      / (unrolled['lower_s'] + unrolled['compile_s'])),
          'step_ratio': scanned['step_s'] / unrolled['step_s']}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--model', default='smollm2-135m', help="a preset, or 'tiny'")
  parser.add_argument('--ref', default='', help='the tree before the change (default: the '
                      'merge base of HEAD and main)')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--remat', default='full')
  parser.add_argument('--logprob_chunk', type=int, default=64)
  parser.add_argument('--slots', type=int, default=32)
  parser.add_argument('--prompt', type=int, default=64)
  parser.add_argument('--new', type=int, default=192)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--layer_loop', default='both',
                      choices=('both', 'auto', 'scan', 'unrolled'),
                      help="this tree's engine layer loop(s) for the decode step")
  parser.add_argument('--only', choices=PROGRAMS, help='measure one program alone')
  parser.add_argument('--child', choices=PROGRAMS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    measure = measure_train if args.child == 'train' else measure_decode
    print(json.dumps(measure(args)))
    return
  ref = args.ref or merge_base()
  result = {'ref': ref, 'model': args.model, 'batch': args.batch, 'length': args.length,
            'remat': args.remat, 'slots': args.slots, 'cache_length': args.prompt + args.new}
  with tempfile.TemporaryDirectory(prefix='compile_time_') as parent:
    before = add_worktree(ref, pathlib.Path(parent) / 'before')
    try:
      for program in (args.only,) if args.only else PROGRAMS:
        if program == 'train':
          result[program] = compare(run_child(program, ROOT, args),
                                    run_child(program, before, args))
          continue
        loops = ('scan', 'unrolled') if args.layer_loop == 'both' else (args.layer_loop,)
        earlier = run_child(program, before, argparse.Namespace(**{**vars(args),
                                                                   'layer_loop': 'auto'}))
        result[program] = {
            loop: compare(run_child(program, ROOT, argparse.Namespace(
                **{**vars(args), 'layer_loop': loop})), earlier) for loop in loops}
    finally:
      remove_worktree(before)
  print(json.dumps(result))


if __name__ == '__main__':
  main()
