"""Benchmark: rollout routing replay (R3) against the train/inference mismatch of a tiny MoE.

The inference engine samples with a bfloat16 copy of the params (``model.inference_param_dtype
='bfloat16'``) and records each token's experts; the trainer scores the same tokens in
float32 through its objective (``trainer.objectives.rl_objective``, GRPO), once routing by
its own router (R3 off) and once replaying the recorded experts (R3 on). Printed as one
JSON object: per seed and mode, ``flipped_choices`` (the fraction of the rollout's
(token, layer, slot) expert choices that the trainer's forward routed to another expert:
the choices that flip between the two precisions with R3 off), ``router_disagreement`` (R3
on: the trainer's ``moe/route_flip_fraction``, what the replay overrode) and the
``mismatch/*`` metrics (``mismatch/kl``: k3 of KL(rollout || trainer) over the sampled
tokens), and the same-sized dense model's ``mismatch/*`` for reference.

    .venv/bin/python benchmarks/moe_routing_replay.py --prompts=64 --new_tokens=48

Figures: benchmarks/RESULTS.md, "Rollout routing replay (R3)".
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm.data_types import Rollouts, make_train_batch
from rlax_llm.loss_spec import LossConfig
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import cast_params, create_model, with_param_dtype
from rlax_llm.models.moe import replayed_experts
from rlax_llm.models.presets import TINY_MOE_PRESETS
from rlax_llm.rollout.driver import Driver, Job, VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.rollout.worker import pack_routes
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.scoring import Policy, route_flip_fraction

MOE = TINY_MOE_PRESETS['tiny-qwen3-moe']
# The dense reference: the same decoder with a SwiGLU MLP as wide as the MoE's k experts.
DENSE = dataclasses.replace(MOE, family='qwen3', num_experts=0, num_experts_per_tok=0,
                            moe_mlp_dim=0, norm_topk_prob=False,
                            mlp_dim=MOE.moe_mlp_dim * MOE.num_experts_per_tok)


def rollouts(config: DecoderConfig, params, *, prompts: int, prompt_len: int, new_tokens: int,
             seed: int, inference_dtype, quant: str = 'none') -> Rollouts:
  """Samples (temperature 1) one completion per random prompt with a ``inference_dtype`` copy
  of ``params`` (``quant='int8'``: quantised, ``Engine(quant=...)``) through the engine
  (recording routes when MoE), as ``Rollouts``."""
  model = create_model(config, seed=seed)[0]
  served = with_param_dtype(model, inference_dtype)
  moe = config.is_moe
  engine = Engine(served, make_mesh({'data': 1}, jax.devices()[:1]), slots=min(prompts, 16),
                  max_prefill_length=prompt_len, max_decode_length=new_tokens, pad_id=0,
                  record_routes=moe, quant=quant)
  holder = VersionedParams()
  holder.set(0, engine.place_params(cast_params(params, served)))
  rng = np.random.RandomState(seed)
  spec = SamplingSpec(temperature=1.0)
  ids = rng.randint(1, config.vocab_size, (prompts, prompt_len))
  keys = lambda i: np.asarray(jax.random.key_data(jax.random.key(seed * 100_003 + i)))[None]
  jobs = [Job(tuple(ids[i]), 1, spec, new_tokens, (), keys(i)) for i in range(prompts)]
  samples = [s[0] for s in Driver(engine, holder).run(jobs)]
  n = new_tokens
  tokens = np.zeros((prompts, n), np.int32)
  logps = np.zeros((prompts, n), np.float32)
  for i, s in enumerate(samples):
    tokens[i, :len(s.tokens)], logps[i, :len(s.tokens)] = s.tokens, s.logprobs
  routes = {}
  if moe:
    routes = dict(zip(('prompt_routes', 'completion_routes'),
                      pack_routes(samples, config, prompt_len, n)))
  lengths = np.asarray([len(s.tokens) for s in samples])
  return Rollouts(
      prompt_ids=np.arange(prompts, dtype=np.int64), group_ids=np.arange(prompts, dtype=np.int32),
      prompt_tokens=ids.astype(np.int32), prompt_lengths=np.full(prompts, prompt_len, np.int32),
      completion_tokens=tokens, completion_mask=np.arange(n)[None, :] < lengths[:, None],
      behaviour_logprobs=logps, support_sizes=np.zeros((prompts, n), np.int32),
      versions=np.zeros((prompts, n), np.int32),
      finish_reasons=np.asarray(['length'] * prompts), completions=[''] * prompts,
      sampling=spec, timings={}, **routes)


def measure(config: DecoderConfig, *, prompts: int = 32, prompt_len: int = 8,
            new_tokens: int = 32, seed: int = 0, inference_dtype=jnp.bfloat16,
            quant: str = 'none') -> dict:
  """The trainer's (float32) ``mismatch/*`` against the ``inference_dtype`` engine's
  behaviour log-probs (``quant='int8'``: an int8 engine copy), with R3 off and (a mixture of
  experts) on, and the route flip fractions: ``{'off': {...}, 'on': {...}}`` (dense:
  ``{'off': ...}`` only)."""
  model, params = create_model(config, seed=seed)
  batch = make_train_batch(rollouts(config, params, prompts=prompts, prompt_len=prompt_len,
                                    new_tokens=new_tokens, seed=seed,
                                    inference_dtype=inference_dtype, quant=quant),
                           np.zeros(prompts, np.float32))
  batch = jax.tree.map(jnp.asarray, batch)
  policy = Policy(model, SamplingSpec(temperature=1.0))
  out = {}
  for mode in ('off', 'on') if config.is_moe else ('off',):
    replay = mode == 'on'
    objective = jax.jit(lambda p, b, replay=replay: rl_objective(
        policy, LossConfig(), p, b, None, routing_replay=replay)[1])
    metrics = {k: float(v) for k, v in objective(params, batch).items()
               if k.startswith(('mismatch/', 'moe/')) and np.ndim(v) == 0}
    if config.is_moe:
      # The experts the trainer's forward routed each recorded token to (its router's own
      # top-k, or with R3 the replayed ones), against the rollout's.
      own = jax.jit(lambda p, r: model.apply(p, batch.tokens, routes=r, return_routes=True)[1])(
          params, batch.routes if replay else None)
      used = replayed_experts(own, batch.routes) if replay else own
      metrics['flipped_choices'] = float(route_flip_fraction(used, batch.routes))
      if replay:  # the trainer's metric: what the replay overrode
        metrics['router_disagreement'] = metrics.pop('moe/route_flip_fraction')
    out[mode] = metrics
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--prompts', type=int, default=64)
  parser.add_argument('--prompt_len', type=int, default=8)
  parser.add_argument('--new_tokens', type=int, default=48)
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--quant', default='none', help="the engine copy's model.inference_quant")
  args = parser.parse_args()
  report = {'setup': {'moe': 'tiny-qwen3-moe (8 experts, top-2, 2 layers)',
                      'inference_param_dtype': 'bfloat16', 'trainer': 'float32',
                      **{k: v for k, v in vars(args).items()}, 'backend': jax.default_backend()}}
  for seed in map(int, args.seeds.split(',')):
    sizes = dict(prompts=args.prompts, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, seed=seed, quant=args.quant)
    report[f'seed{seed}'] = {'moe': measure(MOE, **sizes), 'dense': measure(DENSE, **sizes)}
  print(json.dumps(report, indent=1))


if __name__ == '__main__':
  main()
