"""One private Ray cluster on loopback per test process, shared by the modules that use it.

Starting a cluster (and shutting it down) costs seconds, more on a loaded 2-core machine, so
the ``cluster`` fixture starts one the first time a module asks (``init_ray``: a no-op while
one runs) and leaves it running for the next module of the same process (each pytest-xdist
worker has its own); the session's end shuts it down. A module whose own fixture starts a
cluster with other resources (``fake_tpu_host`` in test_tpu_env.py) finds none running: the
shared one is shut down before its first test and started again by the next module that asks.
"""

import pytest

from rlax_llm.backends.ray import init_ray

from smoke_config import smoke_config  # (tests/smoke_config.py)

# Fixtures that call ray.init themselves: a test using one gets no shared cluster.
OWN_CLUSTER_FIXTURES = ('fake_tpu_host',)
_SHARED = {'running': False}  # whether the cluster running in this process is the shared one


@pytest.fixture(scope='session')
def _ray_session():
  """Ray, imported once; the cluster still running at the session's end is shut down."""
  ray = pytest.importorskip('ray')
  yield ray
  if ray.is_initialized():
    ray.shutdown()


@pytest.fixture(scope='module')
def cluster(_ray_session):  # pylint: disable=redefined-outer-name
  """The process's shared cluster (started here when none runs); not shut down with the
  module."""
  del _ray_session
  if init_ray(smoke_config(backend='ray')):
    _SHARED['running'] = True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  """Before the fixtures of a test that starts its own cluster: the shared one is shut down."""
  if _SHARED['running'] and any(name in item.fixturenames for name in OWN_CLUSTER_FIXTURES):
    import ray  # pylint: disable=import-outside-toplevel  # running, so installed
    if ray.is_initialized():
      ray.shutdown()
    _SHARED['running'] = False
