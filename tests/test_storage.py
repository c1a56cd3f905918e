"""rlax_llm.storage: local files as before, and gs:// run directories against a local emulator.

The emulator (``tests/gcs_emulator.py``: ``gcp-storage-emulator`` with ``ifGenerationMatch``
enforced) runs on loopback for this module; gcsfs reaches it through ``STORAGE_EMULATOR_HOST``
and TensorStore (Orbax's arrays) through ``TENSORSTORE_GCS_HTTP_URL``.
"""

import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import threading
import time

import gcs_emulator  # tests/gcs_emulator.py
import jax
import numpy as np
import pytest
from test_resume import (
  WARMUP,
  Preempt,
  _final_params,
  _launch,
  _wait_for_rows,
  assert_same_params,
  read,
  run_once,
  smoke,
)

from rlax_llm import storage
from rlax_llm import workdir as workdir_lib
from rlax_llm import workdir_claim
from rlax_llm.errors import WorkdirHasRun, WorkdirInUse
from rlax_llm.metrics import MetricsWriter, read_metrics
from rlax_llm.storage import write_text_atomic

BUCKET = 'test-bucket'
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def emulator():
  with gcs_emulator.running(BUCKET) as url:
    yield url


@pytest.fixture
def gs(emulator):
  """A fresh gs:// prefix in the emulator's bucket."""
  del emulator
  return f'gs://{BUCKET}/{secrets.token_hex(4)}'


def _fs():
  return storage._gcs()  # pylint: disable=protected-access  # the emulator's objects, raw


# ------------------------------------------------------------------------- local files


def test_write_text_atomic(tmp_path):
  path = tmp_path / 'config.json'
  write_text_atomic(path, 'one')
  write_text_atomic(path, 'two \u2713')
  assert path.read_text(encoding='utf-8') == 'two \u2713'
  assert [p.name for p in tmp_path.iterdir()] == ['config.json']  # no temp file left
  umask = os.umask(0o022)
  os.umask(umask)
  assert path.stat().st_mode & 0o777 == 0o666 & ~umask
  with pytest.raises(FileNotFoundError):
    write_text_atomic(tmp_path / 'missing' / 'x', 'y')


def test_local_append_log_appends_to_the_file(tmp_path):
  path = tmp_path / 'eval.jsonl'
  path.write_text('{"a": 0}\n')
  log = storage.AppendLog(path)
  log.append('{"a": 1}\n')
  assert path.read_text() == '{"a": 0}\n{"a": 1}\n'  # flushed at once, before close
  log.close()
  assert storage.listdir(tmp_path) == ['eval.jsonl'] and storage.listdir(tmp_path / 'no') == []
  assert not storage.is_gcs(path) and storage.is_gcs('gs://b/x')


# ------------------------------------------------------------------------ the emulator


def test_emulator_enforces_generation_preconditions(gs):
  """The extension the lease rests on: create-if-absent, conditional delete, compose and
  metadata patch each fail with 412 (FileExistsError in gcsfs) on a stale generation."""
  lock = f'{gs}/.lock'
  generation = storage.create_exclusive(lock, b'{}', {'owner': 'a'})
  with pytest.raises(FileExistsError):
    storage.create_exclusive(lock, b'{}', {'owner': 'b'})
  assert storage.read_lease(lock) == (generation, {'owner': 'a'})
  assert not storage.renew_lease(lock, generation + 1, {'owner': 'b'})
  assert storage.renew_lease(lock, generation, {'owner': 'a', 'expires': '1'})
  assert storage.read_lease(lock) == (generation, {'owner': 'a', 'expires': '1'})
  assert not storage.delete_if_generation(lock, generation + 1)
  assert storage.delete_if_generation(lock, generation)
  assert storage.read_lease(lock) is None and not storage.delete_if_generation(lock, generation)
  name = f'{gs[len(f"gs://{BUCKET}/"):]}/a'
  _fs().pipe_file(f'{BUCKET}/{name}', b'x')
  with pytest.raises(WorkdirInUse, match='changed by another writer'):
    storage._compose(_fs(), BUCKET, name, [name], 1)  # pylint: disable=protected-access


# ---------------------------------------------------------------- files on gs://


def test_gcs_files_read_back(gs):
  write_text_atomic(f'{gs}/config.json', '{"x": 1}')
  write_text_atomic(f'{gs}/config.json', '{"x": 2}')
  assert storage.read_text(f'{gs}/config.json') == '{"x": 2}'
  assert storage.listdir(gs) == ['config.json'] and storage.listdir(f'{gs}/none') == []
  with pytest.raises(FileNotFoundError):
    storage.read_bytes(f'{gs}/absent')
  with MetricsWriter(gs, console=False, enabled=True) as writer:
    writer.write(1, {'loss': 1.0, 'kl': float('nan')})
    writer.write(2, {'loss': 0.5, 'kl': 0.1})
    writer.ledger(1, {'prompt_ids': [0, 1]})
    writer.write_summary({'final': 0.5})
    assert len(read_metrics(gs)) == 2  # each row is in the object as soon as it is written
  assert read_metrics(gs) == [{'step': 1, 'loss': 1.0, 'kl': None},
                              {'step': 2, 'loss': 0.5, 'kl': 0.1}]
  assert json.loads(storage.read_text(f'{gs}/ledger.jsonl')) == {'step': 1, 'prompt_ids': [0, 1]}
  assert json.loads(storage.read_text(f'{gs}/summary.json')) == {'final': 0.5}
  events = [n for n in storage.listdir(gs) if n.startswith('events.out.tfevents')]
  assert len(events) == 1 and storage.read_bytes(f'{gs}/{events[0]}')  # uploaded at close
  assert workdir_lib.existing_steps(gs) == 2
  with MetricsWriter(gs, console=False, enabled=True, resume_step=1) as writer:  # a resume
    writer.write(2, {'loss': 0.25, 'kl': 0.0})
  assert [r['loss'] for r in read_metrics(gs)] == [1.0, 0.25]


def test_a_host_dying_mid_append_leaves_whole_lines(gs, monkeypatch):
  """The part of an append is uploaded, then the host dies before the compose: the object
  holds only whole lines (the lost line is as lost as an unflushed local one), and the next
  writer removes the orphaned part and appends after the last whole line."""
  path = f'{gs}/metrics.jsonl'
  log = storage.AppendLog(path)
  log.append('{"step": 1}\n')
  log.append('{"step": 2}\n')

  def die(*args, **kwargs):
    raise SystemExit('host died')

  monkeypatch.setattr(storage, '_compose', die)
  with pytest.raises(SystemExit):
    log.append('{"step": 3, "loss": 0.1}\n')
  monkeypatch.undo()
  assert any('.metrics.jsonl.part-' in name for name in storage.listdir(gs))  # the orphan
  assert storage.read_text(path) == '{"step": 1}\n{"step": 2}\n'
  assert workdir_lib.existing_steps(gs) == 2 and len(read_metrics(gs)) == 2
  log = storage.AppendLog(path)  # the resumed run's writer
  assert storage.listdir(gs) == ['metrics.jsonl']
  log.append('{"step": 3}\n')
  assert [row['step'] for row in read_metrics(gs)] == [1, 2, 3]


def test_a_second_writer_on_the_same_object_is_refused(gs):
  """Appends are composed only onto the generation this writer last wrote: a file another
  writer replaced in between is not silently merged."""
  path = f'{gs}/ledger.jsonl'
  first = storage.AppendLog(path)
  first.append('{"step": 1}\n')
  write_text_atomic(path, '{"step": 9}\n')
  with pytest.raises(WorkdirInUse, match='changed by another writer'):
    first.append('{"step": 2}\n')
  assert storage.read_text(path) == '{"step": 9}\n'


# ----------------------------------------------------------------------- the lease


def test_the_lease_refuses_while_live_and_is_taken_over_when_expired(gs):
  """A holder renews its lease (a claim after several lease lengths is still refused); a
  holder that died (stopped renewing, never released) loses it once it expires."""
  holder = workdir_claim.claim(gs, lease_s=1.0)
  other = workdir_claim.GcsLease(storage.path(gs) / '.lock', {'pid': 1}, 1.0)
  with pytest.raises(WorkdirInUse, match='in use by another run .*lease expires in'):
    other.acquire(gs)
  with pytest.raises(WorkdirInUse, match='already claimed by this process'):
    workdir_claim.claim(gs)
  time.sleep(2.5)
  with pytest.raises(WorkdirInUse):
    other.acquire(gs)  # renewed
  holder.close()
  assert storage.listdir(gs) == []  # released: the lease object is deleted
  dead = workdir_claim.GcsLease(storage.path(gs) / '.lock', {'pid': 2}, 1.0)
  dead.acquire(gs)
  dead._stop.set()  # pylint: disable=protected-access  # dies: no renewal, no release
  dead._thread.join()  # pylint: disable=protected-access
  with pytest.raises(WorkdirInUse):
    workdir_claim.claim(gs, lease_s=1.0)
  time.sleep(1.2)
  taken = workdir_claim.claim(gs, lease_s=1.0)
  assert taken.held and storage.read_lease(f'{gs}/.lock')[1]['owner'] == taken.holder['owner']
  assert not storage.renew_lease(f'{gs}/.lock', dead.generation, {})  # the dead one's is gone
  taken.close()


def test_racing_claimers_of_an_expired_lease_one_wins(gs):
  dead = workdir_claim.GcsLease(storage.path(gs) / '.lock', {'pid': 2}, 0.5)
  dead.acquire(gs)
  dead._stop.set()  # pylint: disable=protected-access
  dead._thread.join()  # pylint: disable=protected-access
  time.sleep(0.7)
  leases = [workdir_claim.GcsLease(storage.path(gs) / '.lock', {'pid': n}, 30.0) for n in range(4)]
  outcomes = []

  def take(lease):
    try:
      lease.acquire(gs)
      outcomes.append('won')
    except WorkdirInUse:
      outcomes.append('refused')

  threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(outcomes) == ['refused'] * 3 + ['won']
  for lease in leases:
    lease.release()


def test_claim_for_job_and_a_run_without_checkpoint_on_gcs(gs):
  agreed = []

  def agree(value):
    agreed.append(value)
    return value

  with workdir_claim.claim_for_job(gs, 0, agree) as claim:
    assert claim.held and agreed == [0]
    member = workdir_claim.claim_for_job(gs, 1, lambda value: 0)
    assert not member.held and str(member.workdir) == gs
  write_text_atomic(f'{gs}/metrics.jsonl', '{"step": 1}\n')
  with pytest.raises(WorkdirHasRun):
    workdir_claim.claim_for_job(gs, 0, agree)
  assert agreed == [0, 2] and storage.read_lease(f'{gs}/.lock') is None  # released on refusal


# ------------------------------------------------------------------ runs on gs://


def _launch_gcs(workdir, *extra):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  return subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/default.py:smoke',
       f'--workdir={workdir}', '--config.total_steps=2', '--config.warmup.steps=2',
       '--config.eval.every_steps=2', '--config.checkpoint.every_steps=1',
       '--config.checkpoint.every_seconds=0', '--config.log.text_every=1', *extra],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow  # about 17 s; the SIGTERM-and-resume launch on gs:// stays in CI (suite time)
def test_a_tiny_launch_into_gcs_writes_everything_that_reads_back(gs, tmp_path):
  """``--workdir=gs://...`` with no mount: config.json, metrics, ledger, summary,
  TensorBoard events and Orbax checkpoints, each read back; evaluating the checkpoint from
  gs:// appends its line to a gs:// output."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  result = _launch_gcs(gs)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  names = storage.listdir(gs)
  assert {'config.json', 'metrics.jsonl', 'ledger.jsonl', 'summary.json',
          'checkpoints'} <= set(names) and '.lock' not in names  # released at exit
  assert json.loads(storage.read_text(f'{gs}/config.json'))['total_steps'] == 2
  assert [row['step'] for row in read_metrics(gs)] == [1, 2]
  ledger = [json.loads(line) for line in storage.read_text(f'{gs}/ledger.jsonl').splitlines()]
  assert [row['step'] for row in ledger] == [1, 2]
  assert json.loads(storage.read_text(f'{gs}/summary.json'))['steps'] == 2
  assert workdir_lib.finished_steps(f'{gs}/checkpoints/steps') == [1, 2]
  assert workdir_lib.has_checkpoint(gs)
  events = [n for n in names if n.startswith('events.out.tfevents')]
  assert len(events) == 1
  (tmp_path / events[0]).write_bytes(storage.read_bytes(f'{gs}/{events[0]}'))
  accumulator = EventAccumulator(str(tmp_path), size_guidance={'scalars': 0}).Reload()
  assert [e.step for e in accumulator.Scalars('loss')] == [1, 2]
  output = f'{gs}/eval/eval.jsonl'
  write_text_atomic(output, '{"earlier": 1}\n')
  evaluated = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.evaluate', f'--checkpoint={gs}', f'--output={output}'],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=120, check=False)
  assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
  lines = storage.read_text(output).splitlines()
  assert len(lines) == 2 and json.loads(lines[1])['checkpoint'] == gs
  assert json.loads(lines[1]) == json.loads(evaluated.stdout.splitlines()[-1])


@pytest.mark.slow  # about 40 s; the SIGTERM-and-relaunch case stays in the CI run (suite time)
def test_preempted_run_resumes_from_gcs_equal_to_the_uninterrupted_one(gs, tmp_path):
  """The preemption helpers of tests/test_resume.py, with the workdir on gs://: preempted in
  the warm-up and after step 3, resumed twice from gs://, the run equals an uninterrupted
  local one (per-step metrics, ledger, params bit for bit)."""
  config = smoke()
  _, ref_params = run_once(config, tmp_path, None)
  ref_metrics, ref_ledger = read(tmp_path)
  workdir = storage.path(gs)
  preempted = []
  for at in (WARMUP - 1, WARMUP + 3, None):
    summary, params = run_once(config, workdir, Preempt(at))
    preempted.append(None if summary is None else (summary['steps'], summary['preempted']))
  assert preempted == [None, (3, True), (5, False)]
  assert workdir_lib.finished_steps(workdir / 'checkpoints' / 'steps') == [3, 4, 5]
  metrics, ledger = read(workdir)
  assert metrics == ref_metrics and ledger == ref_ledger
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)


def test_a_second_launch_on_a_held_gcs_workdir_is_refused(gs):
  """While another process holds the workdir's lease, ``python -m rlax_llm.launch`` on it
  exits 1 naming the holder, and writes nothing."""
  with workdir_claim.claim(gs) as holder:
    second = _launch(gs)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 1, out[-3000:]
    assert f'is in use by another run (pid {holder.holder["pid"]}' in out
    assert storage.listdir(gs) == ['.lock']
  assert storage.listdir(gs) == []


def test_sigterm_then_relaunch_on_gcs_resumes(gs, tmp_path):
  """A real SIGTERM to ``python -m rlax_llm.launch --workdir=gs://...``: it exits 0 with a
  checkpoint on gs:// and its lease released; the same command again resumes and ends equal
  to the uninterrupted (local) run: per-step metrics, ledger and the final checkpoint's params
  bit for bit. (The CI counterpart of the slow test above, which also preempts in the warm-up
  and resumes twice.)"""
  workdir = storage.path(gs)
  proc = _launch(gs)
  _wait_for_rows(workdir, 1, proc, timeout=300)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert storage.read_lease(f'{gs}/.lock') is None  # released on the way out
  steps = len(read_metrics(workdir))
  assert steps < 5, 'the SIGTERM came after the last step: nothing was resumed'
  proc = _launch(gs)
  _, ref_params = run_once(smoke(), tmp_path, None)  # the reference, meanwhile
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert read(workdir) == read(tmp_path)
  assert_same_params(_final_params(workdir), ref_params)
