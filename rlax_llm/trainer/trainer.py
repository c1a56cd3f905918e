"""The trainer: a sharded train state and one jitted update step.

Params live on a ``Mesh`` with ``NamedSharding``s derived from the model's logical axes
(``rlax_llm.sharding``); the optimizer state follows the params' shardings; each
batch is sharded along ``batch`` over ``('data', 'fsdp')``. The step is
``jax.jit(value_and_grad(objective) -> optax update)`` with the params and optimizer state
donated, so an update happens in place on device.

Versions count updates: after ``n`` calls of ``step`` the params are version ``n``
(DESIGN.md "Staleness").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from rlax_llm.models.model import Model, Params
from rlax_llm import sharding as sharding_lib

Objective = Callable[[Model, Params, Any, Params | None], tuple[jax.Array, dict[str, Any]]]


def make_optimizer(learning_rate: float | optax.Schedule, *, b1: float = 0.9, b2: float = 0.99,
                   weight_decay: float = 0.0, max_grad_norm: float = 1.0
                   ) -> optax.GradientTransformation:
  """AdamW with global-norm gradient clipping (``max_grad_norm <= 0`` disables clipping)."""
  parts = []
  if max_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(max_grad_norm))
  parts.append(optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts)


class Trainer:
  """Holds ``(params, opt_state)`` on a mesh and applies ``objective`` updates.

  Args:
    model: the decoder (static).
    params: initial params (host or device arrays); placed onto ``mesh``.
    optimizer: an optax transformation.
    objective: ``(model, params, batch, frozen_params) -> (loss, metrics)``.
    mesh: the trainer's mesh (axes ``data``, ``fsdp``, ``tensor``).
    frozen_params: optional params passed to the objective, never updated (e.g. the KL
      reference policy); sharded like ``params``.
    rules: logical-axis rules.
  """

  def __init__(self, model: Model, params: Params, optimizer: optax.GradientTransformation,
               objective: Objective, mesh: Mesh, *, frozen_params: Params | None = None,
               rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES):
    self.model = model
    self.mesh = mesh
    self.rules = rules
    self.param_shardings = sharding_lib.param_shardings(
        model.abstract_params(), model.logical_axes(), mesh, rules)
    # The step donates self.params, so it must never share a buffer with the caller's
    # arrays or with frozen_params: place fresh copies.
    self.params = self._place_copy(params)
    self.frozen_params = None if frozen_params is None else self._place_copy(frozen_params)
    # Param-shaped optimizer leaves (moments) are sharded like their params; the rest
    # (step counts) is replicated on the mesh.
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, self.params),
        self.param_shardings,
        transform_non_params=lambda _: sharding_lib.replicated(mesh))
    self.opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(self.params)
    self._optimizer = optimizer
    self._objective = objective
    self.version = 0
    self._step = jax.jit(
        functools.partial(_update, model, optimizer, objective),
        donate_argnums=(0, 1),
        out_shardings=(self.param_shardings, opt_shardings,
                       sharding_lib.replicated(mesh)))

  def _place_copy(self, params: Params) -> Params:
    # jnp.copy is a real op in the jaxpr, so jit returns new buffers (device_put may reuse
    # the source buffer for a shard already on the right device).
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=self.param_shardings)
    return copy(jax.device_put(params, self.param_shardings))

  def step(self, batch: Any) -> dict[str, float]:
    """One update on ``batch`` (a pytree of ``[B, ...]`` arrays). Returns host metrics."""
    batch = jax.device_put(batch, sharding_lib.batch_sharding(self.mesh, batch, self.rules))
    with sharding_lib.activation_sharding(self.mesh, self.rules):  # used when tracing
      self.params, self.opt_state, metrics = self._step(
          self.params, self.opt_state, batch, self.frozen_params)
    self.version += 1
    return {k: float(v) for k, v in jax.device_get(metrics).items()}

  def host_params(self) -> Params:
    """The current params as host numpy arrays (what the parameter server stores)."""
    return jax.tree.map(np.asarray, jax.device_get(self.params))


def _update(model, optimizer, objective, params, opt_state, batch, frozen_params):
  grad_fn = jax.value_and_grad(lambda p: objective(model, p, batch, frozen_params),
                               has_aux=True)
  (loss, metrics), grads = grad_fn(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
  return params, opt_state, metrics
