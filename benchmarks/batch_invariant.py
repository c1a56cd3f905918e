"""Benchmark: what batch-invariant numerics (``model.batch_invariant``) buy and cost.

SmolLM2-135M-Instruct (the packaged GGUF), fp32, loaded twice: default numerics and
``batch_invariant=True``. Measured in the same process:

* log-prob parity: ``--prompts`` chat prompts sampled (temperature 1, ``--sample_tokens`` new
  tokens each) by the inference engine with the worker's cache layout; the behaviour
  log-probs against the trainer's recompute (``Policy.sequence_log_probs``, the sequences
  padded to 96 and to 128 positions): the largest and mean absolute difference, and how
  many of the log-probs are bitwise equal;
* rollout throughput: greedy, ``--new_tokens`` new tokens, ``--batch`` rows, invariant over
  default tokens/s (runs alternate, ``--repeats`` each, median of the ratios);
* the rollout's phases apart, the same way: one prefill of the batch's prompts, and a
  decode step over all ``--batch`` slots attending to the whole cache (default over
  invariant speed, as for rollouts);
* trainer step: the gradient of the mean log-prob of a ``[--train_rows, 128]`` batch,
  invariant over default seconds (alternating, median).

Prints one JSON object:

    {"parity": {"default": {"max_abs_dlogp", "mean_abs_dlogp", "bitwise_equal_fraction"},
                "batch_invariant": {...}},
     "rollout": {"default_tok_s", "batch_invariant_tok_s", "ratio", "ratios"},
     "prefill": {"default_s", "batch_invariant_s", "ratio", "ratios"},
     "decode_step": {...},
     "train_step": {"default_s", "batch_invariant_s", "ratio", "ratios"}}

    .venv/bin/python benchmarks/batch_invariant.py [--batch=32] [--repeats=3]
        [--invariant_rows=chunks|floor]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm.models import from_pretrained, smollm2_gguf_path
from rlax_llm.models.model import split_module
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.rollout.driver import Job
from rollout_throughput import driver_for

DECODE_STEPS = 16
QUESTIONS = ['What is the capital of France?', 'What is 57 + 68?', 'Name three colors.',
             'Write a haiku about rain.', 'Who wrote Hamlet?', 'What is photosynthesis?',
             'Translate "good morning" to French.', 'Give me a synonym for happy.']


def keys(n: int, seed: int = 1) -> list[np.ndarray]:
  return [np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), i)))[None]
          for i in range(n)]


def parity(model, params, prompts, new_tokens: int) -> dict[str, float]:
  """Behaviour log-probs of sampled completions against the trainer's recompute."""
  spec = SamplingSpec(1.0)
  driver = driver_for(model, params, len(prompts), max(map(len, prompts)), new_tokens)
  samples = [s[0] for s in driver.run([Job(tuple(p), 1, spec, new_tokens, (), k)
                                       for p, k in zip(prompts, keys(len(prompts)))])]
  score = jax.jit(Policy(model, spec).sequence_log_probs)
  diffs = []
  for prompt, sample in zip(prompts, samples):
    n = len(prompt) + len(sample.tokens)
    for width in (96, 128):
      tokens = np.zeros((1, width), np.int32)
      sizes = np.zeros((1, width), np.int32)
      tokens[0, :n] = prompt + sample.tokens
      sizes[0, len(prompt):n] = sample.supports
      trainer = np.asarray(score(params, jnp.asarray(tokens), jnp.asarray(sizes)).logp)[
          0, len(prompt) - 1:n - 1]
      diffs.append(np.abs(trainer - np.asarray(sample.logprobs, np.float32)))
  diffs = np.concatenate(diffs)
  return {'max_abs_dlogp': float(diffs.max()), 'mean_abs_dlogp': float(diffs.mean()),
          'bitwise_equal_fraction': float((diffs == 0).mean()), 'logprobs': int(diffs.size)}


def alternate(fns: dict, repeats: int) -> dict[str, list[float]]:
  """Seconds of each of ``fns`` (warmed up once), run alternately ``repeats`` times."""
  for fn in fns.values():
    fn()
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return times


def decode_steps(engine, placed):
  """A function running ``DECODE_STEPS`` decode steps over all of ``engine``'s slots."""
  state = [engine.init_decode_state()]

  def decode():
    for _ in range(DECODE_STEPS):
      state[0], _ = engine.generate(placed, state[0], GREEDY)
    jax.block_until_ready(state[0])
  return decode


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--prompts', type=int, default=8)
  parser.add_argument('--sample_tokens', type=int, default=32)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--new_tokens', type=int, default=64)
  parser.add_argument('--train_rows', type=int, default=8)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--invariant_rows', default='chunks', choices=('chunks', 'floor'),
                      help='Execution.invariant_rows of the batch-invariant model')
  args = parser.parse_args()

  path = smollm2_gguf_path()
  models = {}
  for name, invariant in (('default', False), ('batch_invariant', True)):
    module, tokenizer = from_pretrained(path, batch_invariant=invariant,
                                        invariant_rows=args.invariant_rows)
    models[name] = split_module(module)
  prompts = [tokenizer.apply_chat_template([{'role': 'user', 'content': q}],
                                           add_generation_prompt=True, tokenize=True)
             for q in QUESTIONS]
  prompts = [prompts[i % len(prompts)] for i in range(max(args.prompts, args.batch))]
  result = {'invariant_rows': args.invariant_rows,
            'parity': {name: parity(model, params, prompts[:args.prompts], args.sample_tokens)
                       for name, (model, params) in models.items()}}
  print(json.dumps({'parity': result['parity']}), flush=True)

  rollouts = {}
  for name, (model, params) in models.items():
    batch = prompts[:args.batch]
    driver = driver_for(model, params, args.batch, max(map(len, batch)), args.new_tokens)
    jobs = [Job(tuple(p), 1, GREEDY, args.new_tokens, (), np.zeros((1, 2), np.uint32))
            for p in batch]
    rollouts[name] = lambda driver=driver, jobs=jobs: driver.run(jobs)
  times = alternate(rollouts, args.repeats)
  tokens = args.batch * args.new_tokens
  ratios = [d / i for d, i in zip(times['default'], times['batch_invariant'])]
  result['rollout'] = {'default_tok_s': statistics.median(tokens / t for t in times['default']),
                       'batch_invariant_tok_s': statistics.median(
                           tokens / t for t in times['batch_invariant']),
                       'ratio': statistics.median(ratios), 'ratios': ratios,
                       'batch': args.batch, 'new_tokens': args.new_tokens}
  print(json.dumps({'rollout': result['rollout']}), flush=True)

  # The rollout's two phases apart: one prefill of the batch's prompts, and decode steps
  # over all slots attending to the whole cache (prompt + new_tokens positions).
  prefills, steps = {}, {}
  for name, (model, params) in models.items():
    batch = prompts[:args.batch]
    engine = driver_for(model, params, args.batch, max(map(len, batch)), args.new_tokens).engine
    placed = engine.place_params(params)
    prefills[name] = lambda engine=engine, placed=placed, batch=batch: jax.block_until_ready(
        engine.prefill(placed, batch))
    steps[name] = decode_steps(engine, placed)
  for phase, fns in (('prefill', prefills), ('decode_step', steps)):
    times = alternate(fns, args.repeats)
    ratios = [d / i for d, i in zip(times['default'], times['batch_invariant'])]
    per = 1 if phase == 'prefill' else DECODE_STEPS
    result[phase] = {'default_s': statistics.median(times['default']) / per,
                     'batch_invariant_s': statistics.median(times['batch_invariant']) / per,
                     'ratio': statistics.median(ratios), 'ratios': ratios}
  print(json.dumps({k: result[k] for k in ('prefill', 'decode_step')}), flush=True)

  tokens = jnp.asarray(np.random.RandomState(0).randint(
      0, models['default'][0].config.vocab_size, (args.train_rows, 128)), jnp.int32)
  steps = {}
  for name, (model, params) in models.items():
    policy = Policy(model, SamplingSpec(1.0))
    grad = jax.jit(jax.grad(lambda p, policy=policy: policy.sequence_log_probs(
        p, tokens).logp.mean()))
    steps[name] = lambda grad=grad, params=params: jax.block_until_ready(grad(params))
  times = alternate(steps, args.repeats)
  ratios = [i / d for d, i in zip(times['default'], times['batch_invariant'])]
  result['train_step'] = {'default_s': statistics.median(times['default']),
                          'batch_invariant_s': statistics.median(times['batch_invariant']),
                          'ratio': statistics.median(ratios), 'ratios': ratios,
                          'rows': args.train_rows, 'length': 128}
  print(json.dumps(result))


if __name__ == '__main__':
  main()
