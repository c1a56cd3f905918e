"""Benchmark: partial rollouts (APRIL) vs running every batch to its longest sample.

RL batches on SmolLM2-135M-Instruct (the packaged GGUF), fp32, greedy, through the
continuous-batching driver: each batch holds ``--per_batch`` requests whose completion
lengths are drawn from a heavy-tailed (Pareto) distribution, as in rollout_throughput.py.

* ``full``: every batch runs until its last request finishes (the long tail keeps a few
  slots busy while the rest idle).
* ``april``: a batch stops once ``--stop_after`` requests finished
  (``Driver.run(..., stop_after=n)``); the unfinished ones are continued in the next batch
  (``Job.resume``: prompt + drawn tokens prefilled, same keys) ahead of new requests.

Both process the same stream of requests for ``--batches`` batches and count what finished.
The figure is finished tokens per second, ``april`` over ``full`` (``ratio``), measured
alternately ``--repeats`` times in one process (medians; the machine is shared and noisy),
with the decode steps and the continuation prefill tokens it costs. Every finished request
is compared with the uninterrupted run (greedy, same weights): ``tokens_equal`` is the
fraction identical token for token.

    .venv/bin/python benchmarks/partial_rollouts.py [--batches=8] [--per_batch=32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import numpy as np  # noqa: E402

from rlax_llm.models import from_pretrained, smollm2_gguf_path  # noqa: E402
from rlax_llm.models.model import split_module  # noqa: E402
from rollout_throughput import (driver_for, heavy_tailed_lengths, jobs_for,  # noqa: E402
                                prompts_for)


def simulate(driver, prompts, lengths, batches: int, per_batch: int, stop_after: int | None):
  """Runs ``batches`` batches over the request stream; returns the finished requests'
  tokens by request index, decode steps, continuation prefill tokens and seconds."""
  stream = iter(range(len(lengths)))
  carried: list[tuple[int, object, tuple]] = []  # (request, job, samples so far)
  done, steps, resumed_tokens = {}, 0, 0
  start = time.perf_counter()
  for _ in range(batches):
    batch = [(r, dataclasses.replace(job, resume=samples)) for r, job, samples in carried]
    for r in [next(stream) for _ in range(per_batch - len(carried))]:
      batch.append((r, jobs_for([prompts[r]], [lengths[r]])[0]))
    resumed_tokens += sum(len(job.prompt_ids) + len(job.resume[0].tokens)
                          for _, job in batch if job.resume is not None)
    results = driver.run([job for _, job in batch], stop_after)
    steps += driver.stats['steps']
    carried = []
    for (r, job), samples in zip(batch, results):
      if samples[0].finish_reason is None:
        carried.append((r, job, tuple(samples)))
      else:
        done[r] = samples[0].tokens
  return done, steps, resumed_tokens, time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--batches', type=int, default=8)
  parser.add_argument('--per_batch', type=int, default=32)
  parser.add_argument('--stop_after', type=int, default=24)
  parser.add_argument('--slots', type=int, default=32)
  parser.add_argument('--max_len', type=int, default=128)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()

  path = smollm2_gguf_path()
  module, tokenizer = from_pretrained(path)
  model, params = split_module(module)
  n = args.batches * args.per_batch
  lengths = heavy_tailed_lengths(np.random.RandomState(0), n, args.max_len)
  prompts = prompts_for(tokenizer, n)
  driver = driver_for(model, params, args.slots, len(prompts[0]), args.max_len)
  modes = {'full': None, 'april': args.stop_after}
  for stop in modes.values():  # compile every bucket both modes use
    simulate(driver, prompts, lengths, args.batches, args.per_batch, stop)
  times = {mode: [] for mode in modes}
  out = {}
  for _ in range(args.repeats):
    for mode, stop in modes.items():
      done, steps, resumed, elapsed = simulate(driver, prompts, lengths, args.batches,
                                               args.per_batch, stop)
      times[mode].append(sum(len(t) for t in done.values()) / elapsed)
      out[mode] = (done, steps, resumed)
  full, april = out['full'][0], out['april'][0]
  common = [r for r in april if r in full]
  figures = {mode: {'finished_requests': len(out[mode][0]),
                    'finished_tokens': sum(len(t) for t in out[mode][0].values()),
                    'decode_steps': out[mode][1], 'continuation_prefill_tokens': out[mode][2],
                    'finished_tok_s': statistics.median(times[mode])} for mode in modes}
  print(json.dumps({
      'benchmark': 'partial_rollouts', 'model': path.name, 'dtype': 'float32',
      'batches': args.batches, 'per_batch': args.per_batch, 'stop_after': args.stop_after,
      'slots': args.slots, 'repeats': args.repeats,
      'length_mean': float(np.mean(lengths)), 'length_max': int(max(lengths)),
      **figures,
      'ratio': statistics.median(a / f for a, f in zip(times['april'], times['full'])),
      'tokens_equal': sum(april[r] == full[r] for r in common) / max(1, len(common)),
  }, indent=2))


if __name__ == '__main__':
  main()
