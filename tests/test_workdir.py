"""The run directory: unique default names, an exclusive claim per run, atomic writes."""

import datetime
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from rlax_llm import workdir as workdir_lib
from rlax_llm.errors import WorkdirError, WorkdirHasRun, WorkdirInUse
from rlax_llm.storage import write_text_atomic
from rlax_llm.workdir import default_workdir, existing_steps, truncate_rows
from rlax_llm.workdir_claim import JobMember, WorkdirClaim, claim, claim_for_job

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _python(code: str, **kwargs) -> subprocess.Popen:
  env = dict(os.environ)
  env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
  return subprocess.Popen([sys.executable, '-c', textwrap.dedent(code)], cwd=ROOT, env=env,
                          text=True, **kwargs)


class _Holder:
  """A subprocess that claims ``workdir``, writes config.json, says 'ready' and waits."""

  def __init__(self, workdir: pathlib.Path):
    self.proc = _python(f'''
        import sys
        from rlax_llm.storage import write_text_atomic
        from rlax_llm.workdir_claim import claim
        c = claim({str(workdir)!r})
        write_text_atomic(c.workdir / 'config.json', 'holder config')
        print('ready', flush=True)
        sys.stdin.readline()  # hold the claim until the test closes stdin
        c.close()
        ''', stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = self.proc.stdout.readline()
    assert line.strip() == 'ready', (line, self.proc.stderr.read())

  def exit(self) -> None:
    self.proc.stdin.close()
    assert self.proc.wait(timeout=30) == 0, self.proc.stderr.read()

  def kill(self) -> None:
    self.proc.send_signal(signal.SIGKILL)
    assert self.proc.wait(timeout=30) == -signal.SIGKILL


def test_default_workdir_same_second_in_four_processes_is_unique(tmp_path):
  # Every process waits for the same instant, 0.1 s into a second, then names its run.
  start = math.ceil(time.time()) + 1.1
  procs = [_python(f'''
      import time
      from rlax_llm.workdir import default_workdir
      time.sleep(max(0.0, {start!r} - time.time()))
      print(default_workdir('run', root={str(tmp_path)!r}))
      ''', stdout=subprocess.PIPE) for _ in range(4)]
  paths = [pathlib.Path(p.communicate(timeout=60)[0].strip()) for p in procs]
  assert all(p.returncode == 0 for p in procs)
  assert len(set(paths)) == 4, paths
  assert all(p.is_dir() and p.parent == tmp_path and p.name.startswith('run-') for p in paths)
  assert sorted(tmp_path.iterdir()) == sorted(paths)


def test_default_workdir_retries_a_taken_name(tmp_path, monkeypatch):
  suffixes = iter(['aaaaaa', 'aaaaaa', 'bbbbbb'])
  monkeypatch.setattr(workdir_lib, '_new_suffix', lambda: next(suffixes))
  now = datetime.datetime(2026, 1, 2, 3, 4, 5)  # both in the same second: the names collide
  monkeypatch.setattr(workdir_lib, 'datetime', types.SimpleNamespace(
      datetime=types.SimpleNamespace(now=lambda: now)))
  first = default_workdir('run', root=tmp_path)
  second = default_workdir('run', root=tmp_path)
  assert first.is_dir() and second.is_dir()
  assert (first.name, second.name) == ('run-20260102-030405-aaaaaa', 'run-20260102-030405-bbbbbb')
  with pytest.raises(ValueError, match="run name 'a/b' cannot be a directory name"):
    default_workdir('a/b', root=tmp_path)


def test_claim_refused_while_another_process_holds_it(tmp_path):
  workdir = tmp_path / 'wd'
  holder = _Holder(workdir)
  try:
    lock_before = (workdir / '.lock').read_text()
    with pytest.raises(WorkdirInUse) as e:
      claim(workdir)
    message = str(e.value)
    assert f'pid {holder.proc.pid} on host ' in message
    assert f'workdir {workdir} is in use by another run' in message
    assert 'Pass another --workdir, or wait' in message
    assert json.loads(lock_before)['started'] in message
    # The refused claim touched nothing of the holder's.
    assert (workdir / 'config.json').read_text() == 'holder config'
    assert (workdir / '.lock').read_text() == lock_before
    assert sorted(p.name for p in workdir.iterdir()) == ['.lock', 'config.json']
  finally:
    holder.exit()
  with claim(workdir) as c:  # the holder exited: free again
    assert c.held and json.loads((workdir / '.lock').read_text())['pid'] == os.getpid()
  assert (workdir / '.lock').read_text() == ''


def test_claim_free_after_holder_is_killed(tmp_path):
  workdir = tmp_path / 'wd'
  holder = _Holder(workdir)
  with pytest.raises(WorkdirInUse):
    claim(workdir)
  holder.kill()  # SIGKILL: no cleanup ran; the stale .lock content stays behind
  assert json.loads((workdir / '.lock').read_text())['pid'] == holder.proc.pid
  with claim(workdir) as c:
    assert c.holder['pid'] == os.getpid()


class _Agree:
  """A stand-in for ``rlax_llm.distributed.agree``: records what this process sent and
  answers with process 0's value (``answer``, or what was sent when None)."""

  def __init__(self, answer=None):
    self.answer, self.sent = answer, []

  def __call__(self, value: int) -> int:
    self.sent.append(value)
    return value if self.answer is None else self.answer


def test_a_job_claims_through_process_0_and_the_others_join_without_the_lock(tmp_path):
  """The job's rule: process 0 claims (and tells the others it did); another process of the
  same job is not refused while process 0 holds the lock, and takes no lock itself."""
  workdir = tmp_path / 'wd'
  agree0 = _Agree()
  with claim_for_job(workdir, 0, agree0) as first:
    assert isinstance(first, WorkdirClaim) and first.held and agree0.sent == [0]
    lock = (workdir / '.lock').read_text()
    agree1 = _Agree(answer=0)  # process 0's outcome: claimed
    with claim_for_job(workdir, 1, agree1) as member:
      assert isinstance(member, JobMember) and not member.held and agree1.sent == [0]
    assert (workdir / '.lock').read_text() == lock  # process 1 left process 0's lock alone
    assert first.held
  with claim_for_job(workdir, 0) as alone:  # a one-process run: no exchange
    assert alone.held


def test_a_second_job_is_refused_in_every_process(tmp_path):
  """A second job on a workdir a run holds: its process 0 is refused as ``claim`` refuses
  and sends that outcome; its other processes raise the same class, pointing at process 0."""
  workdir = tmp_path / 'wd'
  holder = _Holder(workdir)
  try:
    agree0 = _Agree()
    with pytest.raises(WorkdirInUse, match=f'pid {holder.proc.pid} on host '):
      claim_for_job(workdir, 0, agree0)
    assert agree0.sent == [1]
    with pytest.raises(WorkdirInUse, match='process 0 of this job could not claim workdir'):
      claim_for_job(workdir, 1, _Agree(answer=agree0.sent[0]))
  finally:
    holder.exit()
  write_text_atomic(workdir / 'metrics.jsonl', '{"step": 1}\n')
  agree0 = _Agree()
  with pytest.raises(WorkdirHasRun):
    claim_for_job(workdir, 0, agree0)
  with pytest.raises(WorkdirHasRun, match='process 0 of this job'):
    claim_for_job(workdir, 1, _Agree(answer=agree0.sent[0]))
  (tmp_path / 'file').write_text('')
  agree0 = _Agree()
  with pytest.raises(WorkdirError, match='exists but is not a directory'):
    claim_for_job(tmp_path / 'file', 0, agree0)
  with pytest.raises(WorkdirError, match='process 0 of this job') as e:
    claim_for_job(tmp_path / 'file', 1, _Agree(answer=agree0.sent[0]))
  assert type(e.value) is WorkdirError  # pylint: disable=unidiomatic-typecheck


def test_a_non_zero_process_without_agree_is_refused(tmp_path):
  with pytest.raises(ValueError, match='process 1 of a job needs agree'):
    claim_for_job(tmp_path / 'wd', 1)


def test_claim_twice_in_one_process_is_refused(tmp_path):
  workdir = tmp_path / 'wd'
  first = claim(workdir)
  with pytest.raises(WorkdirInUse, match=f'already claimed by this process \\(pid {os.getpid()}'):
    claim(workdir)
  (tmp_path / 'link').symlink_to(workdir)
  with pytest.raises(WorkdirInUse):
    claim(tmp_path / 'link')  # another path to the same directory
  first.close()
  first.close()  # idempotent
  assert not first.held
  with claim(workdir):
    pass


def test_workdir_of_run_that_died_before_first_step_is_claimable(tmp_path):
  for metrics in (None, '', '{"step": 1'):  # absent, empty, torn first row
    workdir = tmp_path / f'wd{metrics!r}'
    workdir.mkdir()
    (workdir / 'config.json').write_text('{}')
    (workdir / '.lock').write_text('{"pid": 1, "host": "gone", "started": "earlier"}\n')
    if metrics is not None:
      (workdir / 'metrics.jsonl').write_text(metrics)
    with claim(workdir) as c:
      assert c.held


def test_workdir_with_rows_is_refused(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
  with pytest.raises(WorkdirHasRun,
                     match=f'workdir {tmp_path} already holds a run \\(3 steps in metrics.jsonl'):
    claim(tmp_path)
  with claim(tmp_path / 'sub'):  # the refusal released the lock and registered nothing
    pass
  (tmp_path / 'metrics.jsonl').write_text('{"step": 1}\n')
  with pytest.raises(WorkdirHasRun, match=r'\(1 step in metrics.jsonl\) but no checkpoint'):
    claim(tmp_path)
  (tmp_path / 'checkpoints' / 'steps' / '1.orbax-checkpoint-tmp-5').mkdir(parents=True)
  with pytest.raises(WorkdirHasRun):  # an unfinished save is no checkpoint
    claim(tmp_path)
  (tmp_path / 'checkpoints' / 'steps' / '1').mkdir()
  with claim(tmp_path):  # a finished one is resumed
    pass


def test_truncate_rows_keeps_steps_up_to_the_restored_one(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n{"note": 1}\n{"step": 4')
  assert truncate_rows(path, 2) == 3  # step 3, the unparsable line and the torn last line
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"note": 1}\n'
  assert truncate_rows(tmp_path / 'absent.jsonl', 2) == 0


def test_claim_refuses_a_file(tmp_path):
  (tmp_path / 'f').write_text('')
  with pytest.raises(WorkdirError, match='exists but is not a directory'):
    claim(tmp_path / 'f')


def test_existing_steps(tmp_path):
  assert existing_steps(tmp_path) == 0
  path = tmp_path / 'metrics.jsonl'
  path.write_text('')
  assert existing_steps(tmp_path) == 0
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
  assert existing_steps(tmp_path) == 2  # torn last line: not a step
  path.write_text('{"step": 1}\n\nnot json\n[1]\n{"step": 2}\n{"step": 2}\n{"step": 3}')
  assert existing_steps(tmp_path) == 2  # replayed step 2 counts once; unterminated 3 not
