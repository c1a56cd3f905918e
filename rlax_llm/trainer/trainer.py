"""The trainer: a sharded train state and one jitted update step.

Params live on a ``Mesh`` with ``NamedSharding``s derived from the model's logical axes
(``rlax_llm.sharding``); the optimizer state follows the params' shardings; each batch is
sharded along ``batch`` over ``('data', 'fsdp')``. The step is
``jax.jit(value_and_grad(objective) -> optax update)`` with the params and optimizer state
donated, so an update happens in place on device.

Non-finite updates are never applied: when the loss, the gradient norm or any updated
parameter is NaN/Inf, the step keeps the previous params and optimizer state and reports
``update/skipped = 1``. After ``max_nonfinite_updates`` skipped updates in a row the trainer
raises ``NonFiniteError``: a run whose updates have diverged stops instead of carrying on.

Trainers alike share their programs: the jitted step (and the placement and optimizer-state
init) is made once per value key, ``(model, mesh, rules, optimizer, objective, micro_batches,
totals_fn, trainable)`` (``_programs``), so a second trainer of the same run in one process (a
new run, a sweep, an evaluation then training) traces, lowers and compiles nothing. The model
compares by value (``models.model.Model``); an objective built with ``Bound`` and an
optimizer from ``make_optimizer`` do too, while any other callable is its own key (no
sharing, never a wrong program).

Versions count applied updates: after ``n`` applied updates the params are version ``n``
(docs/architecture.md "Versions and staleness"); a skipped update does not make a new version.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from rlax_llm.errors import NonFiniteError
from rlax_llm import sharding as sharding_lib
from rlax_llm.models.model import Model, Params

# ``objective(params, batch, reference_params, totals=None) -> (loss, metrics)``; ``totals``
# (whole-batch normalisers, ``rlax_llm.losses.Totals``) is passed only with micro-batches.
Objective = Callable[..., tuple[jax.Array, dict[str, Any]]]


class Bound(functools.partial):
  """``functools.partial`` equal to another (and hashed alike) when its function, arguments
  and keywords are equal (``functools.partial`` compares by identity): an objective bound to
  the same settings twice, e.g. ``Bound(rl_objective, policy, loss, logprob_chunk=0)``, is
  the same objective, so the trainers given them share their compiled step. Every argument
  must be hashable by value (models, policies, frozen configs, numbers)."""

  def __eq__(self, other: object) -> bool:
    return type(other) is type(self) and (self.func, self.args, self.keywords) == (
        other.func, other.args, other.keywords)

  def __hash__(self) -> int:
    return hash((self.func, self.args, tuple(sorted(self.keywords.items()))))


@functools.lru_cache(maxsize=64)
def learning_rate_schedule(learning_rate: float, decay_steps: int = 0
                           ) -> float | optax.Schedule:
  """The RL learning rate: constant for ``decay_steps == 0``, else a cosine decay from
  ``learning_rate`` to a tenth of it over ``decay_steps`` optimizer updates, then flat (an
  update skipped for non-finite gradients or an empty batch does not advance it). One object
  per settings (memoised), so optimizers built on it compare equal (``make_optimizer``)."""
  if decay_steps == 0:
    return learning_rate
  return optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=0.1)


@functools.lru_cache(maxsize=64)
def make_optimizer(learning_rate: float | optax.Schedule, *, b1: float = 0.9, b2: float = 0.99,
                   weight_decay: float = 0.0, max_grad_norm: float = 1.0
                   ) -> optax.GradientTransformation:
  """AdamW with global-norm gradient clipping (``max_grad_norm <= 0`` disables clipping).

  Memoised: the same settings (a schedule: the same object) give the same transformation,
  so trainers built with equal settings share their compiled step (``Trainer``); optax
  transformations hold no state, so sharing one is safe."""
  parts = []
  if max_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(max_grad_norm))
  parts.append(optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts)


class Trainer:
  """Holds ``(params, opt_state)`` on a mesh and applies ``objective`` updates.

  Args:
    model: the decoder (static); gives the params' shapes and logical axes.
    params: initial params (host or device arrays); placed onto ``mesh``.
    optimizer: an optax transformation.
    objective: ``(params, batch, reference_params) -> (loss, metrics)``.
    mesh: the trainer's mesh (axes ``data``, ``fsdp``, ``tensor``).
    reference_params: optional params passed to the objective and never updated (the KL
      reference policy); sharded like ``params``.
    max_nonfinite_updates: consecutive skipped (non-finite) updates before ``step`` raises.
    micro_batches: split each batch into this many micro-batches and accumulate their
      gradients (one optimizer update per batch): the activation memory of one step is that
      of ``B / micro_batches`` rows. The loss and gradient equal the whole batch's to float
      rounding, because each micro-batch's loss is normalised by ``totals_fn(batch)`` (the
      whole batch's token/sequence counts) and the shares are summed; other metrics are the
      mean over micro-batches. Rows are dealt out strided (row ``r`` goes to micro-batch
      ``r % micro_batches``), so every micro-batch stays spread over the data-parallel devices.
    totals_fn: ``batch -> losses.Totals``; needed when ``micro_batches > 1``.
    check_batch: optional host-side ``batch -> None`` that raises on a batch the objective
      cannot score (e.g. ``objectives.check_windows``), before any compute.
    trainable: optional params-shaped tree of bools (e.g. ``lora.trainable_mask``): only
      the True leaves are differentiated, updated and given optimizer state; the others stay
      frozen (bitwise). None: every param trains.
    rules: logical-axis rules.
  """

  def __init__(self, model: Model, params: Params, optimizer: optax.GradientTransformation,
               objective: Objective, mesh: Mesh, *, reference_params: Params | None = None,
               max_nonfinite_updates: int = 3, micro_batches: int = 1,
               totals_fn: Callable[[Any], Any] | None = None,
               check_batch: Callable[[Any], None] | None = None,
               trainable: Params | None = None,
               rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES):
    if max_nonfinite_updates < 1:
      raise ValueError(f'max_nonfinite_updates={max_nonfinite_updates} must be >= 1.')
    if micro_batches < 1:
      raise ValueError(f'micro_batches={micro_batches} must be >= 1.')
    if micro_batches > 1 and totals_fn is None:
      raise ValueError(f'micro_batches={micro_batches} needs totals_fn (the whole batch\'s '
                       'loss normalisers, e.g. objectives.loss_totals); without it each '
                       'micro-batch would be normalised by its own counts.')
    self.micro_batches = micro_batches
    self.objective = objective
    self.check_batch = check_batch
    self.model = model
    self.mesh = mesh
    self.rules = rules
    self.max_nonfinite_updates = max_nonfinite_updates
    key = (model, mesh, _hashable_rules(rules), optimizer, objective, micro_batches, totals_fn,
           _mask_key(trainable))
    try:
      hash(key)
    except TypeError:  # e.g. a Bound objective with an unhashable argument: not shared
      programs = _programs.__wrapped__(*key)
    else:
      programs = _programs(*key)
    self.param_shardings = programs.param_shardings
    # Param-shaped optimizer leaves (moments) are sharded like their params; the rest
    # (step counts) is replicated on the mesh.
    # (Kept as an attribute: a compile-only lowering of the step places its abstract
    # optimizer state by them, launch/recipes/compile.py.)
    self.opt_shardings = programs.opt_shardings
    self._copy = programs.copy
    # The step donates self.params, so it must never share a buffer with the caller's
    # arrays or with reference_params: place fresh copies.
    self.params = self._place_copy(params)
    self.reference_params = (None if reference_params is None
                             else self._place_copy(reference_params))
    self.opt_state = programs.init(self.params)
    self.version = 0
    self.nonfinite_streak = 0
    self._step = programs.step

  def _place_copy(self, params: Params) -> Params:
    # jnp.copy is a real op in the jaxpr, so jit returns new buffers (device_put may reuse
    # the source buffer for a shard already on the right device). sharding.place: on several
    # hosts each process places its own copy (e.g. the warm-up's params, restored).
    return self._copy(sharding_lib.place(params, self.param_shardings))

  def step(self, batch: Any) -> dict[str, float]:
    """One update on ``batch`` (a pytree of ``[B, ...]`` arrays). Returns host metrics.

    ``metrics['update/skipped']`` is 1.0 when the update was non-finite and not applied.
    Raises ``NonFiniteError`` on the ``max_nonfinite_updates``-th skipped update in a row.
    """
    rows = {x.shape[0] for x in jax.tree.leaves(batch)}
    if any(r % self.micro_batches for r in rows):
      raise ValueError(f'batch rows {sorted(rows)} are not divisible by micro_batches='
                       f'{self.micro_batches}; choose a micro_batches that divides the batch.')
    if self.check_batch is not None:
      self.check_batch(batch)
    batch = sharding_lib.global_batch(batch, self.mesh, self.rules)
    with sharding_lib.activation_sharding(self.mesh, self.rules):  # used when tracing
      self.params, self.opt_state, metrics = self._step(
          self.params, self.opt_state, batch, self.reference_params)
    # Scalars as floats; vector metrics ('hist/...': histogram bins) as numpy arrays.
    metrics = {k: float(v) if np.ndim(v) == 0 else np.asarray(v)
               for k, v in jax.device_get(metrics).items()}
    if metrics['update/skipped']:
      self.nonfinite_streak += 1
      if self.nonfinite_streak >= self.max_nonfinite_updates:
        raise NonFiniteError(
            f'{self.nonfinite_streak} consecutive updates were non-finite and skipped (last: '
            f"loss={metrics['loss']}, grad_norm={metrics['grad_norm']}); the params stay at "
            f'version {self.version}. The run has diverged: lower the learning rate or check '
            'the rewards and the data.')
    else:
      self.nonfinite_streak = 0
      self.version += 1
    return metrics

  def host_params(self) -> Params:
    """The current params as whole host numpy arrays (``host_arrays``): for inspection and
    evaluation, and for the local backend on several hosts, where each host's server holds
    a full copy that its own inference workers pull. Pushes do not use it: in one process
    the backends push the device arrays shard by shard (``paramserver.local_shards``), and a
    Ray trainer spanning several processes (``ray.trainer_processes``) pushes from each
    process only the blocks that process holds, to one server, with no gather
    (``ParameterServer.push_shards``)."""
    return host_arrays(self.params)

  def counters(self) -> dict[str, int]:
    """The trainer's scalar state besides the arrays (what a checkpoint stores)."""
    return {'version': self.version, 'nonfinite_streak': self.nonfinite_streak}

  def load(self, params: Params, opt_state: Any, counters: dict[str, int]) -> None:
    """Continues from a checkpoint: ``params`` and ``opt_state`` must already be placed like
    ``self.params``/``self.opt_state`` (``rlax_llm.checkpoint`` restores onto their
    shardings); ``counters`` as ``counters()`` returned them."""
    want = jax.tree.structure(self.opt_state)
    if jax.tree.structure(opt_state) != want:
      raise ValueError(f'the restored optimizer state has structure '
                       f'{jax.tree.structure(opt_state)}, this trainer\'s is {want}.')
    self.params = params
    self.opt_state = opt_state
    self.version = int(counters['version'])
    self.nonfinite_streak = int(counters['nonfinite_streak'])


class _Programs(NamedTuple):
  """A trainer's shardings and jitted functions (``_programs``)."""

  param_shardings: Params
  opt_shardings: Any
  copy: Callable[[Params], Params]  # fresh buffers on param_shardings
  init: Callable[[Params], Any]  # params -> optimizer state on opt_shardings
  step: Callable[..., Any]  # (params, opt_state, batch, reference) -> (params, opt_state, metrics)


@functools.lru_cache(maxsize=16)
def _programs(model: Model, mesh: Mesh, rules: tuple[tuple[str, Any], ...],
              optimizer: optax.GradientTransformation, objective: Objective,
              micro_batches: int, totals_fn: Callable[[Any], Any] | None,
              trainable: tuple[Any, tuple[bool, ...]] | None) -> _Programs:
  """The shardings and jitted functions of a trainer with these arguments, made once per
  value key (``functools.lru_cache``): trainers alike get the same ``jax.jit`` objects, so
  JAX's own cache serves the second one's calls without tracing, lowering or compiling.

  Every input a program closes over is in the key: the model (by value), the mesh (by its
  devices and axes) and logical-axis ``rules`` (the shardings, and the activation sharding
  the step is traced under, ``Trainer.step``), the optimizer and objective (by value when
  built with ``make_optimizer``/``Bound``, else by identity), the micro-batching and the
  trainable mask (``_mask_key``). Donation and out_shardings are those of one trainer.
  """
  trainable = None if trainable is None else jax.tree.unflatten(trainable[0], trainable[1])
  param_shardings = sharding_lib.param_shardings(
      model.abstract_params(), model.logical_axes(), mesh, rules)
  opt_shardings = optax.tree_utils.tree_map_params(
      optimizer, lambda _, sharding: sharding,
      jax.eval_shape(optimizer.init, _trained(model.abstract_params(), trainable)),
      _trained(param_shardings, trainable),
      transform_non_params=lambda _: sharding_lib.replicated(mesh))
  copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=param_shardings)
  init = jax.jit(lambda p: optimizer.init(_trained(p, trainable)), out_shardings=opt_shardings)
  step = jax.jit(
      functools.partial(_update, optimizer, objective, micro_batches, totals_fn, trainable),
      donate_argnums=(0, 1),
      out_shardings=(param_shardings, opt_shardings, sharding_lib.replicated(mesh)))
  return _Programs(param_shardings, opt_shardings, copy, init, step)


def _hashable_rules(rules: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
  """Logical-axis rules as a tuple of ``(name, axes)`` with ``axes`` a tuple if a list."""
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def _mask_key(trainable: Params | None) -> tuple[Any, tuple[bool, ...]] | None:
  """A ``trainable`` mask as ``(treedef, leaves)``: hashable, equal for equal masks."""
  if trainable is None:
    return None
  leaves, treedef = jax.tree.flatten(trainable)
  return treedef, tuple(bool(leaf) for leaf in leaves)


def host_arrays(tree: Any) -> Any:
  """``tree``'s arrays as whole host numpy arrays. Arrays spanning several processes are
  gathered with ``multihost_utils.process_allgather``, a collective that every process must
  call at the same point (every process then holds the whole tree)."""
  if all(x.is_fully_addressable for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)):
    return jax.tree.map(np.asarray, jax.device_get(tree))
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _strided(batch, parts: int):
  """``[B, ...]`` leaves -> ``[parts, B / parts, ...]``; part ``i`` holds rows ``i::parts``."""
  return jax.tree.map(
      lambda x: jnp.swapaxes(x.reshape((x.shape[0] // parts, parts) + x.shape[1:]), 0, 1),
      batch)


def _trained(tree: Any, trainable: Params | None) -> Any:
  """The leaves of a params-shaped ``tree`` that ``trainable`` marks (None: all), as a
  flat ``{path: leaf}`` dict (the whole ``tree`` when ``trainable`` is None)."""
  if trainable is None:
    return tree
  marks = traverse_util.flatten_dict(trainable)
  return {k: v for k, v in traverse_util.flatten_dict(tree).items() if marks[k]}


def _with_trained(params: Params, trained: Any, trainable: Params | None) -> Params:
  """``params`` with the ``_trained`` leaves replaced by ``trained``."""
  if trainable is None:
    return trained
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(params), **trained})


def _loss_and_grads(objective, micro_batches, totals_fn, trainable, params, batch,
                    reference_params):
  """``((loss, metrics), grads)``, the gradients with respect to ``_trained(params,
  trainable)`` only."""
  objective = (lambda trained, *args, inner=objective, full=params, **kw:
               inner(_with_trained(full, trained, trainable), *args, **kw))
  params = _trained(params, trainable)
  if micro_batches == 1:
    grad_fn = jax.value_and_grad(lambda p: objective(p, batch, reference_params), has_aux=True)
    return grad_fn(params)
  totals = totals_fn(batch)
  grad_fn = jax.value_and_grad(
      lambda p, micro: objective(p, micro, reference_params, totals=totals), has_aux=True)

  def accumulate(carry, micro):
    (loss, metrics), grads = grad_fn(params, micro)
    return jax.tree.map(jnp.add, carry, ((loss, metrics), grads)), None

  parts = _strided(batch, micro_batches)
  first = jax.tree.map(lambda x: x[0], parts)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(grad_fn, params, first))
  ((loss, metrics), grads), _ = jax.lax.scan(accumulate, zeros, parts)
  # Loss and gradients are shares of the whole batch's (they sum); metrics are averaged.
  return (loss, jax.tree.map(lambda m: m / micro_batches, metrics)), grads


def _update(optimizer, objective, micro_batches, totals_fn, trainable, params, opt_state,
            batch, reference_params):
  (loss, metrics), grads = _loss_and_grads(objective, micro_batches, totals_fn, trainable,
                                           params, batch, reference_params)
  trained = _trained(params, trainable)
  updates, new_opt_state = optimizer.update(grads, opt_state, trained)
  new_trained = optax.apply_updates(trained, updates)
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(new_trained)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm,
                 **{'update/skipped': (~ok).astype(jnp.float32)})
  return (_with_trained(params, keep(new_trained, trained), trainable),
          keep(new_opt_state, opt_state), metrics)
