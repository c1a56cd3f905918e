"""Tests for rlax_llm.paramserver.server."""

import re
import sys

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.paramserver import ParameterServer, WeightSnapshot
from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.paramserver.shards import Shard, ShardPush


def make_params(scale: float = 1.0) -> dict:
  """Small nested tree: numpy float32 / int32 leaves and a JAX array leaf."""
  return {
    'embed': np.arange(6, dtype=np.float32).reshape(2, 3) * scale,
    'layer': {
      'w': jnp.full((3,), 2.0 * scale, dtype=jnp.float32),
      'step': np.array(7, dtype=np.int32),
    },
  }


def assert_tree_equal(actual, expected) -> None:
  assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
  for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
    assert isinstance(a, np.ndarray)
    assert a.dtype == np.asarray(e).dtype
    np.testing.assert_array_equal(a, np.asarray(e))


def _push_error(server: ParameterServer, version) -> str:
  with pytest.raises(ValueError) as info:
    server.push(version, make_params())
  return str(info.value)


def test_push_get_round_trip():
  server = ParameterServer()
  params = make_params()
  server.push(0, params)
  snap = server.get(0)
  assert isinstance(snap, WeightSnapshot)
  assert snap.version == 0
  assert_tree_equal(snap.params, params)
  assert snap.metadata == {
    "['embed']": ((2, 3), 'float32'),
    "['layer']['step']": ((), 'int32'),
    "['layer']['w']": ((3,), 'float32'),
  }
  assert server.template == snap.metadata
  assert server.latest_version() == 0
  assert server.versions() == [0]


def test_get_returns_the_exact_version():
  server = ParameterServer(keep=3)
  for v in range(3):
    server.push(v, make_params(scale=v + 1.0))
  assert server.latest_version() == 2 and server.get(2).version == 2
  np.testing.assert_array_equal(server.get(2).params['layer']['w'], [6.0, 6.0, 6.0])
  np.testing.assert_array_equal(server.get(1).params['layer']['w'], [4.0, 4.0, 4.0])


def test_non_finite_values_are_stored_as_is():
  server = ParameterServer()
  params = make_params()
  params['embed'][0, 0] = np.nan
  params['embed'][1, 2] = -np.inf
  server.push(0, params)
  embed = server.get(0).params['embed']
  assert np.isnan(embed[0, 0]) and embed[1, 2] == -np.inf


@pytest.mark.parametrize('bad_version', [0, 2, -1])
def test_push_with_old_version_raises_and_changes_nothing(bad_version):
  server = ParameterServer()
  server.push(0, make_params(scale=1.0))
  server.push(2, make_params(scale=1.0))
  with pytest.raises(
    ValueError,
    match=rf'version {bad_version} rejected: the latest version is 2 .*never go backwards',
  ):
    server.push(bad_version, make_params(scale=5.0))
  assert server.latest_version() == 2
  assert server.versions() == [0, 2]
  np.testing.assert_array_equal(server.get(2).params['layer']['w'], [2.0, 2.0, 2.0])


@pytest.mark.parametrize('bad_version', [True, 1.0, '3', None])
def test_push_rejects_non_int_versions(bad_version):
  server = ParameterServer()
  assert 'must be an int' in _push_error(server, bad_version)
  assert server.latest_version() == -1
  assert server.versions() == []


def test_push_accepts_numpy_integer_version():
  server = ParameterServer()
  server.push(np.int64(3), make_params())
  assert server.latest_version() == 3
  assert type(server.get(3).version) is int


def _bad_shape(p):
  p['layer']['w'] = jnp.zeros((4,), jnp.float32)


def _bad_dtype(p):
  p['embed'] = p['embed'].astype(np.float16)


def _missing_leaf(p):
  del p['layer']['step']


def _extra_leaf(p):
  p['layer']['b'] = np.zeros((3,), np.float32)


@pytest.mark.parametrize(
  'mutate, pattern',
  [
    (_bad_shape, r"leaf \['layer'\]\['w'\] has shape \(4,\).*expects \(3,\)"),
    (_bad_dtype, r"leaf \['embed'\] has dtype float16.*expects float32"),
    (_missing_leaf, r"missing leaves \[\"\['layer'\]\['step'\]\"\], extra leaves \[\]"),
    (_extra_leaf, r"missing leaves \[\], extra leaves \[\"\['layer'\]\['b'\]\"\]"),
  ],
  ids=['shape', 'dtype', 'missing', 'extra'],
)
def test_template_mismatch_raises_with_leaf_path_and_changes_nothing(mutate, pattern):
  server = ParameterServer()
  server.push(0, make_params())
  bad = make_params(scale=3.0)
  mutate(bad)
  with pytest.raises(ValueError, match=pattern):
    server.push(1, bad)
  assert server.latest_version() == 0
  assert server.versions() == [0]
  # The failed version number is still free: a matching push with it succeeds.
  server.push(1, make_params(scale=3.0))
  assert server.latest_version() == 1


def test_container_type_mismatch_raises():
  server = ParameterServer()
  server.push(0, {'x': [np.zeros(2, np.float32)]})
  with pytest.raises(ValueError, match='container types differ'):
    server.push(1, {'x': (np.zeros(2, np.float32),)})


def test_constructor_template_of_shape_dtype_structs():
  template = jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), make_params()
  )
  server = ParameterServer(template=template)
  assert server.template["['layer']['w']"] == ((3,), 'float32')
  bad = make_params()
  bad['layer']['step'] = np.array(7, dtype=np.int64)
  with pytest.raises(ValueError, match=r"leaf \['layer'\]\['step'\] has dtype int64"):
    server.push(0, bad)
  assert server.latest_version() == -1
  server.push(0, make_params())
  assert server.latest_version() == 0


def test_keep_evicts_old_versions():
  server = ParameterServer(keep=2)
  for v in (0, 1, 5):
    server.push(v, make_params(scale=float(v)))
  assert server.versions() == [1, 5]
  np.testing.assert_array_equal(server.get(1).params['layer']['w'], [2.0, 2.0, 2.0])
  with pytest.raises(KeyError, match=re.escape('held versions: [1, 5]')):
    server.get(0)
  with pytest.raises(KeyError, match=re.escape('held versions: [1, 5]')):
    server.get(3)


@pytest.mark.parametrize('keep', [0, -1, True, 1.5])
def test_keep_is_validated(keep):
  with pytest.raises(ValueError, match='keep must be an int >= 1'):
    ParameterServer(keep=keep)


def test_stored_arrays_are_read_only_copies():
  server = ParameterServer()
  params = make_params()
  server.push(0, params)
  params['embed'][:] = -1.0
  params['layer']['step'][...] = 99
  params['layer']['w'] = jnp.zeros((3,), jnp.float32)  # replacing a leaf in the caller's tree
  snap = server.get(0)
  assert_tree_equal(snap.params, make_params())
  for leaf in jax.tree_util.tree_leaves(snap.params):
    assert not leaf.flags.writeable
    assert not np.shares_memory(leaf, params['embed'])
  with pytest.raises(ValueError, match='read-only'):
    snap.params['embed'][0, 0] = 5.0
  # Rearranging one snapshot's containers leaves the stored version intact.
  snap.params['layer'].clear()
  assert_tree_equal(server.get(0).params, make_params())


def test_updates_carry_the_checksums_taken_at_push_time():
  server = ParameterServer()
  server.push(0, make_params())
  server.push(1, make_params(scale=2.0))
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(make_params(scale=2.0))]
  for base_version in (-1, 0):
    update = server.update(1, base_version=base_version)
    assert update.checksums == tuple(delta_lib.checksum(leaf) for leaf in leaves)


def test_a_dropped_versions_buffers_are_reused_only_when_nobody_holds_them():
  server = ParameterServer(keep=1)

  def addresses(version):
    return {leaf.ctypes.data for leaf in jax.tree_util.tree_leaves(server.get(version).params)}

  server.push(0, make_params(scale=1.0))
  held = server.get(0)  # a reader keeps version 0
  view = held.params['embed'].reshape(-1)  # and a view of one of its leaves
  server.push(1, make_params(scale=2.0))  # drops 0
  v1 = addresses(1)
  server.push(2, make_params(scale=3.0))  # drops 1, which nobody holds
  assert not addresses(2) & {leaf.ctypes.data for leaf in jax.tree_util.tree_leaves(held.params)}
  assert_tree_equal(held.params, make_params(scale=1.0))  # never overwritten
  server.push(3, make_params(scale=4.0))  # reuses version 1's buffers, nobody held them
  assert addresses(3) == v1
  assert_tree_equal(server.get(3).params, make_params(scale=4.0))
  for leaf in jax.tree_util.tree_leaves(server.get(3).params):
    assert not leaf.flags.writeable
  np.testing.assert_array_equal(view, np.arange(6, dtype=np.float32))


@pytest.mark.parametrize('reuse_buffers', [True, False])
def test_a_server_not_reusing_buffers_holds_no_dropped_version(reuse_buffers):
  """reuse_buffers=False (the local backend's server, in the trainer's process): a dropped
  version is freed at once, so between pushes the server holds ``keep`` versions, not
  ``keep + 1``; the versions it holds are the same either way."""
  server = ParameterServer(keep=1, reuse_buffers=reuse_buffers)
  server.push(0, make_params(scale=1.0))
  leaves = jax.tree_util.tree_leaves(server.get(0).params)
  before = [sys.getrefcount(leaf) for leaf in leaves]
  server.push(1, make_params(scale=2.0))  # drops 0
  held = [sys.getrefcount(leaf) for leaf in leaves]
  # The store's reference is gone; the spare pool keeps one only when reusing buffers.
  assert held == [n - 1 + reuse_buffers for n in before]
  assert server.versions() == [1]
  assert_tree_equal(server.get(1).params, make_params(scale=2.0))
  server.push(2, make_params(scale=3.0))
  assert_tree_equal(server.get(2).params, make_params(scale=3.0))


def _read_only(array: np.ndarray) -> np.ndarray:
  """A read-only C-contiguous copy, as Ray deserialises an array from its object store."""
  out = np.array(array, copy=True)
  out.setflags(write=False)
  return out


def test_adopt_keeps_whole_read_only_leaves_and_copies_the_rest():
  embed = _read_only(np.arange(6, dtype=np.float32).reshape(2, 3))
  writable = np.full((3,), 2.0, np.float32)
  strided = _read_only(np.arange(8, dtype=np.int32))[::2]  # read-only, not contiguous
  params = {'embed': embed, 'w': writable, 's': strided}
  server = ParameterServer(keep=2)
  server.push(0, params, adopt=True)
  stored = server.get(0).params
  assert np.shares_memory(stored['embed'], embed)  # kept, not copied
  assert not np.shares_memory(stored['w'], writable)
  assert not np.shares_memory(stored['s'], strided)
  for leaf in jax.tree_util.tree_leaves(stored):
    assert not leaf.flags.writeable
  # The checksums are taken at push time, of the values pushed.
  leaves = jax.tree_util.tree_leaves(params)
  assert server.update(0).checksums == tuple(delta_lib.checksum(np.ascontiguousarray(x))
                                             for x in leaves)
  # Without adopt (the default) every leaf is copied.
  server.push(1, params)
  assert not np.shares_memory(server.get(1).params['embed'], embed)


def test_adopt_keeps_only_whole_leaves_of_a_sharded_push():
  leaf = np.arange(8, dtype=np.float32).reshape(4, 2)
  halves = [_read_only(leaf[:2]), _read_only(leaf[2:])]
  push = ShardPush(jax.tree_util.tree_structure({'a': 0}), ("['a']",), (((4, 2), 'float32'),),
                   (Shard(0, ((0, 2), (0, 2)), halves[0]), Shard(0, ((2, 4), (0, 2)), halves[1])))
  server = ParameterServer(keep=1)
  server.push_shards(0, push, adopt=True)
  stored = server.get(0).params['a']
  np.testing.assert_array_equal(stored, leaf)
  assert not any(np.shares_memory(stored, half) for half in halves)


def test_adopted_memory_is_never_reused_for_a_later_version():
  server = ParameterServer(keep=1)
  adopted = {}
  for version in range(6):  # adopted and copied versions alternate; the spare pool cycles
    params = make_params(scale=version + 1.0)
    params = {'embed': _read_only(params['embed']), 'layer': params['layer']}
    server.push(version, params, adopt=version % 2 == 0)
    if version % 2 == 0:
      adopted[version] = params['embed']
      params = None  # the server alone references the adopted array
    assert_tree_equal(server.get(version).params, make_params(scale=version + 1.0))
  for version, array in adopted.items():  # nothing wrote into them after they were dropped
    np.testing.assert_array_equal(array, make_params(scale=version + 1.0)['embed'])
