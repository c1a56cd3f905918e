"""A private Ray cluster on loopback, shared by the tests of one module."""

import pytest

from rlax_llm.backends.ray import init_ray

from smoke_config import smoke_config  # (tests/smoke_config.py)


@pytest.fixture(scope='module')
def cluster():
  ray = pytest.importorskip('ray')
  started = init_ray(smoke_config(backend='ray'))
  yield
  if started:
    ray.shutdown()
