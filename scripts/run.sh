#!/usr/bin/env bash
# The main job: python -m rlax_llm.launch (the packaged configs/default.py unless flags say
# otherwise).
# Extra arguments are passed through, e.g. scripts/run.sh --config.total_steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes each module's bytecode on its first import (scripts/setup.sh installs without
# compiling; scripts/test.sh does the same).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
exec .venv/bin/python -m rlax_llm.launch "$@"
