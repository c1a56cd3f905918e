"""Training objectives: what the trainer differentiates.

``rl_objective(policy, loss_config, params, batch, reference_params)`` scores the batch's
tokens through the same policy transform the inference worker sampled them with
(``rlax_llm.policy``) and applies the configured policy loss. ``sft_objective(model, params,
batch, reference_params)`` is teacher-forced cross-entropy of the model itself (the warm-up).
The trainer takes them with their leading arguments bound: ``functools.partial(rl_objective,
policy, loss_config)``.

Both take ``totals`` (``loss_totals`` of the whole batch) when the trainer feeds them one
micro-batch at a time: the loss is then that micro-batch's share of the whole batch's.
"""

from __future__ import annotations

from typing import Any

import jax

from rlax_llm import losses
from rlax_llm.data_types import TrainBatch
from rlax_llm.losses.supervised import token_cross_entropy
from rlax_llm.models.model import Model, Params
from rlax_llm.policy import Policy


def loss_totals(batch: TrainBatch | dict[str, jax.Array]) -> losses.Totals:
  """Whole-batch loss normalisers of a ``TrainBatch`` or an SFT batch dict (the loss mask of
  the predicted positions, ``loss_mask[:, 1:]``)."""
  mask = batch['loss_mask'] if isinstance(batch, dict) else batch.loss_mask
  return losses.batch_totals(mask[:, 1:])


def rl_objective(policy: Policy, loss_config: losses.LossConfig, params: Params,
                 batch: TrainBatch, reference_params: Params | None,
                 totals: losses.Totals | None = None, *, logprob_chunk: int = 0
                 ) -> tuple[jax.Array, dict[str, Any]]:
  """Recomputes the log-probs of the batch's tokens under ``policy`` (with the support sizes
  the sampler recorded) and applies the loss.

  With ``loss_config.old_logprobs == 'recompute'`` the proximal log-probs are these same
  log-probs, detached (the params before the update); with ``kl_beta > 0`` the reference
  log-probs come from ``reference_params`` through the same policy transform.
  Metrics add ``entropy`` (of the policy distribution),
  ``policy/out_of_support_fraction`` (loss tokens outside the policy's top-k/top-p support) and
  ``hist/log_ratio`` (``losses.log_ratio_histogram`` of log pi_theta - log pi_behaviour).
  ``logprob_chunk`` > 0 computes the log-probs ``logprob_chunk`` positions at a time, never
  materialising ``[B, T, V]`` logits (``Policy.sequence_log_probs``).
  """
  scored = policy.sequence_log_probs(params, batch.tokens, batch.support_sizes,
                                     chunk=logprob_chunk)
  mask = batch.loss_mask[:, 1:]
  ref_logp = None
  if loss_config.kl_beta > 0:
    if reference_params is None:
      raise ValueError('rl.kl_beta > 0 needs reference params; the trainer was built without.')
    ref_logp = policy.sequence_log_probs(jax.lax.stop_gradient(reference_params),
                                         batch.tokens, batch.support_sizes,
                                         chunk=logprob_chunk).logp
  old_logp = (jax.lax.stop_gradient(scored.logp) if loss_config.old_logprobs == 'recompute'
              else None)
  loss, diagnostics = losses.policy_loss(
      loss_config, scored.logp, batch.behaviour_logprobs[:, 1:], batch.advantages, mask,
      old_logp=old_logp, ref_logp=ref_logp, totals=totals)
  diagnostics = dict(diagnostics)
  diagnostics['entropy'] = losses.masked_token_mean(scored.entropy, mask)
  diagnostics['policy/out_of_support_fraction'] = losses.masked_token_mean(
      ~scored.in_support, mask)
  # A vector metric: rlax_llm.metrics draws it as the TensorBoard histogram 'log_ratio'.
  diagnostics['hist/log_ratio'] = losses.log_ratio_histogram(
      scored.logp - batch.behaviour_logprobs[:, 1:], mask)
  return loss, diagnostics


def sft_objective(model: Model, params: Params, batch: dict[str, jax.Array],
                  reference_params: Params | None = None,
                  totals: losses.Totals | None = None) -> tuple[jax.Array, dict[str, Any]]:
  """Teacher-forced cross-entropy. ``batch``: ``tokens`` int32 [B, T], ``loss_mask`` [B, T]."""
  del reference_params
  logits = model.apply(params, batch['tokens'])[:, :-1]
  return token_cross_entropy(logits, batch['tokens'][:, 1:], batch['loss_mask'][:, 1:],
                             None if totals is None else totals.tokens)
