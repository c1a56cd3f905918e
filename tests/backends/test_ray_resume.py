"""Ray runs are preemption-safe: the trainer actor writes the checkpoints (the driver hands
it the controller's state) and restores them itself; a run interrupted at random moments and
resumed equals an uninterrupted one, on Ray as on the local backend. A lost trainer actor
stops the run naming the checkpoint to resume from.

The helpers are ``tests/test_resume.py``'s: the same configs (``smoke``: checkpoints every 2
steps, a 4-step warm-up), the same stop event (``Preempt``: set at its ``n``-th check; on Ray
the controller checks it after every RL step, the warm-up running in the trainer actor) and
the same comparison (``comparable``: all but ``time/`` and ``sync/``)."""

import random
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

ray = pytest.importorskip('ray')

from rlax_llm.backends import build_run  # noqa: E402
from rlax_llm.backends.ray import TrainerLost  # noqa: E402
from rlax_llm.checkpoint import latest_step  # noqa: E402
from rlax_llm import roles  # noqa: E402
from rlax_llm.config import run_spec  # noqa: E402
from rlax_llm.data_types import Rollouts, TrainBatch  # noqa: E402
from rlax_llm.errors import RlaxError  # noqa: E402

from test_ray import DriverTraffic  # noqa: E402  (tests/backends/test_ray.py)

from test_resume import (Preempt, _final_params, _launch, _wait_for_rows,  # noqa: E402
                         assert_same_params, read, run_once, smoke)


def ray_smoke(steps, j=1, k=1):
  config = smoke(steps, j, k)
  config.backend = 'ray'
  return config


def run_ray(config, workdir, stop=None, wrap=None):
  """One launch of ``config`` on Ray in this process; ``wrap(run)`` may inject faults.
  Returns the summary."""
  with build_run(config, workdir, run_spec(config), stop=stop) as run:
    if wrap is not None:
      wrap(run)
    return run.execute()


def preempted(config, workdir, seed, times):
  """Runs ``config`` on Ray to the end, stopped after ``times`` random RL steps (distinct,
  seeded) and relaunched each time; returns the steps each launch ended at."""
  cuts = sorted(random.Random(seed).sample(range(1, config.total_steps), times))
  ended = []
  for at in [b - a for a, b in zip([0] + cuts, cuts)] + [None]:
    summary = run_ray(config, workdir, Preempt(at))
    assert summary['preempted'] == (at is not None)
    ended.append(summary['steps'])
  assert ended == cuts + [config.total_steps]
  return ended


@pytest.mark.parametrize('j, k, seed, times', [
    (1, 1, 0, 1),  # the default run's case (about 45 s here); three preemptions are slow
    pytest.param(1, 1, 0, 3, marks=pytest.mark.slow),
    pytest.param(4, 8, 1, 3, marks=pytest.mark.slow)])
def test_ray_preempted_and_resumed_equals_an_uninterrupted_run(cluster, tmp_path, monkeypatch,
                                                               j, k, seed, times):
  """Stopped after random steps and relaunched each time, a Ray run's per-step metrics,
  ledger and final params equal the uninterrupted local run's; with three preemptions
  (slow) also an uninterrupted Ray run's (tests/backends/test_ray.py shows that an
  uninterrupted Ray run equals the local one in the default run).

  The same launches also show that the driver carries no weight bytes: every object
  crossing the driver through Ray while the runs train, checkpoint and resume is recorded
  (``DriverTraffic``), and none is an array shaped like a param or an optimizer moment,
  though rollouts and train batches crossed. The control: a param-shaped array the driver
  puts into the object store is counted. (test_ray.py's slow
  ``test_the_driver_carries_no_weight_bytes`` has the full control: the old checkpoint
  path, the trainer's state fetched to the driver, counts at least twice the model.)"""
  steps = 5 if k == 1 else 7
  config = ray_smoke(steps, j, k)
  _, params, _ = roles.build_model(config, roles.build_task(config))  # shapes only
  leaves = jax.tree.leaves(params)
  signatures = {(tuple(a.shape), np.dtype(a.dtype)) for a in leaves}
  traffic = DriverTraffic(monkeypatch)
  preempted(config, tmp_path / 'ray', seed, times)
  assert any(isinstance(v, Rollouts) for v in traffic.values)  # received by the driver
  assert any(isinstance(v, TrainBatch) for v in traffic.values)  # sent by it
  assert traffic.weight_bytes(signatures) == 0
  largest = max(leaves, key=lambda a: a.nbytes)
  ray.get(ray.put(np.asarray(largest)))  # the control: weight bytes the driver does carry
  assert traffic.weight_bytes(signatures) >= largest.nbytes
  local_summary, local_params = run_once(smoke(steps, j, k), tmp_path / 'local', None)
  assert local_summary['steps'] == steps
  metrics, ledger = read(tmp_path / 'ray')
  assert [row['step'] for row in metrics] == list(range(1, steps + 1))  # no step twice
  assert (metrics, ledger) == read(tmp_path / 'local')
  assert_same_params(_final_params(tmp_path / 'ray'), local_params)
  if times > 1:
    run_ray(ray_smoke(steps, j, k), tmp_path / 'ray_whole')
    assert read(tmp_path / 'ray_whole') == (metrics, ledger)


@pytest.mark.parametrize('relaunch', [
    False, pytest.param(True, marks=pytest.mark.slow)])  # resuming on Ray: the test above
def test_a_lost_trainer_actor_stops_the_run_naming_the_checkpoint(cluster, tmp_path, relaunch):
  """The trainer actor's process dies in step 3 (checkpoint at step 2): the run stops
  with an error naming step 2 and the workdir; (slow) relaunching resumes from step 2 and
  ends equal to the uninterrupted local run."""
  config = ray_smoke(5)

  def kill_after_step_3(run):
    trainer = run.controller.trainer
    step = trainer.step

    def step_then_die(batch):
      if run.controller.step == 3:
        # Once step 2's background write is on disk (a write the kill interrupted would be
        # lost, and the message would name the one before it).
        deadline = time.time() + 30
        while latest_step(tmp_path / 'ray') != 2 and time.time() < deadline:
          time.sleep(0.05)
        ray.kill(trainer.actor, no_restart=True)
      return step(batch)
    trainer.step = step_then_die

  with pytest.raises(TrainerLost, match=r'the trainer actor was lost \(.*\); the run stops: '
                     r'the last checkpoint is step 2 in .*checkpoints; relaunch with '
                     r'--workdir=.* to resume from it') as error:
    run_ray(config, tmp_path / 'ray', wrap=kill_after_step_3)
  assert isinstance(error.value, RlaxError)  # launch prints it as one 'error: ...' line
  if not relaunch:
    return
  assert run_ray(config, tmp_path / 'ray')['steps'] == 5
  run_once(smoke(5), tmp_path / 'local', None)
  assert read(tmp_path / 'ray') == read(tmp_path / 'local')


@pytest.mark.slow
def test_sigterm_to_a_ray_launch_checkpoints_and_exits_0(tmp_path):
  """``python -m rlax_llm.launch --config.backend=ray``, SIGTERM after its first step: it
  saves a checkpoint (written by the trainer actor) and exits 0; the same command again
  resumes and ends equal to the local backend's uninterrupted run."""
  proc = _launch(tmp_path / 'ray', '--config.backend=ray')
  _wait_for_rows(tmp_path / 'ray', 1, proc, timeout=180)
  time.sleep(random.Random(0).uniform(0.0, 0.5))
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0 and 'checkpoint saved' in out, out[-3000:]
  proc = _launch(tmp_path / 'ray', '--config.backend=ray')
  out, _ = proc.communicate(timeout=180)
  assert proc.returncode == 0, out[-3000:]
  proc = _launch(tmp_path / 'local')
  out, _ = proc.communicate(timeout=180)
  assert proc.returncode == 0, out[-3000:]
  assert read(tmp_path / 'ray') == read(tmp_path / 'local')
  assert_same_params(_final_params(tmp_path / 'ray'), _final_params(tmp_path / 'local'))
