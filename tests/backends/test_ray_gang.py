"""The Ray backend with a trainer spanning several processes (``ray.trainer_processes``), the
shape of a multi-host TPU trainer slice: 2 trainer actors x 2 CPU devices joined into one
``jax.distributed`` job (Gloo collectives on loopback), against 1 trainer actor x 4 devices.
The trainer mesh spans all 4 devices (``mesh.trainer.fsdp=-1``: the params are split over
them, so each process holds part of every large leaf); each actor pushes only its own blocks
of each version to the server actor, which commits a version once both parts arrived; both
actors write their part of the Orbax checkpoints and restore them."""

import time

import jax
import pytest

ray = pytest.importorskip('ray')

from rlax_llm import roles  # noqa: E402
from rlax_llm.backends import build_run  # noqa: E402
from rlax_llm.backends.ray import TrainerLost  # noqa: E402
from rlax_llm.config import run_spec, validate_config  # noqa: E402

from test_multihost import _assert_same_training  # noqa: E402
from test_resume import Preempt, read, smoke  # noqa: E402

STEPS = 4


def gang(processes: int):
  """``test_resume``'s smoke run (a 4-step warm-up, checkpoints every 2 steps) on Ray, its
  trainer ``processes`` actors of ``4 // processes`` CPU devices each, its params split over
  the 4 devices (fsdp)."""
  config = smoke(STEPS)
  config.backend = 'ray'
  config.ray.trainer_processes = processes
  config.ray.trainer_env = {
      'XLA_FLAGS': f'--xla_force_host_platform_device_count={4 // processes}'}
  config.mesh.trainer.data, config.mesh.trainer.fsdp = 1, -1
  validate_config(config)
  return config


def launch(config, workdir, stop=None, wrap=None):
  """One launch of ``config`` on Ray in this process; returns the summary and every push the
  server actor accepted (``ServerRole.received``: version, process, processes, bytes).
  ``wrap(run)`` may inject faults."""
  with build_run(config, workdir, run_spec(config), stop=stop) as run:
    if wrap is not None:
      wrap(run)
    summary = run.execute()
    # The server actor the trainer actors push to (RayTrainer.server, for inspection).
    pushes = ray.get(run.controller.trainer.server.received.remote())
  return summary, pushes


@pytest.fixture(scope='module')
def runs(cluster, tmp_path_factory):
  """The uninterrupted runs, launched once on demand: ``runs(processes)`` -> (workdir,
  pushes)."""
  done = {}

  def get(processes: int):
    if processes not in done:
      workdir = tmp_path_factory.mktemp(f'gang{processes}')
      summary, pushes = launch(gang(processes), workdir)
      assert summary['steps'] == STEPS and not summary['preempted']
      done[processes] = workdir, pushes
    return done[processes]

  return get


def _model_bytes(config) -> int:
  """The bytes of one version of the params (the model built here, for its shapes)."""
  _, params, _ = roles.build_model(config, roles.build_task(config))
  return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def test_each_trainer_process_pushes_only_its_own_shards(runs):
  """The server actor received every version (the starting one and one per step) as 2
  pushes, one from each process, neither the whole model, together exactly the whole (each
  block once). (The first test: it launches the 2-process run; the next, the 1-process one,
  whose trainer pushes each version whole, once.)"""
  _, pushes = runs(2)
  total = _model_bytes(gang(2))
  assert sorted({version for version, *_ in pushes}) == list(range(STEPS + 1))
  for version in range(STEPS + 1):
    parts = [(process, count, nbytes) for v, process, count, nbytes in pushes if v == version]
    assert sorted(process for process, _, _ in parts) == [0, 1] and {
        count for _, count, _ in parts} == {2}, pushes
    assert sum(nbytes for _, _, nbytes in parts) == total
    assert all(0 < nbytes < total for _, _, nbytes in parts), parts


def test_two_trainer_processes_train_as_one_with_four_devices(runs):
  """Per-step rewards (and evaluations, versions, staleness) equal, losses within 1e-6
  (relative where |loss| > 1: a step over 2 processes sums its gradients in another order),
  the ledger (prompts, versions) the same. The 1-process trainer pushed each version whole,
  once (the control of the test above: the server's record does show a whole push)."""
  (two, _), (one, whole_pushes) = runs(2), runs(1)
  rows, ledger = read(two)
  reference, reference_ledger = read(one)
  assert [row['step'] for row in rows] == list(range(1, STEPS + 1))
  _assert_same_training(rows, reference, steps=set(range(1, STEPS + 1)))
  assert ledger == reference_ledger
  assert whole_pushes == [(v, 0, 1, _model_bytes(gang(1))) for v in range(STEPS + 1)]


@pytest.mark.slow  # two launches of the 2-process run: about 100 s here
def test_the_trainer_processes_checkpoint_and_resume(runs, tmp_path):
  """Preempted after step 2 (checkpoint written by both processes: each its own shards of
  the params and optimizer state) and relaunched, the 2-process run ends equal to the
  uninterrupted one, bit for bit (less time/ and sync/)."""
  config = gang(2)
  summary, _ = launch(config, tmp_path, stop=Preempt(2))
  assert summary['preempted'] and summary['steps'] == 2
  for item in ('params', 'opt_state'):
    assert {p.name for p in (tmp_path / 'checkpoints' / 'steps' / '2' / item).glob(
        'ocdbt.process_*')} == {'ocdbt.process_0', 'ocdbt.process_1'}
  summary, pushes = launch(config, tmp_path)
  assert summary['steps'] == STEPS
  # The resumed trainer pushed its restored version 2, then 3 and 4, each in two parts.
  assert sorted((v, process) for v, process, *_ in pushes) == [
      (v, p) for v in (2, 3, 4) for p in (0, 1)]
  assert read(tmp_path) == read(runs(2)[0])


@pytest.mark.slow  # 30-46 s here; the CI run keeps the push and same-run cases (suite time)
def test_a_lost_trainer_process_stops_the_run(cluster, tmp_path):
  """Process 1's actor dies in step 1: the driver does not wait on process 0 (left alone in
  its collectives) and the run stops with ``TrainerLost`` (the path of a lost one-process
  trainer, tests/backends/test_ray_resume.py, there with a checkpoint to name)."""
  def kill_process_1_in_step_1(run):
    trainer = run.controller.trainer
    step = trainer.step

    def step_then_die(batch):
      ray.kill(trainer.actors[1], no_restart=True)
      return step(batch)
    trainer.step = step_then_die

  start = time.monotonic()
  with pytest.raises(TrainerLost, match=r'the trainer actor was lost \(.*\); the run stops: '
                     r'no checkpoint was written yet'):
    launch(gang(2), tmp_path, wrap=kill_process_1_in_step_1)
  assert time.monotonic() - start < 120  # not a collective's timeout
