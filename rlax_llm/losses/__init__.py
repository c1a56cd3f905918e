"""Losses as pure functions: advantages, policy losses, KL estimators, diagnostics."""

from rlax_llm.losses.advantages import grpo_advantages
from rlax_llm.losses.kl import KL_ESTIMATORS, kl_penalty
from rlax_llm.losses.policy import (POLICY_LOSSES, grpo_loss, importance_ratio,
                                    masked_token_mean, policy_loss, ppo_clip_objective,
                                    sequence_mean_aggregate)

__all__ = [
    'KL_ESTIMATORS', 'POLICY_LOSSES', 'grpo_advantages', 'grpo_loss', 'importance_ratio',
    'kl_penalty', 'masked_token_mean', 'policy_loss', 'ppo_clip_objective',
    'sequence_mean_aggregate',
]
