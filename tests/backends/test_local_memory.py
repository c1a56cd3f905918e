"""The local backend's host memory: every role allocates from one process's heap, so buffers
of 1 MiB and more are mapped on their own and go back to the system when freed
(``backends.local.return_freed_buffers``); its parameter server holds no spare version
(tests/paramserver/test_server.py)."""

import ctypes
import subprocess
import sys
import textwrap

import pytest

# Run in a process of its own: glibc maps a request of the threshold's size only when its
# heap has no free chunk that large, and a test process's heap (after other tests) has many.
_CHECK = textwrap.dedent('''
    import ctypes
    import numpy as np
    from rlax_llm.backends.local import MMAP_THRESHOLD_BYTES, return_freed_buffers

    class MallInfo2(ctypes.Structure):
      _fields_ = [(name, ctypes.c_size_t) for name in (
          'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks',
          'fordblks', 'keepcost')]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    mapped = lambda: libc.mallinfo2().hblks  # allocations with a mapping of their own
    # Freeing a 16 MiB mapped buffer raises glibc's default (dynamic) threshold to 16 MiB, so
    # without a fixed threshold a 2 MiB buffer would come from the heap, which keeps it.
    large = np.ones(2 << 20)
    del large
    assert return_freed_buffers()
    before = mapped()
    buffer = np.ones(2 * MMAP_THRESHOLD_BYTES // 8)  # 2 MiB
    assert mapped() == before + 1, (before, mapped())
    del buffer
    assert mapped() == before, (before, mapped())
    small = np.ones(MMAP_THRESHOLD_BYTES // 16)  # 0.5 MiB: from the heap, as before
    assert mapped() == before, (before, mapped())
''')


def test_buffers_of_a_mib_or_more_are_mapped_and_given_back_when_freed():
  if not hasattr(ctypes.CDLL(None), 'mallinfo2'):
    pytest.skip('the C library is not glibc >= 2.33 (no mallinfo2)')
  result = subprocess.run([sys.executable, '-c', _CHECK], capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
