"""tests/conftest.py compiles with XLA:CPU's legacy emitters and runs the tests marked
``default_emitters`` in a subprocess with the default ones."""

import os

import pytest

from codegen import DEFAULT_EMITTERS_ENV, LEGACY_EMITTERS  # tests/codegen.py


@pytest.mark.default_emitters
def test_a_marked_test_runs_with_the_default_emitters():
  assert LEGACY_EMITTERS not in os.environ['XLA_FLAGS'].split()
  assert os.environ.get(DEFAULT_EMITTERS_ENV) == '1'
  assert '--xla_force_host_platform_device_count=8' in os.environ['XLA_FLAGS'].split()


def test_the_other_tests_compile_with_the_legacy_emitters_once():
  flags = os.environ['XLA_FLAGS'].split()
  assert flags.count(LEGACY_EMITTERS) == (0 if os.environ.get(DEFAULT_EMITTERS_ENV) else 1)
  assert len(flags) == len(set(flags))
