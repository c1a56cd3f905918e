"""Credit over the turns of multi-turn episodes: per-turn advantages ``[B, N]`` from episode
returns, per-turn rewards and environment states, and their broadcast to tokens ``[B, T]``.

A batch holds ``B`` trajectories (episodes), each of up to ``N`` model turns; trajectories
with the same ``group_ids`` entry ran the same task (same environment seed), as the ``G``
samples of a prompt do in single-turn GRPO. Per-turn inputs, named as the trajectory batch
names them:

================  ===========  =============================================================
``turn_rewards``  float [B,N]  reward the environment gave for turn ``t`` of trajectory ``i``
``turn_mask``     bool [B,N]   True for turns that happened (padding, dropped turns False)
``state_ids``     int [B,N]    the environment state the turn acted in; equal ids = identical
                               state. The caller maps ``env.state_key()`` strings to ints,
                               best with a per-batch dictionary (key -> 0, 1, ...): a 64-bit
                               hash would be truncated to int32 (jax without x64)
``token_turn``    int [B,T]    the turn each token belongs to; -1 for prompt, environment,
                               tool and padding tokens
================  ===========  =============================================================

Estimators (``TURN_ESTIMATORS``; every advantage is 0 on masked turns):

===================  ==========================================================================
``trajectory_grpo``  the episode return normalised in its group (GRPO on whole trajectories),
                     the same for every turn of the trajectory: ``A^E`` below.
``turn_grpo``        the discounted return from each turn, ``R_t = sum_k gamma^k r_{t+k}``,
                     normalised over all turns of the group's trajectories (one pool per
                     group, every turn position together): per-turn rewards with a discount.
                     This is GiGPO's step-level advantage with every turn of a group in one
                     step group (``gigpo``'s ``A^S`` when all ``state_ids`` of a group are equal).
``gigpo``            ``A = A^E + omega * A^S``: Feng et al., "Group-in-Group Policy Optimization
                     for LLM Agent Training" (GiGPO), arXiv 2505.10978.
===================  ==========================================================================

GiGPO (equation numbers of arXiv 2505.10978, as the authors' verl-agent code cites them):

* Eq. 3, episode relative advantage: ``A^E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / F_norm``
  over the trajectories ``j`` of ``tau_i``'s group, ``R(tau)`` the episode return.
* Eq. 5, discounted return of each step: ``R_t^(i) = sum_{k >= t} gamma^(k - t) r_k^(i)``.
* Eq. 6, anchor-state grouping: every step of the group's trajectories whose environment
  state is identical joins one step group, ``G^S(s) = {(a_t^(i), R_t^(i)) : s_t^(i) = s}``,
  whatever the turn index ``t`` and even within one trajectory (a revisited state).
* Eq. 7, step relative advantage: ``A^S(a_t^(i)) = (R_t^(i) - mean_{G^S} R) / F_norm`` over
  the returns of the step's group.
* Eq. 8: ``A(a_t^(i)) = A^E(tau_i) + omega * A^S(a_t^(i))`` (``omega = 1``, ``gamma = 0.95`` in
  the paper).

``F_norm`` (``norm``): ``'std'`` divides by the group's Bessel-corrected standard deviation plus
``eps`` (the paper's "w/ std"; verl-agent ``mode='mean_std_norm'``), ``'mean'`` by 1 (only the
mean is removed; "w/o std"; verl-agent ``mode='mean_norm'``). Both are the library's own group
normalisations (``advantages.group_advantages`` with ``'grpo'`` and ``'drgrpo'``), so their
edge cases hold here: a group of one (a singleton step group, a task sampled once) or a group
whose values are all equal gets 0, never NaN. Where we differ from verl-agent: its episode
level gives a task sampled once ``A^E = R`` (mean 0, std 1), ours 0; and its episode mean
and std run over the group's *steps* (each trajectory weighted by its length), ours over
its trajectories, as Eq. 3 writes.

Masked turns contribute nothing: no reward, no discount step (``gamma`` counts the turns
that happened, so a dropped turn inside a trajectory does not shorten the horizon), no
member of any group, and advantage 0; a trajectory all of whose turns are masked is no
member of its episode group either (the environment runner masks every turn of an episode
that timed out: ``controller.episodes``).
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm import loss_spec
from rlax_llm.loss_spec import NORMS
from rlax_llm.losses.advantages import group_advantages

GAMMA = 0.95  # GiGPO's discount of later turns' rewards (arXiv 2505.10978, Sec. 5)
OMEGA = 1.0  # GiGPO's weight of the step-level advantage (arXiv 2505.10978, Eq. 8)


def _check_turns(group_ids, turn_mask, **per_turn):
  """Shapes and dtypes of the per-turn inputs (``[B, N]``) against ``group_ids`` ``[B]``."""
  chex.assert_rank(group_ids, 1)
  chex.assert_type(group_ids, int)
  chex.assert_rank(turn_mask, 2)
  chex.assert_equal_shape_prefix([group_ids, turn_mask], 1)
  for name, value in per_turn.items():
    if value.shape != turn_mask.shape:
      raise ValueError(f'{name} must have the shape of turn_mask [B, N] = {turn_mask.shape}, '
                       f'got {value.shape}.')


def _check_norm(norm: str) -> str:
  if norm not in NORMS:
    raise ValueError(f'norm={norm!r} is not valid; choose one of {list(NORMS)} (GiGPO\'s '
                     'F_norm: the standard deviation, or 1).')
  return NORMS[norm]


def discounted_turn_returns(turn_rewards: jax.Array, turn_mask: jax.Array,
                            gamma: float | jax.Array) -> jax.Array:
  """Discounted return from each turn, ``R_t = r_t + gamma R_{t+1}`` (GiGPO Eq. 5).

  Args:
    turn_rewards: float ``[B, N]``.
    turn_mask: ``[B, N]``, True for turns that happened. A masked turn adds no reward and no
      discount step (its successor's return passes through it), and its return is 0.
    gamma: discount in ``[0, 1]`` (a Python float or a traced scalar).
  Returns:
    float32 ``[B, N]`` (float64 for float64 rewards).
  """
  chex.assert_rank(turn_rewards, 2)
  chex.assert_equal_shape([turn_rewards, turn_mask])
  rewards = turn_rewards.astype(jnp.promote_types(turn_rewards.dtype, jnp.float32))
  mask = turn_mask.astype(bool)
  gamma = jnp.asarray(gamma, rewards.dtype)

  def step(next_return, turn):  # right to left over the turns
    reward, valid = turn
    value = jnp.where(valid, reward + gamma * next_return, next_return)
    return value, jnp.where(valid, value, 0.0)

  _, returns = jax.lax.scan(step, jnp.zeros(rewards.shape[:1], rewards.dtype),
                            (rewards.T, mask.T), reverse=True)
  return returns.T


def step_group_ids(group_ids: jax.Array, state_ids: jax.Array,
                   turn_mask: jax.Array) -> jax.Array:
  """GiGPO's anchor-state step groups (Eq. 6): one id per ``(group, state)`` pair.

  Args:
    group_ids: int ``[B]``, the task group of each trajectory.
    state_ids: int ``[B, N]``, the state each turn acted in (equal = identical state).
    turn_mask: ``[B, N]``, True for turns that happened.
  Returns:
    int32 ``[B, N]``: the turns of trajectories in one group that share a state have one id;
    ids are ``0 .. K - 1``, numbered in order of (group id, state id); masked turns get -1.
    Equal states in different groups are different step groups. Jit-safe (a fixed-size
    ``jnp.unique`` over the ``B * N`` pairs).
  """
  _check_turns(group_ids, turn_mask, state_ids=state_ids)
  chex.assert_type(state_ids, int)
  b, n = state_ids.shape
  _, group = jnp.unique(group_ids, return_inverse=True, size=b)
  mask = turn_mask.astype(bool)
  # Masked turns share a sentinel pair that sorts after every real one (dense groups < b).
  pairs = jnp.stack([jnp.where(mask, group.reshape(b, 1), b),
                     jnp.where(mask, state_ids, 0)], axis=-1).reshape(b * n, 2)
  _, ids = jnp.unique(pairs, axis=0, return_inverse=True, size=b * n)
  return jnp.where(mask, ids.reshape(b, n), -1).astype(jnp.int32)


def _normalize_in_groups(values: jax.Array, ids: jax.Array, mask: jax.Array, norm: str,
                         eps: float) -> jax.Array:
  """``values [B, N]`` normalised within the turns sharing an id (``group_advantages``)."""
  flat = group_advantages(values.reshape(-1), ids.reshape(-1), NORMS[norm],
                          valid=mask.reshape(-1), eps=eps)
  return flat.reshape(values.shape)


def trajectory_advantages(episode_returns: jax.Array, group_ids: jax.Array,
                          turn_mask: jax.Array, norm: str = 'std',
                          eps: float = 1e-6) -> jax.Array:
  """Trajectory-level GRPO: ``A^E`` (GiGPO Eq. 3) on every turn of the trajectory.

  Args:
    episode_returns: float ``[B]``, each trajectory's return.
    group_ids: int ``[B]``; trajectories with equal ids ran the same task.
    turn_mask: ``[B, N]``, True for turns that happened.
    norm: ``'std'`` or ``'mean'`` (``F_norm``, module docstring).
    eps: added to the standard deviation.
  Returns:
    float32 ``[B, N]``, 0 on masked turns.
  """
  estimator = _check_norm(norm)
  _check_turns(group_ids, turn_mask)
  chex.assert_shape(episode_returns, group_ids.shape)
  # A trajectory none of whose turns happened (timed out, or its environment failed, before
  # its first step completed) is no member of its group: its return says nothing of a policy.
  episode = group_advantages(episode_returns, group_ids, estimator,
                             valid=turn_mask.astype(bool).any(axis=1), eps=eps)
  return jnp.where(turn_mask.astype(bool), episode[:, None], 0.0)


def turn_grpo_advantages(group_ids: jax.Array, turn_rewards: jax.Array, turn_mask: jax.Array,
                         gamma: float | jax.Array = GAMMA, norm: str = 'std',
                         eps: float = 1e-6) -> jax.Array:
  """Per-turn rewards with a discount: each turn's discounted return (Eq. 5) normalised over
  every turn of its group's trajectories (all turn positions in one pool per group).

  Args:
    group_ids: int ``[B]``.
    turn_rewards: float ``[B, N]``.
    turn_mask: ``[B, N]``, True for turns that happened.
    gamma: discount.
    norm: ``'std'`` or ``'mean'``.
    eps: added to the standard deviation.
  Returns:
    float32 ``[B, N]``, 0 on masked turns.
  """
  _check_norm(norm)
  _check_turns(group_ids, turn_mask, turn_rewards=turn_rewards)
  mask = turn_mask.astype(bool)
  returns = discounted_turn_returns(turn_rewards, mask, gamma)
  ids = jnp.broadcast_to(group_ids[:, None], mask.shape)
  return _normalize_in_groups(returns, ids, mask, norm, eps)


def gigpo_advantages(episode_returns: jax.Array, group_ids: jax.Array, turn_rewards: jax.Array,
                     turn_mask: jax.Array, state_ids: jax.Array,
                     gamma: float | jax.Array = GAMMA, omega: float | jax.Array = OMEGA,
                     norm: str = 'std', eps: float = 1e-6) -> jax.Array:
  """GiGPO per-turn advantages ``A = A^E + omega * A^S`` (arXiv 2505.10978, Eq. 3-8).

  ``A^E``: the episode return normalised over the trajectories of its group (Eq. 3).
  ``A^S``: each turn's discounted return (Eq. 5) normalised over its anchor-state step group
  (Eq. 6-7): the turns of the group's trajectories that acted in an identical state
  (``step_group_ids``). A turn alone in its step group gets ``A^S = 0``.

  Args:
    episode_returns: float ``[B]``, each trajectory's return ``R(tau)``.
    group_ids: int ``[B]``; trajectories with equal ids ran the same task.
    turn_rewards: float ``[B, N]``, per-turn rewards ``r_t``.
    turn_mask: ``[B, N]``, True for turns that happened.
    state_ids: int ``[B, N]``, equal ids = identical environment state.
    gamma: discount of the step-level returns (paper: 0.95).
    omega: weight of ``A^S`` (paper: 1).
    norm: ``'std'`` or ``'mean'`` (``F_norm`` of both levels, module docstring).
    eps: added to standard deviations.
  Returns:
    float32 ``[B, N]``, 0 on masked turns. Jit-able (``norm`` static); shapes are static.
  """
  _check_norm(norm)
  _check_turns(group_ids, turn_mask, turn_rewards=turn_rewards, state_ids=state_ids)
  mask = turn_mask.astype(bool)
  episode = trajectory_advantages(episode_returns, group_ids, mask, norm, eps)
  returns = discounted_turn_returns(turn_rewards, mask, gamma)
  step = _normalize_in_groups(returns, step_group_ids(group_ids, state_ids, mask), mask, norm,
                              eps)
  return episode + omega * step


def broadcast_turn_advantages(turn_advantages: jax.Array, token_turn: jax.Array) -> jax.Array:
  """Per-token advantages ``[B, T]`` from per-turn ones ``[B, N]``: each token gets its turn's.

  With these, a multi-turn trajectory's tokens go through the policy losses unchanged
  (``policy_loss`` takes ``[B, T]`` advantages).

  Args:
    turn_advantages: float ``[B, N]``.
    token_turn: int ``[B, T]``, the turn of each token: ``0 .. N - 1`` for the model's tokens,
      -1 for prompt, environment, tool and padding tokens (any value outside ``0 .. N - 1``
      is treated as -1).
  Returns:
    ``[B, T]`` of ``turn_advantages``' dtype, 0 where ``token_turn`` is not a turn.
  """
  chex.assert_rank([turn_advantages, token_turn], 2)
  chex.assert_type(token_turn, int)
  chex.assert_equal_shape_prefix([turn_advantages, token_turn], 1)
  n = turn_advantages.shape[1]
  is_turn = (token_turn >= 0) & (token_turn < n)
  picked = jnp.take_along_axis(turn_advantages, jnp.where(is_turn, token_turn, 0), axis=1)
  return jnp.where(is_turn, picked, 0.0).astype(turn_advantages.dtype)


TurnEstimator = Callable[..., jax.Array]


def _trajectory(episode_returns, group_ids, turn_rewards, turn_mask, state_ids, gamma, omega,
                norm, eps):
  del turn_rewards, state_ids, gamma, omega  # the episode return is the whole signal
  return trajectory_advantages(episode_returns, group_ids, turn_mask, norm, eps)


def _turn_grpo(episode_returns, group_ids, turn_rewards, turn_mask, state_ids, gamma, omega,
               norm, eps):
  del episode_returns, state_ids, omega  # per-turn rewards are the whole signal
  return turn_grpo_advantages(group_ids, turn_rewards, turn_mask, gamma, norm, eps)


_TURN_FUNCTIONS: dict[str, TurnEstimator] = {
    'trajectory_grpo': _trajectory,
    'turn_grpo': _turn_grpo,
    'gigpo': gigpo_advantages,
}
# Multi-turn advantage estimators: name -> function of the trajectory batch's turn arrays,
# all called the same way (``turn_advantages``). Selectable as ``rl.advantage_estimator``;
# the names are ``loss_spec.TURN_ESTIMATORS`` (a name there without a function here fails on
# import).
TURN_ESTIMATORS: dict[str, TurnEstimator] = {
    name: _TURN_FUNCTIONS[name] for name in loss_spec.TURN_ESTIMATORS}


def turn_advantages(estimator: str, *, episode_returns: jax.Array, group_ids: jax.Array,
                    turn_rewards: jax.Array, turn_mask: jax.Array, state_ids: jax.Array,
                    gamma: float | jax.Array = GAMMA, omega: float | jax.Array = OMEGA,
                    norm: str = 'std', eps: float = 1e-6) -> jax.Array:
  """Per-turn advantages ``[B, N]`` of the estimator named ``estimator`` (``TURN_ESTIMATORS``).

  Every estimator takes the same inputs (those it does not use are ignored): the trajectory
  batch's ``rewards`` as ``episode_returns`` ``[B]``, ``group_ids`` ``[B]``, and its
  ``turn_rewards``, ``turn_mask``, ``state_ids`` ``[B, N]``. Turn them into token advantages
  with ``broadcast_turn_advantages(adv, token_turn)``.
  """
  if estimator not in TURN_ESTIMATORS:
    raise ValueError(f'Unknown multi-turn advantage estimator {estimator!r}; choose one of '
                     f'{list(TURN_ESTIMATORS)}.')
  return TURN_ESTIMATORS[estimator](episode_returns, group_ids, turn_rewards, turn_mask,
                                    state_ids, gamma, omega, norm, eps)


def credit_metrics(turn_advantages: np.ndarray, turn_mask: np.ndarray, group_ids: np.ndarray,
                   episode_returns: np.ndarray, step_ids: np.ndarray | None = None,
                   eps: float = 1e-6) -> dict[str, float]:
  """What a batch's multi-turn credit holds, for the run's metrics (host numpy; not jitted).

  Args:
    turn_advantages: float ``[B, N]``, each turn's advantage (a trajectory-level estimator's
      ``[B]`` broadcast over its turns).
    turn_mask: bool ``[B, N]``, True for turns that happened.
    group_ids: int ``[B]``.
    episode_returns: float ``[B]``.
    step_ids: int ``[B, N]``, GiGPO's step groups (``step_group_ids``; -1 masked), or None.
    eps: below this magnitude an advantage counts as zero.
  Returns:
    ``credit/zero_fraction`` (turns with no signal), ``credit/abs_mean`` and ``credit/std``
    over the turns that happened; ``credit/flat_groups``: the fraction of groups whose
    episodes all returned the same (GRPO's advantage is 0 there); per turn index ``t``
    (where any happened) ``credit/turn{t}_mean`` and ``credit/turn{t}_zero``; with
    ``step_ids``: ``credit/step_groups`` (count), ``credit/step_group_size`` (mean turns
    per step group) and ``credit/singleton_turns`` (the fraction of turns alone in their
    step group: their ``A^S`` is 0).
  """
  adv = np.asarray(turn_advantages, np.float64)
  mask = np.asarray(turn_mask, bool)
  chex.assert_equal_shape([adv, mask])
  groups = np.asarray(group_ids)
  returns = np.asarray(episode_returns, np.float64)
  chex.assert_shape([groups, returns], adv.shape[:1])
  real = adv[mask]
  out = {'credit/zero_fraction': float(np.mean(np.abs(real) < eps)) if real.size else 1.0,
         'credit/abs_mean': float(np.mean(np.abs(real))) if real.size else 0.0,
         'credit/std': float(np.std(real)) if real.size else 0.0,
         'credit/flat_groups': float(np.mean([np.ptp(returns[groups == g]) < eps
                                              for g in np.unique(groups)]))}
  for t in range(adv.shape[1]):
    if mask[:, t].any():
      column = adv[mask[:, t], t]
      out[f'credit/turn{t}_mean'] = float(column.mean())
      out[f'credit/turn{t}_zero'] = float(np.mean(np.abs(column) < eps))
  if step_ids is not None:
    ids = np.asarray(step_ids)[mask]
    _, sizes = np.unique(ids, return_counts=True)
    out['credit/step_groups'] = float(len(sizes))
    out['credit/step_group_size'] = float(sizes.mean()) if len(sizes) else 0.0
    out['credit/singleton_turns'] = (float(np.sum(sizes == 1) / len(ids)) if len(ids)
                                     else 0.0)
  return out
