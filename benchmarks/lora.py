"""Benchmark: LoRA training (rank 16 on every projection) against transformers + peft, the
trainer's memory with and without LoRA, and the bytes of a weight sync with LoRA.

One process, one JSON object. The model (``--model``): SmolLM2-135M-Instruct (the packaged
GGUF, loaded by ``from_pretrained``; the torch model is transformers' ``LlamaForCausalLM``
built from the same config and holding the same weights, ``config_to_hf``/``params_to_hf``),
or ``tiny`` (a 2-layer random decoder: the test's smoke run). A batch of ``--batch`` x
``--length`` tokens (random; the completion half under the loss mask) with random behaviour
log-probs and advantages, the GRPO clipped objective (``--logprob_chunk`` on both sides,
``train_step.TorchStep``; default 0: whole logits, as ``configs/smollm2.py``), AdamW with
global-norm clipping, fp32; ``--dtype=bfloat16``:
the LoRA step's frozen base and its matmuls in bfloat16 on both sides (the adapters and their
optimizer state float32 on both: peft's ``autocast_adapter_dtype``), for 1. and 2.'s LoRA row.
``--shared_prefix``: the batch in the controller's layout instead (groups of 8 consecutive
rows sharing a prompt of at most ``--length - --new_tokens`` tokens, then at most
``--new_tokens`` completion tokens, ragged: ``shared_prefix.make_batch``), and our trainers
score it as ``configs/smollm2.py`` does (``rl.shared_prefix``: each group's prompt once per
micro-batch into a KV cache, the completion window alone scored; the same loss and gradients
to rounding, ``tests/trainer/test_shared_prefix.py``); peft runs the whole rows, as a
transformers model does. ``--batch=32 --length=64 --new_tokens=16 --micro_batches=1`` is the
recipe's own step (4 prompts x 8 samples, 48 + 16 tokens, one pass).

1. **Train step** (``train``): our ``Trainer`` over ``lora.create``'s adapters
   (``trainable=lora.trainable_mask``) against ``peft.get_peft_model`` on the torch model
   (same rank, alpha, targets ``q,k,v,o,gate,up,down``, no dropout; ``torch.optim.AdamW``
   over the adapters, eager). Both split the batch into ``--micro_batches`` and accumulate
   gradients (one update per batch). One warm-up step each (compilation), then ``--repeats``
   timed steps, ours and theirs alternately (the machine is shared: each ratio compares
   neighbouring runs); ``ratio`` is the median of the per-repeat ratios (goal >= 1.5).
2. **Memory** (``memory``): the bytes of the trainer's state trees (params, optimizer state)
   with LoRA and with full fine-tuning, and the step's temporaries (activations, gradients,
   optimizer temporaries) from XLA's compiled memory analysis of the jitted step
   (``temp_size_in_bytes``); for torch + peft: its parameters, its optimizer state after a
   step, and the tensors autograd saves for the backward pass (``saved_tensors_hooks``, each
   storage counted once) in one micro-batch's forward.
3. **Weight sync** (``sync``): after the timed real optimizer steps, the adapter tree
   (``lora.adapter_tree``: every ``A`` and ``B``, what a LoRA trainer pushes per version) is
   pushed to an in-process ``ParameterServer`` and pulled whole (what a worker holding the
   base pulls per version), and as an update from the previous version; against the full
   fp32 params pulled whole, and against the bf16 sparse delta (``paramserver.delta``) of one
   full fine-tuning step at the SmolLM2 recipe's learning rate (``configs/smollm2.py``:
   ``rl.learning_rate``). ``lora_adapters_bf16``: the same with ``lora.sync_dtype='bfloat16'``
   (``lora.synced_adapters``: the adapters rounded to bfloat16 for the wire), whole and as a
   delta from the previous version (the elements whose bfloat16 bits changed);
   ``lora_adapters_int8``: with ``lora.sync_dtype='int8'`` (each factor int8 with a float32
   scale per rank component). Each wire row's ``weight_change_error`` is how far the weight
   changes the workers merge are from the trained ones (``wire_error``).
   ``lora_over_full_fp32``, ``lora_bf16_over_full_fp32`` and ``lora_int8_over_full_fp32`` are
   the goal's figures (goal <= 0.01). ``adapter_bytes_by_rank``: the adapter tree's fp32
   bytes at other ranks (from the shapes, all seven targets; bfloat16 is half).
   The LoRA trainer's learning rate is the ``configs/smollm2.py:lora`` variant's (30x the full
   recipe's), the full trainer's the recipe's: the deltas depend on it.

    .venv/bin/python benchmarks/lora.py [--model=smollm2] [--batch=16 --length=256]
        [--micro_batches=4] [--repeats=3] [--dtype=float32|bfloat16]
        [--shared_prefix [--new_tokens=N]]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared_prefix import make_batch  # this folder (sys.path[0])
from train_step import TorchStep, model_config, timed, train_batch

from rlax_llm import losses, sharding
from rlax_llm.configs import smollm2 as smollm2_recipe
from rlax_llm.data_types import TrainBatch
from rlax_llm.models import from_pretrained, smollm2_gguf_path
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.files.hf import config_to_hf, params_to_hf
from rlax_llm.models.model import abstract_model, cast_params, create_model, split_module
from rlax_llm.models.quant import Int8Weight
from rlax_llm.paramserver import ParameterServer
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer import objectives
from rlax_llm.trainer.scoring import Policy
from rlax_llm.trainer.trainer import Trainer, make_optimizer

TINY = model_config('tiny', 256)
GROUP_SIZE = 8  # --shared_prefix: rows per group sharing a prompt (configs/smollm2.py's)
# The narrower wires (lora.sync_dtype) whose adapter versions the sync figures also measure.
WIRE_DTYPES = ('bfloat16', 'int8')
TORCH_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


def tree_bytes(tree) -> int:
  """Bytes of every array leaf of ``tree``."""
  return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                 if hasattr(x, 'dtype')))


def load(name: str):
  """``(model, params)``: SmolLM2-135M-Instruct's GGUF weights, or the tiny random decoder."""
  if name == 'tiny':
    return create_model(TINY, seed=0)
  module, _ = from_pretrained(smollm2_gguf_path())
  return split_module(module)


def in_dtype(model, params, dtype: str):
  """``(model, params)`` computing and storing the base in ``dtype`` (``'bfloat16'``: the
  frozen base of a LoRA run in bfloat16 and its matmuls' operands and outputs in bfloat16,
  summed in float32, ``numerics.accumulated_product``; ``lora.create``'s adapters stay
  float32)."""
  if dtype == 'float32':
    return model, params
  target = abstract_model(model.config.with_execution(param_dtype=jnp.dtype(dtype),
                                                      dtype=jnp.dtype(dtype)))
  return target, cast_params(params, target)


def step_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
  """Adds the flags of the timed step (model, batch, objective, LoRA; shared by this script
  and ``profile_step.py``, which profiles the same step) to ``parser`` and parses them;
  ``--new_tokens=0`` becomes half ``--length``."""
  parser.add_argument('--model', default='smollm2', choices=('smollm2', 'tiny'))
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--micro_batches', type=int, default=4)
  parser.add_argument('--logprob_chunk', type=int, default=0,
                      help='both sides; 0: whole logits, as configs/smollm2.py')
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'),
                      help="the LoRA step's frozen base and matmuls (both sides; full "
                           'fine-tuning and the sync stay float32)')
  parser.add_argument('--rank', type=int, default=16)
  parser.add_argument('--alpha', type=float, default=32.0)
  parser.add_argument('--shared_prefix', action='store_true',
                      help='groups of 8 rows sharing a prompt, our step scoring the '
                           "completions only (rl.shared_prefix, as configs/smollm2.py's)")
  parser.add_argument('--new_tokens', type=int, default=0,
                      help='--shared_prefix: completion tokens at most (0: half --length)')
  args = parser.parse_args()
  args.new_tokens = args.new_tokens or args.length // 2
  return args


def make_trainer(model, params, lr: float, args, trainable=None) -> Trainer:
  """Our GRPO ``Trainer`` as the benchmark's flags say (``args.shared_prefix``: scoring the
  ``args.new_tokens`` completion window of groups of ``GROUP_SIZE`` rows, ``rl.shared_prefix``)."""
  mesh = sharding.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  scoring, check = {}, None
  if args.shared_prefix:
    scoring, check = objectives.shared_prefix_scoring(args.new_tokens, GROUP_SIZE,
                                                      args.micro_batches)
  objective = functools.partial(objectives.rl_objective, Policy(model, SamplingSpec()),
                                losses.LossConfig(loss='grpo').resolve(),
                                logprob_chunk=args.logprob_chunk, **scoring)
  return Trainer(model, params, make_optimizer(lr), objective, mesh,
                 micro_batches=args.micro_batches, totals_fn=objectives.loss_totals,
                 trainable=trainable, check_batch=check)


def benchmark_batch(args, vocab: int) -> TrainBatch:
  """The timed batch: ``--batch`` x ``--length`` random tokens, the completion half under the
  loss mask (``train_step.train_batch``); with ``--shared_prefix``, the controller's layout
  (``shared_prefix.make_batch``): groups of ``GROUP_SIZE`` consecutive rows sharing a prompt
  of ``length - new_tokens`` tokens at most, ragged prompts and completions."""
  if not args.shared_prefix:
    return train_batch(args.batch, args.length, vocab)
  if args.batch % GROUP_SIZE or not 0 < args.new_tokens < args.length:
    raise ValueError(f'--shared_prefix needs --batch a multiple of {GROUP_SIZE} (got '
                     f'{args.batch}) and 0 < --new_tokens < --length (got {args.new_tokens}, '
                     f'{args.length})')
  return make_batch(args.batch // GROUP_SIZE, GROUP_SIZE, args.length - args.new_tokens,
                    args.new_tokens, vocab)


def compiled_step(trainer: Trainer, batch: TrainBatch):
  """The trainer's jitted step compiled for ``batch`` (AOT: its memory analysis), and the
  batch placed as ``Trainer.step`` places it."""
  placed = sharding.global_batch(batch, trainer.mesh, trainer.rules)
  with sharding.activation_sharding(trainer.mesh, trainer.rules):
    lowered = trainer._step.lower(  # pylint: disable=protected-access
        trainer.params, trainer.opt_state, placed, trainer.reference_params)
  return lowered.compile(), placed


def memory_row(trainer: Trainer, compiled) -> dict:
  analysis = compiled.memory_analysis()
  row = {'params_bytes': tree_bytes(trainer.params),
         'optimizer_bytes': tree_bytes(trainer.opt_state),
         'step_temp_bytes': int(analysis.temp_size_in_bytes)}
  row['total_bytes'] = sum(row.values())
  return row


def wire_error(model: lora_lib.LoRAModel, params, synced) -> float:
  """How far the weight changes the workers merge from ``synced`` (``lora.synced_adapters``)
  are from the trained ones: ``||dW_wire - dW|| / ||dW||`` over every adapted weight
  (``dW = s * A @ B``, ``lora.delta``; Frobenius norms summed over the adapters)."""
  trained = jax.tree.leaves(lora_lib.adapter_tree(params))
  wire = jax.tree_util.tree_leaves_with_path(synced,
                                            is_leaf=lambda x: isinstance(x, Int8Weight))
  wire = [lora_lib.wire_factor(x, path[-1].key) for path, x in wire]
  error = total = 0.0
  for i in range(0, len(trained), 2):
    exact = lora_lib.delta(model, trained[i], trained[i + 1])
    ours = lora_lib.delta(model, *wire[i:i + 2])  # in float32, whatever the wire dtype
    error += float(jnp.sum(jnp.square(ours - exact)))
    total += float(jnp.sum(jnp.square(exact)))
  return (error / total) ** 0.5 if total else 0.0


def pulled_bytes(server: ParameterServer, version: int, base_version: int = -1) -> dict:
  update = server.update(version, base_version)
  return {'bytes': int(update.nbytes), 'changed_fraction': float(update.density)}


# ----------------------------------------------------------------------------- torch + peft

def torch_model(model, params, lora: lora_lib.LoRAConfig, dtype: str = 'float32'):
  """transformers' model of ``model.config`` holding ``params`` (in ``dtype``), with peft's
  adapters (float32 either way: peft's ``autocast_adapter_dtype``)."""
  config = transformers.AutoConfig.for_model(
      **{k: v for k, v in config_to_hf(model.config).items() if k != 'architectures'})
  config._attn_implementation = 'sdpa'  # pylint: disable=protected-access
  reference = transformers.AutoModelForCausalLM.from_config(config).float()
  state = {k: torch.from_numpy(np.array(v, np.float32))
           for k, v in params_to_hf(params, model.config).items()}
  missing, unexpected = reference.load_state_dict(state, strict=False)
  assert not unexpected and set(missing) <= {'lm_head.weight'}, (missing, unexpected)
  reference = reference.to(getattr(torch, dtype))
  peft_config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                target_modules=list(TORCH_TARGETS), bias='none')
  return peft.get_peft_model(reference, peft_config).train()


# ----------------------------------------------------------------------------- the benchmark

def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--torch_threads', type=int, default=0, help='0: torch default')
  args = step_args(parser)
  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  lr = float(smollm2_recipe.get_config().rl.learning_rate)
  lora_lr = float(smollm2_recipe.get_config('lora').rl.learning_rate)
  lora = lora_lib.LoRAConfig(args.rank, args.alpha)
  base, params0 = load(args.model)
  batch = benchmark_batch(args, base.config.vocab_size)
  tokens = args.batch * args.length
  out = {'benchmark': 'lora', 'model': args.model, 'batch': args.batch, 'length': args.length,
         'micro_batches': args.micro_batches, 'logprob_chunk': args.logprob_chunk,
         'rank': args.rank, 'alpha': args.alpha, 'targets': ','.join(lora.targets),
         'learning_rate': lr, 'lora_learning_rate': lora_lr, 'dtype': args.dtype,
         'shared_prefix': args.shared_prefix,
         'new_tokens': args.new_tokens if args.shared_prefix else None,
         'torch_threads': torch.get_num_threads(),
         'load_average_start': os.getloadavg()[0]}

  # 1. The LoRA train step, ours and peft's alternately.
  model, params = lora_lib.create(*in_dtype(base, params0, args.dtype), lora, seed=0)
  trainer = make_trainer(model, params, lora_lr, args, lora_lib.trainable_mask(model))
  compiled, _ = compiled_step(trainer, batch)
  lora_memory = memory_row(trainer, compiled)
  del compiled
  reference = torch_model(base, params0, lora, args.dtype)
  theirs = TorchStep(reference, batch, args.micro_batches, lr, args.logprob_chunk)
  server = ParameterServer(keep=2)
  server.push(0, lora_lib.adapter_tree(trainer.params))
  wires = {dtype: (dataclasses.replace(lora, sync_dtype=dtype), ParameterServer(keep=2))
           for dtype in WIRE_DTYPES}
  for wire_lora, wire_server in wires.values():
    wire_server.push(0, lora_lib.synced_adapters(wire_lora, lora_lib.adapter_tree(trainer.params)))
  start = time.perf_counter()
  first_loss = float(trainer.step(batch)['loss'])
  compile_s = time.perf_counter() - start
  peft_first_loss = theirs()
  ours_s, theirs_s = [], []
  for _ in range(args.repeats):
    ours_s.append(timed(functools.partial(trainer.step, batch)))
    theirs_s.append(timed(theirs))
  ratios = [t / o for o, t in zip(ours_s, theirs_s)]
  out['train'] = {
      'ours_tok_s': tokens / statistics.median(ours_s),
      'peft_tok_s': tokens / statistics.median(theirs_s),
      'ratio': statistics.median(ratios), 'ratios': [round(r, 3) for r in ratios],
      'ours_step_s': [round(s, 3) for s in ours_s],
      'peft_step_s': [round(s, 3) for s in theirs_s], 'ours_first_step_s': compile_s,
      # The same objective on the same batch and weights (B = 0: the base model's loss).
      'first_loss': first_loss, 'peft_first_loss': peft_first_loss,
      'trained_params': tree_bytes(lora_lib.adapter_tree(trainer.params)) // 4,
      'peft_trained_params': sum(p.numel() for p in theirs.trained)}
  out['memory'] = {'lora': lora_memory, 'peft': theirs.memory()}
  del theirs, reference

  # 3a. The adapters after the real steps above: version (1 + repeats) vs version 0.
  version = 1 + args.repeats
  server.push(version, lora_lib.adapter_tree(trainer.params))
  lora_sync = pulled_bytes(server, version)
  lora_sync['from_previous'] = pulled_bytes(server, version, 0)
  lora_wire = {}
  for dtype, (wire_lora, wire_server) in wires.items():
    synced = lora_lib.synced_adapters(wire_lora, lora_lib.adapter_tree(trainer.params))
    wire_server.push(version, synced)
    lora_wire[dtype] = pulled_bytes(wire_server, version)
    lora_wire[dtype]['from_previous'] = pulled_bytes(wire_server, version, 0)
    lora_wire[dtype]['weight_change_error'] = wire_error(model, trainer.params, synced)
  del trainer, server, wires

  # 2 (full) and 3b: full fine-tuning's memory, and one full step's bf16 delta.
  full = make_trainer(base, params0, lr, args)
  compiled, placed = compiled_step(full, batch)
  out['memory']['full'] = memory_row(full, compiled)
  fp32 = ParameterServer(keep=1)
  fp32.push(0, full.params)
  bf16 = ParameterServer(keep=2)
  bf16.push(0, jax.tree.map(lambda x: x.astype(jnp.bfloat16), full.params))
  full.params, full.opt_state, _ = compiled(full.params, full.opt_state, placed, None)
  del compiled
  bf16.push(1, jax.tree.map(lambda x: x.astype(jnp.bfloat16), full.params))
  full_fp32 = pulled_bytes(fp32, 0)['bytes']
  delta = pulled_bytes(bf16, 1, 0)
  out['memory']['lora_over_full_total'] = (out['memory']['lora']['total_bytes']
                                           / out['memory']['full']['total_bytes'])
  out['sync'] = {
      'lora_adapters': lora_sync, 'lora_adapters_bf16': lora_wire['bfloat16'],
      'lora_adapters_int8': lora_wire['int8'],
      'full_fp32_bytes': full_fp32,
      'full_bf16_delta': delta, 'lora_over_full_fp32': lora_sync['bytes'] / full_fp32,
      'lora_over_bf16_delta': lora_sync['bytes'] / delta['bytes'],
      'lora_bf16_over_full_fp32': lora_wire['bfloat16']['bytes'] / full_fp32,
      'lora_bf16_delta_over_full_fp32': (lora_wire['bfloat16']['from_previous']['bytes']
                                         / full_fp32),
      'lora_int8_over_full_fp32': lora_wire['int8']['bytes'] / full_fp32,
      'lora_int8_delta_over_full_fp32': lora_wire['int8']['from_previous']['bytes'] / full_fp32,
      'bf16_delta_over_full_fp32': delta['bytes'] / full_fp32,
      'adapter_bytes_by_rank': {
          r: tree_bytes(lora_lib.adapter_tree(m.abstract_params()))
          for r in (1, 2, 4, 8, 16)
          for m in [dataclasses.replace(model, lora=lora_lib.LoRAConfig(r, args.alpha))]}}
  out['load_average_end'] = os.getloadavg()[0]
  print(json.dumps(out, indent=2))


if __name__ == '__main__':
  main()
