"""The shared-memory transport (rlax_llm/paramserver/shm.py) in one process: a version written
into a slot, committed by reference and read back zero-copy with its checksums; corruption
is caught; a slot is reused only when nobody holds it; closing, or the owner's death, frees
every segment; which processes use it."""

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from memfd import holders  # (tests/memfd.py)

from rlax_llm.cli import load_config_file
from rlax_llm.config import validate_config
from rlax_llm.errors import ConfigError
from rlax_llm.paramserver import ParameterServer, Shard, ShardPush, delta, local_shards, shm
from rlax_llm.transport_spec import TRANSPORTS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def params_of(version: int) -> dict:
  rng = np.random.default_rng(version)
  return {'w': rng.random((64, 33), np.float32), 'b': rng.random((5,), np.float32).astype(
      ml_dtypes.bfloat16), 'n': np.arange(7, dtype=np.int32) + version,
          'e': np.zeros((0, 3), np.float32)}


class Pair:
  """A server with its ring, a writer and a reader (all in this process)."""

  def __init__(self, keep: int = 1):
    self.server = ParameterServer(keep=keep)
    self.ring = shm.SlotRing()
    self.writer, self.reader = shm.SlotWriter(), shm.SlotReader()

  def push(self, version: int, push: ShardPush) -> shm.Slot:
    slot = self.ring.reserve(version, shm.layout(push.specs)[1])
    checksums = self.writer.write(slot, push)
    empty = ShardPush(push.treedef, push.paths, push.specs, ())
    self.ring.commit(self.server, version, slot, empty, checksums)
    return slot

  def pull(self, version: int, report: bool = True) -> list[np.ndarray]:
    """What a worker does: reports the slots it holds, gets the update, maps, verifies."""
    update, handed = self.ring.in_slots(self.server.update(version, -1))
    self.ring.lease('worker', self.reader.held() if report else [], handed)
    update = self.reader.resolve(update)
    leaves = delta.apply([None] * update.num_leaves, update)
    delta.verify(leaves, update.checksums, list(self.server.template), version)
    return leaves


def test_a_version_round_trips_through_a_slot_with_its_checksums():
  pair = Pair(keep=2)
  params = params_of(0)
  push = local_shards(params, to_host=True)
  slot = pair.push(0, push)
  stored = pair.server.get(0).params
  leaves = pair.pull(0)
  # Bit for bit, each leaf's checksum the one of the pushed array (taken while copying).
  for (path, want), got in zip(sorted(params.items()), leaves):
    assert got.dtype == want.dtype and got.shape == want.shape, path
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
  assert pair.server.update(0, -1).checksums == tuple(
      delta.checksum(x) for _, x in sorted(params.items()))
  # No copy by the server or the reader: both are read-only views of the slot.
  for leaf in [*stored.values(), *leaves]:
    assert leaf.size == 0 or not (leaf.flags.owndata or leaf.flags.writeable)
  sent, handed = pair.ring.in_slots(pair.server.update(0, -1))
  assert handed == [slot.name] and sent.nbytes == 0
  assert all(isinstance(u, shm.SlotLeaf) for bucket in sent.buckets for u in bucket
             if not (isinstance(u, delta.LeafUpdate) and u.full.size == 0))


def test_a_leaf_pushed_in_blocks_is_assembled_and_summed_in_the_slot():
  pair = Pair()
  full = np.random.default_rng(1).random((8, 6), np.float32)
  push = dataclasses.replace(local_shards({'x': full}, to_host=True), shards=(
      Shard(0, ((4, 8), (0, 6)), full[4:]), Shard(0, ((0, 4), (0, 6)), full[:4])))
  pair.push(0, push)
  (leaf,) = pair.pull(0)
  np.testing.assert_array_equal(leaf, full)
  missing = ShardPush(push.treedef, push.paths, push.specs, push.shards[:1])
  slot = pair.ring.reserve(1, shm.layout(push.specs)[1])
  with pytest.raises(ValueError, match=r"leaf \['x'\]: the shards hold 24 of its 48 elements"):
    pair.writer.write(slot, missing)


def test_a_corrupted_byte_is_detected_by_the_reader():
  pair = Pair()
  push = local_shards(params_of(0), to_host=True)
  slot = pair.push(0, push)
  offsets, _ = shm.layout(push.specs)
  index = push.paths.index("['w']")
  buffer = shm._Mappings(writable=True).buffer(slot)  # pylint: disable=protected-access
  buffer[offsets[index] + 1000] ^= 0x10  # one bit of one byte, after the commit
  with pytest.raises(ValueError, match=r"leaf \['w'\] of version 0 fails its checksum"):
    pair.pull(0)


def test_a_slot_a_reader_holds_is_never_overwritten():
  """keep=1: version 0 is dropped at once, but the reader still holds a view derived from
  one of its leaves (the leaf itself gone), and a pull of it is still being answered on the
  server's side: later versions go to other slots and version 0's bytes never change. The
  control, a reader that does not report what it holds, gets its bytes overwritten: the
  assertion would catch a reuse that ignored the readers."""
  pair = Pair(keep=1)
  pair.push(0, local_shards(params_of(0), to_host=True))
  leaves = pair.pull(0)
  derived = leaves[-1][10:20].T  # ['w'] rows 10..19, transposed: a view of a view
  expected = params_of(0)['w'][10:20].T.copy()
  in_flight = pair.server.update(0, -1)  # the server answering a pull of version 0
  del leaves
  for version in range(1, 7):
    pair.push(version, local_shards(params_of(version), to_host=True))
    np.testing.assert_array_equal(pair.pull(version)[-1], params_of(version)['w'])
    np.testing.assert_array_equal(derived, expected)
  del in_flight
  assert len(pair.ring.names()) <= 4  # reused: version 0's slot, plus two in rotation

  control = Pair(keep=1)
  control.push(0, local_shards(params_of(0), to_host=True))
  derived = control.pull(0, report=False)[-1][10:20].T
  for version in range(1, 4):
    control.push(version, local_shards(params_of(version), to_host=True))
    control.pull(version, report=False)
  assert not np.array_equal(derived, expected)


def test_reservations_of_versions_that_never_committed_are_given_up():
  pair = Pair()
  push = local_shards(params_of(0), to_host=True)
  nbytes = shm.layout(push.specs)[1]
  lost = pair.ring.reserve(0, nbytes)  # its writer died before committing
  again = pair.ring.reserve(0, nbytes)
  assert again != lost  # reserved: not handed out twice
  slot = pair.ring.reserve(1, nbytes)  # a newer version: version 0's are given up
  assert slot in (lost, again) and len(pair.ring.names()) == 2
  empty = ShardPush(push.treedef, push.paths, push.specs, ())
  with pytest.raises(ValueError, match='not reserved for it'):
    pair.ring.commit(pair.server, 2, slot, empty, (0,) * len(push.specs))


def test_closing_the_ring_frees_every_segment_and_leaves_nothing_in_dev_shm():
  before = set(os.listdir('/dev/shm'))
  pair = Pair(keep=1)
  for version in range(3):
    pair.push(version, local_shards(params_of(version), to_host=True))
  tag = pair.ring.names()[0].rsplit('_', 1)[0]
  assert holders(tag) == [str(os.getpid())]
  pair.ring.close()
  pair.server = pair.writer = pair.reader = None  # the server's views, the others' mappings
  assert holders(tag) == []
  assert set(os.listdir('/dev/shm')) == before
  with pytest.raises(RuntimeError, match='closed'):
    pair.ring.reserve(9, 10)


def test_the_segments_of_a_killed_owner_are_freed():
  """A server process killed with SIGKILL (no cleanup runs) leaves no segment behind."""
  code = ('import sys, time; from rlax_llm.paramserver import shm; ring = shm.SlotRing(); '
          'print(ring.reserve(0, 1 << 20).name, flush=True); time.sleep(60)')
  proc = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, 'PYTHONPATH': str(ROOT)})
  try:
    tag = proc.stdout.readline().strip().rsplit('_', 1)[0]
    assert tag.startswith(shm.PREFIX) and holders(tag) == [str(proc.pid)]
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  for _ in range(50):
    if not holders(tag):
      break
    time.sleep(0.1)
  assert holders(tag) == []
  assert not any(name.startswith(tag) for name in os.listdir('/dev/shm'))


@pytest.mark.parametrize('transport, server, client, processes, expected', [
    ('auto', 'node-a', 'node-a', 1, True),
    ('auto', 'node-a', 'node-b', 1, False),  # another machine: the object store
    ('auto', 'node-a', 'node-a', 2, False),  # a trainer of several processes
    ('object_store', 'node-a', 'node-a', 1, False),
])
def test_which_processes_use_the_slots(transport, server, client, processes, expected):
  assert shm.use_slots(transport, server, client, processes) is expected


def test_an_unknown_transport_is_refused():
  with pytest.raises(ValueError, match="paramserver.transport='plasma'"):
    shm.use_slots('plasma', 'a', 'a')


def test_the_config_refuses_a_transport_as_the_slots_do():
  """One list of transports (rlax_llm.transport_spec) for the config and the slots."""
  config = load_config_file('configs/default.py:smoke')
  config.paramserver.transport = 'plasma'
  with pytest.raises(ConfigError) as refused_by_config:
    validate_config(config)
  with pytest.raises(ValueError) as refused_by_slots:
    shm.use_slots('plasma', 'a', 'a')
  assert str(refused_by_config.value) == f'config.{refused_by_slots.value}'
  for transport in TRANSPORTS:
    config.paramserver.transport = transport
    assert validate_config(config).transport == transport
