"""Training objectives: what the trainer differentiates, given a model and a batch.

Each objective has the signature ``(model, params, batch, frozen_params) -> (loss, metrics)``
so the trainer's jitted step is the same for supervised warm-up and RL.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from rlax_llm import losses
from rlax_llm.losses.supervised import entropy_from_logits, token_cross_entropy
from rlax_llm.models.model import Model, Params, token_logprobs
from rlax_llm.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class RLLossConfig:
  """Which policy loss and its hyper-parameters (``config.rl`` in configs/)."""

  loss: str = 'grpo'
  clip_eps: float = 0.2
  kl_beta: float = 0.0
  kl_estimator: str = 'k3'

  def __post_init__(self):
    if self.loss not in losses.POLICY_LOSSES:
      raise ValueError(f'rl.loss={self.loss!r} is not a known loss; choose one of '
                       f'{sorted(losses.POLICY_LOSSES)}.')
    if self.kl_estimator not in losses.KL_ESTIMATORS:
      raise ValueError(f'rl.kl_estimator={self.kl_estimator!r}; choose one of '
                       f'{losses.KL_ESTIMATORS}.')


def rl_objective(model: Model, params: Params, batch: TrainBatch, ref_params: Params | None,
                 config: RLLossConfig) -> tuple[jax.Array, dict[str, Any]]:
  """Recomputes log-probs of the batch's tokens and applies the configured policy loss."""
  logits = model.apply(params, batch.tokens)[:, :-1]
  targets = batch.tokens[:, 1:]
  mask = batch.loss_mask[:, 1:]
  logp = token_logprobs(logits, targets)
  ref_logp = None
  if config.kl_beta > 0:
    if ref_params is None:
      raise ValueError('rl.kl_beta > 0 needs reference params; the trainer was built without.')
    ref_logits = model.apply(jax.lax.stop_gradient(ref_params), batch.tokens)[:, :-1]
    ref_logp = token_logprobs(ref_logits, targets)
  loss, diagnostics = losses.policy_loss(
      config.loss, logp, batch.behaviour_logprobs[:, 1:], batch.advantages, mask,
      clip_eps=config.clip_eps, kl_beta=config.kl_beta, ref_logp=ref_logp,
      kl_estimator=config.kl_estimator)
  diagnostics = dict(diagnostics)
  diagnostics['entropy'] = losses.masked_token_mean(
      jax.lax.stop_gradient(entropy_from_logits(logits)), mask)
  return loss, diagnostics


def sft_objective(model: Model, params: Params, batch: dict[str, jax.Array],
                  frozen_params: Params | None = None) -> tuple[jax.Array, dict[str, Any]]:
  """Teacher-forced cross-entropy. ``batch``: ``tokens`` int32 [B, T], ``loss_mask`` [B, T]."""
  del frozen_params
  logits = model.apply(params, batch['tokens'])[:, :-1]
  return token_cross_entropy(logits, batch['tokens'][:, 1:], batch['loss_mask'][:, 1:])
