"""Decode attention on XLA:CPU as a compiled kernel (``cpu_attention.cc``, an XLA FFI call).

A decode step's attention (one query per slot over its KV cache) is memory-bound: it reads
every cached key and value once and does three multiply-adds per float read (SmolLM2's
three queries per kv head). XLA:CPU runs those small batched products on one thread,
reading the cache at about 16 GB/s, and a step attends to a whole attend bucket. The kernel
reads each slot's cache in memory order on all of XLA's intra-op threads, and only the
positions the slot holds. ``Execution.decode_attention='cpu_kernel'`` selects it for
decode steps of two or more rows; the inference engine picks it by default where it applies
(``rlax_llm.rollout.engine.Engine``). Its results equal the XLA attention's to float32
rounding (a different summation order and a polynomial ``exp``; ``tests/models``), so
greedy tokens match and log-probs move by about 1e-7; measured in benchmarks/RESULTS.md.

The source ships with the package and is compiled on first use with the C++ compiler found
(``$CXX``, else ``g++``, ``c++`` or ``clang++``) for this machine's CPU (``-march=native``),
into ``$RLAX_LLM_KERNEL_CACHE`` (default ``~/.cache/rlax_llm/kernels``) under a name that
hashes the source, flags, compiler, jax version and CPU, so a stale or foreign build is
never loaded. Without a compiler ``available()`` is False, ``unavailable_reason()`` says
why, and the engine keeps XLA's attention.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = pathlib.Path(__file__).with_suffix('.cc')
TARGET = 'rlax_llm_decode_attention'
HEAD_DIMS = (64, 128)
MAX_GROUPS = 8
LANES = 16  # cache block lengths must be multiples of it


def supports(*, head_dim: int, groups: int, block_length: int, dtype) -> str | None:
  """None when the kernel handles these shapes, else what it does not support."""
  if head_dim not in HEAD_DIMS:
    return f'head_dim={head_dim} (the kernel has {HEAD_DIMS})'
  if not 1 <= groups <= MAX_GROUPS:
    return f'{groups} queries per kv head (the kernel has 1-{MAX_GROUPS})'
  if block_length % LANES:
    return f'cache blocks of {block_length} positions (the kernel needs a multiple of {LANES})'
  if jnp.dtype(dtype) != jnp.float32:
    return f'compute dtype {jnp.dtype(dtype).name} (the kernel is float32)'
  return None


def _cpu_signature() -> str:
  try:  # the flags line: what -march=native compiles for
    for line in pathlib.Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith(('flags', 'Features')):
        return line
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _compiler() -> str | None:
  for name in (os.environ.get('CXX'), 'g++', 'c++', 'clang++'):
    path = shutil.which(name) if name else None
    if path:
      return path
  return None


# The compile flags (with ``-I`` jax's FFI headers, which the jax version in the key
# identifies: one build serves every environment of that version).
FLAGS = ('-O3', '-march=native', '-std=c++17', '-shared', '-fPIC')


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get('RLAX_LLM_KERNEL_CACHE',
                                     pathlib.Path.home() / '.cache' / 'rlax_llm' / 'kernels'))


@functools.cache
def _build() -> tuple[pathlib.Path | None, str]:
  """``(path of the built library, '')`` or ``(None, why not)``; compiles at most once per
  key (atomically: concurrent test workers may race to build the same file)."""
  compiler = _compiler()
  if compiler is None:
    return None, 'no C++ compiler found ($CXX, g++, c++ or clang++)'
  try:
    version = subprocess.run([compiler, '--version'], capture_output=True, text=True,
                             timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e:
    return None, f'{compiler} --version failed: {e}'
  key = hashlib.sha256('\0'.join([SOURCE.read_text(), ' '.join(FLAGS), version,
                                  jax.__version__, _cpu_signature()]).encode()).hexdigest()
  path = cache_dir() / f'decode_attention-{key[:20]}.so'
  if path.exists():
    return path, ''
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=path.parent)
    os.close(fd)
  except OSError as e:
    return None, f'cannot write the kernel cache {path.parent} ({e}); set RLAX_LLM_KERNEL_CACHE'
  try:
    done = subprocess.run([compiler, *FLAGS, f'-I{jax.ffi.include_dir()}', str(SOURCE), '-o',
                           tmp], capture_output=True, text=True, timeout=300)
    if done.returncode:
      return None, f'{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}'
    os.replace(tmp, path)
  except (OSError, subprocess.SubprocessError) as e:
    return None, f'building {SOURCE.name} failed: {e}'
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return path, ''


@functools.cache
def _register() -> str:
  """Builds, loads and registers the FFI target once; '' on success, else why not."""
  path, why = _build()
  if path is None:
    return why
  try:
    library = ctypes.cdll.LoadLibrary(str(path))
  except OSError as e:
    return f'loading {path} failed: {e}'
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.RlaxLlmDecodeAttention),
                              platform='cpu')
  return ''


def unavailable_reason() -> str:
  """'' when the kernel can run here (the CPU backend and a build), else why not."""
  if jax.default_backend() != 'cpu':
    return f'the default backend is {jax.default_backend()}, not cpu'
  return _register()


def available() -> bool:
  return not unavailable_reason()


def decode_attention(q: jax.Array, keys: tuple[jax.Array, ...], values: tuple[jax.Array, ...],
                     lengths: jax.Array) -> jax.Array:
  """Attention of one query per slot over its cache blocks.

  Args:
    q: float32 ``[B, KV, G, D]``, the queries grouped by kv head (unscaled).
    keys: blocks ``[B, KV, D, L]`` (``kv_cache.KEY_BLOCK_AXES``), in position order.
    values: blocks ``[B, KV, L, D]`` (``kv_cache.VALUE_BLOCK_AXES``), as many as ``keys``.
    lengths: int ``[B]``: slot ``b`` attends to positions ``[0, lengths[b])``, clamped to
      ``[1, len(keys) * L]`` (an inactive slot's output is then finite junk, as XLA's).
  Returns:
    float32 ``[B, KV, G, D]``: ``softmax(q k^T / sqrt(D)) v`` per slot and kv head.
  """
  why = unavailable_reason()
  if why:
    raise RuntimeError(f'the CPU decode-attention kernel is unavailable: {why}.')
  if not keys or len(keys) != len(values):
    raise ValueError(f'{len(keys)} key blocks and {len(values)} value blocks; need as many '
                     'of each, at least one.')
  b, kv, g, d = q.shape
  block = values[0].shape[2]
  why = supports(head_dim=d, groups=g, block_length=block, dtype=q.dtype)
  if why:
    raise ValueError(f'the CPU decode-attention kernel does not support {why}.')
  for k, v in zip(keys, values):
    if k.shape != (b, kv, d, block) or v.shape != (b, kv, block, d):
      raise ValueError(f'cache blocks keys {k.shape} / values {v.shape} do not fit queries '
                       f'{q.shape}: need [{b}, {kv}, {d}, L] / [{b}, {kv}, L, {d}].')
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q, *keys, *values, lengths.astype(np.int32))
