"""``LossConfig``: the policy loss as a value (its name and knobs), and the loss table's names.

A leaf module (no JAX): the config boundary (``rlax_llm.config``) builds and validates a
``LossConfig`` without loading the loss math, and ``rlax_llm.losses`` computes with it. The
names every choice is checked against live here once: the named losses (``LOSSES``, each a
``LossSpec``), the advantage estimators (``ESTIMATORS``, ``TURN_ESTIMATORS``), aggregations,
KL estimators, M2PO variants, the multi-turn group normalisations (``NORMS``) and the
train-inference mismatch correction (``MismatchConfig``). The formulas are
``rlax_llm.losses`` (table: ``losses/policy.py``, ``docs/losses.md``).
"""

from __future__ import annotations

import dataclasses
import math

# Group-relative and baseline-free advantage estimators (``losses.advantages``).
ESTIMATORS = ('grpo', 'drgrpo', 'rloo', 'median', 'gdpo', 'reinforce', 'reinforce_pp',
              'w_reinforce')
# Estimators without a group baseline: a group whose rewards are all equal still gets
# non-zero advantages (dynamic sampling must not drop it).
BASELINE_FREE = ('reinforce', 'w_reinforce')
# Multi-turn advantage estimators (``losses.multi_turn.turn_advantages``).
TURN_ESTIMATORS = ('trajectory_grpo', 'turn_grpo', 'gigpo')
# GiGPO's F_norm -> the group normalisation (an ``ESTIMATORS`` name) that applies it.
NORMS = {'std': 'grpo', 'mean': 'drgrpo'}
# How per-token terms become one scalar (``losses.components.aggregate``).
AGGREGATIONS = ('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum',
                'seq-mean-token-sum-norm')
KL_ESTIMATORS = ('k1', 'k2', 'k3')  # ``losses.kl.kl_penalty``
M2PO_VARIANTS = ('paper', 'areal', 'adaptive_clip')
OLD_LOGPROBS = ('behaviour', 'recompute')
MISMATCH_LEVELS = ('token', 'sequence')
MISMATCH_MODES = ('truncate', 'mask')
# On-policy distillation (``losses.distill``; ``DistillConfig``): 'off', the per-token reverse
# KL as an advantage, or GKD's generalised JSD over the teacher's top-k support.
DISTILL_KINDS = ('off', 'reverse_kl', 'gkd')
# The ``LossConfig`` fields whose ``None`` means "the named loss's default" (``resolve``).
RESOLVED_FIELDS = ('advantage_estimator', 'eps_low', 'eps_high', 'aggregation', 'kl_estimator')


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """How a named algorithm composes the shared parts, and its defaults."""

  reference: str
  advantage_estimator: str
  ratio: str  # 'token' | 'sequence'
  objective: str  # 'ppo_clip' | 'pg' | 'cispo' | 'm2po'
  aggregation: str
  eps_low: float = 0.2
  eps_high: float = 0.2
  kl_estimator: str = 'k3'


LOSSES: dict[str, LossSpec] = {
    'ppo': LossSpec('Schulman et al., PPO, arXiv 1707.06347', 'grpo', 'token', 'ppo_clip',
                    'token-mean'),
    'grpo': LossSpec('Shao et al., DeepSeekMath (GRPO), arXiv 2402.03300', 'grpo', 'token',
                     'ppo_clip', 'seq-mean-token-mean'),
    'dapo': LossSpec('Yu et al., DAPO, arXiv 2503.14476', 'grpo', 'token', 'ppo_clip',
                     'token-mean', eps_low=0.2, eps_high=0.28),
    'drgrpo': LossSpec('Liu et al., Understanding R1-Zero-Like Training (Dr. GRPO), '
                       'arXiv 2503.20783', 'drgrpo', 'token', 'ppo_clip',
                       'seq-mean-token-sum-norm'),
    'gspo': LossSpec('Zheng et al., GSPO, arXiv 2507.18071', 'grpo', 'sequence', 'ppo_clip',
                     'seq-mean-token-mean', eps_low=3e-4, eps_high=4e-4),
    'cispo': LossSpec('MiniMax, MiniMax-M1 (CISPO), arXiv 2506.13585', 'grpo', 'token',
                      'cispo', 'token-mean', eps_low=1.0, eps_high=0.28),
    'reinforce': LossSpec('Williams, REINFORCE (1992)', 'reinforce', 'token', 'pg',
                          'seq-mean-token-sum'),
    'rloo': LossSpec('Ahmadian et al., Back to Basics (RLOO), arXiv 2402.14740', 'rloo',
                     'token', 'pg', 'seq-mean-token-sum'),
    'reinforce_pp': LossSpec('Hu, REINFORCE++, arXiv 2501.03262', 'reinforce_pp', 'token',
                             'ppo_clip', 'token-mean', kl_estimator='k2'),
    'm2po': LossSpec('Zheng, Zhao & Chen, Prosperity before Collapse (M2PO), '
                     'arXiv 2510.01161', 'grpo', 'token', 'm2po', 'token-mean'),
}


def _choice(name: str, value, valid, optional: bool = False) -> None:
  if optional and value is None:
    return
  if value not in valid:
    raise ValueError(f'{name}={value!r} is not valid; choose one of {list(valid)}.')


def _finite_at_least(value, low: float) -> bool:
  return (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and value >= low)


@dataclasses.dataclass(frozen=True)
class MismatchConfig:
  """Train-inference mismatch correction (``losses.components.mismatch_weights``), validated
  here.

  level: ``MISMATCH_LEVELS``; mode: ``MISMATCH_MODES``; threshold: finite > 0;
  veto_threshold: None or finite > 0.
  """

  level: str = 'token'
  mode: str = 'truncate'
  threshold: float = 2.0
  veto_threshold: float | None = None

  def __post_init__(self):
    if self.level not in MISMATCH_LEVELS:
      raise ValueError(f'mismatch.level={self.level!r} is not valid; choose one of '
                       f'{MISMATCH_LEVELS}.')
    if self.mode not in MISMATCH_MODES:
      raise ValueError(f'mismatch.mode={self.mode!r} is not valid; choose one of '
                       f'{MISMATCH_MODES}.')
    if not _positive_finite(self.threshold):
      raise ValueError(f'mismatch.threshold={self.threshold!r} must be > 0 and finite.')
    if self.veto_threshold is not None and not _positive_finite(self.veto_threshold):
      raise ValueError(f'mismatch.veto_threshold={self.veto_threshold!r} must be None or > 0 '
                       'and finite.')


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """On-policy distillation from a frozen teacher (``rlax_llm.losses.distill``; docs/losses.md
  "On-policy distillation"), validated here.

  Attributes:
    kind: ``DISTILL_KINDS``. ``'reverse_kl'``: per-token advantages ``A = A_task + weight *
      (log pi_teacher - log pi_student)`` on the sampled tokens (``with_reward=False``: the
      distillation term alone). ``'gkd'``: GKD's generalised JSD over the teacher's top
      ``top_k`` tokens per position.
    beta: GKD's interpolation, in ``[0, 1]`` (0: forward KL(teacher || student), 1: reverse
      KL(student || teacher)); read with ``kind='gkd'`` only.
    weight: lambda, finite >= 0: the distillation term's weight.
    top_k: int >= 1 with ``kind='gkd'`` (the teacher's support per position); unused (0)
      otherwise.
    with_reward: add the task's group advantage (True) or train on the teacher alone.
    tail: with ``kind='gkd'``, compare the teacher's top ``top_k`` plus one bucket for each
      side's mass outside them (``losses.distill.with_tail``) rather than both renormalised
      on the top ``top_k`` (False, GKD's and TRL's form).
  """

  kind: str = 'off'
  beta: float = 0.5
  weight: float = 1.0
  top_k: int = 0
  with_reward: bool = True
  tail: bool = False

  def __post_init__(self):
    _choice('distill.kind', self.kind, DISTILL_KINDS)
    if not _finite_at_least(self.beta, 0.0) or self.beta > 1:
      raise ValueError(f'distill.beta={self.beta!r} must be a number in [0, 1] (0: forward '
                       'KL(teacher || student), 1: reverse KL(student || teacher)).')
    if not _finite_at_least(self.weight, 0.0):
      raise ValueError(f'distill.weight={self.weight!r} must be a finite number >= 0 (lambda '
                       'in A = A_task + lambda * A_distill).')
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f'distill.top_k={self.top_k!r} must be an int >= 0.')
    if self.kind == 'gkd' and self.top_k < 1:
      raise ValueError(f"distill.top_k={self.top_k} with distill.kind='gkd': GKD compares the "
                       "distributions over the teacher's top-k tokens; set top_k >= 1 (e.g. 20).")
    if not isinstance(self.with_reward, bool):
      raise ValueError(f'distill.with_reward={self.with_reward!r} must be True or False.')
    if not isinstance(self.tail, bool):
      raise ValueError(f'distill.tail={self.tail!r} must be True or False.')
    if self.tail and self.kind != 'gkd':
      raise ValueError(f"distill.tail=True with distill.kind={self.kind!r}: the tail bucket is "
                       "GKD's (its top-k support); set kind='gkd' or tail=False.")
    if self.kind != 'off' and not self.with_reward and self.weight == 0:
      raise ValueError('distill.weight=0 with distill.with_reward=False trains on nothing; set '
                       'weight > 0 or with_reward=True.')

  @property
  def enabled(self) -> bool:
    return self.kind != 'off'


def _positive_finite(value) -> bool:
  return _finite_at_least(value, 0.0) and value > 0


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The policy loss and every knob of it: the one object that travels from ``config.rl`` to
  ``losses.policy_loss``, validated here (and nowhere else) when it is built.

  ``None`` fields take the named loss's defaults (``LOSSES[loss]``); ``resolve()`` fills them.

  Attributes:
    loss: a key of ``LOSSES``.
    advantage_estimator: ``ESTIMATORS``, ``TURN_ESTIMATORS`` (per-turn advantages of
      multi-turn episodes) or None.
    eps_low, eps_high: clip range of ``ppo_clip``/``cispo`` objectives (finite >= 0) or None.
    aggregation: ``AGGREGATIONS`` or None.
    kl_beta: KL penalty weight (finite >= 0); > 0 needs reference log-probs.
    kl_estimator: ``KL_ESTIMATORS`` or None.
    m2po_tau, m2po_variant: M2PO's second-moment threshold (finite > 0) and variant.
    old_logprobs: the proximal policy of the ratio. ``'behaviour'``: the rollout engine's
      log-probs of the tokens under the version that sampled them (RLAX; what stale data
      needs). ``'recompute'``: the trainer's own log-probs of the batch under its params
      before the update (decoupled PPO: Hilton et al., arXiv 2110.00641; AReaL,
      arXiv 2505.24298). The ratio then measures only this update, and the gap to the
      behaviour policy (staleness and train-inference numerics) goes to the ``mismatch``
      weights. Refused with M2PO: its second moment would be identically 0 and it would
      mask nothing.
    mismatch: an optional ``MismatchConfig`` (TIS/MIS weights ``pi_old / pi_behaviour``);
      needs ``old_logprobs='recompute'``.
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
  mismatch: MismatchConfig | None = None

  def __post_init__(self):
    _choice('loss', self.loss, sorted(LOSSES))
    _choice('advantage_estimator', self.advantage_estimator, ESTIMATORS + TURN_ESTIMATORS,
            optional=True)
    _choice('aggregation', self.aggregation, AGGREGATIONS, optional=True)
    _choice('kl_estimator', self.kl_estimator, KL_ESTIMATORS, optional=True)
    _choice('m2po_variant', self.m2po_variant, M2PO_VARIANTS)
    _choice('old_logprobs', self.old_logprobs, OLD_LOGPROBS)
    for name in ('eps_low', 'eps_high'):
      value = getattr(self, name)
      if value is not None and not _finite_at_least(value, 0.0):
        raise ValueError(f'{name}={value!r} must be a finite number >= 0 (or None for the '
                         "loss's default).")
    if not _finite_at_least(self.kl_beta, 0.0):
      raise ValueError(f'kl_beta={self.kl_beta!r} must be a finite number >= 0.')
    if not _finite_at_least(self.m2po_tau, 0.0) or self.m2po_tau == 0:
      raise ValueError(f'm2po_tau={self.m2po_tau!r} must be a finite number > 0.')
    if self.mismatch is not None and not isinstance(self.mismatch, MismatchConfig):
      raise ValueError(f'mismatch={self.mismatch!r} must be a MismatchConfig or None.')
    if self.mismatch is not None and self.old_logprobs != 'recompute':
      raise ValueError("mismatch: the correction needs old_logprobs='recompute' (it compares "
                       "the trainer's log-probs with the rollout engine's).")
    if self.loss == 'm2po' and self.old_logprobs == 'recompute':
      raise ValueError(
          "old_logprobs='recompute' cannot be used with loss='m2po': M2PO bounds the second "
          'moment of log(pi_theta / pi_behaviour) over stale rollouts (arXiv 2510.01161), but '
          "the trainer's recomputed log-probs of its current params make that ratio exactly "
          '1, so M2 would be identically 0 and M2PO would mask nothing. Use '
          "old_logprobs='behaviour'.")

  @property
  def spec(self) -> LossSpec:
    return LOSSES[self.loss]

  def resolve(self) -> LossConfig:
    """This config with every ``None`` replaced by the named loss's default."""
    spec = self.spec
    return dataclasses.replace(self, **{
        field: getattr(spec, field) if getattr(self, field) is None else getattr(self, field)
        for field in RESOLVED_FIELDS})

  @property
  def estimator(self) -> str:
    """The advantage estimator: the configured one, else the loss's default."""
    return self.advantage_estimator or self.spec.advantage_estimator
