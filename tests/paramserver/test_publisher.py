"""The trainer side of weight sync (``rlax_llm.paramserver.publisher``): the base once, then
each version once, through whatever transport a backend gives; adapter-only sync decided
once, from the config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from smoke_config import smoke_config  # tests/smoke_config.py

from rlax_llm.models import lora as lora_lib
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model, with_param_dtype
from rlax_llm.paramserver.publisher import Publisher, adapter_sync

CONFIG = DecoderConfig(vocab_size=16, num_layers=1, embed_dim=8, num_heads=2, num_kv_heads=1,
                       head_dim=4, mlp_dim=16, max_seq_len=8)


@pytest.fixture(scope='module')
def model_and_params():
  return create_model(CONFIG, seed=0)


class Recorder:
  """A transport (``publisher.Push``) that records each push: ``(server, version, params)``."""

  def __init__(self):
    self.pushes = []

  def __call__(self, server, version, params):
    self.pushes.append((server, version, params))

  def sent(self):
    return [(server, version) for server, version, _ in self.pushes]


def assert_same(tree, want):
  assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(want)
  for got, expected in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_each_version_is_pushed_once_in_the_workers_dtype(model_and_params):
  """A restored trainer publishes the version it restored, a step skipped for a non-finite
  update publishes nothing new, and each version goes cast to the workers' dtypes."""
  model, params = model_and_params
  inference = with_param_dtype(model, jnp.bfloat16)
  push = Recorder()
  publisher = Publisher(model, inference, push, 'versions')
  for version in (0, 0, 1, 1, 3):
    publisher.publish(version, params)
  assert push.sent() == [('versions', 0), ('versions', 1), ('versions', 3)]
  assert publisher.pushed == 3
  assert {leaf.dtype for leaf in jax.tree.leaves(push.pushes[0][2])} == {jnp.dtype(jnp.bfloat16)}
  assert_same(push.pushes[0][2], jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


def test_adapter_sync_pushes_the_base_once_then_the_adapters(model_and_params):
  model, params = model_and_params
  lmodel, lparams = lora_lib.create(model, params, lora_lib.LoRAConfig(2, 4.0, ('q', 'v')))
  push = Recorder()
  publisher = Publisher(lmodel, model, push, 'versions', 'base')
  for version in (0, 1, 1, 2):
    publisher.publish(version, lparams)
  assert push.sent() == [('base', 0), ('versions', 0), ('versions', 1), ('versions', 2)]
  assert_same(push.pushes[0][2], lora_lib.base_tree(lparams))
  assert_same(push.pushes[1][2], lora_lib.adapter_tree(lparams))


def test_merged_sync_pushes_the_merged_weights_and_no_base(model_and_params):
  model, params = model_and_params
  lmodel, lparams = lora_lib.create(model, params,
                                    lora_lib.LoRAConfig(2, 4.0, ('q', 'v'), sync='merged'))
  push = Recorder()
  Publisher(lmodel, model, push, 'versions').publish(0, lparams)
  assert push.sent() == [('versions', 0)]
  assert_same(push.pushes[0][2], lora_lib.merge_program(lmodel)(lparams))


def test_a_base_server_goes_with_adapter_sync_and_only_with_it(model_and_params):
  model, params = model_and_params
  lmodel, _ = lora_lib.create(model, params, lora_lib.LoRAConfig(2, 4.0, ('q', 'v')))
  with pytest.raises(ValueError, match=r"needs a base_server .* got base_server=None"):
    Publisher(lmodel, model, Recorder(), 'versions')
  with pytest.raises(ValueError, match=r"and only it \(lora.sync\); got base_server='base'"):
    Publisher(model, model, Recorder(), 'versions', 'base')


def test_adapter_sync_is_decided_from_the_config():
  assert adapter_sync(smoke_config()) is None  # no LoRA
  lora = adapter_sync(smoke_config(lora__rank=2, lora__targets='q,v'))
  assert lora == lora_lib.LoRAConfig(2, lora.alpha, ('q', 'v'))
  assert adapter_sync(smoke_config(lora__rank=2, lora__sync='merged')) is None
