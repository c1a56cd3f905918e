"""Losses as pure functions: advantages, policy losses, KL estimators, masks, diagnostics.

Public API:
  ``group_advantages(rewards, group_ids, estimator='grpo')`` -> per-sample advantages;
  ``policy_loss(LossConfig(loss=name, ...), logp, behaviour_logp, advantages, loss_mask, ...)``
  -> ``(loss, diagnostics)`` for every name in ``LOSSES``;
  ``m2po_mask(log_ratio, loss_mask, tau=0.04)`` -> bool kept mask;
  ``turn_advantages(name, ...)`` -> per-turn advantages of multi-turn episodes (GiGPO and
  the others in ``TURN_ESTIMATORS``), ``broadcast_turn_advantages`` -> per-token ones;
  on-policy distillation (``losses.distill``): ``reverse_kl_advantages``, ``mix_advantages``,
  ``generalized_jsd`` and ``gkd_loss`` (configured by ``DistillConfig``).
See ``docs/losses.md`` for the formulas, defaults and references. The names and
``LossConfig`` are ``rlax_llm.loss_spec``'s (a leaf module: the config boundary validates a
loss without importing JAX), re-exported here.
"""

from rlax_llm.loss_spec import (
                                        AGGREGATIONS,
                                        BASELINE_FREE,
                                        DISTILL_KINDS,
                                        DistillConfig,
                                        ESTIMATORS,
                                        KL_ESTIMATORS,
                                        LOSSES,
                                        M2PO_VARIANTS,
                                        LossConfig,
                                        LossSpec,
                                        MismatchConfig,
)
from rlax_llm.losses.advantages import (
                                        POSITIVE_WEIGHT,
                                        batch_normalize,
                                        group_advantages,
)
from rlax_llm.losses.components import (
                                        aggregate,
                                        m2po_mask,
                                        m2po_trust_region_candidates,
                                        Totals,
                                        batch_totals,
                                        masked_token_mean,
                                        mismatch_weights,
                                        ppo_clip_objective,
                                        sequence_log_ratio,
                                        token_log_ratio,
)
from rlax_llm.losses.diagnostics import (LOG_RATIO_BIN_EDGES, log_ratio_histogram,
                                         mismatch_diagnostics, ratio_diagnostics)
from rlax_llm.losses.distill import (
                                        generalized_jsd,
                                        gkd_loss,
                                        mix_advantages,
                                        reverse_kl_advantages,
)
from rlax_llm.losses.kl import kl_penalty
from rlax_llm.losses.multi_turn import (
                                        TURN_ESTIMATORS,
                                        broadcast_turn_advantages,
                                        credit_metrics,
                                        discounted_turn_returns,
                                        gigpo_advantages,
                                        step_group_ids,
                                        trajectory_advantages,
                                        turn_advantages,
                                        turn_grpo_advantages,
)
from rlax_llm.losses.policy import (
                                        policy_loss,
)

__all__ = [
    'AGGREGATIONS', 'BASELINE_FREE', 'DISTILL_KINDS', 'DistillConfig', 'ESTIMATORS', 'KL_ESTIMATORS', 'LOSSES', 'M2PO_VARIANTS',
    'LossConfig', 'LossSpec', 'MismatchConfig', 'POSITIVE_WEIGHT', 'Totals', 'aggregate',
    'batch_normalize', 'batch_totals', 'group_advantages', 'kl_penalty', 'm2po_mask',
    'm2po_trust_region_candidates',
    'LOG_RATIO_BIN_EDGES', 'log_ratio_histogram',
    'masked_token_mean', 'mismatch_diagnostics', 'mismatch_weights', 'policy_loss',
    'ppo_clip_objective', 'ratio_diagnostics', 'sequence_log_ratio', 'token_log_ratio',
    'TURN_ESTIMATORS', 'broadcast_turn_advantages', 'credit_metrics', 'discounted_turn_returns',
    'gigpo_advantages', 'step_group_ids', 'trajectory_advantages', 'turn_advantages',
    'turn_grpo_advantages', 'generalized_jsd', 'gkd_loss', 'mix_advantages',
    'reverse_kl_advantages',
]
