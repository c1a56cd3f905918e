"""Benchmark: one GRPO train step on SmolLM2-135M, rlax_llm (JAX) vs torch (transformers +
AdamW, eager), same run, same shapes, fp32.

Each framework runs in its own subprocess (so each one's peak RSS is its own): a batch of
``--batch`` x ``--length`` tokens (prompt + completion; the completion half is under the loss
mask) with random behaviour log-probs and advantages, the GRPO clipped objective, AdamW. One
untimed step (compilation / allocator warm-up), then ``--steps`` timed ones; tokens/s =
batch x length / median step time. Prints one JSON object with ``ours_tok_s``, ``torch_tok_s``
and ``ratio`` (ours / torch), both peak RSS figures, and our compiled step's temp memory with
and without chunked log-probs (``rl.logprob_chunk``) at this vocabulary.

    .venv/bin/python benchmarks/train_step.py [--batch=16 --length=256 --steps=2]

The models are random-initialised with SmolLM2-135M's architecture (the weights' values do
not change the cost).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np


def grpo_batch(batch: int, length: int, vocab: int, seed: int = 0):
  """Random ``(tokens [B, T] int32, loss_mask, behaviour_logprobs [B, T] float32,
  advantages [B] float32)``: the completion half of each row under the mask."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, vocab, (batch, length)).astype(np.int32)
  mask = np.zeros((batch, length), np.float32)
  mask[:, length // 2:] = 1.0
  behaviour = (np.log(rng.uniform(1e-5, 1e-3, (batch, length))) * mask).astype(np.float32)
  advantages = rng.randn(batch).astype(np.float32)
  return tokens, mask, behaviour, advantages


def train_batch(batch: int, length: int, vocab: int):
  """``grpo_batch`` as our trainer's ``TrainBatch`` (groups of 4 rows)."""
  # pylint: disable-next=import-outside-toplevel  # jax-heavy: the torch subprocess skips it
  from rlax_llm.data_types import TrainBatch
  tokens, mask, behaviour, advantages = grpo_batch(batch, length, vocab)
  return TrainBatch(
      tokens=tokens, loss_mask=mask, behaviour_logprobs=behaviour,
      support_sizes=np.where(mask > 0, vocab, 0).astype(np.int32),
      advantages=advantages, versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(batch // 4), 4).astype(np.int32))


def torch_grpo_losses(model, tokens, mask, behaviour, advantages):
  """transformers ``model``'s GRPO clipped objective per row ``[B]`` (masked mean over the
  completion) on torch tensors ``tokens [B, T]`` (long), ``mask``, ``behaviour [B, T]``,
  ``advantages [B]``: the loss our ``rl_objective`` computes with ``loss='grpo'``."""
  import torch  # pylint: disable=import-outside-toplevel
  logits = model(input_ids=tokens).logits[:, :-1]  # [B, T-1, V] predicts tokens[:, 1:]
  logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
  m = mask[:, 1:]
  ratio = torch.exp(logp - behaviour[:, 1:])
  adv = advantages[:, None]
  surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)  # eps 0.2
  return -(surrogate * m).sum(1) / m.sum(1).clamp(min=1)


def run_ours(args) -> dict:
  import functools  # pylint: disable=import-outside-toplevel
  import dataclasses
  import jax
  from rlax_llm import losses
  from rlax_llm.models import presets
  from rlax_llm.models.model import create_model
  from rlax_llm.sampling_spec import SamplingSpec
  from rlax_llm.trainer.scoring import Policy
  from rlax_llm.sharding import make_mesh
  from rlax_llm.trainer import objectives
  from rlax_llm.trainer.trainer import Trainer, make_optimizer

  config = dataclasses.replace(presets.PRESETS['smollm2-135m'],
                               max_seq_len=args.length).with_execution(remat=args.remat)
  model, params = create_model(config, seed=0)
  batch = train_batch(args.batch, args.length, config.vocab_size)
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  loss = losses.LossConfig(loss='grpo').resolve()
  policy = Policy(model, SamplingSpec())
  out = {}
  for chunk in sorted({0, args.logprob_chunk}):
    objective = functools.partial(objectives.rl_objective, policy, loss, logprob_chunk=chunk)
    trainer = Trainer(model, params, make_optimizer(1e-6), objective, mesh,
                      micro_batches=args.micro_batches, totals_fn=objectives.loss_totals)
    lowered = trainer._step.lower(trainer.params, trainer.opt_state, batch, None)  # pylint: disable=protected-access
    memory = lowered.compile().memory_analysis()
    out[f'ours_temp_bytes_chunk{chunk}'] = int(memory.temp_size_in_bytes)
    if chunk != args.logprob_chunk:
      del trainer
      continue
    trainer.step(batch)  # compile + warm-up
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      trainer.step(batch)
      times.append(time.perf_counter() - start)
    out['ours_step_s'] = statistics.median(times)
    out['ours_tok_s'] = args.batch * args.length / out['ours_step_s']
  return out


def run_torch(args) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers

  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100_000.0,
      rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=args.length,
      attn_implementation='sdpa')
  model = transformers.LlamaForCausalLM(config).float().train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99),
                                weight_decay=0.0)
  tokens, mask, behaviour, advantages = (torch.from_numpy(a) for a in grpo_batch(
      args.batch, args.length, config.vocab_size))
  tokens = tokens.long()

  def step():
    loss = torch_grpo_losses(model, tokens, mask, behaviour, advantages).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

  step()
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  return {'torch_step_s': step_s, 'torch_tok_s': args.batch * args.length / step_s,
          'torch_threads': torch.get_num_threads()}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--logprob_chunk', type=int, default=64)
  parser.add_argument('--remat', default='none')
  parser.add_argument('--micro_batches', type=int, default=1)
  parser.add_argument('--only', choices=('ours', 'torch'))
  args = parser.parse_args()
  if args.only:
    result = run_ours(args) if args.only == 'ours' else run_torch(args)
    result[f'{args.only}_peak_rss_bytes'] = resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))
    return
  result = {'batch': args.batch, 'length': args.length, 'dtype': 'float32',
            'logprob_chunk': args.logprob_chunk, 'remat': args.remat,
            'micro_batches': args.micro_batches}
  for which in ('ours', 'torch'):
    out = subprocess.run(
        [sys.executable, __file__, f'--only={which}', f'--batch={args.batch}',
         f'--length={args.length}', f'--steps={args.steps}',
         f'--logprob_chunk={args.logprob_chunk}', f'--remat={args.remat}',
         f'--micro_batches={args.micro_batches}'],
        check=True, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS='cpu'))
    result.update(json.loads(out.stdout.strip().splitlines()[-1]))
  result['ratio'] = result['ours_tok_s'] / result['torch_tok_s']
  result['peak_rss_ratio'] = result['ours_peak_rss_bytes'] / result['torch_peak_rss_bytes']
  print(json.dumps(result))


if __name__ == '__main__':
  main()
