"""The local backend's host memory: every role allocates from one process's heap, so buffers
of 1 MiB and more are mapped on their own and go back to the system when freed
(``backends.local.return_freed_buffers``); its parameter server holds no spare version
(tests/paramserver/test_server.py)."""

import ctypes

import numpy as np
import pytest

from rlax_llm.backends.local import MMAP_THRESHOLD_BYTES, return_freed_buffers


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks',
      'fordblks', 'keepcost')]


def _mapped_blocks() -> int:
  """glibc's count of allocations with a mapping of their own (``mallinfo2().hblks``)."""
  libc = ctypes.CDLL(None)
  if not hasattr(libc, 'mallinfo2'):
    pytest.skip('the C library is not glibc >= 2.33 (no mallinfo2)')
  libc.mallinfo2.restype = _MallInfo2
  return libc.mallinfo2().hblks


def test_buffers_of_a_mib_or_more_are_mapped_and_given_back_when_freed():
  # Freeing a 16 MiB mapped buffer raises glibc's default (dynamic) threshold to 16 MiB, so
  # without a fixed threshold a 2 MiB buffer would come from the heap, which keeps it.
  _mapped_blocks()  # skips where the C library is not glibc
  large = np.ones(2 << 20)  # 16 MiB
  del large
  assert return_freed_buffers()
  before = _mapped_blocks()
  buffer = np.ones(2 * MMAP_THRESHOLD_BYTES // 8)  # 2 MiB
  assert _mapped_blocks() == before + 1
  del buffer
  assert _mapped_blocks() == before
  small = np.ones(MMAP_THRESHOLD_BYTES // 16)  # 0.5 MiB: from the heap, as before
  assert _mapped_blocks() == before
  del small
