#!/usr/bin/env bash
# Thin wrapper: python -m launch.recipes multihost "$@" with this checkout importable.
# Options: launch/multihost/README.md, or --help. --dry-run checks and prints; nothing runs.
# Every host of the slice runs the same `python -m rlax_llm.launch` command on the same
# --workdir, with its own --config.distributed.process_id. Process 0 claims the workdir for
# the job and writes config.json, metrics, ledger, TensorBoard and summary; every process
# trains (one trainer mesh over all hosts), runs its own inference workers and writes its
# shards of the checkpoints (launch/multihost/README.md, "What the processes do").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$python" ] && ! command -v "$python" >/dev/null; then python=python3; fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m launch.recipes multihost "$@"
