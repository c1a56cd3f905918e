"""Lossless sparse weight deltas: bit-exact round trips, the full/delta choice, buckets, and the
parameter server's update(version, base_version)."""

import functools
import re

import jax
import ml_dtypes
import numpy as np
import pytest

from rlax_llm.data_types import TrainBatch
from rlax_llm.losses import LossConfig
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.paramserver import ParameterServer
from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.trainer import Trainer, make_optimizer

CONFIG = DecoderConfig(vocab_size=32, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_seq_len=16)


def _batch(seed):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, 32, (8, 12)).astype(np.int32)
  mask = np.zeros((8, 12), np.float32)
  mask[:, 4:] = 1.0
  return TrainBatch(tokens=tokens, loss_mask=mask,
                    behaviour_logprobs=(np.log(rng.uniform(0.02, 0.2, (8, 12))) * mask
                                        ).astype(np.float32),
                    support_sizes=np.zeros((8, 12), np.int32),
                    advantages=rng.randn(8).astype(np.float32),
                    versions=np.zeros((8, 12), np.int32), group_ids=np.arange(8, dtype=np.int32))


@pytest.fixture(scope='module')
def versions():
  """Host params after 0, 1, 2 and 3 real AdamW steps at an RL learning rate."""
  model, params = create_model(CONFIG, seed=0)
  trainer = Trainer(model, params, make_optimizer(1e-5),
                    functools.partial(rl_objective, Policy(model, SamplingSpec()), LossConfig()),
                    make_mesh({'data': 1}, jax.devices()[:1]))
  out = [trainer.host_params()]
  for step in range(3):
    trainer.step(_batch(step))
    out.append(trainer.host_params())
  return out


@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_round_trip_is_bit_exact_after_real_optimizer_steps(versions, dtype):
  leaves = [[np.asarray(x, dtype) for x in jax.tree.leaves(v)] for v in versions]
  for base, new in zip(leaves, leaves[1:]):
    delta = delta_lib.encode(base, new, base_version=0, version=1)
    rebuilt = delta_lib.apply(base, delta)
    for a, b in zip(rebuilt, new):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert 0 < delta.density <= 1
  # Across two updates too (a worker that skipped a version).
  delta = delta_lib.encode(leaves[0], leaves[3], base_version=0, version=3)
  for a, b in zip(delta_lib.apply(leaves[0], delta), leaves[3]):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_bf16_updates_are_sparse_fp32_dense(versions):
  """Adam moves every fp32 weight a little; most of those moves vanish in a bf16 cast."""
  fp32 = [[np.asarray(x) for x in jax.tree.leaves(v)] for v in versions[:2]]
  bf16 = [[x.astype(ml_dtypes.bfloat16) for x in leaves] for leaves in fp32]
  dense = delta_lib.encode(*fp32, base_version=0, version=1)
  sparse = delta_lib.encode(*bf16, base_version=0, version=1)
  assert dense.density > 0.9 and sparse.density < dense.density
  full_bytes = sum(x.nbytes for x in bf16[1])
  assert sparse.nbytes <= full_bytes  # never more than sending everything


def test_bits_not_values_nan_and_signed_zero():
  base = [np.array([0.0, 1.0, np.nan, 2.0], np.float32)]
  nan_other = np.array([np.nan], np.float32).view(np.uint32) ^ np.uint32(1)
  new = [np.array([-0.0, 1.0, nan_other.view(np.float32)[0], 2.0], np.float32)]
  delta = delta_lib.encode(base, new, base_version=0, version=1)
  assert delta.changed == 2  # -0.0 and the NaN with another payload; 1.0 and 2.0 unchanged
  rebuilt = delta_lib.apply(base, delta)[0]
  np.testing.assert_array_equal(rebuilt.view(np.uint32), new[0].view(np.uint32))
  assert base[0].view(np.uint32)[0] == 0  # the base is not modified


def test_each_leaf_takes_the_smaller_form_and_buckets_are_bounded():
  rng = np.random.RandomState(0)
  base = [rng.randn(1000).astype(np.float32) for _ in range(6)]
  new = [b.copy() for b in base]
  new[0][:10] += 1  # 1% changed: delta (10 * 8 bytes)
  new[1][:] += 1  # all changed: whole leaf
  new[2][:499] += 1  # just under half: delta is still smaller (499 * 8 < 1000 * 4)
  new[3][:501] += 1  # just over half: whole
  delta = delta_lib.encode(base, new, base_version=3, version=4, bucket_bytes=4500)
  forms = {u.leaf: u.full is not None for b in delta.buckets for u in b}
  assert forms == {0: False, 1: True, 2: False, 3: True, 4: False, 5: False}
  assert all(sum(u.nbytes for u in b) <= 4500 or len(b) == 1 for b in delta.buckets)
  assert len(delta.buckets) > 1
  assert delta.nbytes == 80 + 4000 + 499 * 8 + 4000
  for a, b in zip(delta_lib.apply(base, delta), new):
    np.testing.assert_array_equal(a, b)


def test_shape_mismatch_and_missing_leaves_raise():
  with pytest.raises(ValueError, match='leaf 0'):
    delta_lib.encode([np.zeros(3, np.float32)], [np.zeros(4, np.float32)], base_version=0,
                     version=1)
  delta = delta_lib.encode([np.zeros(3, np.float32)], [np.ones(3, np.float32)], base_version=0,
                           version=1)
  with pytest.raises(ValueError, match='covers 1 leaves, the base has 2'):
    delta_lib.apply([np.zeros(3, np.float32)] * 2, delta)


def test_server_update_is_a_delta_from_a_held_base_else_whole(versions):
  server = ParameterServer(keep=2)
  for version, params in enumerate(versions):
    server.push(version, params)
  assert server.versions() == [2, 3]
  new_leaves = [np.asarray(x) for x in jax.tree.leaves(versions[3])]
  held = server.update(3, base_version=2)
  assert held.base_version == 2 and held.version == 3
  base = [np.asarray(x) for x in jax.tree.leaves(versions[2])]
  for a, b in zip(delta_lib.apply(base, held), new_leaves):
    np.testing.assert_array_equal(a, b)
  for base_version in (-1, 0):  # nothing held / evicted: whole leaves
    whole = server.update(3, base_version=base_version)
    assert whole.base_version == -1 and whole.density == 1.0
    assert all(u.full is not None for b in whole.buckets for u in b)
    for a, b in zip(delta_lib.apply([None] * len(new_leaves), whole), new_leaves):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(KeyError, match='version 1 is not held'):
    server.update(1)
  tree = jax.tree_util.tree_unflatten(server.treedef, new_leaves)
  assert jax.tree.structure(tree) == jax.tree.structure(versions[3])


def test_verify_names_the_leaf_whose_checksum_differs():
  leaves = [np.arange(4, dtype=np.float32), np.ones(3, ml_dtypes.bfloat16)]
  checksums = [delta_lib.checksum(leaf) for leaf in leaves]
  delta_lib.verify(leaves, checksums, ['a', 'b'], version=3)
  flipped = leaves[1].copy()
  flipped.view(np.uint16)[2] ^= 1  # one bit of one element
  with pytest.raises(ValueError, match=r"leaf b of version 3 fails its checksum .*base_version=-1"):
    delta_lib.verify([leaves[0], flipped], checksums, ['a', 'b'], version=3)
  with pytest.raises(ValueError, match='version 3 came with 1 checksums for 2 leaves'):
    delta_lib.verify(leaves, checksums[:1], ['a', 'b'], version=3)


def reference_checksum(data: bytes) -> int:
  """delta.checksum's definition in plain Python ints (the independent reference)."""
  block = 8 * 4096
  golden = 0x9E3779B97F4A7C15
  total = 0
  for i, start in enumerate(range(0, len(data), block)):
    chunk = data[start:start + block]
    chunk += bytes(-len(chunk) % 8)
    words = np.frombuffer(chunk, '<u8')
    total += (int(words.sum(dtype=np.uint64)) * (2 * i + 1) * golden)
  return (total + len(data)) % 2**64


@pytest.mark.parametrize('nbytes', [0, 3, 8, 32768, 32768 * 3 + 13])
def test_checksum_matches_its_reference_and_reads_bytes_in_c_order(nbytes):
  data = np.random.RandomState(nbytes).randint(0, 256, nbytes).astype(np.uint8)
  assert delta_lib.checksum(data) == reference_checksum(data.tobytes())
  if nbytes % 4 == 0 and nbytes:
    as_f32 = data.view(np.float32).reshape(-1, 1)
    assert delta_lib.checksum(as_f32) == delta_lib.checksum(data)  # bytes, not values
    fortran = np.asfortranarray(as_f32.reshape(-1, 2)) if nbytes % 8 == 0 else as_f32
    assert delta_lib.checksum(fortran) == delta_lib.checksum(data)  # C order whatever layout


def test_checksum_detects_every_flipped_bit():
  rng = np.random.RandomState(0)
  leaf = rng.randn(3 * 8192 + 5).astype(np.float32)  # three whole 32 KiB blocks and a tail
  expected = delta_lib.checksum(leaf)
  raw = leaf.view(np.uint8)
  positions = list(range(64)) + list(rng.randint(0, raw.size * 8, 2000)) + [raw.size * 8 - 1]
  for bit in positions:
    flipped = raw.copy()
    flipped[bit // 8] ^= np.uint8(1 << (bit % 8))
    assert delta_lib.checksum(flipped) != expected, bit
  swapped = leaf.copy()
  swapped[[0, 8192]] = swapped[[8192, 0]]  # two elements of different blocks swapped
  assert delta_lib.checksum(swapped) != expected


def test_the_server_and_the_worker_agree_through_one_checksum(versions):
  """The checksums the server takes at push are the ones verify recomputes on the leaves a
  puller rebuilds (whole and from a delta), and a flipped bit in transit is caught."""
  server = ParameterServer(keep=2)
  server.push(0, versions[0])
  server.push(1, versions[1])
  paths = list(server.template)
  base = [np.asarray(x) for x in jax.tree.leaves(versions[0])]
  for update in (server.update(1), server.update(1, base_version=0)):
    delta_lib.verify(delta_lib.apply(base, update), update.checksums, paths, version=1)
  whole = server.update(1)
  leaves = [np.array(x) for x in delta_lib.apply(base, whole)]
  leaves[2].reshape(-1).view(np.uint8)[5] ^= 4
  with pytest.raises(ValueError, match=rf'leaf {re.escape(paths[2])} of version 1 fails its'):
    delta_lib.verify(leaves, whole.checksums, paths, version=1)


@pytest.mark.parametrize('shape, dtype', [((), np.float32), ((3, 8193), np.float32),
                                          ((5, 7), ml_dtypes.bfloat16), ((70000,), np.uint8)])
def test_copy_with_checksum_copies_and_agrees_with_checksum(shape, dtype):
  src = np.asarray(np.random.RandomState(0).randn(*shape)).astype(dtype)
  dst = np.empty(shape, dtype)
  assert delta_lib.copy_with_checksum(dst, src, chunk_bytes=1) == delta_lib.checksum(src)
  assert dst.tobytes() == src.tobytes()
  assert delta_lib.copy_with_checksum(np.empty(shape, dtype), src) == delta_lib.checksum(src)
  with pytest.raises(ValueError, match='same shape and dtype'):
    delta_lib.copy_with_checksum(np.empty((2,), np.float64), src)
