"""Free TCP ports for the servers tests start in subprocesses (coordinators, emulators, engines).

Binding port 0, closing the socket and handing the number to a subprocess leaves a window of
seconds (the child imports jax before it binds) in which the kernel may give the same number
to anyone else: another xdist worker's probe, or any outgoing connection's source port, all
drawn from the same ephemeral range. jax's coordinator is a gRPC server, which binds with
``SO_REUSEPORT``: two coordinators on one port both start and the kernel splits the clients
between them, so two 2-process jobs of concurrent tests join into each other (seen once:
both processes of tests/test_distributed.py reported process index 1).

``free_port`` therefore draws from below the ephemeral range, where the kernel hands out no
port by itself, and reserves each number for the whole test session with an exclusive
``flock`` on a file named after it, held open by the test process (released when it exits,
even by a crash), so no two test processes of any run on this machine hand out the same port.
"""

import fcntl
import os
import pathlib
import random
import socket
import tempfile

_LOW, _HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
_HELD: list[int] = []  # the open lock files of the ports this process handed out
_RANDOM = random.Random()  # its own: tests that seed the global one would draw alike


def _lock_dir() -> pathlib.Path:
  path = pathlib.Path(tempfile.gettempdir()) / f'rlax_llm_test_ports_{os.getuid()}'
  path.mkdir(exist_ok=True)
  return path


def _bindable(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(('127.0.0.1', port))
    except OSError:
      return False
  return True


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on and no other test process is handed."""
  lock_dir = _lock_dir()
  for _ in range(200):
    port = _RANDOM.randrange(_LOW, _HIGH)
    fd = os.open(lock_dir / str(port), os.O_CREAT | os.O_RDWR, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      continue
    if _bindable(port):
      _HELD.append(fd)
      return port
    os.close(fd)
  raise RuntimeError(f'no free port found in [{_LOW}, {_HIGH}) after 200 tries')
