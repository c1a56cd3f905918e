"""Benchmark: the real SmolLM2-135M-Instruct (GGUF) in rlax_llm vs transformers, same run.

Prints one JSON object: logits parity (max |diff| on a chat prompt), load time, forward
latency on a 128-token batch and greedy decoding throughput, each for rlax_llm (JAX, jitted,
KV cache) and for transformers (torch eager CPU, ``generate`` with its KV cache) measured in
the same process, and their ratios. Also random-init parity per family.

    .venv/bin/python benchmarks/models.py
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import torch  # noqa: E402
import transformers  # noqa: E402

from rlax_llm.models import from_pretrained, smollm2_gguf_path, split_module  # noqa: E402
from rlax_llm.sampling_spec import GREEDY  # noqa: E402
from rlax_llm.rollout.driver import generate  # noqa: E402
from rlax_llm.rollout.engine import Engine  # noqa: E402
from rlax_llm.sharding import make_mesh  # noqa: E402


def timed(fn, repeats=3):
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  torch.set_num_threads(os.cpu_count() or 1)
  path = smollm2_gguf_path()
  t0 = time.perf_counter()
  model, tokenizer = from_pretrained(path)
  ours_load = time.perf_counter() - t0
  t0 = time.perf_counter()
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  ref_load = time.perf_counter() - t0

  messages = [{'role': 'user', 'content': 'What is the capital of France?'}]
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  with torch.no_grad():
    ref_logits = ref(torch.tensor([ids])).logits.numpy()
  max_diff = float(np.abs(np.asarray(model(jnp.asarray([ids], jnp.int32))) - ref_logits).max())

  functional, params = split_module(model)
  batch = np.random.RandomState(0).randint(0, 49_152, (4, 128))
  forward = jax.jit(functional.apply)
  ours_fwd = timed(lambda: forward(params, jnp.asarray(batch, jnp.int32)).block_until_ready())
  with torch.no_grad():
    ref_fwd = timed(lambda: ref(torch.tensor(batch)).logits)

  new = 32
  prompts = np.array([ids] * 4)
  engine = Engine(functional, make_mesh({'data': 1}, jax.devices()[:1]), slots=4,
                  max_prefill_length=len(ids), max_decode_length=new, pad_id=tokenizer.pad_id)
  sampler = lambda: generate(functional, params, prompts.tolist(), GREEDY,
                             max_new_tokens=new, engine=engine)
  ours_gen = timed(sampler)
  ours_tokens = np.asarray(sampler()[0].tokens)
  with torch.no_grad():
    gen = lambda: ref.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
    ref_gen = timed(gen, repeats=2)
    ref_tokens = gen()[0, len(ids):].numpy()
  eos_positions = np.flatnonzero(ours_tokens == tokenizer.eos_id)
  answer_len = int(eos_positions[0]) if eos_positions.size else new
  print(json.dumps({
      'benchmark': 'models',
      'model': path.name,
      'logits_max_abs_diff_vs_transformers': max_diff,
      'load_s': {'rlax_llm': ours_load, 'transformers': ref_load,
                 'ratio': ours_load / ref_load},
      'forward_4x128_s': {'rlax_llm_jit': ours_fwd, 'transformers_eager': ref_fwd,
                          'speedup': ref_fwd / ours_fwd},
      'greedy_decode_4x32': {'rlax_llm_tokens_per_s': 4 * new / ours_gen,
                             'transformers_tokens_per_s': 4 * new / ref_gen,
                             'speedup': ref_gen / ours_gen,
                             # min_new_tokens stops transformers from ending the answer
                             # with <|im_end|>, so compare the answer up to our first eos.
                             'answer_tokens_equal': bool(np.array_equal(
                                 ours_tokens[:answer_len], ref_tokens[:answer_len])),
                             'answer_len': answer_len,
                             'answer': tokenizer.decode(ours_tokens[:answer_len])},
  }, indent=2))


if __name__ == '__main__':
  main()
