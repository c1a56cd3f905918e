"""The Ray backend: each role in its own actor process, on a private Ray cluster on loopback.
The same seed gives the same metrics as the local backend; a worker process that dies is
replaced and the run completes."""

import jax
import numpy as np
import pytest

ray = pytest.importorskip('ray')

from rlax_llm.backends import build_run  # noqa: E402
from rlax_llm.backends import ray as ray_backend  # noqa: E402
from rlax_llm.config import run_spec  # noqa: E402
from rlax_llm.data_types import Rollouts  # noqa: E402
from rlax_llm.metrics import read_metrics  # noqa: E402

from smoke_config import smoke_config  # noqa: E402  (tests/smoke_config.py)


def smoke(backend, steps=6, **overrides):
  fields = dict(backend=backend, total_steps=steps, staleness__j=4, staleness__k=8,
                log__tensorboard=False, eval__every_steps=3,
                checkpoint__every_steps=0, checkpoint__every_seconds=0.0)
  return smoke_config(**(fields | overrides))


def strip(rows):
  return [{k: v for k, v in row.items() if not k.startswith('time/')} for row in rows]


def execute(config, workdir, wrap=None, state=None):
  """Runs ``config``; ``wrap(controller)`` may replace role handles (e.g. inject faults);
  ``state``: a list that receives the trainer's ``state()`` after the run."""
  with build_run(config, workdir, run_spec(config)) as run:
    if wrap is not None:
      wrap(run.controller)
    summary = run.execute()
    if state is not None:
      state.append(run.controller.trainer.state().result())
  return summary, read_metrics(workdir / 'metrics.jsonl')


def test_ray_and_local_give_the_same_run(cluster, tmp_path, monkeypatch):
  """The same run on both backends. While the Ray run trains, the driver (the controller's
  process) sends version numbers and receives rollouts and the trainer's metrics only: the
  trainer actor pushes to the server actor and the worker actors pull from it."""
  received, sent = [], []
  result = ray_backend.RayFuture.result

  def spy_result(self, timeout=None):
    value = result(self, timeout)
    received.append(value)
    return value

  def spy_generate(controller):
    for handle in controller.workers:
      def generate(*args, _generate=handle.generate):
        sent.append(args)
        return _generate(*args)
      handle.generate = generate

  monkeypatch.setattr(ray_backend.RayFuture, 'result', spy_result)
  states = []
  _, ray_rows = execute(smoke('ray'), tmp_path / 'ray', wrap=spy_generate, state=states)
  monkeypatch.undo()
  *during_run, after = received  # after: the trainer's state(), fetched once the run ended
  assert len(after) == 3 and any(isinstance(v, Rollouts) for v in during_run)
  # Rollouts, or a step's metrics (RayTrainer.step's future yields those, its version kept).
  assert all(isinstance(v, Rollouts) or (isinstance(v, dict) and 'loss' in v)
             for v in during_run), [type(v) for v in during_run]
  assert all(type(version) is int and rng.shape == (2,) for _, rng, version, *_ in sent)
  _, local_rows = execute(smoke('local'), tmp_path / 'local', state=states)
  assert strip(ray_rows) == strip(local_rows)
  assert max(r['staleness/max'] for r in ray_rows) <= 7
  # The Ray trainer's state() (the TrainerHandle protocol) is the local one's: params,
  # optimizer state and counters, fetched from the actor.
  (ray_params, ray_opt, ray_counters), (params, opt, counters) = states
  assert ray_counters == counters and counters['version'] == ray_rows[-1]['version']
  for a, b in zip(jax.tree.leaves((ray_params, ray_opt)), jax.tree.leaves((params, opt)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


class KilledAtCall:
  """A worker handle whose actor process is killed just before its ``call``-th ``generate``
  call (a real process death: the call's result never comes)."""

  def __init__(self, handle, call):
    self._handle, self._call, self._calls = handle, call, 0

  def __getattr__(self, name):
    return getattr(self._handle, name)

  def generate(self, *args, **kwargs):
    self._calls += 1
    if self._calls == self._call:
      ray.kill(self._handle.actor, no_restart=True)
    return self._handle.generate(*args, **kwargs)


def test_a_dead_worker_process_is_replaced(cluster, tmp_path):
  def fault(controller):
    controller.workers[1] = KilledAtCall(controller.workers[1], 2)
  summary, rows = execute(smoke('ray', rollout__workers=2), tmp_path, wrap=fault)
  assert summary['workers/lost'] == 1 and len(rows) == 6
  assert 'inference worker 1 was lost' in summary['events'][0]


def test_partial_rollouts_on_ray_equal_local(cluster, tmp_path):
  """APRIL's unfinished groups travel to the worker actors inside requests (with their
  keys and tokens) and come back continued: the same run as the local backend."""
  april = dict(rollout__oversample=1.0, rollout__stop_after_groups=4, rollout__slots=6,
               task__max_operand=9, task__num_eval=4, staleness__j=2, staleness__k=3)
  _, ray_rows = execute(smoke('ray', **april), tmp_path / 'ray')
  _, local_rows = execute(smoke('local', **april), tmp_path / 'local')
  assert strip(ray_rows) == strip(local_rows)
  assert sum(r['rollout/carried_groups'] for r in ray_rows) > 0
