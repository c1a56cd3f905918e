"""A local run whose inference worker records what it sampled with (imported by the tests of
the workers' inference copy: bfloat16 and int8)."""

import jax
import numpy as np

from rlax_llm.backends import local as local_backend
from rlax_llm.config import run_spec
from rlax_llm.metrics import read_metrics


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
      held = jax.tree_util.tree_unflatten(worker.receiver._treedef,
                                          worker.receiver._host_leaves)
      sampled.append((held, worker.params, rollouts))
      return rollouts
    worker.generate = recording
    start = r.controller.trainer.host_params().result()  # version 0: float32, as trained
    r.execute()
    final = r.controller.trainer.host_params().result()
  return worker, sampled, start, final, r.controller.trainer.trainer.model


def assert_trained_with_mismatch(tmp_path, start, final) -> list[dict]:
  """Asserts that the 3-step run in ``tmp_path`` (sampling with an inference copy, the
  trainer's float32 recompute as the PPO ratio's reference) trained its params (``start`` ->
  ``final``) with finite losses and a nonzero mismatch each step, the ratio exactly 1.
  Returns its metrics rows."""
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  assert [row['step'] for row in rows] == [1, 2, 3]
  assert any(row['update/skipped'] == 0 for row in rows)
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start),
                                                       jax.tree.leaves(final)))
  for row in rows:
    assert np.isfinite(row['loss'])
    for key in ('mismatch/kl', 'mismatch/max_abs_dlogp', 'mismatch/p95_abs_dlogp'):
      assert np.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row['is/ratio_min'] == row['is/ratio_max'] == 1.0  # against the fp32 recompute
  return rows
