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

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm import losses
from rlax_llm.data_types import TrainBatch
from rlax_llm.loss_spec import DistillConfig
from rlax_llm.losses.supervised import token_cross_entropy
from rlax_llm.models.model import Model, Params
from rlax_llm.trainer.scoring import Policy


def loss_totals(batch: TrainBatch | dict[str, jax.Array]) -> losses.Totals:
  """Whole-batch loss normalisers of a ``TrainBatch`` or an SFT batch dict (the loss mask of
  the predicted positions, ``loss_mask[:, 1:]``)."""
  mask = batch['loss_mask'] if isinstance(batch, dict) else batch.loss_mask
  return losses.batch_totals(mask[:, 1:])


def rl_objective(policy: Policy, loss_config: losses.LossConfig, params: Params,
                 batch: TrainBatch, reference_params: Params | None,
                 totals: losses.Totals | None = None, *, logprob_chunk: int = 0,
                 window: int = 0, share: int = 1, gkd: DistillConfig | None = None,
                 routing_replay: bool = False, moe_aux_loss_coef: float = 0.0
                 ) -> tuple[jax.Array, dict[str, Any]]:
  """Recomputes the log-probs of the batch's tokens under ``policy`` (with the support sizes
  the sampler recorded) and applies the loss.

  With ``loss_config.old_logprobs == 'recompute'`` the proximal log-probs are these same
  log-probs, detached (the params before the update); with ``kl_beta > 0`` the reference
  log-probs come from ``reference_params`` through the same policy transform.
  ``batch.advantages`` is ``[B]`` (one per row) or ``[B, T]`` (per token, aligned with
  ``batch.tokens``, as ``losses.broadcast_turn_advantages`` gives for multi-turn episodes).
  Metrics add ``entropy`` (of the policy distribution),
  ``policy/out_of_support_fraction`` (loss tokens outside the policy's top-k/top-p support) and
  ``hist/log_ratio`` (``losses.log_ratio_histogram`` of log pi_theta - log pi_behaviour).
  ``logprob_chunk`` > 0 computes the log-probs ``logprob_chunk`` positions at a time, never
  materialising ``[B, T, V]`` logits (``Policy.sequence_log_probs``).

  ``window`` > 0 scores only the ``window`` positions from each row's first loss token on
  (``Policy.window_log_probs``): the prompt is context, run once per block of ``share``
  consecutive rows with equal prompts (the samples of a group). Every loss token must lie in
  its row's window and blocks must share their prompts; ``check_windows`` checks a batch on
  the host. The loss and gradients equal the unwindowed ones to float rounding (the
  Dr. GRPO length constant stays the padded width ``T - 1``).

  ``gkd`` (on-policy distillation with ``kind='gkd'``): the loss adds ``gkd.weight`` times
  ``losses.gkd_loss`` (GKD's generalised JSD, ``gkd.beta``) between the teacher's top-k
  log-probs (``batch.teacher_top_logp``, ids ``batch.teacher_top_ids``, ``[B, T, K]``) and the
  student's log-softmax at those ids (at the sampling temperature, ``scoring.full_support``),
  both renormalised on the teacher's support (``gkd.tail``: each completed by its mass
  outside it instead), over the sampled tokens. The student's
  log-softmax is read chunk by chunk (``logprob_chunk``) and in the windows (``window``) like
  the log-probs. Metric ``distill/gkd``: that divergence's token mean.

  A mixture of experts: ``routing_replay`` (``model.routing_replay='r3'``) routes every
  token by the experts the rollout engine recorded (``batch.routes``; the policy, reference
  and recomputed log-probs alike) and reports ``moe/route_flip_fraction``, the fraction of
  those choices the trainer's own router would have made otherwise (Ma et al., arXiv
  2510.11370). ``moe_aux_loss_coef`` > 0 (``rl.moe_aux_loss_coef``) adds that times the
  router's load-balancing loss over each row's tokens up to its last loss token (padding
  excluded; ``moe/aux_loss``; full forward only); 0 leaves the objective as without it.
  """
  if gkd is not None and (batch.teacher_top_ids is None or batch.teacher_top_logp is None):
    raise ValueError("rl_objective(gkd=...) needs the teacher's top-k in the batch "
                     '(teacher_top_ids and teacher_top_logp, [B, T, K]); this batch has none: '
                     'distill it with controller.completions.distill_batch first.')
  ids = batch.teacher_top_ids if gkd is not None else None
  teacher_logp = batch.teacher_top_logp
  length = batch.tokens.shape[1]
  routes = None
  if routing_replay:
    if batch.routes is None:
      raise ValueError('routing_replay=True replays the experts the rollout recorded, but the '
                       'batch has no routes; the inference workers must record them '
                       '(model.routing_replay=\'r3\').')
    routes = batch.routes
  aux_mask = None
  if moe_aux_loss_coef > 0:
    if window:
      raise ValueError('rl.moe_aux_loss_coef > 0 needs the full forward; rl.shared_prefix '
                       'scores through a KV cache. Set one of them off.')
    last = length - 1 - jnp.argmax(batch.loss_mask[:, ::-1] > 0, axis=1)
    aux_mask = ((jnp.arange(length)[None, :] <= last[:, None])
                & jnp.any(batch.loss_mask > 0, axis=1, keepdims=True)).astype(jnp.float32)
  if window:
    starts = jnp.argmax(batch.loss_mask > 0, axis=1).astype(jnp.int32)
    offsets = starts[:, None] + jnp.arange(window, dtype=jnp.int32)
    index = jnp.minimum(offsets, length - 1)
    pick = lambda x: jnp.take_along_axis(x, index, axis=1)
    mask = jnp.where(offsets < length, pick(batch.loss_mask), 0.0)
    behaviour = pick(batch.behaviour_logprobs)
    advantages = pick(batch.advantages) if batch.advantages.ndim == 2 else batch.advantages
    if ids is not None:
      teacher_logp = jnp.take_along_axis(teacher_logp, index[..., None], axis=1)
    score = lambda p, ids=None, aux_mask=None: policy.window_log_probs(
        p, batch.tokens, batch.support_sizes, starts, width=window, share=share,
        chunk=logprob_chunk, support_ids=ids, routes=routes)
  else:
    mask = batch.loss_mask[:, 1:]
    behaviour = batch.behaviour_logprobs[:, 1:]
    # Per-token advantages [B, T] (multi-turn credit) are aligned with the tokens: position t
    # is token t, predicted from < t, like the loss mask.
    advantages = batch.advantages[:, 1:] if batch.advantages.ndim == 2 else batch.advantages
    if ids is not None:
      teacher_logp = teacher_logp[:, 1:]
    score = lambda p, ids=None, aux_mask=None: policy.sequence_log_probs(
        p, batch.tokens, batch.support_sizes, chunk=logprob_chunk, support_ids=ids,
        routes=routes, aux_mask=aux_mask)
  scored = score(params, ids, aux_mask=aux_mask)
  ref_logp = None
  if loss_config.kl_beta > 0:
    if reference_params is None:
      raise ValueError('rl.kl_beta > 0 needs reference params; the trainer was built without.')
    ref_logp = score(jax.lax.stop_gradient(reference_params)).logp
  old_logp = (jax.lax.stop_gradient(scored.logp) if loss_config.old_logprobs == 'recompute'
              else None)
  loss, diagnostics = losses.policy_loss(
      loss_config, scored.logp, behaviour, advantages, mask, old_logp=old_logp,
      ref_logp=ref_logp, max_length=length - 1, totals=totals)
  diagnostics = dict(diagnostics)
  if gkd is not None:
    divergence = losses.gkd_loss(scored.support_logp, teacher_logp, mask, gkd.beta, gkd.tail)
    # A micro-batch's share of the whole batch's token mean (the shares sum to it).
    share_of = (1.0 if totals is None else
                jnp.sum(mask > 0) / jnp.maximum(totals.tokens, 1.0))
    loss = loss + gkd.weight * divergence * share_of
    diagnostics['distill/gkd'] = divergence
  if scored.aux_loss is not None:
    share_of_rows = 1.0 if totals is None else batch.tokens.shape[0] / totals.rows
    loss = loss + moe_aux_loss_coef * scored.aux_loss * share_of_rows
    diagnostics['moe/aux_loss'] = scored.aux_loss
  if scored.route_flips is not None:
    diagnostics['moe/route_flip_fraction'] = scored.route_flips
  diagnostics['entropy'] = losses.masked_token_mean(scored.entropy, mask)
  diagnostics['policy/out_of_support_fraction'] = losses.masked_token_mean(
      ~scored.in_support, mask)
  # A vector metric: rlax_llm.metrics draws it as the TensorBoard histogram 'log_ratio'.
  diagnostics['hist/log_ratio'] = losses.log_ratio_histogram(scored.logp - behaviour, mask)
  return loss, diagnostics


def check_windows(batch: TrainBatch, window: int, share: int = 1) -> None:
  """Raises ValueError unless ``rl_objective(window=window)`` can score ``batch`` exactly:
  every row's loss tokens lie within ``window`` positions of its first one, which is at most
  ``T - window``, and consecutive blocks of ``share`` rows have equal prompts (the tokens
  before their first loss token; a row without loss tokens only has to carry its block's
  prompt). Host-side (numpy), before the batch reaches the device.
  """
  mask = np.asarray(batch.loss_mask) > 0
  rows, length = mask.shape
  starts = mask.argmax(axis=1)
  last = length - 1 - mask[:, ::-1].argmax(axis=1)
  bad = np.flatnonzero(mask.any(axis=1) & ((last - starts >= window) |
                                           (starts > length - window)))
  if bad.size:
    b = int(bad[0])
    raise ValueError(
        f'rows {bad.tolist()} have loss tokens outside a window of {window} positions (row '
        f'{b}: loss tokens {int(starts[b])}..{int(last[b])} of {length}); rl.shared_prefix '
        f'scores at most sampling.max_new_tokens = {window} completion tokens after the '
        'prompt. Set rl.shared_prefix=False for other layouts.')
  if share > 1:
    if rows % share:
      raise ValueError(f'{rows} rows are not blocks of {share} (rl.group_size).')
    # A row without loss tokens (start 0) only has to carry its block's prompt.
    block_starts = np.repeat(starts.reshape(-1, share).max(axis=1), share)
    tokens = np.asarray(batch.tokens)
    prompts = np.where(np.arange(length) < block_starts[:, None], tokens, -1)
    blocks = prompts.reshape(rows // share, share, length)
    moved = (mask.any(axis=1) & (starts != block_starts)).reshape(-1, share).any(axis=1)
    differ = np.flatnonzero(np.any(blocks != blocks[:, :1], axis=(1, 2)) | moved)
    if differ.size:
      raise ValueError(
          f'row blocks {differ.tolist()} (of {share} rows each) do not share one prompt; '
          'rl.shared_prefix needs the samples of each group in consecutive rows. Set '
          'rl.shared_prefix=False for other batches.')


def shared_prefix_scoring(window: int, group_size: int, micro_batches: int
                          ) -> tuple[dict[str, int], Callable[[TrainBatch], None]]:
  """``rl_objective`` keywords (``window``, ``share``) and the ``Trainer`` batch check for
  shared-prefix scoring of batches made of groups of ``group_size`` consecutive rows.

  The trainer deals rows out to ``micro_batches`` strided, so a group's samples stay
  consecutive within each micro-batch, ``group_size / micro_batches`` of them, exactly when
  ``micro_batches`` divides ``group_size``; otherwise only the completions are scored
  (``share`` 1).
  """
  share = group_size // micro_batches if group_size % micro_batches == 0 else 1
  check = functools.partial(check_windows, window=window,
                            share=group_size if share > 1 else 1)
  return {'window': window, 'share': share}, check


def sft_objective(model: Model, params: Params, batch: dict[str, jax.Array],
                  reference_params: Params | None = None,
                  totals: losses.Totals | None = None) -> tuple[jax.Array, dict[str, Any]]:
  """Teacher-forced cross-entropy. ``batch``: ``tokens`` int32 [B, T], ``loss_mask`` [B, T]."""
  del reference_params
  logits = model.apply(params, batch['tokens'])[:, :-1]
  return token_cross_entropy(logits, batch['tokens'][:, 1:], batch['loss_mask'][:, 1:],
                             None if totals is None else totals.tokens)
