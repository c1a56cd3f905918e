"""tests/ports.py: the ports tests hand to their servers never collide across test processes."""

import socket
import subprocess
import sys

import ports


class _Sequence:
  """Stands in for ports._RANDOM: draws the given ports in order."""

  def __init__(self, *values):
    self.values = list(values)

  def randrange(self, low, high):
    value = self.values.pop(0)
    assert low <= value < high
    return value


def test_a_port_another_process_holds_is_never_handed_out(monkeypatch, tmp_path):
  monkeypatch.setattr(ports.tempfile, 'gettempdir', lambda: str(tmp_path))
  first = ports.free_port()
  # Another test process draws the same number: its lock is held here, so it takes the next.
  code = (f'import sys; sys.path.insert(0, {str(ports.__file__.rsplit("/", 1)[0])!r})\n'
          'import ports, tempfile\n'
          f'tempfile.gettempdir = lambda: {str(tmp_path)!r}\n'
          'class S:\n'
          f'  values = [{first}, {first + 1 if first + 1 < ports._HIGH else first - 1}]\n'
          '  def randrange(self, low, high): return self.values.pop(0)\n'
          'ports._RANDOM = S()\n'
          'print(ports.free_port())\n')
  other = int(subprocess.run([sys.executable, '-c', code], check=True, capture_output=True,
                             text=True).stdout)
  assert other != first


def test_a_port_something_listens_on_is_skipped(monkeypatch, tmp_path):
  monkeypatch.setattr(ports.tempfile, 'gettempdir', lambda: str(tmp_path))
  port = ports._LOW + 7
  with socket.socket() as listener:
    listener.bind(('127.0.0.1', port))
    listener.listen()
    monkeypatch.setattr(ports, '_RANDOM', _Sequence(port, port + 1))
    assert ports.free_port() == port + 1
