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
  """Which policy loss and its hyper-parameters (``config.rl`` in configs/).

  ``None`` fields take the named loss's defaults (``losses.LOSSES[loss]``).
  ``old_logprobs``: what the importance ratio compares against. ``'behaviour'`` uses the
  rollout engine's log-probs (needed for stale data: M2PO, TIS); ``'recompute'`` uses the
  trainer's own log-probs of the batch before the update (RLAX's recomputation; valid only
  on-policy, where the sampling version is the trainer's current one), which also enables
  the ``mismatch`` correction.
  """

  loss: str = 'grpo'
  advantage_estimator: str | None = None
  eps_low: float | None = None
  eps_high: float | None = None
  aggregation: str | None = None
  kl_beta: float = 0.0
  kl_estimator: str | None = None
  m2po_tau: float = 0.04
  m2po_variant: str = 'paper'
  old_logprobs: str = 'behaviour'
  mismatch: losses.MismatchConfig | None = None

  def __post_init__(self):
    if self.loss not in losses.LOSSES:
      raise ValueError(f'rl.loss={self.loss!r} is not a known loss; choose one of '
                       f'{sorted(losses.LOSSES)}.')
    if self.advantage_estimator is not None and (
        self.advantage_estimator not in losses.ESTIMATORS):
      raise ValueError(f'rl.advantage_estimator={self.advantage_estimator!r}; choose one of '
                       f'{losses.ESTIMATORS}.')
    if self.kl_estimator is not None and self.kl_estimator not in losses.KL_ESTIMATORS:
      raise ValueError(f'rl.kl_estimator={self.kl_estimator!r}; choose one of '
                       f'{losses.KL_ESTIMATORS}.')
    if self.aggregation is not None and self.aggregation not in losses.AGGREGATIONS:
      raise ValueError(f'rl.aggregation={self.aggregation!r}; choose one of '
                       f'{losses.AGGREGATIONS}.')
    if self.m2po_variant not in losses.M2PO_VARIANTS:
      raise ValueError(f'rl.m2po_variant={self.m2po_variant!r}; choose one of '
                       f'{losses.M2PO_VARIANTS}.')
    if self.old_logprobs not in ('behaviour', 'recompute'):
      raise ValueError(f"rl.old_logprobs={self.old_logprobs!r}; choose 'behaviour' or "
                       "'recompute'.")
    if self.mismatch is not None and self.old_logprobs != 'recompute':
      raise ValueError("rl.mismatch correction needs rl.old_logprobs='recompute' (it compares "
                       "the trainer's log-probs with the rollout engine's).")

  @property
  def estimator(self) -> str:
    """The advantage estimator: the configured one, else the loss's default."""
    return self.advantage_estimator or losses.LOSSES[self.loss].advantage_estimator


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
  old_logp = jax.lax.stop_gradient(logp) if config.old_logprobs == 'recompute' else None
  loss, diagnostics = losses.policy_loss(
      config.loss, logp, batch.behaviour_logprobs[:, 1:], batch.advantages, mask,
      old_logp=old_logp, ref_logp=ref_logp, kl_beta=config.kl_beta,
      kl_estimator=config.kl_estimator, eps_low=config.eps_low, eps_high=config.eps_high,
      aggregation=config.aggregation, m2po_tau=config.m2po_tau,
      m2po_variant=config.m2po_variant, mismatch=config.mismatch)
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
