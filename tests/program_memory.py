"""The test session's guard against the kernel's limit on memory mappings (tests/conftest.py
calls it after each test file)."""

import gc
import sys

# Each program XLA:CPU compiles (or loads from the persistent cache) is JIT-linked into memory
# mappings of its own, about five a program, held while anything references it: JAX's caches,
# the library's memoised programs (trainer._programs, the engine's, make_optimizer), fixtures.
# A pytest-xdist process runs a hundred test files and passed 32,000 mappings after ten of
# them; at the kernel's limit (vm.max_map_count, 65,530 by default) the next mapping fails
# and LLVM's JIT linker segfaults (in a cache write or read, at about half of the run, where
# the process happened to be). So at the end of a test file, past MAX_MAPPINGS, the process
# drops every cached program: the next file's come back from the persistent cache on disk.
MAX_MAPPINGS = 30_000


def mappings() -> int:
  """The memory mappings this process holds (``/proc/self/maps`` lines; 0 off Linux)."""
  try:
    with open('/proc/self/maps', 'rb') as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def release_programs() -> None:
  """Drops every compiled program this process caches: JAX's caches and each memoised
  (``functools.lru_cache``/``cache``) function of rlax_llm, then collects the garbage."""
  for name, module in list(sys.modules.items()):
    if name == 'rlax_llm' or name.startswith('rlax_llm.'):
      for value in list(vars(module).values()):
        if callable(getattr(value, 'cache_clear', None)) and hasattr(value, '__wrapped__'):
          value.cache_clear()
  if 'jax' in sys.modules:
    sys.modules['jax'].clear_caches()
  gc.collect()
