"""Named model presets (architectures of the real targets), and memory per device on a mesh.

Sizes follow each model's published ``config.json``. ``memory_per_device`` uses
``jax.eval_shape`` (nothing is allocated) and the logical-axis sharding rules to report the
bytes of params and optimizer state each device holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlax_llm import sharding as sharding_lib
from rlax_llm.models.decoder_config import DecoderConfig, RopeScaling
from rlax_llm.models.files.gguf import smollm2_gguf_path
from rlax_llm.models.model import abstract_model

_QWEN3 = dict(vocab_size=151_936, head_dim=128, rope_theta=1_000_000.0, norm_eps=1e-6,
              qk_norm=True, family='qwen3', max_seq_len=40_960)

PRESETS: dict[str, DecoderConfig] = {
    'smollm2-135m': DecoderConfig(
        vocab_size=49_152, num_layers=30, embed_dim=576, num_heads=9, num_kv_heads=3,
        head_dim=64, mlp_dim=1536, rope_theta=100_000.0, norm_eps=1e-5, tie_embeddings=True,
        max_seq_len=8192, family='llama'),
    'qwen3-0.6b': DecoderConfig(num_layers=28, embed_dim=1024, num_heads=16, num_kv_heads=8,
                                mlp_dim=3072, tie_embeddings=True, **_QWEN3),
    'qwen3-1.7b': DecoderConfig(num_layers=28, embed_dim=2048, num_heads=16, num_kv_heads=8,
                                mlp_dim=6144, tie_embeddings=True, **_QWEN3),
    'qwen3-8b': DecoderConfig(num_layers=36, embed_dim=4096, num_heads=32, num_kv_heads=8,
                              mlp_dim=12_288, tie_embeddings=False, **_QWEN3),
    'qwen3-32b': DecoderConfig(num_layers=64, embed_dim=5120, num_heads=64, num_kv_heads=8,
                               mlp_dim=25_600, tie_embeddings=False, **_QWEN3),
    'qwen2.5-7b': DecoderConfig(
        vocab_size=152_064, num_layers=28, embed_dim=3584, num_heads=28, num_kv_heads=4,
        head_dim=128, mlp_dim=18_944, rope_theta=1_000_000.0, norm_eps=1e-6,
        tie_embeddings=False, qkv_bias=True, max_seq_len=32_768, family='qwen2'),
    'llama-3.1-8b': DecoderConfig(
        vocab_size=128_256, num_layers=32, embed_dim=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        norm_eps=1e-5, tie_embeddings=False, max_seq_len=131_072, family='llama'),
    'qwq-32b': DecoderConfig(
        vocab_size=152_064, num_layers=64, embed_dim=5120, num_heads=40, num_kv_heads=8,
        head_dim=128, mlp_dim=27_648, rope_theta=1_000_000.0, norm_eps=1e-5,
        tie_embeddings=False, qkv_bias=True, max_seq_len=40_960, family='qwen2'),
}


# Presets whose checkpoint ships as a pip package (nothing is downloaded at run time).
PACKAGED_CHECKPOINTS = {'smollm2-135m': smollm2_gguf_path}


def packaged_checkpoint(name: str):
  """The local path of preset ``name``'s packaged checkpoint.

  Raises ValueError when none ships with rlax_llm (pass the checkpoint's path instead), and
  FileNotFoundError when its package is not installed.
  """
  if name not in PACKAGED_CHECKPOINTS:
    raise ValueError(f'no checkpoint of {name!r} ships with rlax_llm (packaged: '
                     f'{sorted(PACKAGED_CHECKPOINTS)}); pass the path of an HF directory or a '
                     '.gguf file of the model.')
  return PACKAGED_CHECKPOINTS[name]()


def get_preset(name: str, **overrides: Any) -> DecoderConfig:
  """A named config (``PRESETS``) with optional field overrides (e.g. ``max_seq_len``, or
  ``execution=Execution(dtype=jnp.bfloat16)``)."""
  if name not in PRESETS:
    raise ValueError(f'Unknown model {name!r}; choose one of {sorted(PRESETS)}.')
  return dataclasses.replace(PRESETS[name], **overrides)


def count_params(config: DecoderConfig) -> int:
  """Number of parameters (tied embeddings counted once)."""
  params = abstract_model(config).abstract_params()
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def memory_per_device(config: DecoderConfig, mesh: Mesh, *, optimizer_moments: int = 2,
                      optimizer_dtype: Any = jnp.float32,
                      rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_RULES
                      ) -> dict[str, float]:
  """Bytes of params and optimizer state on the most loaded device.

  Args:
    config: the model.
    mesh: the trainer mesh; shardings come from the logical-axis ``rules``.
    optimizer_moments: state tensors per param (AdamW: 2).
    optimizer_dtype: dtype of the optimizer state.
  Returns:
    ``{'params_bytes', 'optimizer_bytes', 'total_bytes', 'total_gib', 'num_params'}`` per
    device (the max over devices; shards are equal-sized under these rules).
  """
  model = abstract_model(config)
  abstract = model.abstract_params()
  shardings = sharding_lib.param_shardings(abstract, model.logical_axes(), mesh, rules)
  params_bytes = 0
  opt_bytes = 0
  opt_itemsize = jnp.dtype(optimizer_dtype).itemsize
  for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    shard = int(np.prod(sharding.shard_shape(leaf.shape)))
    params_bytes += shard * jnp.dtype(leaf.dtype).itemsize
    opt_bytes += optimizer_moments * shard * opt_itemsize
  total = params_bytes + opt_bytes
  return {'params_bytes': float(params_bytes), 'optimizer_bytes': float(opt_bytes),
          'total_bytes': float(total), 'total_gib': total / 2**30,
          'num_params': float(count_params(config))}
