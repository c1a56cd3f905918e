"""A launched subprocess on one CPU device, as a user runs it: the tests' environment less the
8 fake host devices of tests/conftest.py (and, where asked, less its XLA optimisation level)."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

_TEST_ONLY_XLA_FLAGS = ('--xla_force_host_platform_device_count',)
# tests/conftest.py's: compiles faster, runs slower (a user's run keeps XLA's default level).
_OPT_LEVEL_FLAG = '--xla_backend_optimization_level'


def one_device_env(*, xla_default_level: bool = False) -> dict[str, str]:
  """This process's environment with ``ROOT`` on ``PYTHONPATH`` and ``XLA_FLAGS`` less
  ``--xla_force_host_platform_device_count`` (8 devices would make the trainer's mesh
  ``data=8``: another program, and memory a real model does not have).

  ``xla_default_level``: also less tests/conftest.py's ``--xla_backend_optimization_level``,
  for a run whose thousands of steps cost more than its compiles (tests/test_default_run.py's
  1000-step warm-up)."""
  dropped = _TEST_ONLY_XLA_FLAGS + ((_OPT_LEVEL_FLAG,) if xla_default_level else ())
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env['XLA_FLAGS'] = ' '.join(flag for flag in env.get('XLA_FLAGS', '').split()
                              if not flag.startswith(dropped))
  return env
