"""Test-session setup: 8 fake CPU devices, so sharding code runs as on a small TPU slice.

XLA reads the flag when the backend initialises, so it must be set before jax is imported.
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Many tests build the same small programs (each run jits its roles afresh): XLA's persistent
# compilation cache, shared with the subprocesses tests launch, compiles each once per session.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.environ.get('TMPDIR', '/tmp'), f'rlax_llm_test_jax_cache_{os.getuid()}'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')


def pytest_sessionfinish(session, exitstatus):
  """Under CI every optional dependency is installed, so a skipped test means a broken install.

  Tests skip (with the reason) when a reference package or the SmolLM2 checkpoint is missing
  on a developer's machine; in CI (``CI`` set, as ``.ci/run`` runs) that fails the run.
  """
  del exitstatus
  reporter = session.config.pluginmanager.get_plugin('terminalreporter')
  skipped = reporter.stats.get('skipped', []) if reporter else []
  if os.environ.get('CI') and skipped:
    reporter.write_line(f'CI: {len(skipped)} test(s) were skipped; under CI every dependency '
                        'is installed, so a skip is a failure (see the skip reasons above).',
                        red=True)
    session.exitstatus = 1
