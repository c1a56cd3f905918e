"""A run's workdir holding one step checkpoint of a config's model, without running it: for
the tests of what reads checkpoints back (``python -m rlax_llm.export``, ``serve``)."""

import jax
import jax.numpy as jnp

from rlax_llm import evaluate
from rlax_llm.checkpoint import Checkpointer


def perturbed(params):
  """``params`` plus a small deterministic pattern (so that every leaf differs from the
  seeded init, zeros included)."""
  return jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size, dtype=x.dtype)
                                                   .reshape(x.shape)), params)


def write_step_checkpoint(workdir, config, step: int, version: int, params=None):
  """Writes ``config.json`` and step ``step`` (trainer params version ``version``) of
  ``config``'s model into ``workdir``: ``params``, default the config's seeded init
  ``perturbed``. Returns ``(model, params)``."""
  _, _, model, init, _ = evaluate.policy_params(config)
  params = perturbed(init) if params is None else params
  (workdir / 'config.json').write_text(config.to_json_best_effort(indent=2))
  checkpointer = Checkpointer(workdir)
  checkpointer.save(step, params=params, opt_state={'count': jnp.zeros(())},
                    trainer={'version': version, 'nonfinite_streak': 0}, controller={},
                    rollouts={})
  checkpointer.close()
  return model, params
