"""The policy, defined once: model logits -> the distribution that samples and is trained.

The sampling transform (temperature, then top-k, then top-p truncation) is part of the policy
(docs/architecture.md "One policy"). The inference worker samples from it and records each token's
behaviour log-prob under it; the trainer recomputes log-probs of the same tokens through the
very same functions here. On-policy (same params) the two agree to float rounding, so the
importance ratio is 1 and off-policy corrections (PPO clip, M2PO, TIS/MIS) measure only real
policy change.

What truncation means for the trained policy
--------------------------------------------
With logits ``z``, temperature ``T``, and the kept set ``K(z)`` (the ``top_k`` largest scaled
logits, then the smallest prefix of those, by probability, whose mass reaches ``top_p``), the
policy is the truncated, renormalised distribution

    pi(a) = exp(z_a / T) / sum_{b in K(z)} exp(z_b / T)   for a in K(z),  0 otherwise.

* **Behaviour log-probs** are ``log pi(a)`` of the sampled token, under the params that
  sampled it (``sample``).
* **Trainer log-probs** are the same formula under the trainer's params
  (``token_log_probs``). A trainer that used the plain ``log_softmax(z / T)`` instead would see
  ``log r = log S`` on-policy, where ``S = sum_{b in K} softmax(z / T)_b < 1`` is the kept mass:
  the known bias of naive renormalisation (TRL #6789), which biases every ratio-based loss.
* **The support travels with the rollout.** The sampler records the size ``|K|`` of the
  support each token was drawn from; the trainer takes ``K`` = the ``|K|`` largest logits
  under its params. Recomputing the top-p decision instead is fragile: the trainer's logits
  differ from the sampler's by float rounding (another program computes them), and a token
  whose cumulative mass sits at the top-p threshold then falls on the other side, changing
  the normaliser of its position by that token's mass (a 0.9% ratio error on a random model
  at temperature 1.3 and top-p 0.9 in our tests). The log-sum-exp over the ``|K|`` largest
  logits is continuous in the logits, so on-policy the ratio is 1 up to rounding. Off-policy
  the current policy is evaluated with the support size the behaviour policy used.
* **Tokens outside the support.** Off-policy, a token sampled under old params may fall
  outside ``K(z)`` of the new params, where ``pi(a) = 0`` and ``log pi(a) = -inf``. We
  score such a token with the same normaliser, ``z_a / T - log sum_{b in K(z)} exp(z_b / T)``:
  equal to ``log pi(a)`` for every token in the support, finite and below every kept token's
  log-prob outside it, and continuous at the support boundary (a token that crosses the top-p
  threshold by a rounding error does not make the ratio jump to 0). Losses therefore never see
  ``-inf``/NaN; the ratio of such a token is small, so clipping or M2PO masking handles it as
  a far-off-policy token. ``token_log_probs`` also returns whether each token is in the
  support; the trainer logs the fraction outside as ``policy/out_of_support_fraction``.
* **Temperature 0** is greedy decoding, a point mass (behaviour log-prob exactly 0). It is
  valid for evaluation and refused for rollouts (``SamplingSpec.check_for_rollouts``): every
  sample of a group would be identical, every group advantage 0, and RL would learn nothing.

References: Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p),
arXiv 1904.09751; Fan et al., "Hierarchical Neural Story Generation" (top-k),
arXiv 1805.04833.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rlax_llm.models.numerics import invariant_max, invariant_sum
from rlax_llm.sampling_spec import SamplingSpec

# Prefix lengths of the sorted logits tried, in order, when the kept set needs the largest
# logits in order (top-p, or a recorded support size without top-k); a row that no prefix
# decides gets its threshold from ``_bisect`` instead of a sort of the vocabulary. None by
# default. SmolLM2 (49k logits), 32 slots, sampled rollouts against the earlier ladder
# (256, 1024, 4096, then a sort): at temperature 1.0 and top-p 0.95 bisecting every step
# ran at 1.11x its rate and the 256-prefix first at 0.97x (the nucleus is longer than 256
# tokens at 14% of positions, so at 32 rows almost every step needs more); at temperature
# 0.7 and top-p 0.9 (every nucleus seen <= 181 tokens), 0.92x and 0.98x. A top-k cut's
# values are always the first prefix. benchmarks/RESULTS.md, "The sampler's cut".
SORTED_PREFIXES: tuple[int, ...] = ()
BISECTION_STEPS = 32  # one per bit of a float32: the search always ends on a logit
# argmax: the entries per block (its docstring).
ARGMAX_BLOCK = 256


def _prefix_lengths(vocab: int, top_k: int) -> list[int]:
  """The ascending prefix lengths ``_in_sorted_prefixes`` tries: ``top_k`` (if it truncates),
  then the ``SORTED_PREFIXES`` above it and below ``vocab``."""
  first = [top_k] if 0 < top_k < vocab else []
  return first + [n for n in SORTED_PREFIXES if max(first, default=0) < n < vocab]


def _largest(x: jax.Array, n: int) -> jax.Array:
  """The ``n`` largest entries of each row of ``x [..., V]``, in descending order."""
  return jax.lax.top_k(x, n)[0]


def _in_sorted_prefixes(solve, lengths: list[int], search):
  """The kept set's threshold ``[..., 1]`` from the shortest prefix that decides every row.

  ``solve(n)`` -> ``(threshold, decided bool [...])`` from the ``n`` largest logits of each
  row; ``search()`` -> the threshold of every row without ordering its logits
  (``_bisect``). Tries ``lengths`` in order and stops at the first that decides every row;
  rows the last prefix leaves undecided take ``search()``'s threshold, the others keep the
  prefix's. A row decided by a prefix gets the same threshold from any longer one, so a
  row's threshold never depends on the rows beside it. ``lax.cond`` runs only the branch
  taken; called on a whole batch, not under ``vmap`` (where ``cond`` runs every branch).
  """
  if not lengths:
    return search()
  threshold, decided = solve(lengths[0])
  rest = (lambda: _in_sorted_prefixes(solve, lengths[1:], search)) if len(lengths) > 1 else (
      lambda: jnp.where(decided[..., None], threshold, search()))
  return jax.lax.cond(jnp.all(decided), lambda: threshold, rest)


def _order_keys(x: jax.Array) -> jax.Array:
  """uint32 keys that order like the float32 values ``x`` (``-0.0`` just below ``0.0``)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _bisect(x: jax.Array, holds) -> jax.Array:
  """The largest entry ``t`` of each row of ``x`` (float32 ``[..., V]``) such that
  ``holds(x >= t)`` (bool ``[..., V]`` -> bool ``[...]``), as ``[..., 1]``; the smallest
  entry if ``holds`` is false even for the whole row. ``holds`` must be monotone (true for a
  set, true for every larger one).

  A bisection over the float32 order (``_order_keys``), ``BISECTION_STEPS`` passes over the
  row, each an elementwise compare and a sum: no sort. Rows are independent.
  """
  keys = _order_keys(x)
  lo = jnp.min(keys, axis=-1, keepdims=True)
  hi = jnp.max(keys, axis=-1, keepdims=True)

  def step(_, bounds):
    lo, hi = bounds
    half = hi - lo
    mid = lo + (half >> 1) + (half & 1)  # above lo while lo < hi
    ok = holds(keys >= mid)[..., None]
    searching = lo < hi
    return (jnp.where(searching & ok, mid, lo),
            jnp.where(searching & ~ok, mid - jnp.uint32(1), hi))

  lo, _ = jax.lax.fori_loop(0, BISECTION_STEPS, step, (lo, hi))
  return jnp.min(jnp.where(keys >= lo, x, jnp.inf), axis=-1, keepdims=True)


def _nucleus(mass_before: jax.Array, top_p: float) -> jax.Array:
  """bool ``[..., n]``: the positions (in descending order) before the first whose mass
  before reaches ``top_p``. A prefix even where rounding makes the running mass dip by an
  ulp after that position, so a longer prefix of the sorted logits never keeps more."""
  return jnp.cumsum(mass_before >= top_p, axis=-1) == 0


def _top_p_threshold(masked: jax.Array, top_p: float, lengths: list[int],
                     invariant: bool, active: jax.Array | None,
                     top_k_values: jax.Array | None = None) -> jax.Array:
  """The smallest scaled logit the top-p cut keeps, ``[..., 1]``.

  ``masked``: float32 ``[..., V]`` scaled logits, ``-inf`` outside the top-k set. In
  descending order, a token is kept while the mass before it is ``< top_p``. The mass
  before each position is summed prefix by prefix (``lengths``' boundaries), so a position
  gets the same float value from every prefix that holds it, and a row's kept set does not
  depend on which prefix length its batch needed. Rows where ``active`` (bool ``[...]``)
  is False never make the batch take a longer prefix (their threshold is then any value).
  ``top_k_values``: the top-k cut's ``lax.top_k`` values, the first prefix (not ranked
  again). A row no prefix decides keeps its smallest superlevel set of mass ``>= top_p``
  (``_bisect``): the same set, up to the rounding of the mass at the boundary.
  """
  row_sum = invariant_sum if invariant else (lambda x: jnp.sum(x, axis=-1, keepdims=True))
  top = invariant_max(masked) if invariant else jnp.max(masked, axis=-1, keepdims=True)
  exps = jnp.exp(masked - top)
  total = row_sum(exps)
  finite = jnp.sum(masked > -jnp.inf, axis=-1)

  def solve(n):
    given = top_k_values is not None and top_k_values.shape[-1] == n
    values = top_k_values if given else _largest(masked, n)
    probs = jnp.exp(values - top) / total
    parts, carry, lo = [], jnp.zeros_like(total), 0
    for hi in [b for b in lengths if b <= n]:
      chunk = probs[..., lo:hi]
      running = jnp.cumsum(chunk, axis=-1)
      parts.append(carry + (running - chunk))
      carry, lo = carry + running[..., -1:], hi
    keep = _nucleus(jnp.concatenate(parts, axis=-1), top_p)
    threshold = jnp.min(jnp.where(keep, values, jnp.inf), axis=-1, keepdims=True)
    decided = ~keep[..., -1] | (finite <= n)
    return threshold, decided if active is None else decided | ~active

  def search():
    probs = exps / total
    return _bisect(masked, lambda kept: row_sum(jnp.where(kept, probs, 0.0))[..., 0] >= top_p)

  return _in_sorted_prefixes(solve, lengths, search)


def transform_logits(logits: jax.Array, spec: SamplingSpec,
                     support_size: jax.Array | None = None, *, invariant: bool = False,
                     active: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Temperature scaling and the kept set.

  Args:
    logits: float ``[..., V]`` raw model logits.
    spec: a non-greedy ``SamplingSpec``.
    support_size: optional int ``[...]``: keep exactly the ``support_size`` largest scaled
      logits (ties kept) instead of deciding top-k/top-p from these logits (see
      ``token_log_probs``). Ignored when ``spec`` does not truncate.
    invariant: the top-p cut's max and sum over the vocabulary are ``invariant_max`` and
      ``invariant_sum`` (``log_probs``).
    active: optional bool ``[...]``, the rows whose kept set matters (an engine's busy
      slots): the others get one too, which may be wider than their top-p cut, but never
      make the batch look past the shortest prefix of its logits (below). None: every row.
  Returns:
    ``(scaled float32 [..., V], kept bool [..., V])``: ``logits / T`` (for ``T < 1``,
    ``(logits - max) / T``: dividing by ``T < 1`` magnifies the logits and their rounding,
    which gave log-probs of +0.1 at ``T = 1e-6``; shifted, each row's largest is exactly 0
    and no log-prob is positive. ``T >= 1`` magnifies nothing and keeps the plain
    division, so runs at ``T = 1`` round as they always did) and the support
    ``K`` (top-k first, then top-p over the top-k-renormalised distribution; ties at a
    threshold are kept).

  Neither sorts the vocabulary: top-k alone takes the k-th largest; top-p within a top-k
  set cuts the top-k values in order; top-p without top-k (and a recorded support size)
  bisects over the logits' float order (``_bisect``), after the ``SORTED_PREFIXES`` (none
  by default) when some row needs more. Call it on a whole batch rather than under
  ``vmap``, which would run every prefix and the bisection for every row.
  """
  if spec.greedy:
    raise ValueError('transform_logits needs temperature > 0; greedy decoding has no '
                     'log-probs to train on.')
  scaled = logits.astype(jnp.float32)
  if spec.temperature < 1.0:
    largest = invariant_max(scaled) if invariant else jnp.max(scaled, axis=-1, keepdims=True)
    scaled = scaled - jax.lax.stop_gradient(largest)
  scaled = scaled / spec.temperature
  vocab = scaled.shape[-1]
  lengths = _prefix_lengths(vocab, spec.top_k)
  if support_size is not None and spec.truncates:
    size = jnp.clip(support_size, 1, vocab).astype(jnp.int32)[..., None]
    if 0 < spec.top_k < vocab:  # top-p keeps a prefix of the top k (ties at the k-th kept)
      size = jnp.minimum(size, spec.top_k)
    kth = _in_sorted_prefixes(
        lambda n: (jnp.take_along_axis(_largest(scaled, n), jnp.minimum(size, n) - 1, axis=-1),
                   size[..., 0] <= n), lengths,
        lambda: _bisect(scaled, lambda kept: jnp.sum(kept, axis=-1) >= size[..., 0]))
    return scaled, scaled >= kth
  kept, top_k_values = jnp.ones(scaled.shape, bool), None
  if 0 < spec.top_k < vocab:
    # The k-th largest as the min of the top k: XLA:CPU rewrites a slice of top_k's values
    # into a slice of a full sort (320 ms instead of 3 ms at [32, 49152]).
    top_k_values = jax.lax.top_k(scaled, spec.top_k)[0]
    kept = scaled >= jnp.min(top_k_values, axis=-1, keepdims=True)
  if spec.top_p < 1.0:
    masked = jnp.where(kept, scaled, -jnp.inf)
    threshold = _top_p_threshold(masked, spec.top_p, lengths, invariant, active,
                                 top_k_values)
    kept = kept & (scaled >= threshold)
  return scaled, kept


def log_probs(logits: jax.Array, spec: SamplingSpec, support_size: jax.Array | None = None,
              *, invariant: bool = False, active: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array]:
  """Log-probs of every token under the policy (see the module docstring).

  ``invariant``: the normaliser's max and sum over the vocabulary are ``invariant_max`` and
  ``invariant_sum`` (fixed trees of elementwise ops) instead of reductions, which XLA fused
  one way into a decode step and another into a trainer batch, rounding differently (the
  model's ``batch_invariant`` numerics). ``active``: as in ``transform_logits``.

  Returns ``(logp float32 [..., V], kept bool [..., V])``; ``logp`` is the truncated
  log-prob on ``kept`` and the same normaliser's finite extension elsewhere.
  """
  scaled, kept = transform_logits(logits, spec, support_size, invariant=invariant,
                                  active=active)
  masked = jnp.where(kept, scaled, -jnp.inf)
  if invariant:
    largest = jax.lax.stop_gradient(invariant_max(masked))
    normaliser = largest + jnp.log(invariant_sum(jnp.exp(masked - largest)))
  else:
    normaliser = jax.nn.logsumexp(masked, axis=-1, keepdims=True)
  return scaled - normaliser, kept


def token_log_probs(logits: jax.Array, tokens: jax.Array, spec: SamplingSpec,
                    support_size: jax.Array | None = None, *, invariant: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
  """Log-prob of each given token under the policy.

  Args:
    logits: float ``[..., V]``; ``tokens``: int ``[...]`` (the tokens these logits predict).
    spec: the policy's sampling transform.
    support_size: optional int ``[...]``, the support size the sampler recorded for each
      token. With it the support is the ``support_size`` largest logits, whose normaliser
      is continuous in the logits; without it top-k/top-p are decided from these logits,
      and a rounding difference that moves a token across the top-p threshold shifts every
      log-prob of the position (see the module docstring).
    invariant: batch-invariant normaliser (``log_probs``).
  Returns:
    ``(logp float32 [...], in_support bool [...])``.
  """
  chex.assert_equal_shape_prefix([logits, tokens], tokens.ndim)
  logp, kept = log_probs(logits, spec, support_size, invariant=invariant)
  index = tokens[..., None].astype(jnp.int32)
  return (jnp.take_along_axis(logp, index, axis=-1)[..., 0],
          jnp.take_along_axis(kept, index, axis=-1)[..., 0])


def _first_max(x: jax.Array, axis: int = -1) -> jax.Array:
  """The first index of the largest entry along ``axis`` (a NaN counts as the largest), as
  a max and a min: two reductions XLA vectorises."""
  axis = axis % x.ndim
  largest = jnp.max(x, axis=axis, keepdims=True)
  hit = (x == largest) | jnp.isnan(x)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.min(jnp.where(hit, index, x.shape[axis]), axis=axis)


def argmax(x: jax.Array, *, block: int = ARGMAX_BLOCK, vocab_major: bool = False
           ) -> jax.Array:
  """``jnp.argmax(x, axis=-1)``, equal in every case (the first index of the largest entry;
  a NaN counts as the largest): float ``[..., V]`` -> int32 ``[...]``.

  In blocks of ``block`` entries: each block's maximum, the first block holding the row's
  (``_first_max``), then the first maximum inside that block; a vocabulary that is not a
  multiple of ``block`` is padded with ``-inf`` (never before a real entry). The max-then-min
  form over the whole row writes an int32 index array the size of ``x``: after the 49k-token
  lm head of 32 rows, 3.4 ms on XLA:CPU against 1.2 ms in blocks (head and argmax alone);
  the batch-32 rollout benchmark's workload ran 1.03x faster (benchmarks/RESULTS.md,
  engine section). ``jnp.argmax`` (one variadic reduction, element by element on XLA:CPU)
  is slower than both.

  ``vocab_major`` (``x`` ``[B, V]`` only): ``x`` is the transpose of a ``[V, B]`` array, as
  the logits of ``head_logits`` are when ``head_is_vocab_major`` (a decode step's head on
  XLA:CPU). The blocks are then taken along the vocabulary axis of ``x.T``, which reads the
  array as the product wrote it; the row-wise blocks would first copy it to ``[B, V]``.
  Same result either way; only the speed differs (benchmarks/RESULTS.md, engine section).
  """
  if block < 1:
    raise ValueError(f'argmax block must be a positive number of entries, got {block}.')
  if vocab_major and x.ndim != 2:
    raise ValueError(f'argmax(vocab_major=True) takes [B, V] logits, got shape {x.shape}.')
  axis = 0 if vocab_major else x.ndim - 1  # the vocabulary axis of y
  y = x.T if vocab_major else x
  vocab = y.shape[axis]
  if vocab <= 2 * block:
    return _first_max(y, axis)
  blocks = -(-vocab // block)
  if blocks * block != vocab:
    pad = [(0, 0)] * y.ndim
    pad[axis] = (0, blocks * block - vocab)
    y = jnp.pad(y, pad, constant_values=-jnp.inf)
  y = y.reshape(y.shape[:axis] + (blocks, block) + y.shape[axis + 1:])
  # XLA:CPU's max does not always propagate a NaN, so a block holding one scores NaN here.
  scores = jnp.where(jnp.any(jnp.isnan(y), axis=axis + 1), jnp.nan,
                     jnp.max(y, axis=axis + 1))  # [..., blocks] or [blocks, B]
  first = _first_max(scores, axis)
  piece = jnp.take_along_axis(y, jnp.expand_dims(first, (axis, axis + 1)), axis=axis)
  piece = jnp.squeeze(piece, axis)  # the first top block: [..., block] or [block, B]
  return first * block + _first_max(piece, axis)


def sample(logits: jax.Array, rng: jax.Array, spec: SamplingSpec, *, invariant: bool = False,
           vocab_major: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one token per row and returns its behaviour log-prob and support size.

  Args:
    logits: float ``[B, V]`` raw model logits.
    rng: a PRNG key.
    spec: the sampling transform; greedy takes the argmax with log-prob 0 (a point mass).
    invariant: batch-invariant normaliser (``log_probs``).
    vocab_major: the logits' layout, for greedy's ``argmax`` (the same tokens either way).
  Returns:
    ``(tokens int32 [B], logp float32 [B], support_size int32 [B])``: the support size is
    how many tokens the draw could have picked (what the trainer's ``token_log_probs``
    takes to reproduce this distribution; 1 for greedy).
  """
  if spec.greedy:
    tokens = argmax(logits, vocab_major=vocab_major)
    return tokens, jnp.zeros(tokens.shape, jnp.float32), jnp.ones(tokens.shape, jnp.int32)
  logp, kept = log_probs(logits, spec, invariant=invariant)
  return _draw(logp, kept, jax.random.gumbel(rng, logp.shape, logp.dtype))


def _draw(logp: jax.Array, kept: jax.Array, noise: jax.Array
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """jax.random.categorical's Gumbel-max draw from ``logp [B, V]`` restricted to ``kept``
  (the same tokens for the same Gumbel ``noise [B, V]``), with the faster ``argmax``."""
  masked = jnp.where(kept, logp, -jnp.inf)
  tokens = argmax(noise + masked)
  return (tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0],
          kept.sum(-1).astype(jnp.int32))


def sample_rows(logits: jax.Array, keys: jax.Array, spec: SamplingSpec, *,
                invariant: bool = False, active: jax.Array | None = None,
                vocab_major: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``sample`` with one PRNG key per row: row ``b`` draws with ``keys[b]`` alone, so its
  token does not depend on which other rows share the batch (continuous batching).

  The transform runs on the whole batch (``transform_logits``: its prefix ladder is a
  ``lax.cond`` per batch, which ``vmap`` would turn into running every branch); only the
  noise is drawn row by row, ``[1, V]`` per key as ``sample(logits[b:b + 1], keys[b])``.
  The noise does not depend on the logits, so XLA can draw it while the model runs.

  Args:
    logits: float ``[B, V]``; keys: ``[B]`` PRNG keys; invariant: as in ``sample``.
    active: optional bool ``[B]``, the rows whose draw is used (``transform_logits``).
    vocab_major: as in ``sample`` (greedy only).
  Returns:
    ``(tokens int32 [B], logp float32 [B], support_size int32 [B])``.
  """
  if spec.greedy:
    return sample(logits, keys[0], spec, vocab_major=vocab_major)
  logp, kept = log_probs(logits, spec, invariant=invariant, active=active)
  return _draw(logp, kept, jax.vmap(
      lambda key: jax.random.gumbel(key, (1,) + logp.shape[1:], logp.dtype)[0])(keys))


def entropy(logits: jax.Array, spec: SamplingSpec, support_size: jax.Array | None = None
            ) -> jax.Array:
  """Entropy of the policy distribution per position: float ``[..., V]`` -> float32 ``[...]``."""
  logp, kept = log_probs(logits, spec, support_size)
  return -jnp.sum(jnp.where(kept, jnp.exp(logp) * logp, 0.0), axis=-1)
