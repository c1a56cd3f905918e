"""Independent float64 NumPy references for ``rlax_llm.losses``, written from the papers.

Nothing here imports ``rlax_llm``: every expected value in ``tests/losses`` comes from these
formulas (or from hand arithmetic in the tests). Conventions: per-token inputs are ``[B, T]``,
``mask`` is 1 on loss tokens, advantages are ``[B]`` or ``[B, T]``; every loss is returned as
the quantity to *minimise* (minus the objective).
"""

from __future__ import annotations

import numpy as np


def f64(x):
  return np.asarray(x, np.float64)


def _prep(logp, old_logp, advantages, mask):
  logp, old_logp = f64(logp), f64(old_logp)
  adv = f64(advantages)
  adv = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
  return logp, old_logp, adv, np.asarray(mask) > 0


# ---------------------------------------------------------------------------------------------
# Aggregations (RLAX arXiv 2512.06392 names), each over the tokens where ``mask`` is set.


def token_mean(x, mask):
  """DAPO: ``sum_it x / sum_i |o_i|`` (0 with no token)."""
  m = np.asarray(mask) > 0
  return float(f64(x)[m].sum() / m.sum()) if m.any() else 0.0


def seq_mean_token_mean(x, mask):
  """GRPO: mean over non-empty sequences of the per-sequence token mean."""
  x, m = f64(x), np.asarray(mask) > 0
  rows = [x[i][m[i]].mean() for i in range(x.shape[0]) if m[i].any()]
  return float(np.mean(rows)) if rows else 0.0


def seq_mean_token_sum(x, mask):
  """REINFORCE: mean over non-empty sequences of the per-sequence token sum."""
  x, m = f64(x), np.asarray(mask) > 0
  rows = [x[i][m[i]].sum() for i in range(x.shape[0]) if m[i].any()]
  return float(np.mean(rows)) if rows else 0.0


def seq_mean_token_sum_norm(x, mask, max_length=None):
  """Dr. GRPO: ``sum_it x / (B * L_max)``, ``L_max`` the padded width unless given."""
  x, m = f64(x), np.asarray(mask) > 0
  length = x.shape[1] if max_length is None else max_length
  return float(x[m].sum() / (x.shape[0] * length))


AGGREGATIONS = {
    'token-mean': token_mean,
    'seq-mean-token-mean': seq_mean_token_mean,
    'seq-mean-token-sum': seq_mean_token_sum,
    'seq-mean-token-sum-norm': seq_mean_token_sum_norm,
}


# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL Divergence", 2020), samples from the policy.


def kl(logp, ref_logp, estimator):
  log_ratio = f64(ref_logp) - f64(logp)
  if estimator == 'k1':
    return -log_ratio
  if estimator == 'k2':
    return 0.5 * log_ratio ** 2
  assert estimator == 'k3'
  return np.exp(log_ratio) - 1.0 - log_ratio


# ---------------------------------------------------------------------------------------------
# Named policy losses, one function per algorithm. ``old_logp`` is the proximal policy of the
# ratio ``r = exp(logp - old_logp)``; ``weight`` is an optional detached per-token factor (the
# train-inference mismatch weight) multiplying each token's objective.


def ppo_clip(ratio, adv, eps_low, eps_high):
  return np.minimum(ratio * adv, np.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)


def ppo_loss(logp, old_logp, adv, mask, weight=1.0, eps=0.2):
  """PPO (Schulman et al. 2017), per-token clipped surrogate, token-mean."""
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  return -token_mean(weight * ppo_clip(np.exp(logp - old_logp), adv, eps, eps), mask)


def grpo_loss(logp, old_logp, adv, mask, weight=1.0, eps=0.2):
  """GRPO (DeepSeekMath eq. 3): ``-1/G sum_i 1/|o_i| sum_t min(rA, clip(r)A)``."""
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  return -seq_mean_token_mean(weight * ppo_clip(np.exp(logp - old_logp), adv, eps, eps), mask)


def dapo_loss(logp, old_logp, adv, mask, weight=1.0, eps_low=0.2, eps_high=0.28):
  """DAPO: clip-higher ``[1 - 0.2, 1 + 0.28]``, token-level mean over the batch."""
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  ratio = np.exp(logp - old_logp)
  return -token_mean(weight * ppo_clip(ratio, adv, eps_low, eps_high), mask)


def drgrpo_loss(logp, old_logp, adv, mask, weight=1.0, eps=0.2, max_length=None):
  """Dr. GRPO: token sum of the PPO surrogate divided by the constant ``B * L_max``."""
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  objective = ppo_clip(np.exp(logp - old_logp), adv, eps, eps)
  length = logp.shape[1] if max_length is None else max_length
  per_token = np.broadcast_to(weight * objective, logp.shape)
  return -float(per_token[mask].sum() / (logp.shape[0] * length))


def gspo_sequence_ratio(logp, old_logp, mask):
  """GSPO ``s_i = (pi/pi_old)^(1/|o_i|) = exp(1/|o_i| sum_t log r_it)``, one per row."""
  logp, old_logp, mask = f64(logp), f64(old_logp), np.asarray(mask) > 0
  out = np.ones(logp.shape[0])
  for i in range(logp.shape[0]):
    if mask[i].any():
      out[i] = np.exp(np.mean(logp[i][mask[i]] - old_logp[i][mask[i]]))
  return out


def gspo_loss(logp, old_logp, adv, mask, weight=1.0, eps_low=3e-4, eps_high=4e-4):
  """GSPO (Zheng et al. 2025): ``-1/G sum_i min(s_i A_i, clip(s_i, 1-3e-4, 1+4e-4) A_i)``.

  With per-token advantages the clipped surrogate is taken per token with the shared
  ``s_i``, then sequence-mean-token-mean.
  """
  s = gspo_sequence_ratio(logp, old_logp, mask)
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  ratio = np.broadcast_to(s[:, None], logp.shape)
  return -seq_mean_token_mean(weight * ppo_clip(ratio, adv, eps_low, eps_high), mask)


def cispo_coefficient(logp, old_logp, eps_low=1.0, eps_high=0.28):
  return np.clip(np.exp(f64(logp) - f64(old_logp)), 1.0 - eps_low, 1.0 + eps_high)


def cispo_loss(logp, old_logp, adv, mask, weight=1.0, eps_low=1.0, eps_high=0.28):
  """CISPO (MiniMax-M1): ``-token-mean(sg[clip(r, 1-eps_low, 1+eps_high)] A log pi)``."""
  coeff = cispo_coefficient(logp, old_logp, eps_low, eps_high)
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  return -token_mean(weight * coeff * adv * logp, mask)


def reinforce_loss(logp, old_logp, adv, mask, weight=1.0):
  """REINFORCE (Williams 1992) with an importance weight: ``-1/G sum_i sum_t sg[r] A logp``."""
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  return -seq_mean_token_sum(weight * np.exp(logp - old_logp) * adv * logp, mask)


def rloo_loss(logp, old_logp, adv, mask, weight=1.0):
  """RLOO (Ahmadian et al. 2024): the REINFORCE estimator, with leave-one-out advantages."""
  return reinforce_loss(logp, old_logp, adv, mask, weight)


def reinforce_pp_loss(logp, old_logp, adv, mask, weight=1.0, eps=0.2):
  """REINFORCE++ (Hu 2025): PPO clipped surrogate (eps 0.2), token-mean."""
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  return -token_mean(weight * ppo_clip(np.exp(logp - old_logp), adv, eps, eps), mask)


def m2po_mask_loop(log_ratio, candidates, tau):
  """M2PO Algorithm 1, literally: drop the current largest ``(log r)^2`` while the mean of the
  kept candidates exceeds ``tau``. Ties: the later token (flattened order) goes first."""
  shape = np.shape(log_ratio)
  m2 = np.square(f64(log_ratio)).reshape(-1)
  kept = np.asarray(candidates, bool).reshape(-1).copy()
  while kept.any() and m2[kept].mean() > tau:
    idx = np.flatnonzero(kept)
    worst = idx[m2[idx] == m2[idx].max()][-1]
    kept[worst] = False
  return kept.reshape(shape)


def m2po_paper_candidates(logp, old_logp, adv, mask):
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  lr = logp - old_logp
  return mask & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))


def m2po_paper_loss(logp, old_logp, adv, mask, weight=1.0, tau=0.04):
  """M2PO (arXiv 2510.01161), paper variant: candidates push r away from 1 in A's direction;
  ``-sum_it M r A / sum_it loss_mask`` with ``M = 0`` only on dropped candidates."""
  candidates = m2po_paper_candidates(logp, old_logp, adv, mask)
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  lr = logp - old_logp
  dropped = candidates & ~m2po_mask_loop(lr, candidates, tau)
  objective = np.where(dropped, 0.0, weight * np.exp(lr) * adv)
  return -float(objective[mask].sum() / max(mask.sum(), 1))


def m2po_areal_loss(logp, old_logp, adv, mask, weight=1.0, tau=0.04):
  """M2PO, AReaL variant: every loss token is a candidate; mean over the kept tokens."""
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  lr = logp - old_logp
  kept = m2po_mask_loop(lr, mask, tau)
  objective = weight * np.exp(lr) * adv
  return -float(objective[kept].sum() / max(kept.sum(), 1))


def m2po_adaptive_delta(logp, old_logp, mask, tau=0.04):
  """Largest ``|log r|`` among the tokens the M2PO mask keeps (candidates: all loss tokens)."""
  lr = f64(logp) - f64(old_logp)
  kept = m2po_mask_loop(lr, np.asarray(mask) > 0, tau)
  return float(np.abs(lr[kept]).max()) if kept.any() else 0.0


def m2po_adaptive_clip_loss(logp, old_logp, adv, mask, weight=1.0, tau=0.04):
  """M2PO, adaptive-clip variant: PPO clip with ratio bounds ``[e^-delta, e^delta]``."""
  delta = m2po_adaptive_delta(logp, old_logp, mask, tau)
  logp, old_logp, adv, mask = _prep(logp, old_logp, adv, mask)
  ratio = np.exp(logp - old_logp)
  objective = np.minimum(ratio * adv, np.clip(ratio, np.exp(-delta), np.exp(delta)) * adv)
  return -token_mean(weight * objective, mask)


M2PO_LOSSES = {'paper': m2po_paper_loss, 'areal': m2po_areal_loss,
               'adaptive_clip': m2po_adaptive_clip_loss}

# name -> (objective reference, aggregation of the KL term, default KL estimator).
ALGORITHMS = {
    'ppo': (ppo_loss, 'token-mean', 'k3'),
    'grpo': (grpo_loss, 'seq-mean-token-mean', 'k3'),
    'dapo': (dapo_loss, 'token-mean', 'k3'),
    'drgrpo': (drgrpo_loss, 'seq-mean-token-sum-norm', 'k3'),
    'gspo': (gspo_loss, 'seq-mean-token-mean', 'k3'),
    'cispo': (cispo_loss, 'token-mean', 'k3'),
    'reinforce': (reinforce_loss, 'seq-mean-token-sum', 'k3'),
    'rloo': (rloo_loss, 'seq-mean-token-sum', 'k3'),
    'reinforce_pp': (reinforce_pp_loss, 'token-mean', 'k2'),
    'm2po': (None, 'token-mean', 'k3'),
}


def mismatch_weights(old_logp, rollout_logp, mask, level='token', mode='truncate',
                     threshold=2.0, veto_threshold=None):
  """TIS (truncate) / MIS (mask) weights ``pi_train_old / pi_rollout`` with a sequence veto.

  Token level: ``w_t = exp(old_t - rollout_t)``; sequence level: ``exp(sum_t ...)`` over the
  row's loss tokens. Truncate: ``min(w, C)``; mask: ``w if w <= C else 0``. A row with any loss
  token whose token-level weight is ``< veto_threshold`` is zeroed. 0 outside the mask.
  """
  mask = np.asarray(mask) > 0
  old_logp, rollout_logp = f64(old_logp), f64(rollout_logp)
  w = np.zeros(old_logp.shape)
  for i in range(old_logp.shape[0]):
    token_w = np.exp(old_logp[i] - rollout_logp[i])
    if level == 'token':
      row = token_w
    else:
      row = np.full(old_logp.shape[1], np.exp(np.sum((old_logp[i] - rollout_logp[i])[mask[i]])))
    row = np.minimum(row, threshold) if mode == 'truncate' else np.where(row <= threshold, row,
                                                                         0.0)
    if veto_threshold is not None and np.any(token_w[mask[i]] < veto_threshold):
      row = np.zeros_like(row)
    w[i] = np.where(mask[i], row, 0.0)
  return w


def policy_loss(name, logp, behaviour_logp, adv, mask, *, old_logp=None, ref_logp=None,
                kl_beta=0.0, kl_estimator=None, max_length=None, tau=0.04, variant='paper',
                mismatch=None):
  """Any named loss with the shared options: ratio against ``old_logp`` when given, a
  detached mismatch weight (``mismatch`` = kwargs of ``mismatch_weights``), and
  ``kl_beta * aggregation(KL(pi || ref))`` aggregated like the objective over the loss mask."""
  fn, kl_aggregation, default_estimator = ALGORITHMS[name]
  proximal = behaviour_logp if old_logp is None else old_logp
  weight = 1.0
  if mismatch is not None:
    weight = mismatch_weights(old_logp, behaviour_logp, mask, **mismatch)
  if name == 'm2po':
    loss = M2PO_LOSSES[variant](logp, proximal, adv, mask, weight, tau=tau)
  elif name == 'drgrpo':
    loss = fn(logp, proximal, adv, mask, weight, max_length=max_length)
  else:
    loss = fn(logp, proximal, adv, mask, weight)
  if kl_beta > 0:
    per_token = kl(logp, ref_logp, kl_estimator or default_estimator)
    agg = AGGREGATIONS[kl_aggregation]
    kl_term = (agg(per_token, mask, max_length) if kl_aggregation == 'seq-mean-token-sum-norm'
               else agg(per_token, mask))
    loss += kl_beta * kl_term
  return loss


# ---------------------------------------------------------------------------------------------
# Diagnostics.


def nearest_rank_quantile(values, q):
  values = f64(values)
  return float(np.quantile(values, q, method='inverted_cdf')) if values.size else 0.0


def mismatch_kl(trainer_logp, rollout_logp, mask):
  """k3 estimate of KL(rollout || trainer) on rollout samples: mean of e^(t-r) - 1 - (t-r)."""
  d = (f64(trainer_logp) - f64(rollout_logp))[np.asarray(mask) > 0]
  return float(np.mean(np.exp(d) - 1.0 - d)) if d.size else 0.0


# ---------------------------------------------------------------------------------------------
# Advantage estimators: loops over groups, from each paper's formula.


def _groups(group_ids, valid):
  group_ids = np.asarray(group_ids)
  valid = np.ones(len(group_ids), bool) if valid is None else np.asarray(valid, bool)
  for g in sorted(set(group_ids[valid].tolist())):
    yield np.flatnonzero((group_ids == g) & valid)


def grpo_advantages(rewards, group_ids, valid=None, eps=1e-6):
  """``(r - mean_g) / (std_g + eps)``, Bessel std; 0 for a group of one or an invalid row."""
  rewards = f64(rewards)
  out = np.zeros(len(rewards))
  for idx in _groups(group_ids, valid):
    if len(idx) > 1:
      r = rewards[idx]
      out[idx] = (r - r.mean()) / (r.std(ddof=1) + eps)
  return out


def drgrpo_advantages(rewards, group_ids, valid=None):
  """``r - mean_g`` (no std); 0 for a group of one."""
  rewards = f64(rewards)
  out = np.zeros(len(rewards))
  for idx in _groups(group_ids, valid):
    if len(idx) > 1:
      out[idx] = rewards[idx] - rewards[idx].mean()
  return out


def rloo_advantages(rewards, group_ids, valid=None):
  """``r_i - mean_{j != i} r_j`` over the other valid members; 0 for a group of one."""
  rewards = f64(rewards)
  out = np.zeros(len(rewards))
  for idx in _groups(group_ids, valid):
    if len(idx) > 1:
      for i in idx:
        others = [rewards[j] for j in idx if j != i]
        out[i] = rewards[i] - sum(others) / len(others)
  return out


def median_advantages(rewards, group_ids, valid=None, eps=1e-6):
  """MC-GRPO: ``(r - median_g) / (std_g + eps)``, Bessel std; 0 for a group of one."""
  rewards = f64(rewards)
  out = np.zeros(len(rewards))
  for idx in _groups(group_ids, valid):
    if len(idx) > 1:
      r = rewards[idx]
      out[idx] = (r - np.median(r)) / (r.std(ddof=1) + eps)
  return out


def batch_normalize(x, valid=None, eps=1e-6):
  """``(x - mean) / (std + eps)`` over the valid rows, Bessel std; 0 if all equal."""
  x = f64(x)
  valid = np.ones(len(x), bool) if valid is None else np.asarray(valid, bool)
  out = np.zeros(len(x))
  v = x[valid]
  if v.size > 1 and v.max() > v.min():
    out[valid] = (v - v.mean()) / (v.std(ddof=1) + eps)
  return out


def gdpo_advantages(rewards, group_ids, reward_weights=None, valid=None, eps=1e-6):
  """GDPO: GRPO-normalise each reward column in its group, weighted sum, batch-normalise."""
  rewards = f64(rewards)
  weights = np.ones(rewards.shape[1]) if reward_weights is None else f64(reward_weights)
  total = sum(weights[k] * grpo_advantages(rewards[:, k], group_ids, valid, eps)
              for k in range(rewards.shape[1]))
  return batch_normalize(total, valid, eps)


def reinforce_advantages(rewards, group_ids, valid=None):
  """No baseline: ``r`` (0 on invalid rows)."""
  rewards = f64(rewards)
  valid = np.ones(len(rewards), bool) if valid is None else np.asarray(valid, bool)
  return np.where(valid, rewards, 0.0)


def w_reinforce_advantages(rewards, group_ids, valid=None, positive_weight=0.1):
  """W-REINFORCE: ``positive_weight * r - (1 - r)`` (0 on invalid rows), no baseline."""
  rewards = f64(rewards)
  valid = np.ones(len(rewards), bool) if valid is None else np.asarray(valid, bool)
  return np.where(valid, positive_weight * rewards - (1.0 - rewards), 0.0)


def reinforce_pp_advantages(rewards, group_ids, valid=None, eps=1e-6):
  """REINFORCE++-baseline: ``r - mean_g`` (0 for a group of one), then batch-normalised."""
  return batch_normalize(drgrpo_advantages(rewards, group_ids, valid), valid, eps)


ESTIMATORS = {
    'grpo': grpo_advantages,
    'drgrpo': drgrpo_advantages,
    'rloo': rloo_advantages,
    'median': median_advantages,
    'gdpo': gdpo_advantages,
    'reinforce': reinforce_advantages,
    'reinforce_pp': reinforce_pp_advantages,
    'w_reinforce': w_reinforce_advantages,
}


# ---------------------------------------------------------------------------------------------
# Multi-turn credit (GiGPO, Feng et al., arXiv 2505.10978): loops over trajectories and
# dictionaries of step groups.


def discounted_turn_returns(turn_rewards, turn_mask, gamma):
  """``R_t = sum over the later turns that happened of gamma^(their rank after t) r``; masked
  turns add no reward and no discount step, and their return is 0."""
  rewards, mask = f64(turn_rewards), np.asarray(turn_mask, bool)
  out = np.zeros(rewards.shape)
  for i in range(rewards.shape[0]):
    turns = [t for t in range(rewards.shape[1]) if mask[i, t]]
    for rank, t in enumerate(turns):
      out[i, t] = sum(gamma ** k * rewards[i, u] for k, u in enumerate(turns[rank:]))
  return out


def _normalise(values, norm, eps):
  """GiGPO's F_norm over one group: std (Bessel) or 1; a group of one gets 0."""
  values = f64(values)
  if len(values) < 2:
    return np.zeros(len(values))
  centred = values - values.mean()
  return centred / (values.std(ddof=1) + eps) if norm == 'std' else centred


def gigpo_parts(episode_returns, group_ids, turn_rewards, turn_mask, state_ids, gamma,
                norm='std', eps=1e-6):
  """``(A^E [B, N], A^S [B, N])``: Eq. 3 over each group's trajectories (those with a turn
  that happened), Eq. 7 over each step group ``{(group, state)}`` (Eq. 6) of the discounted
  returns (Eq. 5); 0 on masked turns."""
  group_ids, mask = np.asarray(group_ids), np.asarray(turn_mask, bool)
  returns = discounted_turn_returns(turn_rewards, mask, gamma)
  episode = np.zeros(mask.shape)
  for g in set(group_ids.tolist()):
    rows = np.flatnonzero((group_ids == g) & mask.any(axis=1))
    episode[rows] = _normalise(f64(episode_returns)[rows], norm, eps)[:, None]
  step_groups = {}
  for i, t in zip(*np.nonzero(mask)):
    step_groups.setdefault((group_ids[i], state_ids[i][t]), []).append((i, t))
  step = np.zeros(mask.shape)
  for members in step_groups.values():
    values = _normalise([returns[i, t] for i, t in members], norm, eps)
    for (i, t), value in zip(members, values):
      step[i, t] = value
  return np.where(mask, episode, 0.0), step


def gigpo_advantages(episode_returns, group_ids, turn_rewards, turn_mask, state_ids, gamma,
                     omega, norm='std', eps=1e-6):
  """GiGPO Eq. 8: ``A^E + omega A^S``."""
  episode, step = gigpo_parts(episode_returns, group_ids, turn_rewards, turn_mask, state_ids,
                              gamma, norm, eps)
  return episode + omega * step


# ---------------------------------------------------------------------------------------------
# Random test inputs shared by the test files.

# Bands of log-ratios at least 0.04 away from every clip edge the named losses use:
# log 0.8 = -0.223, log 1.2 = 0.182, log 1.28 = 0.247 (and GSPO's +-4e-4, see below).
LOG_RATIO_BANDS = np.array([[-0.6, -0.3], [-0.15, 0.12], [0.3, 0.6]])


def make_inputs(seed, batch=6, length=7, zero_row=None, per_token_adv=False, tiny_rows=True):
  """Random float32 loss inputs as a dict.

  ``logp``; ``behaviour`` (= ``logp - log_ratio``, the proximal policy) with log-ratios in
  ``LOG_RATIO_BANDS``, except rows ``1, 4, ...`` whose log-ratios are within ``1e-4`` of 0
  (inside GSPO's sequence trust region by a margin; ``tiny_rows=False``: every row uses the
  bands); every other row has a sequence mean log-ratio ``>= 0.02`` in size (outside it).
  ``rollout``: ``behaviour`` plus N(0, 0.3) noise, a rollout engine's log-probs for mismatch
  tests. ``ref``: a reference policy. ``mask``: ~65% ones with column 0 always set, except row
  ``zero_row`` (all zero) when given.
  """
  rng = np.random.RandomState(seed)
  logp = -rng.uniform(0.05, 3.0, (batch, length))
  mask = rng.rand(batch, length) < 0.65
  mask[:, 0] = True
  if zero_row is not None:
    mask[zero_row] = False
  log_ratio = np.zeros((batch, length))
  for i in range(batch):
    while True:
      if tiny_rows and i % 3 == 1:
        row = rng.uniform(-1e-4, 1e-4, length)
      else:
        band = LOG_RATIO_BANDS[rng.randint(0, 3, length)]
        row = band[:, 0] + rng.rand(length) * (band[:, 1] - band[:, 0])
      mean = row[mask[i]].mean() if mask[i].any() else 1.0
      if (tiny_rows and i % 3 == 1) or abs(mean) >= 0.02:
        break
    log_ratio[i] = row
  behaviour = logp - log_ratio
  rollout = behaviour + rng.normal(0.0, 0.3, (batch, length))
  ref = logp + rng.normal(0.0, 0.4, (batch, length))
  adv = rng.normal(size=(batch, length) if per_token_adv else (batch,))
  f32 = lambda x: np.asarray(x, np.float32)
  return {'logp': f32(logp), 'behaviour': f32(behaviour), 'rollout': f32(rollout),
          'ref': f32(ref), 'adv': f32(adv), 'mask': mask.astype(np.float32)}
