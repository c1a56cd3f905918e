#!/usr/bin/env bash
# The default test run: every test marked neither slow nor extended. Extra arguments go to
# pytest, but for two of this script's own:
#   --extended  also the extended tier (heavier variants of guarantees the default run checks;
#               tests/tiers.py names each one's default-run counterpart)
#   --all       every test, the slow ones too
# Tests run in RLAX_TEST_WORKERS pytest-xdist processes (default 2, one per core of the CI
# machine; 0 runs them in this process); a file's tests stay in one process (its fixtures are
# shared), the longest files first (tests/conftest.py: LONGEST_FILES), and XLA's compilation
# cache is shared between the processes (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
args=()
for arg in "$@"; do
  case "$arg" in
    --extended) tier=(-m 'not slow') ;;
    --all) tier=(-m '') ;;
    *) args+=("$arg") ;;
  esac
done
bash scripts/setup.sh
workers="${RLAX_TEST_WORKERS:-2}"
if [[ "$workers" == 0 ]]; then
  exec .venv/bin/python -m pytest -q ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"}
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder \
  ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"}
