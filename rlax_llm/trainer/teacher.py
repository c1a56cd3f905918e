"""The teacher role of on-policy distillation: a frozen model that scores the student's tokens.

``Teacher`` holds a model's params, loaded once (``roles.build_teacher``: the loaders the
trainer's model uses), never updated, and answers ``score(tokens, loss_mask)`` with its
per-token log-probs of the tokens (and optionally its top-k log-probs per position, for GKD).
It runs the trainer's scoring definitions (``rlax_llm.policy.log_probs``, chunked by
``rl.logprob_chunk`` with ``scoring.map_chunks``) at the student's sampling temperature over
the full vocabulary (``scoring.full_support``): the student's behaviour log-probs it is
compared with are at that temperature, so a teacher equal to the student scores every token
exactly as the student sampled it (advantage 0), and the student's model, not its
temperature-scaled sampler, is drawn to the teacher's (docs/losses.md "On-policy
distillation", "The temperature"). The controller asks it (on Ray through
``ray_actors.TeacherRole``, the actor holding it) for the scores of each gathered batch, in its
deterministic order, and puts them into the trainer's batch (``losses.distill``); weights
never move through the controller. A teacher must share the student's tokenizer: the same
vocabulary with the same ids (``check_same_tokenizer``, before any compute).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rlax_llm.models.model import Model, Params
from rlax_llm.policy import log_probs
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.tokenization import Tokenizer
from rlax_llm.trainer.scoring import Policy, full_support, map_chunks


@dataclasses.dataclass(frozen=True)
class TeacherScores:
  """The teacher's scores of a batch ``tokens [B, T]``, aligned with the tokens: position
  ``t`` scores token ``t`` (predicted from tokens ``< t``); position 0 and positions off the
  loss mask are 0.

  Attributes:
    logp: float32 ``[B, T]``, log pi_teacher(token t | tokens < t).
    top_logp: float32 ``[B, T, K]``, the teacher's ``K`` largest log-probs of the next token
      at each position, largest first; None without ``top_k``.
    top_ids: int32 ``[B, T, K]``, their token ids; None without ``top_k``.
  """

  logp: np.ndarray
  top_logp: np.ndarray | None = None
  top_ids: np.ndarray | None = None


def check_same_tokenizer(teacher: Tokenizer, student: Tokenizer, *, teacher_name: str,
                         student_name: str) -> None:
  """Raises ValueError unless ``teacher`` and ``student`` have the same vocabulary with the
  same ids (vocabulary size, special ids, and every id's text). Host-side, before any
  compute: a teacher's log-probs of another vocabulary's ids would be of other tokens."""
  problem = None
  if teacher.vocab_size != student.vocab_size:
    problem = f'vocabulary sizes differ: {teacher.vocab_size} vs {student.vocab_size}'
  else:
    for name in ('pad_id', 'bos_id', 'eos_id'):
      a, b = getattr(teacher, name), getattr(student, name)
      if a != b:
        problem = f'{name} differs: {a} vs {b}'
        break
  if problem is None:
    ids = np.arange(teacher.vocab_size, dtype=np.int32)[:, None]
    a = teacher.decode_batch(ids, stop_at_eos=False)
    b = student.decode_batch(ids, stop_at_eos=False)
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if differ:
      i = differ[0]
      problem = (f'{len(differ)} ids decode differently, e.g. id {i}: {a[i]!r} vs {b[i]!r}')
  if problem is not None:
    raise ValueError(
        f'the teacher {teacher_name} and the student {student_name} have different tokenizers '
        f'(teacher vs student: {problem}). On-policy distillation scores the student\'s token '
        'ids with the teacher, so both must share one vocabulary and its ids: choose a teacher '
        "of the student's model family.")


class Teacher:
  """A frozen model scoring token sequences (see the module docstring).

  Args:
    model: the teacher's decoder.
    params: its params (host or device arrays), copied onto ``device`` once.
    tokenizer, student_tokenizer: checked equal first (``check_same_tokenizer``).
    top_k: > 0: ``score`` also returns the teacher's top-``top_k`` log-probs per position.
    chunk: > 0: log-probs (and top-k) ``chunk`` positions at a time
      (``scoring.map_chunks``): the ``[B, T, V]`` logits are never whole.
    temperature: the student's sampling temperature (``sampling.temperature``); the teacher
      scores ``log_softmax(logits / temperature)`` over the whole vocabulary.
    device: where the params live and the forward runs (None: the default device).
    name, student_name: how messages name the two models.
  """

  def __init__(self, model: Model, params: Params, tokenizer: Tokenizer,
               student_tokenizer: Tokenizer, *, top_k: int = 0, chunk: int = 0,
               temperature: float = 1.0, device: jax.Device | None = None,
               name: str = 'teacher', student_name: str = 'student'):
    check_same_tokenizer(tokenizer, student_tokenizer, teacher_name=name,
                         student_name=student_name)
    if top_k < 0 or top_k > model.config.vocab_size:
      raise ValueError(f'top_k={top_k} must be in [0, vocab_size = {model.config.vocab_size}].')
    self.model = model
    self.top_k = top_k
    self.policy = Policy(model, full_support(SamplingSpec(temperature=temperature)))
    self.params = jax.device_put(jax.tree.map(jnp.asarray, params),
                                 device or jax.devices()[0])
    self._score = _score_program(self.policy, top_k, chunk)

  def score(self, tokens: np.ndarray, loss_mask: np.ndarray) -> TeacherScores:
    """The teacher's scores of ``tokens`` (int32 ``[B, T]``) on ``loss_mask`` (``[B, T]``,
    1 on the student's sampled tokens); see ``TeacherScores``."""
    tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
    chex.assert_rank(tokens, 2)
    chex.assert_equal_shape([tokens, loss_mask])
    out = jax.device_get(self._score(self.params, tokens.astype(np.int32),
                                     loss_mask.astype(np.float32)))
    return TeacherScores(*(None if x is None else np.asarray(x) for x in out))


@functools.lru_cache(maxsize=8)
def _score_program(policy: Policy, top_k: int, chunk: int) -> Callable[..., Any]:
  """``_score`` jitted once per (policy, top_k, chunk), each by value: teachers alike (a
  second run's) share the compiled program."""
  return jax.jit(functools.partial(_score, policy, top_k, chunk))


def _score(policy: Policy, top_k: int, chunk: int, params: Params, tokens: jax.Array,
           loss_mask: jax.Array):
  """``Teacher.score`` on the device: one forward, the lm head and log-softmax ``chunk``
  positions at a time (``scoring.map_chunks``; all at once for 0)."""
  invariant = policy.model.config.execution.batch_invariant

  def one(hidden, targets):  # [B, n, E], [B, n] -> logp [B, n] (, top-k [B, n, K] twice)
    full, _ = log_probs(policy.model.logits(params, hidden), policy.sampling,
                        invariant=invariant)
    logp = jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0]
    return (logp, *jax.lax.top_k(full, top_k)) if top_k else (logp,)

  hidden = policy.model.apply(params, tokens, features=True)[:, :-1]
  outs = (map_chunks(one, chunk, hidden, tokens[:, 1:]) if chunk > 0
          else one(hidden, tokens[:, 1:]))
  mask = loss_mask > 0
  pad = lambda x: jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))  # align with tokens
  logp = jnp.where(mask, pad(outs[0]), 0.0)
  if not top_k:
    return logp, None, None
  keep = mask[..., None]
  return (logp, jnp.where(keep, pad(outs[1]), 0.0),
          jnp.where(keep, pad(outs[2]), 0).astype(jnp.int32))
