#!/usr/bin/env bash
# The main job: python -m rlax_llm.launch (the packaged configs/default.py unless flags say
# otherwise).
# Extra arguments are passed through, e.g. scripts/run.sh --config.total_steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The default config is a CPU run. .venv also holds libtpu (the test install's, for the TPU
# compile tests), which would otherwise spend ~14 s probing for a TPU chip at start-up; set
# JAX_PLATFORMS yourself (e.g. JAX_PLATFORMS= for jax's own choice) to run elsewhere.
export JAX_PLATFORMS="${JAX_PLATFORMS-cpu}"
exec .venv/bin/python -m rlax_llm.launch "$@"
