"""The test session's guard against the kernel's memory-mapping limit (tests/program_memory.py,
called by tests/conftest.py): ``release_programs`` drops the compiled programs JAX and
rlax_llm's memoised functions hold, and with them the memory mappings XLA:CPU's JIT linker
made for each."""

import jax
import jax.numpy as jnp
from program_memory import mappings, release_programs

from rlax_llm.trainer import trainer as trainer_lib


def test_release_programs_returns_the_mappings_of_cached_programs():
  optimizer = trainer_lib.make_optimizer(1e-3)
  assert trainer_lib.make_optimizer.cache_info().currsize >= 1
  before = mappings()
  for i in range(100):  # each held only by jax.jit's cache (the lambda's own object)
    jax.jit(lambda x, i=i: x * i + 1.0)(jnp.ones(i + 1)).block_until_ready()
  grown = mappings()
  assert grown - before >= 100, (before, grown)
  release_programs()
  assert grown - mappings() >= (grown - before) // 2, (before, grown, mappings())
  assert trainer_lib.make_optimizer.cache_info().currsize == 0
  del optimizer
