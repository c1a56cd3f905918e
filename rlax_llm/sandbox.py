"""Runs untrusted Python (model completions) with limits: the code sandbox of the python task.

Each run is a fresh ``python -I -B -S`` subprocess (isolated mode: no user site, no
``PYTHON*`` variables, no script or working directory on ``sys.path``) started in a fresh
temporary directory that is its working directory, ``HOME`` and ``TMPDIR``, with:

* wall time (``SandboxConfig.wall_s``, enforced by the parent), CPU time (``RLIMIT_CPU``),
  address space (``RLIMIT_AS``, 1 GiB by default), file size (``RLIMIT_FSIZE``), open files
  (``RLIMIT_NOFILE``), no core dumps, and process count (``RLIMIT_NPROC``, which the kernel does
  not apply to root, so the guard below also caps forks);
* captured stdout/stderr truncated at ``max_output_bytes`` each (the rest is read and dropped);
* no network: a new network namespace (``unshare --net``: no interface is up, loopback
  included) and a new PID namespace (``unshare --pid --fork --kill-child``) when ``unshare``
  works here (root, or unprivileged user namespaces), else only the guard's socket block;
* the guard (``rlax_llm/_sandbox_child.py``): an audit hook refusing sockets, process spawning,
  forks past the cap, writes outside the temporary directory, signals to other processes,
  ``ctypes`` and the introspection a program would need to find the result nonce;
* cleanup: the run's process group is killed, then every process whose environment carries the
  run's tag (``RLAX_SANDBOX_TAG``, inherited through fork and ``setsid``) is found in ``/proc``
  and SIGKILLed until none is left; with the PID namespace the kernel also kills every process
  of the namespace when its first process exits. The directory is then removed.

Success is reported positively: the harness writes ``'<nonce> <passed> <total>'`` (a random
128-bit nonce it read from stdin) to a dedicated pipe as its very last act, so a program that
exits, crashes or is killed early passes nothing.

This is defence in depth for a trainer scoring its own model's completions, not a security
boundary against a determined attacker: see docs/tasks.md for what to add for untrusted,
multi-tenant use (containers or gVisor/Firecracker, seccomp, separate users, cgroups).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

TAG_VARIABLE = 'RLAX_SANDBOX_TAG'
CHILD_PATH = pathlib.Path(__file__).with_name('_sandbox_child.py')
NAMESPACE_MODES = ('auto', 'on', 'off')
_UNSHARE = ('unshare', '--net', '--pid', '--fork', '--kill-child')
_GiB = 1 << 30
_RESULT_CAP = 1 << 16


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits of one sandboxed run.

  wall_s: wall-clock limit of the whole run, interpreter start included.
  cpu_s: CPU-time limit (``RLIMIT_CPU``, whole seconds, rounded up).
  memory_bytes: address-space limit (``RLIMIT_AS``).
  max_processes: processes the run may create (``RLIMIT_NPROC`` above the user's current count
    when not root; the guard's fork cap always).
  max_output_bytes: stdout and stderr are each kept up to this many bytes.
  max_file_bytes: largest file the run may write (``RLIMIT_FSIZE``).
  max_open_files: ``RLIMIT_NOFILE``.
  test_timeout_s: per-unit-test limit inside the run (SIGALRM; a test past it fails and the
    next one runs); None for none (the wall limit still applies).
  namespaces: ``'auto'`` (network + PID namespaces when ``unshare`` works here), ``'on'``
    (require them: ValueError if unavailable), ``'off'``.
  guard: install the audit-hook guard (see the module docstring).
  site_packages: let the program import installed packages (drops ``-S``).
  python: the interpreter; None for the current one (``sys.executable``).
  """

  wall_s: float = 10.0
  cpu_s: float = 5.0
  memory_bytes: int = _GiB
  max_processes: int = 16
  max_output_bytes: int = 1 << 16
  max_file_bytes: int = 16 << 20
  max_open_files: int = 64
  test_timeout_s: float | None = 3.0
  namespaces: str = 'auto'
  guard: bool = True
  site_packages: bool = False
  python: str | None = None

  def __post_init__(self):
    for name in ('wall_s', 'cpu_s'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f'SandboxConfig.{name} must be a number > 0 (seconds), got {value!r}.')
    if self.test_timeout_s is not None and not (
        isinstance(self.test_timeout_s, (int, float)) and self.test_timeout_s > 0):
      raise ValueError('SandboxConfig.test_timeout_s must be a number > 0 or None, got '
                       f'{self.test_timeout_s!r}.')
    minimum = {'memory_bytes': 64 << 20, 'max_processes': 1, 'max_output_bytes': 1,
               'max_file_bytes': 0, 'max_open_files': 16}
    for name, low in minimum.items():
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f'SandboxConfig.{name} must be an int >= {low}, got {value!r}.')
    if self.namespaces not in NAMESPACE_MODES:
      raise ValueError(f'SandboxConfig.namespaces={self.namespaces!r}; choose one of '
                       f'{NAMESPACE_MODES}.')


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What a run did.

  reported: the harness wrote its nonce-tagged result line (the run reached its end).
  passed / total: unit tests passed / run (``passed`` is 0 unless ``reported``).
  timed_out: the wall limit was hit.
  returncode: of the process the parent started (``unshare`` when namespaces are used).
  stdout / stderr: captured output, decoded with replacement, at most ``max_output_bytes``.
  output_truncated: some output was dropped.
  leftovers_killed: processes of the run still alive after it ended, found and killed.
  isolation: the mechanisms in effect (see ``isolation``).
  """

  reported: bool
  passed: int
  total: int
  timed_out: bool
  returncode: int | None
  stdout: str
  stderr: str
  output_truncated: bool
  wall_s: float
  leftovers_killed: int
  isolation: tuple[str, ...]

  @property
  def fraction(self) -> float:
    """Fraction of unit tests passed (1.0 for a run without tests that reported success)."""
    if not self.reported:
      return 0.0
    return self.passed / self.total if self.total else 1.0


@functools.cache
def namespaces_available(python: str | None = None) -> bool:
  """Whether ``unshare --net --pid --fork`` can start ``python`` here (probed once)."""
  if shutil.which('unshare') is None:
    return False
  try:
    done = subprocess.run([*_UNSHARE, python or sys.executable, '-I', '-S', '-c', 'pass'],
                          capture_output=True, timeout=30, check=False)
  except (OSError, subprocess.SubprocessError):
    return False
  return done.returncode == 0


def _use_namespaces(config: SandboxConfig) -> bool:
  if config.namespaces == 'off':
    return False
  available = namespaces_available(config.python)
  if config.namespaces == 'on' and not available:
    raise ValueError("SandboxConfig.namespaces='on' but `unshare --net --pid --fork` fails on "
                     "this machine (needs root or unprivileged user namespaces); use 'auto' to "
                     'fall back to the guard alone.')
  return available


def isolation(config: SandboxConfig | None = None) -> tuple[str, ...]:
  """Names of the isolation mechanisms a run with ``config`` gets on this machine.

  Always: ``'tempdir'``, ``'rlimits'``, ``'session-kill'``, ``'tag-scan'``; with namespaces:
  ``'netns'``, ``'pidns'``; with the guard: ``'audit-guard'`` (which is also the network block
  when there is no ``'netns'``).
  """
  config = config or SandboxConfig()
  names = ['tempdir', 'rlimits', 'session-kill', 'tag-scan']
  if _use_namespaces(config):
    names += ['netns', 'pidns']
  if config.guard:
    names.append('audit-guard')
  return tuple(names)


_warned_no_network_isolation = False


def run_python(code: str, tests: Sequence[str] = (), *, setup: str = '',
               config: SandboxConfig | None = None) -> SandboxResult:
  """Runs ``setup + code``, then each test in ``tests`` (Python statements, e.g. asserts, run
  in the program's namespace; a test passes when it raises nothing), in a fresh sandbox.

  The program runs as module ``__solution__`` (an ``if __name__ == '__main__'`` block does not
  run) with stdin at end of file. Never raises for anything the program does; raises
  ValueError / TypeError for invalid arguments.
  """
  global _warned_no_network_isolation
  config = config or SandboxConfig()
  if not isinstance(code, str) or not isinstance(setup, str):
    raise TypeError(f'code and setup must be str, got {type(code).__name__} and '
                    f'{type(setup).__name__}.')
  tests = list(tests)
  if not all(isinstance(t, str) for t in tests):
    raise TypeError(f'tests must be a sequence of str, got {tests!r:.200}.')
  namespaces = _use_namespaces(config)
  mechanisms = isolation(config)
  if not namespaces and not config.guard and not _warned_no_network_isolation:
    _warned_no_network_isolation = True
    logging.warning('sandbox: neither network namespaces nor the guard are in effect; '
                    'sandboxed programs can use the network.')
  start = time.monotonic()
  root = tempfile.mkdtemp(prefix='rlax-sandbox-')
  tag = secrets.token_hex(16)
  nonce = secrets.token_hex(16)
  result_r, result_w = os.pipe()
  proc = None
  try:
    os.chmod(root, 0o700)
    python = config.python or sys.executable
    command = [*(_UNSHARE if namespaces else ()), python, '-I', '-B',
               *(() if config.site_packages else ('-S',)), str(CHILD_PATH), 'harness']
    payload = json.dumps({
        'nonce': nonce, 'result_fd': result_w, 'code': code, 'setup': setup, 'tests': tests,
        'test_timeout_s': config.test_timeout_s, 'limits': _limits(config), 'root': root,
        'guard': config.guard, 'max_forks': config.max_processes,
    }).encode('utf-8', 'surrogatepass')
    env = {'PATH': '/usr/local/bin:/usr/bin:/bin', 'HOME': root, 'TMPDIR': root,
           'LANG': 'C.UTF-8', 'LC_ALL': 'C.UTF-8', TAG_VARIABLE: tag}
    try:
      proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=root, env=env, pass_fds=(result_w,),
                              start_new_session=True)
    except OSError as e:
      return SandboxResult(False, 0, len(tests), False, None, '', f'sandbox: {e!r}', False,
                           time.monotonic() - start, 0, mechanisms)
    os.close(result_w)
    result_w = -1
    out = _Collector(proc, payload, result_r, config.max_output_bytes)
    timed_out = not out.run_until_exit(start + config.wall_s)
    killed = kill_run(proc, tag)
    out.drain(time.monotonic() + 1.0)
    returncode = proc.poll()
  finally:
    if proc is not None and proc.poll() is None:
      kill_run(proc, tag)
    for fd in (result_r, result_w):
      if fd >= 0:
        os.close(fd)
    shutil.rmtree(root, ignore_errors=True)
  passed, reported = _parse_result(out.result, nonce, len(tests))
  return SandboxResult(
      reported=reported, passed=passed, total=len(tests), timed_out=timed_out,
      returncode=returncode, stdout=out.text(1), stderr=out.text(2),
      output_truncated=out.truncated, wall_s=time.monotonic() - start,
      leftovers_killed=killed, isolation=mechanisms)


def _limits(config: SandboxConfig) -> dict[str, tuple[int, int]]:
  """The ``RLIMIT_*`` values the child sets on itself before running the program."""
  cpu = int(-(-config.cpu_s // 1))
  if os.geteuid() == 0:
    nproc = config.max_processes  # not enforced for root: the guard's fork cap is
  else:  # the limit counts every process and thread of the user
    nproc = _count_user_tasks(os.getuid()) + config.max_processes
  return {
      'RLIMIT_CPU': (cpu, cpu + 1), 'RLIMIT_AS': (config.memory_bytes, config.memory_bytes),
      'RLIMIT_FSIZE': (config.max_file_bytes, config.max_file_bytes),
      'RLIMIT_NOFILE': (config.max_open_files, config.max_open_files),
      'RLIMIT_NPROC': (nproc, nproc), 'RLIMIT_CORE': (0, 0),
  }


def _count_user_tasks(uid: int) -> int:
  """Processes and threads of ``uid`` (what ``RLIMIT_NPROC`` counts)."""
  count = 0
  for entry in os.scandir('/proc'):
    if entry.name.isdigit():
      try:
        if entry.stat().st_uid == uid:
          count += len(os.listdir(f'/proc/{entry.name}/task'))
      except OSError:
        pass
  return count


def tagged_pids(tag: str) -> set[int]:
  """Live processes whose environment carries ``RLAX_SANDBOX_TAG=tag``."""
  needle = f'\0{TAG_VARIABLE}={tag}\0'.encode()
  found = set()
  me = os.getpid()
  for entry in os.scandir('/proc'):
    if not entry.name.isdigit() or int(entry.name) == me:
      continue
    try:
      with open(f'/proc/{entry.name}/environ', 'rb') as f:
        environ = f.read()
    except OSError:
      continue
    if needle in b'\0' + environ + b'\0':
      found.add(int(entry.name))
  return found


def kill_run(proc: subprocess.Popen, tag: str) -> int:
  """SIGKILLs the run's session and every tagged process until none is left; reaps ``proc``.

  proc: the run's first process, started with ``start_new_session=True``.
  tag: the ``RLAX_SANDBOX_TAG`` value in the run's environment (inherited by its children).
  Returns the number of processes other than ``proc`` that the scan found alive.
  """
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  killed: set[int] = set()
  for _ in range(200):
    pids = tagged_pids(tag) - {proc.pid}
    if not pids:
      break
    for pid in pids:  # stop first so a forking process cannot outrun the kill
      _signal(pid, signal.SIGSTOP)
    for pid in pids:
      _signal(pid, signal.SIGKILL)
    killed |= pids
    time.sleep(0.002)
  try:
    proc.kill()
  except ProcessLookupError:
    pass
  try:
    proc.wait(timeout=5)
  except subprocess.TimeoutExpired:
    logging.error('sandbox: process %d did not exit after SIGKILL', proc.pid)
  return len(killed)


def _signal(pid: int, sig: int) -> None:
  try:
    os.kill(pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


class _Collector:
  """Feeds the payload to stdin and reads stdout, stderr and the result pipe, keeping at most
  ``cap`` bytes of each output stream."""

  def __init__(self, proc: subprocess.Popen, payload: bytes, result_fd: int, cap: int):
    self.proc, self.cap = proc, cap
    self.buffers = {1: bytearray(), 2: bytearray()}
    self.result = bytearray()
    self.truncated = False
    self._payload = memoryview(payload)
    self._selector = selectors.DefaultSelector()
    for fd, key in ((proc.stdout.fileno(), 1), (proc.stderr.fileno(), 2), (result_fd, 0)):
      os.set_blocking(fd, False)
      self._selector.register(fd, selectors.EVENT_READ, key)
    os.set_blocking(proc.stdin.fileno(), False)
    self._selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE, 'stdin')

  def run_until_exit(self, deadline: float) -> bool:
    """Pumps the pipes until the process exits (True) or ``deadline`` passes (False)."""
    while self.proc.poll() is None:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return False
      self._pump(min(remaining, 0.05))
    return True

  def drain(self, deadline: float) -> None:
    """Reads what is left until every pipe is closed or ``deadline`` passes."""
    self._close_stdin()
    while self._selector.get_map() and time.monotonic() < deadline:
      self._pump(0.05)
    for key in list(self._selector.get_map().values()):
      self._selector.unregister(key.fd)
    self._selector.close()

  def text(self, key: int) -> str:
    return self.buffers[key].decode('utf-8', 'replace')

  def _close_stdin(self) -> None:
    if self.proc.stdin is not None and not self.proc.stdin.closed:
      try:
        self._selector.unregister(self.proc.stdin.fileno())
      except (KeyError, ValueError):
        pass
      try:
        self.proc.stdin.close()
      except OSError:
        pass

  def _pump(self, timeout: float) -> None:
    for key, _ in self._selector.select(timeout):
      if key.data == 'stdin':
        try:
          sent = os.write(key.fd, self._payload[:1 << 16])
        except OSError:  # the child died or closed stdin
          self._close_stdin()
          continue
        self._payload = self._payload[sent:]
        if not self._payload:
          self._close_stdin()
        continue
      try:
        chunk = os.read(key.fd, 1 << 16)
      except BlockingIOError:
        continue
      except OSError:
        chunk = b''
      if not chunk:
        self._selector.unregister(key.fd)
        continue
      if key.data == 0:
        room = _RESULT_CAP - len(self.result)
        self.result += chunk[:max(room, 0)]
        continue
      buffer = self.buffers[key.data]
      room = self.cap - len(buffer)
      if len(chunk) > room:
        self.truncated = True
      buffer += chunk[:max(room, 0)]


_RESULT_RE = re.compile(rb'([0-9a-f]{32}) ([0-9]+) ([0-9]+)')


def _parse_result(result: bytes, nonce: str, total: int) -> tuple[int, bool]:
  """(tests passed, whether the harness reported) from the result pipe's last line."""
  lines = bytes(result).strip().splitlines()
  if not lines:
    return 0, False
  match = _RESULT_RE.fullmatch(lines[-1].strip())
  if match is None or match[1].decode() != nonce or int(match[3]) != total:
    return 0, False
  passed = int(match[2])
  return (passed, True) if passed <= total else (0, False)
