"""A local run whose inference worker records what it sampled with (imported by the tests of
the workers' inference copy: bfloat16 and int8)."""

import jax

from rlax_llm.backends import local as local_backend
from rlax_llm.config import run_spec


def recorded_run(config, tmp_path):
  """Runs ``config`` locally in ``tmp_path``, recording each of the worker's generate calls.
  Returns ``(worker, sampled, start, final, trainer model)``: ``sampled`` holds ``(the params
  the worker held (host, as pulled), the params it sampled with (placed), rollouts)`` per
  call; ``start`` and ``final`` the trainer's params before and after."""
  sampled = []
  with local_backend.build_run(config, tmp_path, run_spec(config)) as r:
    worker = r.controller.workers[0].worker
    generate = worker.generate

    def recording(*args, **kwargs):
      rollouts = generate(*args, **kwargs)
      # pylint: disable-next=protected-access
      held = jax.tree_util.tree_unflatten(worker._treedef, worker._host_leaves)
      sampled.append((held, worker.params, rollouts))
      return rollouts
    worker.generate = recording
    start = r.controller.trainer.host_params().result()  # version 0: float32, as trained
    r.execute()
    final = r.controller.trainer.host_params().result()
  return worker, sampled, start, final, r.controller.trainer.trainer.model
