"""Pushes by shard (rlax_llm.paramserver.server.push_shards) on the 8 fake CPU devices: a
trainer spanning two processes is simulated by splitting its addressable shards in two."""

import pickle
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_llm.paramserver import ParameterServer, Shard, ShardPush, local_shards
from rlax_llm.paramserver import delta as delta_lib


@pytest.fixture(scope='module')
def params():
  """Leaves sharded four ways: over both mesh axes, over one (replicated over the other),
  fully replicated, and a host numpy leaf."""
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ('data', 'model'))
  rng = np.random.RandomState(0)

  def place(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))
  return {
      'both': place(jnp.asarray(rng.randn(8, 6), jnp.float32), P('data', 'model')),
      'rows': place(jnp.asarray(rng.randn(12, 3), jnp.bfloat16), P('data', None)),
      'replicated': place(jnp.arange(5, dtype=jnp.int32), P()),
      'host': np.float32(2.5),
  }


def halves(push: ShardPush) -> tuple[ShardPush, ShardPush]:
  """``push`` split as two processes would push it: devices 0-3, and devices 4-7 (plus host
  leaves)."""
  def on_first(shard):
    return isinstance(shard.data, jax.Array) and next(iter(shard.data.devices())).id < 4
  first = tuple(s for s in push.shards if on_first(s))
  second = tuple(s for s in push.shards if not on_first(s))
  return (ShardPush(push.treedef, push.paths, push.specs, first),
          ShardPush(push.treedef, push.paths, push.specs, second))


def assert_stored(server, version, params):
  snap = server.get(version)
  for got, want in zip(jax.tree.leaves(snap.params), jax.tree.leaves(params)):
    want = np.asarray(want)
    assert isinstance(got, np.ndarray) and not got.flags.writeable
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
  assert server.update(version).checksums == tuple(
      delta_lib.checksum(np.asarray(x)) for x in jax.tree.leaves(params))


def test_local_shards_names_each_distinct_block_once(params):
  push = local_shards(params)
  per_leaf = {}
  for shard in push.shards:
    per_leaf.setdefault(push.paths[shard.leaf], []).append(shard.box)
  assert len(per_leaf["['both']"]) == 8  # 4 x 2 blocks
  assert sorted(per_leaf["['rows']"]) == [((r, r + 3), (0, 3)) for r in (0, 3, 6, 9)]
  assert per_leaf["['replicated']"] == [((0, 5),)]  # one replica of 8
  assert per_leaf["['host']"] == [()]
  assert push.nbytes == 8 * 6 * 4 + 12 * 3 * 2 + 5 * 4 + 4


def test_push_of_a_sharded_tree_never_gathers_a_whole_array(params, monkeypatch):
  def no_gather(*args, **kwargs):
    raise AssertionError('push gathered a whole array with jax.device_get')
  monkeypatch.setattr(jax, 'device_get', no_gather)
  server = ParameterServer()
  server.push(0, params)
  assert_stored(server, 0, params)


def test_two_processes_commit_the_version_when_every_block_arrived(params):
  server = ParameterServer(keep=2)
  server.push(0, jax.tree.map(lambda x: np.zeros_like(np.asarray(x)), params))
  first, second = halves(local_shards(params))
  assert first.shards and second.shards
  assert not server.push_shards(1, first, process_index=0, process_count=2)
  # Not visible until complete: the latest, gets and updates still see version 0.
  assert server.latest_version() == 0 and server.versions() == [0]
  with pytest.raises(KeyError, match='version 1 is not held: it is still being pushed'):
    server.get(1)
  with pytest.raises(KeyError, match=r'version 1 is not held: it is still being pushed '
                     r'\(processes \[0\] of 2 pushed; 3 of 4 leaves lack blocks'):
    server.update(1, base_version=0)
  assert server.push_shards(1, second, process_index=1, process_count=2)
  assert server.latest_version() == 1
  assert_stored(server, 1, params)


def test_processes_may_push_concurrently(params):
  server = ParameterServer()
  parts = halves(local_shards(params))
  results, errors = [], []

  def push(index):
    try:
      results.append(server.push_shards(3, parts[index], index, 2))
    except ValueError as e:  # surfaced below
      errors.append(e)
  threads = [threading.Thread(target=push, args=(i,)) for i in (0, 1)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(10)
  assert not errors and sorted(results) == [False, True]
  assert_stored(server, 3, params)


def test_an_overlapping_push_is_an_error_and_changes_nothing(params):
  server = ParameterServer()
  first, second = halves(local_shards(params))
  server.push_shards(0, first, 0, 2)
  with pytest.raises(ValueError, match='process 0 already pushed version 0'):
    server.push_shards(0, second, 0, 2)
  with pytest.raises(ValueError, match=r"process 1 rejected: its shard \(\(0, 2\), \(0, 3\)\) "
                     r"of leaf \['both'\] overlaps the block"):
    server.push_shards(0, first, 1, 2)
  dup = ShardPush(second.treedef, second.paths, second.specs, second.shards + second.shards[:1])
  with pytest.raises(ValueError, match='overlaps the block'):
    server.push_shards(0, dup, 1, 2)  # overlapping itself
  with pytest.raises(ValueError, match='as one of 3 processes; the first push said 2'):
    server.push_shards(0, second, 1, 3)
  assert server.latest_version() == -1
  assert server.push_shards(0, second, 1, 2)  # the rejected pushes reserved nothing
  assert_stored(server, 0, params)


def test_an_incomplete_version_is_an_error_and_is_dropped(params):
  server = ParameterServer()
  first, _ = halves(local_shards(params))
  with pytest.raises(ValueError, match=r'version 0 is incomplete after all 1 processes pushed: '
                     r"3 leaves lack blocks \(\['both'\] misses 24 of 48 elements\)"):
    server.push_shards(0, first)
  assert server.latest_version() == -1 and server.versions() == []
  server.push_shards(0, first, 0, 2)
  with pytest.raises(ValueError, match='incomplete after all 2 processes'):
    server.push_shards(0, ShardPush(first.treedef, first.paths, first.specs, ()), 1, 2)
  server.push(0, params)  # dropped: the version number is free again
  assert_stored(server, 0, params)


def test_a_newer_version_waits_for_the_incomplete_one(params):
  server = ParameterServer()
  first, second = halves(local_shards(params))
  server.push_shards(4, first, 0, 2)
  with pytest.raises(ValueError, match=r'push of version 5 rejected: version 4 is incomplete '
                     r'\(processes \[0\] of 2 pushed'):
    server.push(5, params)
  server.push_shards(4, second, 1, 2)
  server.push(5, params)
  assert server.versions() == [4, 5]


@pytest.mark.parametrize('shard, pattern', [
    (Shard(0, ((0, 9), (0, 6)), np.zeros((9, 6), np.float32)), r'lies outside its shape \(8, 6\)'),
    (Shard(0, ((0, 2), (0, 6)), np.zeros((2, 5), np.float32)),
     r'holds \(2, 5\) float32; its block needs \(2, 6\) float32'),
    (Shard(0, ((0, 2), (0, 6)), np.zeros((2, 6), np.float64)), 'needs .* float32'),
    (Shard(7, (), np.zeros((), np.float32)), 'names leaf 7; the tree has 4 leaves'),
])
def test_a_malformed_shard_is_named(params, shard, pattern):
  push = local_shards(params)
  server = ParameterServer()
  with pytest.raises(ValueError, match=pattern):
    server.push_shards(0, ShardPush(push.treedef, push.paths, push.specs, (shard,)), 0, 2)
  assert server.latest_version() == -1


@pytest.mark.parametrize('index, count', [(2, 2), (-1, 2), (0, 0)])
def test_process_index_and_count_are_checked(params, index, count):
  with pytest.raises(ValueError, match='need 0 <= process_index < process_count'):
    ParameterServer().push_shards(0, local_shards(params), index, count)


def test_a_push_from_another_process_is_a_pickled_shard_push_of_host_arrays(params):
  shards = local_shards(params, to_host=True)
  assert all(isinstance(s.data, np.ndarray) for s in shards.shards)
  server = ParameterServer()
  server.push(0, pickle.loads(pickle.dumps(shards, protocol=5)))
  assert_stored(server, 0, params)


def test_an_empty_leaf_needs_no_block():
  server = ParameterServer()
  params = {'empty': np.zeros((0, 3), np.float32), 'w': np.ones(2, np.float32)}
  server.push(0, params)
  assert_stored(server, 0, params)
  delta_lib.verify(jax.tree.leaves(server.get(0).params), server.update(0).checksums,
                   ['empty', 'w'], version=0)
