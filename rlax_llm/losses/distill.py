"""On-policy distillation losses: a teacher scores the student's own samples.

The student samples completions; a frozen teacher scores the student's tokens; the student
minimises a divergence to the teacher *on its own distribution* (Agarwal et al., "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD), ICLR 2024,
arXiv 2306.13649; Thinking Machines Lab, "On-Policy Distillation", 2025; Qwen3 Technical
Report, arXiv 2505.09388, section 4.5). Two forms:

* **Per-token reverse KL as an advantage** (``reverse_kl_advantages``). With ``y`` the
  student's sampled tokens, the reverse KL ``KL(pi_s || pi_t) = E_{y ~ pi_s}[log pi_s(y) -
  log pi_t(y)]`` is minimised by the policy gradient with the per-token advantage

      A_t = log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t)

  (no discounting: each token's own term, Thinking Machines 2025). ``pi_student`` here is the
  sampler's (behaviour) log-prob, so ``A_t`` is a constant of the batch and flows through the
  ordinary importance-ratio / clipping / TIS machinery of ``losses.policy_loss`` (advantages
  ``[B, T]``): stale student samples are corrected like any others.
* **GKD's generalised Jensen-Shannon divergence** (``generalized_jsd``, ``gkd_loss``) between
  the teacher's and the student's next-token distributions, over the teacher's top-k support
  with both distributions renormalised on it (or, with ``tail``, each completed by one bucket
  for its mass outside the top-k). With ``T`` the teacher, ``S`` the student and
  ``M = beta T + (1 - beta) S``:

      JSD_beta(T || S) = beta KL(T || M) + (1 - beta) KL(S || M),   0 < beta < 1,

  and at the ends (defined by continuity of the *gradient* direction, as in GKD section 3 and
  TRL's ``GKDTrainer.generalized_jsd_loss``, which this matches value for value):
  ``beta = 0`` is the forward KL ``KL(T || S)`` (supervised-KD-like, mode covering) and
  ``beta = 1`` the reverse KL ``KL(S || T)`` (mode seeking). ``benchmarks/peers/
  distill_reference.py`` compares this with TRL's on identical inputs.

Mixing with the task reward (``mix_advantages``): ``A = A_task + lambda * A_distill`` per
token, ``A_task`` the group advantage of the sequence (``[B]``) or the per-token one.

Conventions: per-token arrays are ``[B, T]`` float aligned with the scored tokens; ``loss_mask``
``[B, T]`` is 1 on the student's sampled tokens (the only tokens that get a signal: prompt,
padding and, in multi-turn episodes, environment observations are 0).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rlax_llm.losses import components as C


def reverse_kl_advantages(teacher_logp: jax.Array, student_logp: jax.Array,
                          loss_mask: jax.Array) -> jax.Array:
  """Per-token reverse-KL advantages ``A_t = log pi_teacher(y_t) - log pi_student(y_t)``.

  Thinking Machines 2025 ("On-Policy Distillation"); Qwen3 report (arXiv 2505.09388). No
  discounting: token ``t`` is credited with its own log-ratio only.

  Args:
    teacher_logp: float ``[B, T]``, the teacher's log-probs of the sampled tokens.
    student_logp: float ``[B, T]``, the student's log-probs of the same tokens (the sampler's
      behaviour log-probs: what the student sampled them with).
    loss_mask: ``[B, T]``, 1 on the student's sampled tokens.
  Returns:
    float32 ``[B, T]`` (float64 for float64 inputs), 0 off the mask, stop-gradient.
  """
  chex.assert_rank(teacher_logp, 2)
  chex.assert_equal_shape([teacher_logp, student_logp, loss_mask])
  mask = jnp.asarray(loss_mask) > 0
  diff = C.as_float(teacher_logp) - C.as_float(student_logp)
  return jax.lax.stop_gradient(jnp.where(mask, diff, 0.0))


def mix_advantages(task_advantages: jax.Array | None, distill_advantages: jax.Array,
                   loss_mask: jax.Array, weight: float) -> jax.Array:
  """Per-token ``A = A_task + weight * A_distill`` (``weight`` is the config's lambda).

  Args:
    task_advantages: float ``[B]`` (one per sequence, broadcast over its tokens) or ``[B, T]``;
      None: distillation alone (``A = weight * A_distill``).
    distill_advantages: float ``[B, T]`` (``reverse_kl_advantages``).
    loss_mask: ``[B, T]``; the result is 0 off it.
    weight: lambda, finite >= 0.
  Returns:
    float ``[B, T]``, 0 off the mask.
  """
  chex.assert_rank(distill_advantages, 2)
  chex.assert_equal_shape([distill_advantages, loss_mask])
  mask = jnp.asarray(loss_mask) > 0
  mixed = weight * C.as_float(distill_advantages)
  if task_advantages is not None:
    task = C.as_float(task_advantages)
    if task.shape not in (mask.shape[:1], mask.shape):
      raise ValueError(f'task_advantages must be [B] = {mask.shape[:1]} or [B, T] = '
                       f'{mask.shape}, got {task.shape}.')
    mixed = mixed + (task[:, None] if task.ndim == 1 else task)
  return jnp.where(mask, mixed, 0.0)


def renormalize(logp: jax.Array) -> jax.Array:
  """Log-probs ``[..., K]`` renormalised over their last axis (a distribution restricted to a
  support of ``K`` tokens): ``logp - logsumexp(logp)``."""
  return logp - jax.nn.logsumexp(logp, axis=-1, keepdims=True)


# The smallest mass ``with_tail`` resolves outside a support: float32 sums of the support's
# probabilities round by about 1e-7 each, so a smaller tail is rounding, and a ratio of two
# such tails (the divergence's gradient) is noise.
TAIL_FLOOR = 1e-5


def with_tail(logp: jax.Array) -> jax.Array:
  """Full-vocabulary log-probs of ``K`` tokens ``[..., K]`` -> ``[..., K + 1]``: the same,
  then the log of the mass on every other token, ``log(1 - sum exp(logp))``, held at
  ``log(TAIL_FLOOR)`` (without gradient) where it is smaller. A top-k support and one bucket
  for the rest form a distribution that sums to 1 (to ``TAIL_FLOOR``) without renormalising:
  mass that leaves the top-k shows in the last bucket."""
  inside = jax.nn.logsumexp(logp, axis=-1, keepdims=True)
  rest = jnp.log(jnp.maximum(-jnp.expm1(jnp.minimum(inside, 0.0)), TAIL_FLOOR))
  return jnp.concatenate([logp, rest], axis=-1)


def generalized_jsd(student_logp: jax.Array, teacher_logp: jax.Array, beta: float,
                    tail: bool = False) -> jax.Array:
  """GKD's generalised JSD per position over a support of ``K`` tokens.

  Both inputs are renormalised on the support first (``renormalize``): pass the teacher's
  top-k log-probs and the student's full log-softmax gathered at the same token ids (``K = V``
  with full log-softmaxes is the whole distribution). ``tail``: instead of renormalising,
  each side gets one more category, its mass outside the support (``with_tail``; the inputs
  must then be full-vocabulary log-probs), so a student that moves mass off the teacher's
  top-k is penalised for it (renormalised, that mass is invisible). With ``T``, ``S`` the
  teacher and student so made and ``M = beta T + (1 - beta) S`` (Agarwal et al. 2024, eq. 1;
  TRL's ``generalized_jsd_loss``):

      beta = 0:      KL(T || S)                                (forward KL)
      0 < beta < 1:  beta KL(T || M) + (1 - beta) KL(S || M)
      beta = 1:      KL(S || T)                                (reverse KL)

  Args:
    student_logp: float ``[B, T, K]`` student log-probs on the support (gradient flows).
    teacher_logp: float ``[B, T, K]`` teacher log-probs on the support (treated as constant).
    beta: in ``[0, 1]`` (a Python float: the ends select their own formula).
    tail: compare the supports plus each side's mass outside them (``[..., K + 1]``), not
      the renormalised supports.
  Returns:
    float ``[B, T]`` divergences (>= 0).
  """
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f'beta={beta!r} must be in [0, 1] (0: forward KL(teacher || student), '
                     '1: reverse KL(student || teacher)).')
  chex.assert_rank(student_logp, 3)
  chex.assert_equal_shape([student_logp, teacher_logp])
  close = with_tail if tail else renormalize
  s = close(C.as_float(student_logp))
  t = close(jax.lax.stop_gradient(C.as_float(teacher_logp)))
  kl = lambda p, q: jnp.sum(jnp.exp(p) * (p - q), axis=-1)  # KL(P || Q) from log P, log Q
  if beta == 0.0:
    return kl(t, s)
  if beta == 1.0:
    return kl(s, t)
  m = jnp.logaddexp(t + jnp.log(beta), s + jnp.log1p(-beta))
  return beta * kl(t, m) + (1.0 - beta) * kl(s, m)


def gkd_loss(student_logp: jax.Array, teacher_logp: jax.Array, loss_mask: jax.Array,
             beta: float, tail: bool = False) -> jax.Array:
  """The token-mean of ``generalized_jsd`` over ``loss_mask`` (a scalar to minimise; 0 with
  no loss token).

  Args:
    student_logp, teacher_logp: float ``[B, T, K]`` (``generalized_jsd``).
    loss_mask: ``[B, T]``, 1 on the student's sampled tokens.
    beta: in ``[0, 1]``.
    tail: ``generalized_jsd``'s (the supports plus the mass outside them).
  """
  chex.assert_equal_shape_prefix([student_logp, loss_mask], 2)
  jsd = generalized_jsd(student_logp, teacher_logp, beta, tail)
  return C.masked_token_mean(jsd, jnp.asarray(loss_mask) > 0)
