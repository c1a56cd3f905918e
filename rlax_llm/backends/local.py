"""Builds every role of a run from a validated config and wires them together.

This is the local backend: all roles in one process, each on its own mesh. The Ray backend
(a later issue) places the same roles on actors across hosts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_collections

from rlax_llm import losses
from rlax_llm.controller import Controller, ControllerSettings
from rlax_llm.metrics import MetricsWriter
from rlax_llm.models.decoder import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.paramserver import ParameterServer
from rlax_llm.rollout.sampler import SamplingConfig
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.tasks import make_task
from rlax_llm.trainer.objectives import RLLossConfig, rl_objective
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.trainer import Trainer, make_optimizer
from rlax_llm.trainer.warmup import supervised_warmup

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def decoder_config(config: ml_collections.ConfigDict, vocab_size: int) -> DecoderConfig:
  """The ``DecoderConfig`` for ``config.model`` (``name='tiny'``: sizes from the config)."""
  m = config.model
  return DecoderConfig(
      vocab_size=vocab_size, num_layers=m.num_layers, embed_dim=m.embed_dim,
      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
      mlp_dim=m.mlp_dim, rope_theta=m.rope_theta, tie_embeddings=m.tie_embeddings,
      max_seq_len=m.max_seq_len, param_dtype=_DTYPES[m.param_dtype], dtype=_DTYPES[m.dtype])


def rl_loss_config(rl: ml_collections.ConfigDict) -> RLLossConfig:
  """The ``RLLossConfig`` for ``config.rl`` (``None`` fields take the loss's defaults)."""
  mismatch = None
  if rl.mismatch.enabled:
    mismatch = losses.MismatchConfig(level=rl.mismatch.level, mode=rl.mismatch.mode,
                                     threshold=rl.mismatch.threshold,
                                     veto_threshold=rl.mismatch.veto_threshold)
  return RLLossConfig(
      loss=rl.loss, advantage_estimator=rl.advantage_estimator, eps_low=rl.eps_low,
      eps_high=rl.eps_high, aggregation=rl.aggregation, kl_beta=rl.kl_beta,
      kl_estimator=rl.kl_estimator, m2po_tau=rl.m2po_tau, m2po_variant=rl.m2po_variant,
      old_logprobs=rl.old_logprobs, mismatch=mismatch)


@dataclasses.dataclass
class Run:
  controller: Controller
  writer: MetricsWriter
  warmup_metrics: dict[str, float]

  def execute(self) -> dict[str, float]:
    """Runs the controller; writes and returns the summary (warm-up and final figures)."""
    start = time.perf_counter()
    summary = {**self.warmup_metrics, **self.controller.run()}
    summary['time/total_s'] = time.perf_counter() - start + self.warmup_metrics.get(
        'warmup/time_s', 0.0)
    self.writer.write_summary(summary)
    return summary


@contextlib.contextmanager
def build_run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> Iterator[Run]:
  """Builds task, model, warm-up, trainer, parameter server, worker and controller."""
  rl = config.rl
  loss_config = rl_loss_config(rl)
  settings = ControllerSettings(  # validates the staleness setting before any compute
      total_steps=config.total_steps, prompts_per_step=rl.prompts_per_step,
      group_size=rl.group_size, staleness_j=config.staleness.j,
      staleness_k=config.staleness.k, eval_every=config.eval.every_steps, seed=config.seed,
      advantage_estimator=loss_config.estimator)
  task = make_task(config.task.to_dict() | {'seed': config.seed})
  tokenizer = task.tokenizer
  model, params = create_model(decoder_config(config, tokenizer.vocab_size), seed=config.seed)
  trainer_mesh = make_mesh(config.mesh.trainer.to_dict())
  inference_mesh = make_mesh(config.mesh.inference.to_dict())
  logging.info('devices: %s; trainer mesh %s; inference mesh %s', jax.devices(),
               dict(trainer_mesh.shape), dict(inference_mesh.shape))

  w = config.warmup
  params, warmup_metrics = supervised_warmup(
      model, params, task, trainer_mesh, steps=w.steps, batch_size=w.batch_size,
      learning_rate=w.learning_rate, warmup_steps=w.warmup_steps)

  optimizer = make_optimizer(rl.learning_rate, weight_decay=rl.weight_decay,
                             max_grad_norm=rl.max_grad_norm)
  objective = lambda m, p, b, ref: rl_objective(m, p, b, ref, loss_config)
  trainer = Trainer(model, params, optimizer, objective, trainer_mesh,
                    frozen_params=params if rl.kl_beta > 0 else None)

  server = ParameterServer(keep=2)
  s = config.sampling
  sampling = SamplingConfig(max_new_tokens=s.max_new_tokens, eos_id=tokenizer.eos_id,
                            pad_id=tokenizer.pad_id, temperature=s.temperature, top_k=s.top_k,
                            top_p=s.top_p)
  worker = InferenceWorker(model, tokenizer, sampling, inference_mesh, s.max_prompt_len)
  with MetricsWriter(workdir, tensorboard=config.log.tensorboard,
                     console_every=config.log.console_every) as writer:
    yield Run(Controller(settings, task, trainer, server, worker, writer), writer,
              warmup_metrics)
