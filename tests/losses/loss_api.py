"""Calls ``policy_loss`` by loss name and keyword options, as the tests here describe cases.

Options that are knobs of the loss go into its ``LossConfig``; the per-batch inputs
(``old_logp``, ``ref_logp``, ``max_length``) go to ``policy_loss`` itself. Passing ``old_logp``
implies ``old_logprobs='recompute'`` (the trainer's recomputed proximal log-probs).
"""

from rlax_llm.losses import LossConfig, policy_loss


def call(name, logp, behaviour, adv, mask, *, old_logp=None, ref_logp=None, max_length=None,
         **knobs):
  if old_logp is not None:
    knobs.setdefault('old_logprobs', 'recompute')
  return policy_loss(LossConfig(loss=name, **knobs), logp, behaviour, adv, mask,
                     old_logp=old_logp, ref_logp=ref_logp, max_length=max_length)
