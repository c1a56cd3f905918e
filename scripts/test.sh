#!/usr/bin/env bash
# The default test run (excludes tests marked slow). Extra arguments go to pytest.
# Tests run in RLAX_TEST_WORKERS pytest-xdist processes (default 2, one per core of the CI
# machine; 0 runs them in this process); a file's tests stay in one process (its fixtures are
# shared), the longest files first (tests/conftest.py: LONGEST_FILES), and XLA's compilation
# cache is shared between the processes (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers="${RLAX_TEST_WORKERS:-2}"
if [[ "$workers" == 0 ]]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
