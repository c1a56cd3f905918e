#!/usr/bin/env bash
# The default test run (excludes tests marked slow). Extra arguments go to pytest.
# Tests run in RLAX_TEST_WORKERS pytest-xdist processes (default 2, one per core of the CI
# machine; 0 runs them in this process); a file's tests stay in one process (its fixtures are
# shared), the longest files first (tests/conftest.py: LONGEST_FILES), and XLA's compilation
# cache is shared between the processes (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The whole default run (no arguments) also checks the installed wheel: tests/test_wheel.py
# builds `pip wheel .`, installs it into a fresh virtualenv outside the checkout, launches the
# packaged default config and resumes it (about a minute, so it is marked slow). It runs in
# its own process beside the parallel run (most of its minute is pip and process starts,
# which leave the cores to the tests), and its report is printed after the tests'.
workers="${RLAX_TEST_WORKERS:-2}"
if [[ "$workers" == 0 ]]; then
  if [[ $# == 0 ]]; then
    .venv/bin/python -m pytest -q -p no:xdist -m slow tests/test_wheel.py
  fi
  exec .venv/bin/python -m pytest -q "$@"
fi
wheel_pid=
if [[ $# == 0 ]]; then
  wheel_log=$(mktemp)
  wheel_tmp=$(mktemp -d)  # its own pytest temporary root and no cache: two pytest sessions
  .venv/bin/python -m pytest -q -p no:xdist -p no:cacheprovider --basetemp="$wheel_tmp/t" \
    -m slow tests/test_wheel.py >"$wheel_log" 2>&1 &
  wheel_pid=$!
fi
status=0
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@" \
  || status=$?
if [[ -n "$wheel_pid" ]]; then
  wheel_status=0
  wait "$wheel_pid" || wheel_status=$?
  echo "== the installed wheel (tests/test_wheel.py, run beside the tests above) =="
  cat "$wheel_log"
  rm -rf "$wheel_log" "$wheel_tmp"
  if [[ $status == 0 ]]; then status=$wheel_status; fi
fi
exit "$status"
