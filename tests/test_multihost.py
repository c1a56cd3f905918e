"""``python -m rlax_llm.launch`` as a multi-process job: 2 processes x 2 CPU devices joined with
``jax.distributed`` on loopback (Gloo collectives), against 1 process x 4 devices.

Every process runs the same command on the same workdir (``rlax_llm/distributed.py``):
process 0 claims the workdir and writes the run's files, every process writes its part of the
Orbax checkpoints, the trainer's mesh spans all 4 devices. The runs are subprocesses; the
4-step runs that train and checkpoint are ``slow`` (a minute or more each on a 2-core
machine) and run one at a time; the default run keeps a 2-step job against 1 process and a
second job refused.
"""

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rlax_llm import workdir as workdir_lib
from rlax_llm import workdir_claim
from rlax_llm.metrics import read_metrics

from one_device import ROOT, one_device_env  # tests/one_device.py
from ports import free_port  # tests/ports.py

# The smoke config, shorter: staleness k=2 so checkpoints hold an in-flight batch's rollouts.
FLAGS = ('--config=configs/default.py:smoke', '--config.warmup.steps=20',
         '--config.total_steps=4', '--config.eval.every_steps=2', '--config.staleness.k=2',
         '--config.checkpoint.every_steps=2', '--config.checkpoint.every_seconds=0')


def _launch(workdir: pathlib.Path, processes: int, *flags: str, timeout: float = 400,
            while_running=None) -> list[tuple[int, str, str]]:
  """Runs the launch as ``processes`` processes on 4 CPU devices in all, on ``workdir``;
  returns each process's ``(returncode, stdout, stderr)`` in process order.
  ``while_running(procs)``: called once the processes have started."""
  # The tests' XLA flags (tests/conftest.py's optimisation level: these short runs cost
  # mostly compiles; every run here is compiled alike), with the job's devices per process.
  env = one_device_env()
  env.update(JAX_PLATFORMS='cpu', XLA_FLAGS=f'{env["XLA_FLAGS"]} '
             f'--xla_force_host_platform_device_count={4 // processes}'.strip())
  job = []
  if processes > 1:
    job = ['--config.distributed.initialize=true',
           f'--config.distributed.coordinator_address=127.0.0.1:{free_port()}',
           f'--config.distributed.num_processes={processes}']
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'rlax_llm.launch', *FLAGS, *flags, f'--workdir={workdir}', *job,
       *([f'--config.distributed.process_id={p}'] if processes > 1 else [])],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for p in range(processes)]
  try:
    if while_running is not None:
      while_running(procs)
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def _ok(results) -> None:
  for n, (code, out, err) in enumerate(results):
    assert code == 0, f'process {n}: {out[-1500:]}\n{err[-3000:]}'


def _rows(workdir: pathlib.Path, leave_out: tuple[str, ...] = ('time/',)) -> list[dict]:
  """metrics.jsonl without the wall-clock ``time/`` metrics (and other ``leave_out``)."""
  return [{k: v for k, v in row.items() if not k.startswith(leave_out)}
          for row in read_metrics(workdir)]


def _ledger(workdir: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / workdir_lib.LEDGER_FILENAME).open()]


def _assert_same_training(rows, reference, steps) -> None:
  """Per-step rewards (and evaluations, versions) equal; the loss within 1e-6 (relative where
  |loss| > 1): a trainer step over 2 processes sums its gradients in another order than one
  over 1 process."""
  by_step = {row['step']: row for row in reference}
  for row in rows:
    if row['step'] not in steps:
      continue
    want = by_step[row['step']]
    for key in sorted(set(row) & set(want)):
      if key.startswith(('reward/', 'eval/accuracy', 'sampling_version', 'version',
                         'completion/', 'staleness/')):
        assert row[key] == want[key], (row['step'], key, row[key], want[key])
    assert math.isclose(row['loss'], want['loss'], rel_tol=1e-6, abs_tol=1e-6), (
        row['step'], row['loss'], want['loss'])


def _assert_job_files(workdir: pathlib.Path, results) -> None:
  """Process 0 wrote the run's files (once), the others only their checkpoint shards; every
  process measured the same held-out accuracies (start and final)."""
  finals = {out.split('held-out greedy accuracy: ')[1].split(' in ')[0] for _, out, _ in results}
  assert len(finals) == 1, finals
  assert len(list(workdir.glob('events.out.tfevents.*'))) == 1
  assert 'run summary' in results[0][1]
  assert all('run summary' not in out for _, out, _ in results[1:])
  assert json.loads((workdir / 'summary.json').read_text())['steps'] >= 0


# The CI case: 2 RL steps, no checkpoints (the slow tests below run 4 steps with checkpoints).
SHORT = ('--config.total_steps=2', '--config.checkpoint.every_steps=0')


def test_two_processes_train_two_steps_as_one_process_with_four_devices(tmp_path):
  """Both processes run the same command on the same workdir: process 0 claims it for the
  job (process 1 is not refused), the trainer (mesh over both processes) pushes its versions
  (gathered for each process's worker), every process evaluates the same accuracy; the 2
  steps' rewards equal those of 1 process x 4 devices, the losses within 1e-6, the ledger
  (prompts, versions) is the same."""
  two, one = tmp_path / 'two', tmp_path / 'one'
  # The 1-process run first: the programs it compiles that do not span the job (each
  # process's inference worker samples and evaluates on its own device) are in the
  # persistent compilation cache when both processes of the job ask for them, so they are
  # compiled once, not by each process.
  _ok(_launch(one, 1, *SHORT))
  results = _launch(two, 2, *SHORT)
  _ok(results)
  assert 'jax.distributed: process 1 of 2, 2 local / 4 global devices' in results[1][2]
  assert "trainer mesh {'data': 4" in results[1][2]
  assert json.loads((two / 'config.json').read_text())['distributed']['num_processes'] == 2
  _assert_job_files(two, results)
  assert [row['step'] for row in _rows(two)] == [1, 2]
  _assert_same_training(_rows(two), _rows(one), steps={1, 2})
  assert _ledger(two) == _ledger(one)


def test_a_second_job_on_a_busy_workdir_fails_in_every_process(tmp_path):
  """A workdir another run holds: the second job's process 0 is refused as one process would
  be, and its process 1 stops with it (it does not wait for a process 0 that has gone)."""
  workdir = tmp_path / 'wd'
  with workdir_claim.claim(workdir):
    results = _launch(workdir, 2, '--config.total_steps=0', '--config.warmup.steps=0',
                      timeout=240)
  assert [code for code, _, _ in results] == [1, 1], [err[-2000:] for _, _, err in results]
  assert f'error: workdir {workdir} is in use by another run (pid {os.getpid()}' in (
      results[0][2])
  assert 'error: process 0 of this job could not claim workdir' in results[1][2]
  assert sorted(p.name for p in workdir.iterdir()) == ['.lock']


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Runs launched once for the slow tests, by name, on demand: ``runs('two')``."""
  done = {}

  def get(name: str) -> pathlib.Path:
    if name not in done:
      workdir = tmp_path_factory.mktemp(name) / 'wd'
      results = _launch(workdir, 1 if name == 'one' else 2)
      _ok(results)
      if name != 'one':
        _assert_job_files(workdir, results)
      done[name] = workdir
    return done[name]

  return get


@pytest.mark.slow
def test_two_processes_train_as_one_process_with_four_devices(runs):
  """(a) The 2-process run's per-step rewards equal the 1-process x 4-device run's, its
  losses agree within 1e-6, its ledger (prompts, versions) is the same. More than the CI
  case above: 4 steps with a batch in flight (k=2) and checkpoints written by both processes
  every 2 steps (the runs the other slow tests resume from)."""
  two, one = runs('two'), runs('one')
  assert [row['step'] for row in _rows(two)] == [1, 2, 3, 4]
  _assert_same_training(_rows(two), _rows(one), steps={1, 2, 3, 4})
  assert _ledger(two) == _ledger(one)


@pytest.mark.slow
def test_two_process_runs_are_bitwise_equal(runs):
  """(b) Two 2-process runs: metrics.jsonl (less time/) and the ledger equal bit for bit."""
  assert _rows(runs('two')) == _rows(runs('two_again'))
  assert _ledger(runs('two')) == _ledger(runs('two_again'))


@pytest.mark.slow
def test_a_checkpoint_moves_from_two_processes_to_one_and_back(runs, tmp_path):
  """(c) A 2-process run saves steps 2 (with a batch in flight: k=2) and 3; as if it had
  died before step 3's save, step 2 (written by both processes) restores into 1 process x 4
  devices, which trains steps 3 and 4 and saves both; as if it had died before step 4's
  save, step 3 restores into 2 processes, which train step 4. Each continues the
  uninterrupted 2-process run. (Each resume starts from a checkpoint with a batch in flight:
  resuming from a run's final step with more total_steps at k > 1 is another matter.)"""
  workdir = tmp_path / 'wd'
  _ok(_launch(workdir, 2, '--config.total_steps=3'))
  steps = workdir / 'checkpoints' / 'steps'
  for item in ('params', 'opt_state'):  # each process wrote its shards
    assert {p.name for p in (steps / '2' / item).glob('ocdbt.process_*')} == {
        'ocdbt.process_0', 'ocdbt.process_1'}
  # The JSON items and the numpy rollouts are written once, by process 0.
  assert json.loads((steps / '2' / 'controller' / 'metadata').read_text())['inflight']
  assert list((steps / '2' / 'rollouts').glob('ocdbt.process_0/d/*'))
  assert not list((steps / '2' / 'rollouts').glob('ocdbt.process_1/d/*'))
  shutil.rmtree(steps / '3')
  _ok(_launch(workdir, 1, '--config.checkpoint.every_steps=1'))
  shutil.rmtree(steps / '4')  # as if it had died before step 4's save: resume from step 3
  _ok(_launch(workdir, 2))
  rows, reference = _rows(workdir), _rows(runs('two'))
  assert [row['step'] for row in rows] == [1, 2, 3, 4]
  # Steps 1-2 ran as the reference's did (same job shape): bit for bit.
  assert rows[:2] == reference[:2]
  _assert_same_training(rows, reference, steps={3, 4})
  assert _ledger(workdir) == _ledger(runs('two'))


@pytest.mark.slow
def test_a_signal_to_one_process_preempts_the_whole_job(runs, tmp_path):
  """SIGTERM to process 1 alone (process 0 sees none): every process saves the checkpoint
  after the same step and exits 0; relaunched, the job ends as the uninterrupted 2-process
  run did, bit for bit (less the workers' pull counters ``sync/``: a resumed worker pulls
  whole weights once, docs/checkpoints.md)."""
  workdir = tmp_path / 'wd'

  def signal_process_1_after_step_1(procs):
    deadline = time.monotonic() + 300
    while not workdir_lib.existing_steps(workdir):
      assert time.monotonic() < deadline and procs[0].poll() is None, 'no step 1'
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)

  results = _launch(workdir, 2, while_running=signal_process_1_after_step_1)
  _ok(results)
  assert 'preempted after step' in results[0][1], results[0][1][-2000:]
  stopped = workdir_lib.existing_steps(workdir)
  assert 1 <= stopped < 4
  assert (workdir / 'checkpoints' / 'steps' / str(stopped)).is_dir()
  _ok(_launch(workdir, 2))
  assert (_rows(workdir, ('time/', 'sync/')) == _rows(runs('two'), ('time/', 'sync/')))
  assert _ledger(workdir) == _ledger(runs('two'))
