"""Benchmark: a tiny Qwen3-MoE decoder in rlax_llm (JAX) vs transformers' Qwen3MoeForCausalLM
(torch eager, CPU), same run, same shapes, same weights, float32; and rlax_llm's three expert
paths (``Execution.moe_impl``: 'ragged', grouped matmuls, 'dense', every expert on every
token, and 'blocked', the routed rows in blocks of one expert each) at a few (experts, k)
points.

The model (defaults; every size a flag): 2 layers, hidden 256, 4 heads of 64 (2 kv heads),
16 experts of width 256, top-2 with renormalised gates (``norm_topk_prob``), a 4096-word
vocabulary, untied. Ours is random-initialised; transformers loads the same weights from a HF
directory (``hf.config_to_hf``, ``hf.params_to_hf``), and the first train step's loss on both
sides is printed (``loss``, ``torch_loss``: equal to float32 rounding, so the two did the same
computation).

- **train**: one forward and backward pass (the gradient of every parameter) of the mean
  token log-probability of ``--batch`` x ``--length`` random tokens: ours ``jax.jit`` of
  ``jax.value_and_grad`` over ``Model.apply`` with ``moe_impl=--moe_impl`` (default
  'blocked', XLA:CPU's fastest: **impls**); torch ``loss.backward()`` on the module's
  logits. tokens/s = batch x length / median step time. ``moe_impl`` and
  ``decode_moe_impl`` in the output say which paths ours ran.
- **decode**: greedy generation of ``--new_tokens`` tokens for ``--batch`` prompts of
  ``--prompt`` tokens, each side with its KV cache: ours the ``Engine`` (``rollout.driver.
  generate``; prefill, then one jitted decode step per token), torch ``model.generate``
  (``min_new_tokens`` = ``max_new_tokens``: no early stop); ours with ``--moe_impl`` in
  prefill and ``--decode_moe_impl`` in the decode steps (default 'blocked' for both).
  tokens/s = batch x new tokens / median time, prefill included on both sides.
- **impls**: our train step (as above) and a decode-sized forward (``--batch`` tokens, one per
  row) with ``moe_impl='ragged'``, ``'dense'`` and ``'blocked'`` at each ``--points``
  (experts x k) with the model's other sizes; ``X_over_ragged`` > 1: ragged is faster than
  X. And the engine's greedy generation (as **decode**: prefill, then ``--new_tokens``
  decode steps with the KV cache) with the trainer's experts (ragged), with
  ``model.inference_moe_impl='dense_decode'`` (``Execution.decode_moe_impl='dense'``: the
  decode steps dense, the prefill ragged) and with ``'blocked'`` everywhere
  (``model.inference_moe_impl='blocked'``): ``engine_decode_X_over_ragged``, and
  ``engine_greedy_tokens_equal`` / ``engine_blocked_greedy_tokens_equal`` (the fraction of
  greedy tokens equal to ragged's, 1.0 expected).

Timing: one untimed call (compilation / warm-up), then ``--repeats`` calls of each side
alternately (so both see the same load), the median of each. The machine may be shared: the
load average is printed before and after; compare the ratios, not the absolute figures.

    PYTHONPATH=. .venv/bin/python benchmarks/moe_speed.py [--repeats=5] [--points=8x2,16x2,64x8]
        [--moe_impl=blocked] [--decode_moe_impl=blocked]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('HF_HUB_OFFLINE', '1')
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from batch_invariant import alternate  # noqa: E402  # this folder (sys.path[0])
from rlax_llm.models.decoder_config import DecoderConfig  # noqa: E402
from rlax_llm.models.files import hf  # noqa: E402
from rlax_llm.models.model import abstract_model, create_model, token_logprobs  # noqa: E402
from rlax_llm.rollout.driver import generate  # noqa: E402
from rlax_llm.rollout.engine import Engine  # noqa: E402
from rlax_llm.sampling_spec import GREEDY  # noqa: E402
from rlax_llm.sharding import make_mesh  # noqa: E402


# The expert paths compared (``Execution.moe_impl``).
IMPLS = ('ragged', 'dense', 'blocked')


def model_config(args, experts: int, top_k: int, impl: str = 'ragged') -> DecoderConfig:
  """The benchmark's Qwen3-MoE decoder with ``experts`` experts, ``top_k`` per token."""
  return DecoderConfig(
      family='qwen3_moe', vocab_size=args.vocab, num_layers=args.layers,
      embed_dim=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
      head_dim=args.hidden // args.heads, mlp_dim=args.moe_mlp, moe_mlp_dim=args.moe_mlp,
      num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, qk_norm=True,
      tie_embeddings=False, max_seq_len=max(args.length, args.prompt + args.new_tokens)
  ).with_execution(moe_impl=impl)


def tokens_of(args) -> np.ndarray:
  return np.random.RandomState(0).randint(1, args.vocab, (args.batch, args.length)).astype(
      np.int32)


def ours_train_step(model):
  """jitted ``params, tokens -> (loss, grads)``: the mean next-token log-probability's
  gradient with respect to every parameter."""
  def loss(params, tokens):
    logits = model.apply(params, tokens[:, :-1])
    return -jnp.mean(token_logprobs(logits, tokens[:, 1:]))
  return jax.jit(jax.value_and_grad(loss))


def torch_train_step(model, tokens: np.ndarray):
  tokens = torch.from_numpy(tokens.astype(np.int64))

  def step() -> float:
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1]).logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss = -logp.mean()
    loss.backward()
    return float(loss.detach())
  return step


def median_times(calls: dict, repeats: int) -> dict:
  """``{name: median seconds}`` of ``calls`` run alternately (``batch_invariant.alternate``:
  each once untimed, then ``repeats`` rounds of every call in turn)."""
  return {name: statistics.median(t) for name, t in alternate(calls, repeats).items()}


def against_transformers(args) -> dict:
  """The train and decode steps, ours (``--moe_impl``, ``--decode_moe_impl``) vs
  transformers', same weights and shapes."""
  config = model_config(args, args.experts, args.top_k, args.moe_impl).with_execution(
      decode_moe_impl=args.decode_moe_impl)
  model, params = create_model(config, seed=0)
  with tempfile.TemporaryDirectory() as directory:
    with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
      json.dump(hf.config_to_hf(config, pad_token_id=0, eos_token_id=0, bos_token_id=0), f)
    hf.write_safetensors(os.path.join(directory, 'model.safetensors'),
                         hf.params_to_hf(params, config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32).train()
  tokens = tokens_of(args)
  step = ours_train_step(model)
  jtokens = jnp.asarray(tokens)
  loss = float(step(params, jtokens)[0])
  torch_step = torch_train_step(reference, tokens)
  torch_loss = torch_step()
  train = median_times({'ours': lambda: jax.block_until_ready(step(params, jtokens)),
                     'torch': torch_step}, args.repeats)

  reference.eval()
  prompts = tokens[:, :args.prompt]
  engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=args.batch,
                  max_prefill_length=args.prompt, max_decode_length=args.new_tokens, pad_id=0)
  ours_decode = lambda: generate(model, params, prompts.tolist(), GREEDY,  # noqa: E731
                                 max_new_tokens=args.new_tokens, engine=engine)

  def torch_decode():
    with torch.no_grad():
      return reference.generate(torch.from_numpy(prompts.astype(np.int64)),
                                attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                do_sample=False, pad_token_id=0)
  decode = median_times({'ours': ours_decode, 'torch': torch_decode}, args.repeats)
  ours_tokens = np.array([s.tokens for s in ours_decode()])
  torch_tokens = torch_decode()[:, args.prompt:].numpy()
  train_tokens = args.batch * args.length
  decode_tokens = args.batch * args.new_tokens
  return {
      'moe_impl': args.moe_impl, 'decode_moe_impl': args.decode_moe_impl or args.moe_impl,
      'loss': loss, 'torch_loss': torch_loss,
      'train': {'ours_s': train['ours'], 'torch_s': train['torch'],
                'ours_tok_s': train_tokens / train['ours'],
                'torch_tok_s': train_tokens / train['torch'],
                'speedup': train['torch'] / train['ours']},
      'decode': {'ours_s': decode['ours'], 'torch_s': decode['torch'],
                 'ours_tok_s': decode_tokens / decode['ours'],
                 'torch_tok_s': decode_tokens / decode['torch'],
                 'speedup': decode['torch'] / decode['ours'],
                 'greedy_tokens_equal': float(np.mean(ours_tokens == torch_tokens))}}


def impls(args) -> list[dict]:
  """Ours with ``moe_impl='ragged'``, ``'dense'`` and ``'blocked'`` at each (experts, k)
  point."""
  out = []
  tokens = jnp.asarray(tokens_of(args))
  one_each = tokens[:, :1]
  prompts = tokens_of(args)[:, :args.prompt].tolist()
  for point in filter(None, args.points.split(',')):
    experts, top_k = (int(x) for x in point.split('x'))
    calls = {}
    for impl in IMPLS:
      model, params = create_model(model_config(args, experts, top_k, impl), seed=0)
      step, forward = ours_train_step(model), jax.jit(model.apply)
      calls[f'{impl}_train'] = (
          lambda s=step, p=params: jax.block_until_ready(s(p, tokens)))
      calls[f'{impl}_decode_forward'] = (
          lambda f=forward, p=params: jax.block_until_ready(f(p, one_each)))
    generations = {}
    for impl in IMPLS:  # the engine's decode steps so; its prefill ragged, blocked's blocked
      model = abstract_model(model_config(args, experts, top_k).with_execution(
          moe_impl='blocked' if impl == 'blocked' else 'ragged',
          decode_moe_impl='' if impl == 'ragged' else impl))
      engine = Engine(model, make_mesh({'data': 1}, jax.devices()[:1]), slots=args.batch,
                      max_prefill_length=args.prompt, max_decode_length=args.new_tokens,
                      pad_id=0)
      generations[impl] = calls[f'{impl}_engine_decode'] = functools.partial(
          generate, model, params, prompts, GREEDY, max_new_tokens=args.new_tokens,
          engine=engine)
    times = median_times(calls, args.repeats)
    greedy = {impl: np.array([s.tokens for s in run()]) for impl, run in generations.items()}
    equal = lambda impl: float(np.mean(greedy[impl] == greedy['ragged']))  # noqa: E731
    out.append({'experts': experts, 'top_k': top_k,
                **{f'{name}_s': t for name, t in times.items()},
                **{f'{step}_{impl}_over_ragged': times[f'{impl}_{step}'] / times[f'ragged_{step}']
                   for impl in IMPLS[1:] for step in ('train', 'decode_forward', 'engine_decode')},
                'engine_greedy_tokens_equal': equal('dense'),
                'engine_blocked_greedy_tokens_equal': equal('blocked')})
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layers', type=int, default=2)
  parser.add_argument('--hidden', type=int, default=256)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument('--kv_heads', type=int, default=2)
  parser.add_argument('--moe_mlp', type=int, default=256)
  parser.add_argument('--vocab', type=int, default=4096)
  parser.add_argument('--experts', type=int, default=16)
  parser.add_argument('--top_k', type=int, default=2)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--length', type=int, default=128, help='train rows\' tokens')
  parser.add_argument('--prompt', type=int, default=32)
  parser.add_argument('--new_tokens', type=int, default=64)
  parser.add_argument('--points', default='8x2,16x2,64x8',
                      help='(experts)x(k) points of the ragged/dense comparison (empty: none)')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--moe_impl', default='blocked', choices=IMPLS,
                      help='ours in the head-to-head: the train step and the prefill')
  parser.add_argument('--decode_moe_impl', default='blocked', choices=('', *IMPLS),
                      help="ours in the head-to-head: the decode steps ('': --moe_impl)")
  args = parser.parse_args()
  torch.set_num_threads(os.cpu_count() or 1)
  out = {'benchmark': 'moe_speed', 'load_average_start': os.getloadavg()[0],
         'cpus': os.cpu_count(), 'torch_threads': torch.get_num_threads(),
         'shapes': {k: getattr(args, k) for k in (
             'layers', 'hidden', 'heads', 'kv_heads', 'moe_mlp', 'vocab', 'experts', 'top_k',
             'batch', 'length', 'prompt', 'new_tokens')},
         'versions': {'jax': jax.__version__, 'torch': torch.__version__,
                      'transformers': transformers.__version__}}
  out.update(against_transformers(args))
  out['impls'] = impls(args)
  out['load_average_end'] = os.getloadavg()[0]
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  main()
