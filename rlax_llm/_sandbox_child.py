"""The child side of ``rlax_llm.sandbox``: this file runs INSIDE the sandboxed interpreter.

Standard library only, and imported by nothing in the package: the parent starts
``python -I -B [-S] _sandbox_child.py MODE`` (``-I`` keeps the package, the working directory
and every ``PYTHON*`` variable off ``sys.path``) and talks to it over pipes. Two modes:

* ``harness``: reads one JSON payload from stdin (the code, its unit tests, the limits and a
  random nonce), lowers its own resource limits, installs the guard, runs the code and then
  each test, and writes ``'<nonce> <passed> <total>'`` to the result descriptor as its very
  last act. Success is reported positively: a program that exits, crashes or is killed before
  that line scores nothing.
* ``math``: a persistent ``math-verify`` worker. Reads JSON lines ``{"gold", "pred",
  "timeout"}`` and answers ``{"ok": bool}`` lines; the parent kills it when an answer is late.

The guard is a PEP 578 audit hook (``sys.addaudithook``; it cannot be removed once installed)
that refuses network sockets, process spawning (``exec``, ``system``, ``posix_spawn``,
``subprocess``), more than ``max_forks`` forks in the whole process tree, writes and
directory changes outside the sandbox directory, signals to other processes, ``ctypes`` and
(harness only) the introspection a program would need to find the nonce (``gc`` object walks,
frames). It is defence in depth in front of the operating-system limits, not a boundary
against a determined attacker (docs/tasks.md).
"""

import builtins
import json
import mmap
import os
import resource
import signal
import struct
import sys

_WRITE_FLAGS = (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC)
# Modules a sandboxed program may not import: raw memory access and spawning that bypasses the
# audited `subprocess.Popen` (`_posixsubprocess.fork_exec` raises no audit event).
_DENIED_IMPORTS = frozenset({'ctypes', '_ctypes', '_posixsubprocess', 'cffi', '_testcapi',
                             '_testinternalcapi', '_xxsubinterpreters', 'faulthandler'})
_DENIED_EVENTS = frozenset({
    'os.exec', 'os.posix_spawn', 'os.spawn', 'os.system', 'os.startfile', 'subprocess.Popen',
    'pty.spawn', 'ctypes.dlopen', 'ctypes.dlsym', 'ctypes.cdata', 'ctypes.addressof',
    'os.setxattr', 'os.removexattr', 'sys.remote_exec',
})
# Events whose arguments name paths that are written: {event: (path arg indices, dir_fd
# arg indices)}. A dir_fd makes the path relative to a directory the hook cannot see: refused.
_PATH_EVENTS = {
    'os.remove': ((0,), (1,)), 'os.rmdir': ((0,), (1,)), 'os.mkdir': ((0,), (2,)),
    'os.rename': ((0, 1), (2, 3)), 'os.link': ((0, 1), (2, 3)), 'os.symlink': ((1,), (2,)),
    'os.chmod': ((0,), (2,)), 'os.chown': ((0,), (3,)), 'os.utime': ((0,), (3,)),
    'os.truncate': ((0,), ()), 'os.chflags': ((0,), ()), 'os.lchflags': ((0,), ()),
    'os.chdir': ((0,), ()), 'os.mkfifo': ((0,), (2,)), 'os.mknod': ((0,), (3,)),
    'shutil.rmtree': ((0,), ()), 'shutil.move': ((0, 1), ()), 'shutil.copyfile': ((1,), ()),
}
_INTROSPECTION_EVENTS = frozenset({
    'gc.get_objects', 'gc.get_referrers', 'gc.get_referents', 'sys.settrace', 'sys.setprofile',
    'sys._current_frames', 'sys._current_exceptions', 'sys.monitoring.register_callback',
})
_FRAME_ATTRIBUTES = frozenset({'tb_frame', 'gi_frame', 'cr_frame', 'ag_frame', 'f_back',
                               'f_locals', 'f_globals'})


class SandboxViolation(PermissionError):
  """Raised by the guard inside the sandbox when a program does something it may not."""


def set_limits(limits):
  """Applies ``{'RLIMIT_X': [soft, hard]}`` (``-1`` is unlimited) to this process."""
  for name, (soft, hard) in limits.items():
    resource.setrlimit(getattr(resource, name), (soft, hard))


def install_guard(root, max_forks, introspection):
  """Installs the audit hook; ``root`` is the only directory tree that may be written."""
  root = os.path.realpath(root)
  prefix = root.rstrip(os.sep) + os.sep
  # Fork counter shared by the whole process tree (an anonymous shared mapping survives fork).
  forks = mmap.mmap(-1, 8)
  pid = os.getpid()
  realpath, isdir, fspath = os.path.realpath, os.path.isdir, os.fspath
  for name in list(sys.modules):
    if name.split('.')[0] in _DENIED_IMPORTS:
      del sys.modules[name]  # a cached module would not raise the import event

  def inside(path):
    if isinstance(path, int):
      return True  # an open descriptor: it was checked when it was opened
    try:
      path = fspath(path)
      if isinstance(path, bytes):
        path = path.decode('utf-8', 'surrogateescape')
      resolved = realpath(path)
    except Exception:  # pylint: disable=broad-except
      return False
    return resolved == root or resolved.startswith(prefix)

  def deny(event, detail=''):
    raise SandboxViolation(f'sandbox: {event}{detail} is not allowed')

  def hook(event, args):
    if event in _DENIED_EVENTS:
      deny(event)
    if event.startswith('socket.'):
      deny(event, ' (no network in the sandbox)')
    if event == 'open':
      path, mode, flags = (tuple(args) + (None, None, None))[:3]
      writes = bool((flags or 0) & _WRITE_FLAGS) or any(c in (mode or '') for c in 'wax+')
      if writes and not inside(path):
        deny(event, f' for writing outside the sandbox directory: {path!r}')
      if not isinstance(path, int) and not inside(path):
        try:
          if isdir(path):  # a directory descriptor would let *at calls write outside
            deny(event, f' of a directory outside the sandbox: {path!r}')
        except SandboxViolation:
          raise
        except Exception:  # pylint: disable=broad-except
          pass
    elif event in _PATH_EVENTS:
      paths, dir_fds = _PATH_EVENTS[event]
      for i in dir_fds:
        if i < len(args) and args[i] is not None and args[i] != -100:  # AT_FDCWD
          deny(event, ' with dir_fd')
      for i in paths:
        if i < len(args) and not inside(args[i]):
          deny(event, f' outside the sandbox directory: {args[i]!r}')
    elif event in ('os.fork', 'os.forkpty'):
      count = struct.unpack_from('q', forks)[0] + 1
      if count > max_forks:
        deny(event, f' beyond {max_forks} processes')
      struct.pack_into('q', forks, 0, count)
    elif event in ('os.kill', 'os.killpg'):
      target = args[0] if args else None
      if target not in (0, os.getpid()):
        deny(event, ' to another process')
    elif event == 'import' and args and str(args[0]).split('.')[0] in _DENIED_IMPORTS:
      raise ImportError(f'sandbox: import of {args[0]!r} is not allowed')
    elif introspection:
      if event in _INTROSPECTION_EVENTS:
        deny(event)
      if event == 'sys._getframe' and os.getpid() == pid:
        raise ValueError('sandbox: sys._getframe is not allowed')  # stdlib callers catch this
      if event == 'object.__getattr__' and len(args) > 1 and args[1] in _FRAME_ATTRIBUTES:
        raise AttributeError(f'sandbox: frame access ({args[1]}) is not allowed')

  sys.addaudithook(hook)


class _TestTimeout(BaseException):
  """One unit test ran past its time limit (SIGALRM)."""


def _on_alarm(signum, frame):  # pylint: disable=unused-argument
  raise _TestTimeout()


def _note(what, error):
  """One line on stderr about an exception (tracebacks need frames, which the guard hides)."""
  try:
    kind = 'timeout' if isinstance(error, _TestTimeout) else type(error).__name__
    text = f'sandbox: {what}: {kind}: {error}'[:500]
    os.write(2, text.encode('utf-8', 'replace') + b'\n')
  except BaseException:  # pylint: disable=broad-except
    pass


def harness():
  """Runs the payload's code and tests; reports ``nonce passed total`` on the result fd."""
  if os.getpid() == 1:
    # First process of a new PID namespace: the kernel drops signals init has no handler for
    # (so a program could not even kill itself), and when init exits every other process of
    # the namespace is killed. So init only reaps; the program runs in its child.
    child = os.fork()
    if child:
      while True:
        try:
          pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
          os._exit(1)
        if pid == child:
          code = os.waitstatus_to_exitcode(status)
          os._exit(code if code >= 0 else 128 - code)
  payload = json.loads(sys.stdin.buffer.read().decode('utf-8', 'surrogatepass'))
  sys.stdin.close()
  nonce, result_fd = payload.pop('nonce'), payload['result_fd']
  tests, per_test_s = payload['tests'], payload['test_timeout_s']
  set_limits(payload['limits'])
  if payload['guard']:
    install_guard(payload['root'], payload['max_forks'], introspection=True)
  signal.signal(signal.SIGALRM, _on_alarm)
  namespace = {'__name__': '__solution__', '__builtins__': builtins}
  loaded = True
  try:
    exec(compile(payload['setup'] + '\n' + payload['code'], 'solution.py', 'exec'), namespace)  # pylint: disable=exec-used
  except BaseException as e:  # pylint: disable=broad-except
    loaded = False  # SystemExit too: a program that exits while loading passes no test
    _note('the program raised', e)
  passed = 0
  if loaded:
    for i, test in enumerate(tests):
      ok = False
      try:
        if per_test_s:
          signal.setitimer(signal.ITIMER_REAL, per_test_s)
        exec(compile(test, f'test_{i}.py', 'exec'), namespace)  # pylint: disable=exec-used
        ok = True
      except BaseException as e:  # pylint: disable=broad-except
        ok = False
        _note(f'test {i} failed', e)
      finally:
        try:
          signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException:  # pylint: disable=broad-except
          pass
      passed += ok
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except BaseException:  # pylint: disable=broad-except
      pass
  os.write(result_fd, f'\n{nonce} {passed} {len(tests)}\n'.encode())
  os._exit(0)  # skip atexit handlers and threads the program left behind


def math_worker():
  """Answers ``{"gold", "pred", "timeout"}`` lines with ``{"ok": bool}`` lines."""
  config = json.loads(sys.argv[2])
  set_limits(config['limits'])
  out = os.fdopen(os.dup(1), 'w')
  sys.stdout = sys.stderr
  import logging  # pylint: disable=import-outside-toplevel
  logging.disable(logging.CRITICAL)  # math-verify logs every timeout and parse failure
  try:
    import math_verify  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except
    out.write(json.dumps({'ready': False, 'error': repr(e)}) + '\n')
    out.flush()
    return
  if config['guard']:
    install_guard(config['root'], 0, introspection=False)
  out.write(json.dumps({'ready': True}) + '\n')
  out.flush()
  for line in sys.stdin:
    ok = False
    try:
      request = json.loads(line)
      seconds = max(1, int(request['timeout']))
      gold = math_verify.parse('\\boxed{' + request['gold'] + '}', parsing_timeout=seconds)
      pred = math_verify.parse('\\boxed{' + request['pred'] + '}', parsing_timeout=seconds)
      ok = bool(gold) and bool(pred) and bool(
          math_verify.verify(gold, pred, timeout_seconds=seconds))
    except BaseException:  # pylint: disable=broad-except
      ok = False
    out.write(json.dumps({'ok': ok}) + '\n')
    out.flush()


if __name__ == '__main__':
  if sys.argv[1:2] == ['harness']:
    harness()
  elif sys.argv[1:2] == ['math']:
    math_worker()
  else:
    sys.exit(f'usage: {sys.argv[0]} harness|math CONFIG_JSON')
