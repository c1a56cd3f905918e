"""A run's workdir holding one step checkpoint of a config's model, without running it: for
the tests of what reads checkpoints back (``python -m rlax_llm.export``, ``serve``)."""

import jax
import jax.numpy as jnp

from rlax_llm import evaluate
from rlax_llm.checkpoint import Checkpointer


def write_step_checkpoint(workdir, config, step: int, version: int):
  """Writes ``config.json`` and step ``step`` (trainer params version ``version``) of
  ``config``'s model into ``workdir``, its params the config's seeded init perturbed (so that
  they differ from what the config loads). Returns ``(model, params)``."""
  _, _, model, params, _ = evaluate.policy_params(config)
  params = jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size, dtype=x.dtype)
                                                     .reshape(x.shape)), params)
  (workdir / 'config.json').write_text(config.to_json_best_effort(indent=2))
  checkpointer = Checkpointer(workdir)
  checkpointer.save(step, params=params, opt_state={'count': jnp.zeros(())},
                    trainer={'version': version, 'nonfinite_streak': 0}, controller={},
                    rollouts={})
  checkpointer.close()
  return model, params
