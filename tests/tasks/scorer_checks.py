"""Shared by the scorer tests: a scorer call checked for its range and its time."""

import time

SURROGATE = '\ud800'  # a lone surrogate: invalid UTF-8 once encoded


def timed(fn, *args, limit, **kwargs):
  """``fn(*args, **kwargs)``, asserted to return a float in [0, 1] within ``limit`` seconds."""
  start = time.monotonic()
  value = fn(*args, **kwargs)
  elapsed = time.monotonic() - start
  assert elapsed < limit, f'{elapsed:.2f} s > {limit} s'
  assert isinstance(value, float) and 0.0 <= value <= 1.0
  return value
