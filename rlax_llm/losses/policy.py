"""Named policy losses, each a small composition of the parts in ``components``.

``policy_loss(LossConfig(loss=name, ...), logp, behaviour_logp, advantages, loss_mask, ...)``
returns ``(loss, diagnostics)``: ``loss`` is a scalar to *minimise* (float32; float64 for
float64 inputs), for every algorithm in ``LOSSES``. ``LossConfig`` holds the loss's name and
all its knobs and validates them once, when built (both are defined in the leaf module
``rlax_llm.loss_spec``). The table of formulas, defaults and references is
``docs/losses.md``; in short, with
``r = exp(logp - sg[old])`` (``old`` = ``old_logp`` if given, else ``behaviour_logp``):

=============  ============================================  ====================  =========
name           per-token objective (maximised)               aggregation           advantage
=============  ============================================  ====================  =========
ppo            min(r A, clip(r, 1-eps, 1+eps) A)             token-mean            grpo
grpo           same, eps 0.2                                 seq-mean-token-mean   grpo
dapo           same, eps_low 0.2, eps_high 0.28              token-mean            grpo
drgrpo         same, eps 0.2                                 seq-mean-token-sum-norm drgrpo
gspo           min(s A, clip(s, 1-3e-4, 1+4e-4) A), s=seq r  seq-mean-token-mean   grpo
cispo          sg[clip(r, 1-eps_low, 1+eps_high)] A logp     token-mean            grpo
reinforce      sg[r] A logp                                  seq-mean-token-sum    reinforce
rloo           sg[r] A logp                                  seq-mean-token-sum    rloo
reinforce_pp   PPO clip, eps 0.2, KL estimator k2            token-mean            reinforce_pp
m2po           M r A, M = second-moment mask (no eps clip)   token-mean            grpo
=============  ============================================  ====================  =========

Options shared by all: a KL penalty ``kl_beta * KL(pi || pi_ref)`` (``kl_estimator`` k1/k2/k3,
aggregated like the objective), and a train-inference mismatch correction (``mismatch``:
token/sequence TIS or MIS with a veto threshold; needs ``old_logp``, the trainer's
recomputed log-probs of the sampling version). Importance weights used as coefficients
never carry gradient; ``behaviour_logp``, ``old_logp``, ``ref_logp`` and ``advantages`` are
stop-gradient inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The loss table and LossConfig are declarative (no JAX): ``loss_spec`` defines them, for the
# config boundary to validate a loss without loading this module; they are re-exported here.
from rlax_llm.loss_spec import LOSSES, M2PO_VARIANTS, LossConfig, LossSpec  # noqa: F401
from rlax_llm.losses import components as C
from rlax_llm.losses import diagnostics as D
from rlax_llm.losses.kl import kl_penalty


def _check(logp, behaviour_logp, advantages, loss_mask, old_logp, ref_logp):
  if logp.ndim != 2:
    raise ValueError(f'logp must be [batch, tokens], got shape {logp.shape}.')
  for arg, value in (('behaviour_logp', behaviour_logp), ('loss_mask', loss_mask),
                     ('old_logp', old_logp), ('ref_logp', ref_logp)):
    if value is not None and value.shape != logp.shape:
      raise ValueError(f'{arg} has shape {value.shape} but logp has shape {logp.shape}; '
                       'every per-token input must be [batch, tokens].')
  if advantages.shape not in (logp.shape[:1], logp.shape):
    raise ValueError(f'advantages must be [batch] = {logp.shape[:1]} or [batch, tokens] = '
                     f'{logp.shape}, got {advantages.shape}.')


def policy_loss(config: LossConfig, logp: jax.Array, behaviour_logp: jax.Array,
                advantages: jax.Array, loss_mask: jax.Array, *,
                old_logp: jax.Array | None = None, ref_logp: jax.Array | None = None,
                max_length: int | None = None, totals: C.Totals | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Computes the configured policy loss and its diagnostics.

  Args:
    config: a ``LossConfig`` (which loss, and its knobs).
    logp: float ``[B, T]`` log-probs of the taken tokens under the policy being trained.
    behaviour_logp: float ``[B, T]`` log-probs under the distribution that sampled them
      (from the rollout engine).
    advantages: float ``[B]`` or ``[B, T]`` (compute with ``group_advantages`` and
      ``config.estimator``).
    loss_mask: ``[B, T]``, 1 on tokens that count.
    old_logp: float ``[B, T]``, the trainer's recomputed proximal log-probs; given exactly
      when ``config.old_logprobs == 'recompute'``. Ratios then use it instead of
      ``behaviour_logp``, and the mismatch correction/diagnostics compare it with
      ``behaviour_logp``.
    ref_logp: float ``[B, T]`` reference-policy log-probs; needed when ``kl_beta > 0``.
    max_length: ``L_max`` for ``seq-mean-token-sum-norm`` (default ``T``).
    totals: whole-batch normalisers (``components.batch_totals``) when these inputs are one
      micro-batch: the loss is then this micro-batch's exact share of the whole batch's.
      Not with M2PO, whose mask is a statistic of the whole batch.
  Returns:
    ``(loss, diagnostics)``: a scalar (float32; float64 for float64 inputs) and a dict of
    scalars.
  """
  if not isinstance(config, LossConfig):
    raise TypeError(f'policy_loss takes a LossConfig first, got {config!r}; build one with '
                    "LossConfig(loss='grpo', ...).")
  logp, behaviour_logp, advantages, loss_mask = map(
      jnp.asarray, (logp, behaviour_logp, advantages, loss_mask))
  _check(logp, behaviour_logp, advantages, loss_mask, old_logp, ref_logp)
  resolved = config.resolve()
  spec = resolved.spec
  eps_low, eps_high = resolved.eps_low, resolved.eps_high
  aggregation, kl_estimator = resolved.aggregation, resolved.kl_estimator
  kl_beta, mismatch = resolved.kl_beta, resolved.mismatch
  name = config.loss
  if kl_beta > 0 and ref_logp is None:
    raise ValueError(f'{name}: kl_beta={kl_beta} > 0 needs ref_logp (reference log-probs).')
  if totals is not None and spec.objective == 'm2po':
    raise ValueError('M2PO masks tokens by a statistic of the whole batch (its second moment); '
                     'it cannot be computed one micro-batch at a time. Use micro_batches=1.')
  if (old_logp is not None) != (config.old_logprobs == 'recompute'):
    raise ValueError(f'old_logprobs={config.old_logprobs!r} but old_logp was '
                     f'{"given" if old_logp is not None else "not given"}; pass old_logp (the '
                     "trainer's recomputed log-probs) exactly when old_logprobs='recompute'.")

  mask = loss_mask.astype(jnp.float32)
  bmask = mask > 0
  adv = jax.lax.stop_gradient(C.as_float(advantages))
  adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, mask.shape)
  proximal = behaviour_logp if old_logp is None else old_logp
  log_r = C.token_log_ratio(logp, proximal)
  diagnostics = D.ratio_diagnostics(log_r, bmask)

  # Train-inference mismatch correction: an extra detached per-token weight.
  weight = jnp.ones_like(mask)
  if mismatch is not None:
    weight, kept = C.mismatch_weights(old_logp, behaviour_logp, mask, mismatch)
    diagnostics['mismatch/weight_mean'] = C.masked_token_mean(weight, bmask)
    diagnostics['mismatch/kept_fraction'] = C.masked_token_mean(kept, bmask)
  trainer_side = jax.lax.stop_gradient(logp if old_logp is None else old_logp)
  diagnostics.update(D.mismatch_diagnostics(trainer_side, behaviour_logp, bmask))

  agg_mask = mask
  if spec.objective == 'ppo_clip':
    if spec.ratio == 'sequence':
      seq_lr = C.sequence_log_ratio(log_r, mask)[:, None]
      ratio = jnp.broadcast_to(C.safe_exp(seq_lr), mask.shape)
    else:
      ratio = C.safe_exp(log_r)
    objective, clipped = C.ppo_clip_objective(ratio, adv, eps_low, eps_high)
  elif spec.objective in ('pg', 'cispo'):
    coeff = C.safe_exp(jax.lax.stop_gradient(log_r))
    if spec.objective == 'cispo':
      # The clip only limits the (detached) weight; the token's gradient remains.
      clipped = (coeff > 1.0 + eps_high) | (coeff < 1.0 - eps_low)
      coeff = jnp.clip(coeff, 1.0 - eps_low, 1.0 + eps_high)
    else:
      clipped = jnp.zeros(mask.shape, bool)
    objective = coeff * adv * C.as_float(logp)
  else:  # m2po
    objective, clipped, agg_mask, m2_diag = _m2po(log_r, adv, mask, resolved.m2po_tau,
                                                  resolved.m2po_variant)
    diagnostics.update(m2_diag)

  per_token = -objective * weight
  loss = C.aggregate(per_token, agg_mask, aggregation, max_length, totals)
  if kl_beta > 0:
    kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp), kl_estimator)
    kl_term = C.aggregate(kl, mask, aggregation, max_length, totals)
    loss = loss + kl_beta * kl_term
    diagnostics['kl'] = C.masked_token_mean(jax.lax.stop_gradient(kl), bmask)
  diagnostics['clip_fraction'] = C.masked_token_mean(clipped, bmask)
  diagnostics['advantage/mean'] = C.masked_token_mean(adv, bmask)
  return loss, jax.lax.stop_gradient(diagnostics)


def _m2po(log_r, adv, mask, tau, variant):
  """M2PO objective for one of ``M2PO_VARIANTS``; see ``docs/losses.md``.

  Returns ``(objective, removed, aggregation mask, diagnostics)``.
  """
  bmask = mask > 0
  if variant == 'paper':
    candidates = C.m2po_trust_region_candidates(log_r, adv, bmask)
  else:
    candidates = bmask
  kept = C.m2po_mask(log_r, candidates, tau)
  m2 = jnp.square(jax.lax.stop_gradient(log_r))
  diagnostics = {
      'm2po/m2_before': C.masked_token_mean(m2, candidates),
      'm2po/m2_after': C.masked_token_mean(m2, kept),
      'm2po/candidate_fraction': C.masked_token_mean(candidates, bmask),
  }
  ratio = C.safe_exp(log_r)
  if variant == 'adaptive_clip':
    # The largest kept |log r| becomes a symmetric clip in log space: as in PPO's min, a
    # token whose ratio is beyond exp(+-delta) on the side its advantage pushes keeps the
    # clipped (constant) value and loses its gradient, instead of leaving the denominator.
    # Strict inequalities: the token that sets delta, and every token on-policy (delta = 0),
    # keep their full gradient (jnp.clip/jnp.minimum would split it at the tie).
    delta = jnp.sqrt(D.masked_max(m2, kept))
    lr = jax.lax.stop_gradient(log_r)
    removed = bmask & (((adv > 0) & (lr > delta)) | ((adv < 0) & (lr < -delta)))
    bound = jnp.where(adv > 0, jnp.exp(delta), jnp.exp(-delta))
    objective = jnp.where(removed, bound * adv, ratio * adv)
    agg_mask = mask
  else:
    masked = candidates & ~kept
    objective = jnp.where(masked, 0.0, ratio * adv)
    removed = masked
    agg_mask = kept.astype(jnp.float32) if variant == 'areal' else mask
  diagnostics['m2po/masked_fraction'] = C.masked_token_mean(removed, bmask)
  return objective, removed, agg_mask, diagnostics
