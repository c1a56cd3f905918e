"""Data that flows between roles: requests -> rollouts -> train batches.

The controller sends ``GenerationRequest``s to an inference worker, which returns one
``Rollouts`` (struct-of-arrays, one row per sampled completion) holding everything the
trainer needs later: tokens, behaviour log-probs under the exact sampling transform, the
policy version of every token, finish reasons and timings. Verifiers fill in the rewards;
``make_train_batch`` packs scored rollouts into the padded ``[B, T]`` ``TrainBatch`` the
trainer consumes. ``WeightSnapshot`` lives with the parameter server.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from rlax_llm.model_spec import NO_ROUTE
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.tasks.base import Prompt

# 'stop': emitted eos; 'length': hit max_new_tokens; 'unfinished': generation of its batch
# stopped first (APRIL partial rollouts): continued by a later request, never scored or trained.
FINISH_REASONS = ('stop', 'length', 'unfinished')


@dataclasses.dataclass(frozen=True)
class FollowLatest:
  """The version a ``generate`` call names in free-running mode (``staleness.schedule=
  'free'``): none. The worker samples with the newest weights it holds and pulls the
  server's latest version, before the first decode step and between any two, whenever it is
  ``j`` or more versions ahead of its own; every token records the version that drew it."""

  j: int

  def __post_init__(self):
    if isinstance(self.j, bool) or not isinstance(self.j, int) or self.j < 1:
      raise ValueError(f'FollowLatest.j={self.j!r} must be an int >= 1 (staleness.j).')


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """Sample ``num_samples`` completions of ``prompt`` (its text, or its chat messages
  rendered by the model's chat template) with ``sampling``, each at most
  ``max_new_tokens`` long, ending early at the tokenizer's eos or any of
  ``stop_token_ids`` (kept in the output). The samples share one group id and one prefill.

  ``resume``: continue a group that an earlier call left unfinished (APRIL): its
  ``num_samples`` rows from that call, with their ``sample_keys``; finished rows come back as
  they were, ``'unfinished'`` ones are continued from their tokens with their own keys.
  """

  prompt: Prompt
  num_samples: int
  sampling: SamplingSpec
  max_new_tokens: int
  stop_token_ids: tuple[int, ...] = ()
  resume: 'Rollouts | None' = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    for name in ('num_samples', 'max_new_tokens'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'GenerationRequest.{name}={value!r} must be an int >= 1.')
    if self.resume is not None:
      r = self.resume
      if len(r) != self.num_samples or r.sample_keys is None:
        raise ValueError(f'GenerationRequest.resume must hold num_samples={self.num_samples} '
                         f'rows with sample_keys; got {len(r)} rows, sample_keys '
                         f'{"missing" if r.sample_keys is None else "present"}.')
      if np.any(r.prompt_ids != self.prompt.prompt_id):
        raise ValueError(f'GenerationRequest.resume rows answer prompts '
                         f'{sorted(set(r.prompt_ids.tolist()))}, not {self.prompt.prompt_id}.')


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """Sampled completions, host numpy arrays. ``B`` rows, ``P``/``N`` widths.

  Rows of one request share a ``group_id`` and are contiguous. ``rewards`` is None until a
  verifier has scored the rows (``rlax_llm.verifiers.score_rollouts``).
  """

  prompt_ids: np.ndarray  # int64 [B]
  group_ids: np.ndarray  # int32 [B]
  prompt_tokens: np.ndarray  # int32 [B, P], right-padded
  prompt_lengths: np.ndarray  # int32 [B]
  completion_tokens: np.ndarray  # int32 [B, N], pad after the end
  completion_mask: np.ndarray  # bool [B, N]: generated tokens (eos included)
  behaviour_logprobs: np.ndarray  # float32 [B, N]: log-prob under `sampling`, 0 off the mask
  support_sizes: np.ndarray  # int32 [B, N]: tokens the draw could pick (top-k/top-p support)
  versions: np.ndarray  # int32 [B, N]: policy version per token, -1 off the mask
  finish_reasons: np.ndarray  # str [B]: one of FINISH_REASONS
  completions: list[str]  # decoded text, without eos
  sampling: SamplingSpec | None  # the policy transform of the behaviour log-probs (None:
  #   the requests mixed several specs)
  timings: dict[str, float]  # the worker's figures, e.g. 'generate_s', 'tokens_per_s'
  rewards: np.ndarray | None = None  # float32 [B]
  verifier_errors: int = 0
  restarts: np.ndarray | None = None  # int32 [B]: times a sample was discarded and redone
  on_swap: str = 'continue'  # what a weight swap did to samples in flight
  sample_keys: np.ndarray | None = None  # uint32 [B, key_size]: each sample's PRNG key data
  # Rollout routing replay (a mixture of experts, ``model.routing_replay='r3'``): the experts
  # each prompt / completion token was routed to by the engine, int8 (int16 past 127
  # experts) [B, P or N, layers, k]; NO_ROUTE (-1) on padding and on each row's last token
  # (never fed to the model). None when not recorded.
  prompt_routes: np.ndarray | None = None
  completion_routes: np.ndarray | None = None

  def __len__(self) -> int:
    return len(self.prompt_ids)

  @property
  def finished(self) -> np.ndarray:
    """bool [B]: True where the completion ended with eos."""
    return self.finish_reasons == 'stop'

  @property
  def oldest_version(self) -> int | None:
    """The oldest policy version of any generated token (None: no tokens yet)."""
    drawn = self.versions[self.versions >= 0]
    return int(drawn.min()) if drawn.size else None

  @property
  def mixed_versions(self) -> np.ndarray:
    """bool [B]: True where a row's tokens were drawn by more than one version (a weight
    swap landed mid-sequence: free-running mode, or a continued partial rollout)."""
    drawn = self.versions >= 0
    low = np.where(drawn, self.versions, np.iinfo(np.int32).max).min(axis=1)
    high = np.where(drawn, self.versions, -1).max(axis=1)
    return drawn.any(axis=1) & (low != high)

  @property
  def unfinished_groups(self) -> np.ndarray:
    """The group ids (sorted) with an ``'unfinished'`` row."""
    return np.unique(self.group_ids[self.finish_reasons == 'unfinished'])

  @property
  def informative_groups(self) -> np.ndarray:
    """The group ids (sorted) whose rewards are not all equal: a learning signal under a
    group baseline (dynamic sampling keeps them, prompt replay re-asks their prompts)."""
    if self.rewards is None:
      raise ValueError('informative_groups needs rewards; score the rollouts first.')
    ids, inverse = np.unique(self.group_ids, return_inverse=True)
    low = np.full(len(ids), np.inf)
    high = np.full(len(ids), -np.inf)
    np.minimum.at(low, inverse, self.rewards)
    np.maximum.at(high, inverse, self.rewards)
    return ids[low != high]

  def select(self, rows: np.ndarray) -> 'Rollouts':
    """The rows where the bool mask ``rows`` is True (group ids kept)."""
    index = np.flatnonzero(rows)
    take = lambda a: None if a is None else a[index]
    return dataclasses.replace(
        self, prompt_ids=self.prompt_ids[index], group_ids=self.group_ids[index],
        prompt_tokens=self.prompt_tokens[index], prompt_lengths=self.prompt_lengths[index],
        completion_tokens=self.completion_tokens[index],
        completion_mask=self.completion_mask[index],
        behaviour_logprobs=self.behaviour_logprobs[index],
        support_sizes=self.support_sizes[index], versions=self.versions[index],
        finish_reasons=self.finish_reasons[index],
        completions=[self.completions[i] for i in index], rewards=take(self.rewards),
        restarts=take(self.restarts), sample_keys=take(self.sample_keys),
        prompt_routes=take(self.prompt_routes), completion_routes=take(self.completion_routes))

  # The arrays that ``to_state`` stores as arrays (the rest goes into its JSON part).
  _ARRAYS = ('prompt_ids', 'group_ids', 'prompt_tokens', 'prompt_lengths', 'completion_tokens',
             'completion_mask', 'behaviour_logprobs', 'support_sizes', 'versions', 'rewards',
             'restarts', 'sample_keys', 'prompt_routes', 'completion_routes')

  def to_state(self) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, meta)``: numeric arrays (finish reasons as indices into
    ``FINISH_REASONS``) and a JSON-safe dict of the rest; ``from_state`` inverts it exactly.
    What a checkpoint stores for in-flight rollouts (``rlax_llm.checkpoint``)."""
    arrays = {name: np.asarray(getattr(self, name)) for name in self._ARRAYS
              if getattr(self, name) is not None}
    arrays['finish_reasons'] = np.array([FINISH_REASONS.index(r) for r in self.finish_reasons],
                                        np.int8)
    meta = {'completions': list(self.completions),
            'sampling': None if self.sampling is None else dataclasses.asdict(self.sampling),
            'timings': {k: float(v) for k, v in self.timings.items()},
            'verifier_errors': int(self.verifier_errors), 'on_swap': self.on_swap}
    return arrays, meta

  @classmethod
  def from_state(cls, arrays: dict[str, np.ndarray], meta: dict) -> 'Rollouts':
    """The ``Rollouts`` that ``to_state`` was given."""
    fields = {name: np.asarray(arrays[name]) if name in arrays else None
              for name in cls._ARRAYS}
    return cls(**fields,
               finish_reasons=np.array(FINISH_REASONS)[np.asarray(arrays['finish_reasons'],
                                                                  np.int64)],
               completions=list(meta['completions']),
               sampling=None if meta['sampling'] is None else SamplingSpec(**meta['sampling']),
               timings=dict(meta['timings']), verifier_errors=meta['verifier_errors'],
               on_swap=meta['on_swap'])

  @classmethod
  def concatenate(cls, parts: 'list[Rollouts]') -> 'Rollouts':
    """Rows of ``parts`` in order; group ids renumbered 0, 1, ... by first appearance (each
    part's groups are contiguous), 2-D arrays right-padded to the widest part.
    ``sample_keys`` is kept only when every part has it (rollouts restored from a checkpoint
    written before keys were recorded have none)."""
    if len(parts) == 1:
      return parts[0]
    first = parts[0]

    def cat(name, pad):
      arrays = [getattr(p, name) for p in parts]
      if arrays[0] is None:
        return None
      if arrays[0].ndim >= 2:
        width = max(a.shape[1] for a in arrays)
        arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1])) + ((0, 0),) * (a.ndim - 2),
                         constant_values=pad) for a in arrays]
      return np.concatenate(arrays)
    groups, offset = [], 0
    for part in parts:
      ids = part.group_ids
      starts = np.r_[len(ids) > 0, ids[1:] != ids[:-1]] if len(ids) else np.zeros(0, bool)
      groups.append(np.cumsum(starts) - 1 + offset)
      offset += int(starts.sum())
    generate_s = max(p.timings.get('generate_s', 0.0) for p in parts)
    tokens = sum(int(p.completion_mask.sum()) for p in parts)
    return cls(
        prompt_ids=cat('prompt_ids', 0), group_ids=np.concatenate(groups).astype(np.int32),
        prompt_tokens=cat('prompt_tokens', 0), prompt_lengths=cat('prompt_lengths', 0),
        completion_tokens=cat('completion_tokens', 0),
        completion_mask=cat('completion_mask', False),
        behaviour_logprobs=cat('behaviour_logprobs', 0.0),
        support_sizes=cat('support_sizes', 0), versions=cat('versions', -1),
        finish_reasons=cat('finish_reasons', ''),
        completions=[c for p in parts for c in p.completions],
        sampling=first.sampling if all(p.sampling == first.sampling for p in parts) else None,
        timings={'generate_s': generate_s, 'tokens_per_s': tokens / max(generate_s, 1e-9)},
        rewards=cat('rewards', 0.0), verifier_errors=sum(p.verifier_errors for p in parts),
        restarts=cat('restarts', 0), on_swap=first.on_swap,
        sample_keys=(None if any(p.sample_keys is None for p in parts)
                     else cat('sample_keys', 0)),
        prompt_routes=(None if any(p.prompt_routes is None for p in parts)
                       else cat('prompt_routes', NO_ROUTE)),
        completion_routes=(None if any(p.completion_routes is None for p in parts)
                           else cat('completion_routes', NO_ROUTE)))


@flax.struct.dataclass
class TrainBatch:
  """Padded training arrays; position ``t`` refers to token ``t`` (predicted from ``< t``)."""

  tokens: jax.Array  # int32 [B, T]: prompt then completion, right-padded
  loss_mask: jax.Array  # float32 [B, T]: 1 on completion tokens
  behaviour_logprobs: jax.Array  # float32 [B, T]: 0 off the loss mask
  support_sizes: jax.Array  # int32 [B, T]: the sampler's support size per token, 0 off the mask
  # float32 [B] (one per row), or [B, T] (per token, aligned with ``tokens``: multi-turn
  # credit, ``losses.broadcast_turn_advantages``; 0 off the loss mask)
  advantages: jax.Array
  versions: jax.Array  # int32 [B, T]: -1 off the loss mask
  group_ids: jax.Array  # int32 [B]
  # On-policy distillation with GKD (rl.distill.kind='gkd'; trainer.teacher.TeacherScores):
  # the teacher's top-k next-token ids and log-probs at each position, aligned with ``tokens``
  # (0 off the loss mask); None when unused.
  teacher_top_ids: jax.Array | None = None  # int32 [B, T, K]
  teacher_top_logp: jax.Array | None = None  # float32 [B, T, K]
  # Rollout routing replay: the experts the engine routed each token to, int8/int16
  # [B, T, layers, k], NO_ROUTE (-1) where none was recorded; None when not replayed.
  routes: jax.Array | None = None


def make_train_batch(rollouts: Rollouts, advantages: np.ndarray) -> TrainBatch:
  """Packs each prompt with its completion into a right-padded ``[B, P + N]`` row."""
  b, p = rollouts.prompt_tokens.shape
  n = rollouts.completion_tokens.shape[1]
  if np.any(rollouts.finish_reasons == 'unfinished'):
    raise ValueError(f'rows {np.flatnonzero(rollouts.finish_reasons == "unfinished").tolist()} '
                     'are unfinished (a stopped partial rollout); continue them before '
                     'training.')
  if np.shape(advantages) != (b,):
    raise ValueError(f'advantages must be [B] = ({b},), got shape {np.shape(advantages)}.')
  length = p + n
  tokens = np.zeros((b, length), np.int32)
  loss_mask = np.zeros((b, length), np.float32)
  logps = np.zeros((b, length), np.float32)
  supports = np.zeros((b, length), np.int32)
  versions = np.full((b, length), -1, np.int32)
  routes = None
  if rollouts.prompt_routes is not None and rollouts.completion_routes is not None:
    shape = rollouts.completion_routes.shape[2:]
    routes = np.full((b, length) + shape, NO_ROUTE, rollouts.completion_routes.dtype)
  comp_len = rollouts.completion_mask.sum(axis=1)
  for i in range(b):
    lp, lc = int(rollouts.prompt_lengths[i]), int(comp_len[i])
    tokens[i, :lp] = rollouts.prompt_tokens[i, :lp]
    tokens[i, lp:lp + lc] = rollouts.completion_tokens[i, :lc]
    loss_mask[i, lp:lp + lc] = 1.0
    logps[i, lp:lp + lc] = rollouts.behaviour_logprobs[i, :lc]
    supports[i, lp:lp + lc] = rollouts.support_sizes[i, :lc]
    versions[i, lp:lp + lc] = rollouts.versions[i, :lc]
    if routes is not None:
      routes[i, :lp] = rollouts.prompt_routes[i, :lp]
      routes[i, lp:lp + lc] = rollouts.completion_routes[i, :lc]
  return TrainBatch(tokens=tokens, loss_mask=loss_mask, behaviour_logprobs=logps,
                    support_sizes=supports, advantages=np.asarray(advantages, np.float32), versions=versions,
                    group_ids=np.asarray(rollouts.group_ids, np.int32), routes=routes)


# Why an episode ended (rlax_llm.rollout.episodes): the environment said done; it reached its
# turn limit; its wall-clock timeout passed; its prompt or conversation no longer fit the
# context; its environment raised (rewards 0); an agent harness ended it without a reward
# (rlax_llm.serve.harness_runner; reward 0).
TERMINATIONS = ('done', 'turn_limit', 'timeout', 'context_full', 'env_error', 'no_reward')


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """One multi-turn episode, token-faithful: the ids exactly as the model was fed them
  (prompt, each turn's sampled ids, the environment's ids between turns), host numpy
  arrays. ``T`` tokens, ``N`` turns. A single-turn rollout is a one-turn trajectory.

  Turn ``n``'s model tokens are ``tokens[turn_starts[n]:turn_ends[n]]``; what lies outside
  the turns is prompt or environment text (loss mask 0). ``state_ids[n]`` identifies the
  environment state turn ``n`` acted in (``episodes.state_id`` of ``env.state_key()``:
  stable across processes), for GiGPO's step groups; ``turn_mask[n]`` is False for a turn
  whose environment step did not complete (it raised or timed out, or the turn was cut).
  """

  episode_id: int
  group_id: int
  prompt_id: int
  tokens: np.ndarray  # int32 [T]
  loss_mask: np.ndarray  # bool [T]: True on the model's sampled tokens
  behaviour_logprobs: np.ndarray  # float32 [T]: 0 off the loss mask
  support_sizes: np.ndarray  # int32 [T]: 0 off the loss mask
  versions: np.ndarray  # int32 [T]: policy version per model token, -1 elsewhere
  token_turn: np.ndarray  # int32 [T]: turn index per model token, -1 elsewhere
  turn_starts: np.ndarray  # int32 [N]
  turn_ends: np.ndarray  # int32 [N] (exclusive)
  turn_rewards: np.ndarray  # float32 [N]
  turn_mask: np.ndarray  # bool [N]
  state_ids: np.ndarray  # int64 [N]
  episode_return: float
  termination: str  # one of TERMINATIONS
  texts: tuple[str, ...] = ()  # each turn's decoded action text
  success: bool = False  # the last step's info['success']: the episode reached its goal
  # Rollout routing replay: the experts the engine routed each token to (prompt, sampled and
  # observation tokens alike), int8/int16 [T, layers, k], NO_ROUTE where none (the last
  # token); None when not recorded.
  routes: np.ndarray | None = None

  def __post_init__(self):
    t, n = len(self.tokens), len(self.turn_starts)
    if self.routes is not None and len(self.routes) != t:
      raise ValueError(f'Trajectory.routes has {len(self.routes)} entries for {t} tokens.')
    for name in ('loss_mask', 'behaviour_logprobs', 'support_sizes', 'versions', 'token_turn'):
      if len(getattr(self, name)) != t:
        raise ValueError(f'Trajectory.{name} has {len(getattr(self, name))} entries for '
                         f'{t} tokens.')
    for name in ('turn_ends', 'turn_rewards', 'turn_mask', 'state_ids'):
      if len(getattr(self, name)) != n:
        raise ValueError(f'Trajectory.{name} has {len(getattr(self, name))} entries for '
                         f'{n} turns.')
    if self.termination not in TERMINATIONS:
      raise ValueError(f'Trajectory.termination={self.termination!r} is not one of '
                       f'{TERMINATIONS}.')

  @property
  def num_turns(self) -> int:
    return len(self.turn_starts)


@dataclasses.dataclass(frozen=True)
class TrajectoryBatch:
  """Trajectories as the trainer's rows (``train``, the ``TrainBatch`` the existing losses
  consume) plus their turn structure, right-padded: ``B`` rows, ``T`` tokens, ``N`` turns."""

  train: TrainBatch
  token_turn: np.ndarray  # int32 [B, T]: turn index per model token, -1 elsewhere
  turn_rewards: np.ndarray  # float32 [B, N]: 0 past a row's turns
  turn_mask: np.ndarray  # bool [B, N]: False past a row's turns
  state_ids: np.ndarray  # int64 [B, N]
  episode_returns: np.ndarray  # float32 [B]


def make_trajectory_batch(trajectories: list[Trajectory], advantages: np.ndarray,
                          length: int | None = None, turns: int | None = None
                          ) -> TrajectoryBatch:
  """Packs trajectories into right-padded rows: ``[B, length]`` tokens (default: the
  longest) and ``[B, turns]`` turn arrays (default: the most turns). ``advantages``:
  float ``[B]`` (trajectory level, e.g. GRPO over episode returns). The loss mask is the
  trajectory's (model tokens only), so prompt, environment and padding tokens never train.
  Raises ValueError when a trajectory is longer than ``length`` or has more turns than
  ``turns``."""
  b = len(trajectories)
  if np.shape(advantages) != (b,):
    raise ValueError(f'advantages must be [B] = ({b},), got shape {np.shape(advantages)}.')
  width = max([len(x.tokens) for x in trajectories] + [1]) if length is None else length
  n = max([x.num_turns for x in trajectories] + [1]) if turns is None else turns
  tokens = np.zeros((b, width), np.int32)
  loss_mask = np.zeros((b, width), np.float32)
  logps = np.zeros((b, width), np.float32)
  supports = np.zeros((b, width), np.int32)
  versions = np.full((b, width), -1, np.int32)
  token_turn = np.full((b, width), -1, np.int32)
  turn_rewards = np.zeros((b, n), np.float32)
  turn_mask = np.zeros((b, n), bool)
  state_ids = np.zeros((b, n), np.int64)
  routes = None
  if trajectories and all(x.routes is not None for x in trajectories):
    first = trajectories[0].routes
    routes = np.full((b, width) + first.shape[1:], NO_ROUTE, first.dtype)
  for i, x in enumerate(trajectories):
    t, k = len(x.tokens), x.num_turns
    if t > width or k > n:
      raise ValueError(f'trajectory {i} has {t} tokens and {k} turns; the batch holds '
                       f'length={width} and turns={n}.')
    tokens[i, :t] = x.tokens
    loss_mask[i, :t] = x.loss_mask
    logps[i, :t] = x.behaviour_logprobs
    supports[i, :t] = x.support_sizes
    versions[i, :t] = x.versions
    token_turn[i, :t] = x.token_turn
    turn_rewards[i, :k] = x.turn_rewards
    turn_mask[i, :k] = x.turn_mask
    state_ids[i, :k] = x.state_ids
    if routes is not None:
      routes[i, :t] = x.routes
  train = TrainBatch(tokens=tokens, loss_mask=loss_mask, behaviour_logprobs=logps,
                     support_sizes=supports, advantages=np.asarray(advantages, np.float32),
                     versions=versions,
                     group_ids=np.asarray([x.group_id for x in trajectories], np.int32),
                     routes=routes)
  return TrajectoryBatch(train=train, token_turn=token_turn, turn_rewards=turn_rewards,
                         turn_mask=turn_mask, state_ids=state_ids,
                         episode_returns=np.asarray([x.episode_return for x in trajectories],
                                                    np.float32))
