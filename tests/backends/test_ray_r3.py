"""Rollout routing replay (R3, ``model.routing_replay='r3'``) on Ray (issue 62): the experts
each token was routed to travel from the worker actors to the driver's controller and on to
the trainer actor unchanged, so an R3 run on Ray equals the same run on the local backend
(tests/test_moe_r3.py runs R3 locally). The default run checks the part Ray adds, the
serialisation of a ``Rollouts`` with routes between processes; the run is slow."""

import jax
import numpy as np
import pytest

ray = pytest.importorskip('ray')

from rlax_llm.data_types import Rollouts, make_train_batch  # noqa: E402
from rlax_llm.model_spec import NO_ROUTE  # noqa: E402
from rlax_llm.sampling_spec import SamplingSpec  # noqa: E402

from test_moe_r3 import r3_smoke  # noqa: E402  (tests/test_moe_r3.py)
from test_ray import execute, strip  # noqa: E402  (tests/backends/test_ray.py)


def _routed_rollouts(layers: int = 2, k: int = 2) -> Rollouts:
  """Two samples of a 4-expert model with routes as the engine records them: int8
  ``[B, P or N, layers, k]``, ``NO_ROUTE`` on padding and on each row's last token."""
  rng = np.random.default_rng(0)
  prompt_lengths = np.array([3, 2], np.int32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
  prompt_routes = np.full((2, 3, layers, k), NO_ROUTE, np.int8)
  completion_routes = np.full((2, 4, layers, k), NO_ROUTE, np.int8)
  for i, (lp, lc) in enumerate(zip(prompt_lengths, mask.sum(1))):
    prompt_routes[i, :lp] = rng.integers(0, 4, (lp, layers, k))
    completion_routes[i, :lc - 1] = rng.integers(0, 4, (lc - 1, layers, k))
  return Rollouts(
      prompt_ids=np.array([5, 5]), group_ids=np.array([0, 0], np.int32),
      prompt_tokens=np.array([[1, 7, 8], [1, 9, 0]], np.int32), prompt_lengths=prompt_lengths,
      completion_tokens=np.array([[4, 2, 3, 0], [6, 2, 0, 0]], np.int32),
      completion_mask=mask, behaviour_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
      support_sizes=np.where(mask, 9, 0).astype(np.int32),
      versions=np.where(mask, 3, -1).astype(np.int32),
      finish_reasons=np.array(['stop', 'length']), completions=['423', '62'],
      sampling=SamplingSpec(), timings={'generate_s': 0.1}, prompt_routes=prompt_routes,
      completion_routes=completion_routes)


def test_routes_survive_rays_serialisation(cluster):
  """A ``Rollouts`` with routes through Ray's object store (``ray.put``, then ``ray.get``:
  Ray's serialisation, which a worker actor's rollouts go through on their way to the
  driver): the routes come back with their values, dtype and shape, and pack into the same
  train batch routes."""
  del cluster
  rollouts = _routed_rollouts()
  back = ray.get(ray.put(rollouts), timeout=60)
  for name in ('prompt_routes', 'completion_routes'):
    got, want = getattr(back, name), getattr(rollouts, name)
    assert got.dtype == want.dtype == np.int8 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(make_train_batch(back, np.zeros(2, np.float32)).routes,
                                make_train_batch(rollouts, np.zeros(2, np.float32)).routes)


def _r3_config(backend):
  """tests/test_moe_r3.py's tiny MoE run with R3 (with its warm-up, so that rewards differ
  within groups and updates move the weights), short and synchronous ((j, k) = (1, 1): each
  batch is trained by the version that sampled it), float32 inference (the engine routes as
  the trainer's forward does), no evaluation or checkpoints."""
  config = r3_smoke(steps=3)
  config.backend = backend
  config.eval.every_steps = 0
  config.checkpoint.every_steps, config.checkpoint.every_seconds = 0, 0.0
  config.staleness.j = config.staleness.k = 1
  config.model.inference_param_dtype = 'float32'
  return config


# Two runs of a tiny MoE, one in Ray's actors (which compile the roles again): about a minute
# on a loaded 2-core machine. Its CI counterparts: the serialisation above, and the local R3
# run's pieces in tests/test_moe_r3.py (the routes into the train batch; replaying float32
# routes flips none).
@pytest.mark.slow
def test_an_r3_run_on_ray_equals_local(cluster, tmp_path):
  """Every metric but ``time/`` (``moe/route_flip_fraction`` included, 0 at every step: the
  replayed routes are the trainer's own) and the final params and optimizer state (as
  tests/backends/test_ray.py compares them)."""
  del cluster
  rows, states = {}, []
  for backend in ('ray', 'local'):
    _, rows[backend] = execute(_r3_config(backend), tmp_path / backend, state=states)
  assert len(rows['ray']) == 3
  assert all(row['moe/route_flip_fraction'] == 0.0 for row in rows['ray'])
  assert any(row['grad_norm'] > 0 for row in rows['ray'])  # the weights moved
  assert strip(rows['ray']) == strip(rows['local'])
  (ray_params, ray_opt, ray_counters), (params, opt, counters) = states
  assert ray_counters == counters
  for a, b in zip(jax.tree.leaves((ray_params, ray_opt)), jax.tree.leaves((params, opt)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
