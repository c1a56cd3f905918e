"""Benchmark: one GRPO train step on SmolLM2-135M, rlax_llm (JAX) vs torch (transformers +
AdamW, eager), same run, same shapes, same weights, same work, fp32.

Each framework runs in its own subprocess (so each one's peak RSS is its own), ours first,
then torch's: a batch of ``--batch`` x ``--length`` tokens (prompt + completion; the
completion half under the loss mask) with random behaviour log-probs and advantages, the
GRPO clipped objective, AdamW with global-norm clipping at 1.0. Both sides do the same work:

* ``--micro_batches``: both split the batch into that many micro-batches of strided rows
  (row ``r`` in micro-batch ``r % micro_batches``, as ``Trainer`` deals them), one forward
  and backward pass each, gradients accumulated into one update;
* ``--logprob_chunk``: both run the lm head and log-softmax that many positions at a time,
  each chunk's logits recomputed in the backward pass (ours: ``Policy.sequence_log_probs``'s
  ``chunk``; torch: ``torch.utils.checkpoint`` around each chunk); ``0``: both take the whole
  ``[B, T, vocab]`` logits in one go;
* the same weights: ours are random-initialised with the model's architecture and handed to
  torch through a HF directory (``config_to_hf``, ``params_to_hf``), so the first step's loss
  is the same on both sides (printed: ``first_loss``, ``torch_first_loss``).

Each side reports what it ran: ``*_passes`` (forward passes per step), ``*_rows_per_pass``,
and torch's ``torch_head_chunks_per_pass`` (the lm head's calls in one pass's forward; ours
is ``ceil((length - 1) / logprob_chunk)`` by construction, ``_score_hidden``). One untimed
step (compilation / allocator warm-up), then ``--steps`` timed ones; tokens/s = batch x
length / median step time; ``ratio`` = ours / torch. Also both peak RSS figures, our compiled
step's temp memory with and without chunked log-probs, and the load average before and after
each side (the machine may be shared: the two sides run one after the other, not
alternately, because each needs most of a small machine's memory).

    .venv/bin/python benchmarks/train_step.py [--batch=16 --length=256 --steps=2]
        [--micro_batches=4] [--logprob_chunk=64] [--model=smollm2|tiny]

``--model=tiny``: a 2-layer decoder (the test's smoke run). The weights' values do not
change the cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

GROUP_SIZE = 4  # rows per GRPO group in the random batch


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
  """``grpo_batch`` as our trainer's ``TrainBatch`` (groups of ``GROUP_SIZE`` rows)."""
  # pylint: disable-next=import-outside-toplevel  # jax-heavy: the torch subprocess skips it
  from rlax_llm.data_types import TrainBatch
  tokens, mask, behaviour, advantages = grpo_batch(batch, length, vocab)
  return TrainBatch(
      tokens=tokens, loss_mask=mask, behaviour_logprobs=behaviour,
      support_sizes=np.where(mask > 0, vocab, 0).astype(np.int32),
      advantages=advantages, versions=np.where(mask > 0, 0, -1).astype(np.int32),
      group_ids=np.repeat(np.arange(batch // GROUP_SIZE), GROUP_SIZE).astype(np.int32))


def model_config(name: str, length: int, remat: str = 'none'):
  """Our ``DecoderConfig``: SmolLM2-135M's architecture, or the 2-layer ``tiny`` one."""
  # pylint: disable-next=import-outside-toplevel  # jax-heavy: the torch subprocess skips it
  from rlax_llm.models import presets
  from rlax_llm.models.decoder_config import DecoderConfig
  if name == 'tiny':
    config = DecoderConfig(vocab_size=256, num_layers=2, embed_dim=64, mlp_dim=128,
                           num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=length)
  else:
    config = dataclasses.replace(presets.PRESETS['smollm2-135m'], max_seq_len=length)
  return config.with_execution(remat=remat)


def torch_grpo_losses(model, tokens, mask, behaviour, advantages, chunk: int = 0,
                      on_head=None):
  """transformers ``model``'s GRPO clipped objective per row ``[B]`` (masked mean over the
  completion) on torch tensors ``tokens [B, T]`` (long), ``mask``, ``behaviour [B, T]``,
  ``advantages [B]``: the loss our ``rl_objective`` computes with ``loss='grpo'``.

  ``chunk`` > 0: the decoder's hidden states go through the lm head and log-softmax ``chunk``
  positions at a time, each chunk under ``torch.utils.checkpoint`` (its logits recomputed in
  the backward pass), as our ``Policy.sequence_log_probs(chunk=...)``; 0: whole logits.
  ``on_head(positions)`` is called once per head call of the forward pass.
  """
  import torch  # pylint: disable=import-outside-toplevel
  from torch.utils import checkpoint  # pylint: disable=import-outside-toplevel
  base = model.get_base_model() if hasattr(model, 'get_base_model') else model  # peft
  targets = tokens[:, 1:]
  head = base.get_output_embeddings()

  def score(h, t):  # [B, n, E], [B, n] -> log-probs [B, n]
    return torch.log_softmax(head(h).float(), -1).gather(-1, t[..., None])[..., 0]

  hidden = base.get_decoder()(input_ids=tokens).last_hidden_state[:, :-1]
  n = hidden.shape[1]
  if chunk <= 0:
    logp = score(hidden, targets)  # [B, T-1, V] logits predict tokens[:, 1:]
    if on_head:
      on_head(n)
  else:
    parts = []
    for lo in range(0, n, chunk):
      parts.append(checkpoint.checkpoint(score, hidden[:, lo:lo + chunk],
                                         targets[:, lo:lo + chunk], use_reentrant=False))
      if on_head:
        on_head(parts[-1].shape[1])
    logp = torch.cat(parts, 1)
  m = mask[:, 1:]
  ratio = torch.exp(logp - behaviour[:, 1:])
  adv = advantages[:, None]
  surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)  # eps 0.2
  return -(surrogate * m).sum(1) / m.sum(1).clamp(min=1)


class TorchStep:
  """torch's GRPO step over a transformers (or peft) model: the objective, strided
  micro-batches with the whole batch's normalisers, chunked log-probs, AdamW and clipping of
  our ``Trainer``. ``passes`` and ``rows_per_pass``: the decoder's forward calls in the last
  step and their rows; ``head_chunks_per_pass``: the lm head's calls in a pass's forward."""

  def __init__(self, reference, batch, micro_batches: int, lr: float, chunk: int = 0):
    import torch  # pylint: disable=import-outside-toplevel
    self.model, self.micro_batches, self.chunk = reference, micro_batches, chunk
    self.trained = [p for p in reference.parameters() if p.requires_grad]
    self.optimizer = torch.optim.AdamW(self.trained, lr=lr, betas=(0.9, 0.99),
                                       weight_decay=0.0)
    self.batch = [torch.from_numpy(np.array(x)) for x in (
        batch.tokens, batch.loss_mask, batch.behaviour_logprobs, batch.advantages)]
    self.batch[0] = self.batch[0].long()
    self.rows_per_pass, self.head_chunks_per_pass = [], []

  def loss(self, rows: slice):
    """The rows' share of the whole batch's mean loss (their sum over all rows)."""
    self.head_chunks_per_pass.append(0)

    def on_head(_):
      self.head_chunks_per_pass[-1] += 1
    part = [x[rows] for x in self.batch]
    self.rows_per_pass.append(int(part[0].shape[0]))
    losses_ = torch_grpo_losses(self.model, *part, chunk=self.chunk, on_head=on_head)
    return losses_.sum() / len(self.batch[0])

  @property
  def passes(self) -> int:
    return len(self.rows_per_pass)

  def __call__(self) -> float:
    """One step; returns the batch's loss (before the update)."""
    import torch  # pylint: disable=import-outside-toplevel
    rows = len(self.batch[0])
    self.rows_per_pass, self.head_chunks_per_pass = [], []
    self.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i in range(self.micro_batches):  # strided rows, as the trainer's micro-batches
      loss = self.loss(slice(i, rows, self.micro_batches))
      loss.backward()
      total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(self.trained, 1.0)
    self.optimizer.step()
    return total

  def memory(self) -> dict:
    """Parameter and optimizer-state bytes, and the bytes autograd saves for backward in one
    micro-batch's forward (each storage once)."""
    import torch  # pylint: disable=import-outside-toplevel
    saved = {}

    def pack(tensor):
      storage = tensor.untyped_storage()
      saved[storage.data_ptr()] = storage.nbytes()
      return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
      loss = self.loss(slice(0, len(self.batch[0]), self.micro_batches))
    del loss
    params = sum(p.numel() * p.element_size() for p in self.model.parameters())
    optimizer = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                    for t in state.values() if torch.is_tensor(t))
    return {'params_bytes': params, 'optimizer_bytes': optimizer,
            'saved_activation_bytes': sum(saved.values()),
            'total_bytes': params + optimizer + sum(saved.values())}


def timed(fn) -> float:
  """Seconds ``fn()`` takes."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def timed_steps(step, steps: int) -> tuple[float, list[float]]:
  """``(first step's result, [seconds of each of the next steps])``: one untimed step
  (compilation / warm-up), then ``steps`` timed ones."""
  first = step()
  return first, [timed(step) for _ in range(steps)]


def run_ours(args) -> dict:
  import functools  # pylint: disable=import-outside-toplevel
  import jax
  from rlax_llm import losses
  from rlax_llm.models.files import hf
  from rlax_llm.models.model import create_model
  from rlax_llm.sampling_spec import SamplingSpec
  from rlax_llm.trainer.scoring import Policy
  from rlax_llm.sharding import make_mesh
  from rlax_llm.trainer import objectives
  from rlax_llm.trainer.trainer import Trainer, make_optimizer

  config = model_config(args.model, args.length, args.remat)
  model, params = create_model(config, seed=0)
  # The same weights for the torch side: a HF directory transformers loads.
  with open(os.path.join(args.weights, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(hf.config_to_hf(config), f)
  hf.write_safetensors(os.path.join(args.weights, 'model.safetensors'),
                       hf.params_to_hf(params, config))
  batch = train_batch(args.batch, args.length, config.vocab_size)
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  loss = losses.LossConfig(loss='grpo').resolve()
  policy = Policy(model, SamplingSpec())
  rows_per_pass = set()

  def objective(params, micro, *rest, chunk, **kw):
    rows_per_pass.add(int(micro.tokens.shape[0]))  # at trace time: the rows of one pass
    return objectives.rl_objective(policy, loss, params, micro, *rest, logprob_chunk=chunk,
                                   **kw)

  out = {'load_average_start': os.getloadavg()[0]}
  for chunk in sorted({0, args.logprob_chunk}):
    trainer = Trainer(model, params, make_optimizer(1e-6),
                      functools.partial(objective, chunk=chunk), mesh,
                      micro_batches=args.micro_batches, totals_fn=objectives.loss_totals)
    lowered = trainer._step.lower(  # pylint: disable=protected-access
        trainer.params, trainer.opt_state, batch, None)
    memory = lowered.compile().memory_analysis()
    out[f'ours_temp_bytes_chunk{chunk}'] = int(memory.temp_size_in_bytes)
    if chunk != args.logprob_chunk:
      del trainer
      continue
    first, times = timed_steps(lambda t=trainer: t.step(batch), args.steps)
    out['first_loss'] = float(first['loss'])
    out['ours_step_s'] = statistics.median(times)
    out['ours_step_times'] = [round(t, 3) for t in times]
    out['ours_tok_s'] = args.batch * args.length / out['ours_step_s']
    out['ours_passes'] = trainer.micro_batches
  out['ours_rows_per_pass'] = sorted(rows_per_pass)
  out['ours_head_chunks_per_pass'] = (
      math.ceil((args.length - 1) / args.logprob_chunk) if args.logprob_chunk > 0 else 1)
  out['load_average_end'] = os.getloadavg()[0]
  return out


def run_torch(args) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers

  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      args.weights, attn_implementation='sdpa', dtype=torch.float32).train()
  with open(os.path.join(args.weights, 'config.json'), encoding='utf-8') as f:
    vocab = json.load(f)['vocab_size']
  batch = train_batch_numpy(args.batch, args.length, vocab)
  step = TorchStep(model, batch, args.micro_batches, 1e-6, args.logprob_chunk)
  out = {'torch_load_average_start': os.getloadavg()[0]}
  first, times = timed_steps(step, args.steps)
  step_s = statistics.median(times)
  out.update({
      'torch_first_loss': first, 'torch_step_s': step_s,
      'torch_step_times': [round(t, 3) for t in times],
      'torch_tok_s': args.batch * args.length / step_s,
      'torch_threads': torch.get_num_threads(), 'torch_passes': step.passes,
      'torch_rows_per_pass': sorted(set(step.rows_per_pass)),
      'torch_head_chunks_per_pass': sorted(set(step.head_chunks_per_pass)),
      'torch_load_average_end': os.getloadavg()[0]})
  return out


def train_batch_numpy(batch: int, length: int, vocab: int):
  """``grpo_batch`` with ``TrainBatch``'s field names, without importing rlax_llm (jax)."""
  tokens, mask, behaviour, advantages = grpo_batch(batch, length, vocab)
  return argparse.Namespace(tokens=tokens, loss_mask=mask, behaviour_logprobs=behaviour,
                            advantages=advantages)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--model', default='smollm2', choices=('smollm2', 'tiny'))
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--logprob_chunk', type=int, default=64,
                      help='both sides; 0: whole logits on both')
  parser.add_argument('--remat', default='none')
  parser.add_argument('--micro_batches', type=int, default=1, help='both sides')
  parser.add_argument('--only', choices=('ours', 'torch'))
  parser.add_argument('--weights', help='(internal) the HF directory ours writes for torch')
  args = parser.parse_args()
  if args.batch % args.micro_batches or args.batch % GROUP_SIZE:
    parser.error(f'--batch={args.batch} must be a multiple of --micro_batches='
                 f'{args.micro_batches} and of the group size {GROUP_SIZE}')
  if args.only:
    result = run_ours(args) if args.only == 'ours' else run_torch(args)
    result[f'{args.only}_peak_rss_bytes'] = resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))
    return
  result = {'model': args.model, 'batch': args.batch, 'length': args.length,
            'dtype': 'float32', 'logprob_chunk': args.logprob_chunk, 'remat': args.remat,
            'micro_batches': args.micro_batches}
  with tempfile.TemporaryDirectory(prefix='rlax_train_step_') as weights:
    for which in ('ours', 'torch'):
      out = subprocess.run(
          [sys.executable, __file__, f'--only={which}', f'--model={args.model}',
           f'--batch={args.batch}', f'--length={args.length}', f'--steps={args.steps}',
           f'--logprob_chunk={args.logprob_chunk}', f'--remat={args.remat}',
           f'--micro_batches={args.micro_batches}', f'--weights={weights}'],
          check=False, capture_output=True, text=True,
          env=dict(os.environ, JAX_PLATFORMS='cpu'))
      if out.returncode:
        raise RuntimeError(f'the {which} side exited with {out.returncode}: '
                           f'{out.stderr[-3000:]}')
      result.update(json.loads(out.stdout.strip().splitlines()[-1]))
  result['ratio'] = result['ours_tok_s'] / result['torch_tok_s']
  result['peak_rss_ratio'] = result['ours_peak_rss_bytes'] / result['torch_peak_rss_bytes']
  print(json.dumps(result))


if __name__ == '__main__':
  main()
