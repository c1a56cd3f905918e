"""A launched subprocess on one CPU device, as a user runs it: the tests' environment less the
8 fake host devices of tests/conftest.py."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def one_device_env() -> dict[str, str]:
  """This process's environment with ``ROOT`` on ``PYTHONPATH`` and ``XLA_FLAGS`` less
  ``--xla_force_host_platform_device_count`` (8 devices would make the trainer's mesh
  ``data=8``: another program, and memory a real model does not have)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env['XLA_FLAGS'] = ' '.join(flag for flag in env.get('XLA_FLAGS', '').split()
                              if not flag.startswith('--xla_force_host_platform_device_count'))
  return env
