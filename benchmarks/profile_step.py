"""Profile: where one GRPO train step's time goes, by XLA operation.

The step ``benchmarks/lora.py`` times (its flags, model, batch, objective and trainer; LoRA
rank 16 on every projection, or ``--full`` fine-tuning): the trainer's jitted step compiled
once (ahead of time, so that its program's text is the one that runs), run once, timed once,
then run once more under ``jax.profiler``. Each executed XLA operation of the traced step (the
profiler's ``hlo_op`` events on the host's XLA:CPU threads) is matched by name to its
instruction in the compiled program (``Compiled.as_text()``), and the time summed:

* ``by_opcode``: seconds per HLO opcode of the instruction (``fusion`` counted as ``dot`` when
  its fused computation holds a dot: XLA:CPU fuses dots with their operands' converts and
  bitcasts), and ``dot_fraction``, the matmuls' share of the traced operations' time (``ops_s``;
  loops and other ``CONTROL_FLOW`` are left out of it, their bodies' operations being traced
  themselves: ``control_flow_s``);
* ``top``: the ``--top`` instructions (grouped by name without the ``.N`` suffix and by
  result shape) that took the most time, with their count, opcode and seconds.

This is the measurement behind RESULTS.md's "where the time goes" (the LoRA step's matmuls
~90% of it, and the SwiGLU gradient's transposes before ``decoder.linear`` flattened its
rows). ``traced_step_s`` is slower than ``step_s`` (the profiler's own cost); the figures are
shares of one step, on this machine's XLA:CPU.

    .venv/bin/python benchmarks/profile_step.py [--model=smollm2] [--full]
        [--dtype=float32|bfloat16] [--batch=16 --length=256 --micro_batches=4]
        [--shared_prefix [--new_tokens=N]] [--top=15]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# this folder (sys.path[0])
from lora import benchmark_batch, compiled_step, in_dtype, load, make_trainer, step_args

from rlax_llm.configs import smollm2 as smollm2_recipe
from rlax_llm.models import lora as lora_lib

_INSTRUCTION = re.compile(r'\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\(')
_COMPUTATION = re.compile(r'(?:ENTRY )?%?([\w.\-]+) [^=]*\{\s*$')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')
# Operations whose traced time is that of the operations they run (traced themselves).
CONTROL_FLOW = frozenset({'while', 'conditional', 'call', 'async-start', 'async-done'})


def hlo_instructions(text: str) -> dict[str, tuple[str, str]]:
  """``{instruction name: (opcode, result shape)}`` of a compiled HLO module's text, a fusion's
  opcode given as ``'dot'`` when its fused computation holds a dot."""
  opcodes_in: dict[str, set[str]] = collections.defaultdict(set)
  found, computation = [], None
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head and ' = ' not in line:
      computation = head.group(1)
      continue
    match = _INSTRUCTION.match(line)
    if match:
      name, shape, opcode = match.groups()
      opcodes_in[computation].add(opcode)
      calls = _CALLS.search(line)
      found.append((name, shape, opcode, calls.group(1) if calls else None))
  out = {}
  for name, shape, opcode, calls in found:
    if opcode == 'fusion' and calls and 'dot' in opcodes_in.get(calls, ()):
      opcode = 'dot'
    out[name] = (opcode, shape)
  return out


def op_times(trace_dir: str) -> list[tuple[str, float]]:
  """``[(hlo_op, seconds)]`` of every executed XLA operation in a ``jax.profiler`` trace."""
  paths = glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*', '*.trace.json.gz'))
  if not paths:
    raise FileNotFoundError(f'no *.trace.json.gz under {trace_dir}/plugins/profile: the '
                            'profiler wrote no trace')
  with gzip.open(paths[0]) as f:
    events = json.load(f)['traceEvents']
  return [(e['args']['hlo_op'], e['dur'] / 1e6) for e in events
          if e.get('ph') == 'X' and 'hlo_op' in e.get('args', {})]


def summarise(times: list[tuple[str, float]], instructions: dict[str, tuple[str, str]],
              top: int) -> dict:
  """Seconds by opcode and the ``top`` instruction groups (name without ``.N``, shape)."""
  by_opcode, groups, counts = collections.Counter(), collections.Counter(), collections.Counter()
  control = 0.0
  for op, seconds in times:
    opcode, shape = instructions.get(op, ('?', '?'))
    if opcode in CONTROL_FLOW:  # its body's operations are traced on their own
      control += seconds
      continue
    shape = shape if len(shape) <= 80 else shape[:77] + '...'
    by_opcode[opcode] += seconds
    key = (re.sub(r'\.\d+$', '', op), opcode, shape)
    groups[key] += seconds
    counts[key] += 1
  total = sum(by_opcode.values())
  return {
      'ops_s': total, 'control_flow_s': control,
      'ops_matched': sum(1 for op, _ in times if op in instructions), 'ops_traced': len(times),
      'dot_fraction': by_opcode['dot'] / total if total else 0.0,
      'by_opcode': {k: round(v, 6) for k, v in by_opcode.most_common()},
      'top': [{'op': name, 'opcode': opcode, 'shape': shape, 'count': counts[key],
               'seconds': round(seconds, 6)}
              for key, seconds in groups.most_common(top) for name, opcode, shape in [key]]}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--full', action='store_true', help='full fine-tuning instead of LoRA')
  parser.add_argument('--top', type=int, default=15)
  args = step_args(parser)
  if args.full and args.dtype != 'float32':
    parser.error(f'--dtype={args.dtype} is for the LoRA step (frozen base); --full trains '
                 'float32 master weights: drop --dtype or --full')
  base, params = load(args.model)
  batch = benchmark_batch(args, base.config.vocab_size)
  if args.full:
    trainer = make_trainer(base, params, float(smollm2_recipe.get_config().rl.learning_rate),
                           args)
  else:
    model, params = lora_lib.create(*in_dtype(base, params, args.dtype),
                                    lora_lib.LoRAConfig(args.rank, args.alpha), seed=0)
    trainer = make_trainer(model, params,
                           float(smollm2_recipe.get_config('lora').rl.learning_rate), args,
                           lora_lib.trainable_mask(model))
  # The trainer's jitted step compiled once; its text names the operations the trace times.
  compiled, placed = compiled_step(trainer, batch)
  instructions = hlo_instructions(compiled.as_text())

  def step() -> float:
    start = time.perf_counter()
    trainer.params, trainer.opt_state, metrics = compiled(
        trainer.params, trainer.opt_state, placed, trainer.reference_params)
    jax.block_until_ready((trainer.params, metrics))
    return time.perf_counter() - start

  step()  # warm-up
  step_s = step()
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    traced_s = step()
    jax.profiler.stop_trace()
    times = op_times(trace_dir)
  out = {'benchmark': 'profile_step', 'model': args.model,
         'mode': 'full' if args.full else f'lora rank {args.rank}', 'dtype': args.dtype,
         'batch': args.batch, 'length': args.length, 'micro_batches': args.micro_batches,
         'logprob_chunk': args.logprob_chunk, 'shared_prefix': args.shared_prefix,
         'step_s': step_s, 'traced_step_s': traced_s,
         **summarise(times, instructions, args.top)}
  print(json.dumps(out, indent=2))


if __name__ == '__main__':
  main()
