"""The test processes' XLA:CPU code generation (tests/conftest.py sets it; tests read it).

Tests compile with XLA:CPU's older elemental emitters (``LEGACY_EMITTERS``); a test marked
``default_emitters`` runs in a pytest subprocess whose environment has ``DEFAULT_EMITTERS_ENV``
set, which compiles with XLA's default (fusion) emitters, as users' runs do.
"""

LEGACY_EMITTERS = '--xla_cpu_use_fusion_emitters=false'
DEFAULT_EMITTERS_ENV = 'RLAX_TEST_DEFAULT_EMITTERS'
