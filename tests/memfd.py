"""Which processes of this machine still hold shared memory of a parameter server's ring
(``rlax_llm.paramserver.shm``): the kernel frees a segment's memory once none does."""

import os
import pathlib


def holders(tag: str) -> list[str]:
  """The pids of this user's processes holding a file descriptor or a mapping of a segment
  whose name contains ``tag`` (a ring's ``rlax_ps_<ring>`` prefix)."""
  def read(call, path, default):
    try:
      return call(path)
    except OSError:  # gone (a process, or a descriptor listing it opened), another user's
      return default
  found = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    links = [read(os.readlink, f'/proc/{pid}/fd/{fd}', '')
             for fd in read(os.listdir, f'/proc/{pid}/fd', [])]
    maps = read(lambda path: pathlib.Path(path).read_text(), f'/proc/{pid}/maps', '')
    if any(tag in link for link in links) or tag in maps:
      found.append(pid)
  return found
