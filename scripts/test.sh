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
# A test that runs past its limit (pytest-timeout: 300 s in the default run, whose tests take
# under 60 s; 1800 s with --extended or --all) prints every thread's stack and ends its
# process; a process that dies (a hang cut short, a crash) ends the run with that test failed
# (--max-worker-restart=0): pytest-xdist's file-by-file scheduling otherwise re-runs the
# crashed file on a new process and can wait forever for it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes each module's bytecode (.pyc) on its first import: scripts/setup.sh installs
# without compiling (pip would compile every installed module, most of which no test imports),
# and an environment with PYTHONDONTWRITEBYTECODE set would otherwise compile every imported
# module again in each test process and each run a test launches.
unset PYTHONDONTWRITEBYTECODE
tier=()
limit=300
args=()
for arg in "$@"; do
  case "$arg" in
    --extended) tier=(-m 'not slow'); limit=1800 ;;
    --all) tier=(-m ''); limit=1800 ;;
    *) args+=("$arg") ;;
  esac
done
bash scripts/setup.sh
workers="${RLAX_TEST_WORKERS:-2}"
if [[ "$workers" == 0 ]]; then
  exec .venv/bin/python -m pytest -q --timeout="$limit" --timeout-method=thread \
    ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"}
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder \
  --max-worker-restart=0 --timeout="$limit" --timeout-method=thread \
  ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"}
