"""The worker side of weight sync (``rlax_llm.paramserver.receiver``), without an engine: pull
unless held, deltas from the version held, checksums verified before anything is installed,
adapters merged into the base pulled once. (tests/rollout/test_worker.py runs it inside a
real worker.)"""

import dataclasses

import jax
import numpy as np
import pytest

from rlax_llm.models import lora as lora_lib
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.paramserver import ParameterServer
from rlax_llm.paramserver.publisher import Publisher
from rlax_llm.paramserver.receiver import Receiver

CONFIG = DecoderConfig(vocab_size=16, num_layers=1, embed_dim=8, num_heads=2, num_kv_heads=1,
                       head_dim=4, mlp_dim=16, max_seq_len=8)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


def versions(params, count):
  """``count`` versions of ``params``: version ``v`` adds ``v`` to the first leaf only."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  return [jax.tree_util.tree_unflatten(treedef, [np.asarray(leaves[0]) + v]
                                       + [np.asarray(x) for x in leaves[1:]])
          for v in range(count)]


def assert_same(tree, want):
  jax.tree.map(np.testing.assert_array_equal, tree, want)


def test_pulls_unless_held_then_deltas_from_the_version_held(model_and_params):
  model, params = model_and_params
  server = ParameterServer(keep=3)
  made = versions(params, 3)
  for version, tree in enumerate(made):
    server.push(version, tree)
  installed = []
  receiver = Receiver(model, lambda version, tree: installed.append((version, tree)))
  assert receiver.version == -1
  first = receiver.ensure(1, server.update)
  assert first['sync/bytes'] == first['sync/full_bytes'] == sum(
      np.asarray(x).nbytes for x in jax.tree.leaves(params))  # nothing held: whole leaves
  assert receiver.ensure(1, server.update) == {}  # held: no pull
  second = receiver.ensure(2, server.update)
  assert second['sync/bytes'] == np.asarray(jax.tree.leaves(params)[0]).nbytes  # one leaf
  assert [v for v, _ in installed] == [1, 2] and receiver.version == 2
  assert_same(installed[-1][1], made[2])


def test_a_corrupted_update_installs_nothing(model_and_params):
  model, params = model_and_params
  server = ParameterServer(keep=2)
  for version, tree in enumerate(versions(params, 2)):
    server.push(version, tree)
  installed = []
  receiver = Receiver(model, lambda version, tree: installed.append(version))
  receiver.ensure(0, server.update)
  update = server.update(1, 0)
  (leaf, *rest), *buckets = update.buckets
  full = np.array(leaf.full, copy=True)
  full.reshape(-1).view(np.uint8)[0] ^= 1
  bad = dataclasses.replace(update, buckets=((dataclasses.replace(leaf, full=full), *rest),
                                             *buckets))
  with pytest.raises(ValueError, match='of version 1 fails its checksum'):
    receiver.apply(bad)
  other = Receiver(model, lambda *_: None)
  other.load(1, params)  # holds version 1 (loaded whole), not the update's base
  with pytest.raises(ValueError, match='a delta from version 0 but this worker holds '
                     'version 1'):
    other.apply(update)
  assert installed == [0] and receiver.version == 0
  receiver.apply(update)
  assert installed == [0, 1]


def test_adapter_versions_merge_into_the_base_pulled_once(model_and_params):
  """What the publisher pushes under adapter-only sync, the receiver merges: the installed
  params are the trainer's merged weights; the base is fetched once; later versions come as
  deltas of the adapters."""
  model, params = model_and_params
  lora = lora_lib.LoRAConfig(2, 4.0, ('q', 'v'))
  lmodel, first = lora_lib.create(model, params, lora)
  second = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.5 if lora_lib.is_adapter_path(path) and path[-1].key == 'b'
      else x, first)
  server, base_server = ParameterServer(keep=2), ParameterServer(keep=1)
  publisher = Publisher(lmodel, model, lambda s, v, p: s.push(v, p), server, base_server)
  publisher.publish(0, first)
  publisher.publish(1, second)
  bases, installed = [], []

  def fetch_base():
    bases.append(base_server.update(0))
    return bases[-1]
  receiver = Receiver(model, lambda version, tree: installed.append((version, tree)),
                      lora=lora, fetch_base=fetch_base, place_base=lambda base: base)
  assert receiver.adapters
  receiver.ensure(0, server.update)
  figures = receiver.ensure(1, server.update)
  assert len(bases) == 1 and receiver.version == 1
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora_lib.adapter_tree(first)))
  assert 0 < figures['sync/bytes'] < adapter_bytes  # only B changed: a delta
  assert_same(installed[-1][1], lora_lib.merge_program(lmodel)(second))
  with pytest.raises(ValueError, match='needs lora, fetch_base .* and place_base'):
    Receiver(model, lambda *_: None, lora=lora, fetch_base=fetch_base)
