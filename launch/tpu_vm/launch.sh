#!/usr/bin/env bash
# Thin wrapper: python -m launch.recipes tpu-vm "$@" with this checkout importable.
# Options: launch/tpu_vm/README.md, or --help. --dry-run checks and prints; nothing runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$python" ] && ! command -v "$python" >/dev/null; then python=python3; fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m launch.recipes tpu-vm "$@"
