#!/usr/bin/env bash
# Creates one virtualenv per peer library for the head-to-head (benchmarks/peers/README.md):
#   benchmarks/peers/.venv-tunix  google-tunix 0.1.7 on the JAX/Flax that rlax_llm uses here
#   benchmarks/peers/.venv-trl    trl 1.16.0 on torch 2.13.0 (the CPU wheel, installed first)
# Idempotent: a venv is (re)installed only when its pins in this script changed. Writes the
# resolved versions to requirements-<peer>.lock next to this script (committed: what a study
# ran with). The peers never become dependencies of rlax_llm (pyproject.toml is untouched).
# Usage: bash benchmarks/peers/setup.sh [tunix|trl ...]   (both when no argument)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

# The pins. Tunix runs on the JAX/Flax/optax of rlax_llm's venv (the same XLA for both JAX
# sides); torch is pinned so that pip never swaps in a CUDA build.
TUNIX_PINS=(google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 psutil)
TRL_TORCH=torch==2.13.0
TRL_PINS=(trl==1.16.0 "$TRL_TORCH" transformers accelerate datasets safetensors psutil)

make_venv() {  # make_venv NAME PIN...
  local name=$1; shift
  local venv=".venv-$name" stamp want
  stamp="$venv/.pins"
  want=$(printf '%s\n' "$@" | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "setup: $venv is up to date" >&2
  else
    echo "setup: installing $venv ($*)" >&2
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    if [ "$name" = trl ]; then
      # torch first, alone, from the CPU wheel; the constraint keeps it through the rest.
      "$venv/bin/python" -m pip install -q "$TRL_TORCH"
      printf '%s\n' "$TRL_TORCH" > "$venv/constraints.txt"
      "$venv/bin/python" -m pip install -q -c "$venv/constraints.txt" "$@"
    else
      "$venv/bin/python" -m pip install -q "$@"
    fi
    echo "$want" > "$stamp"
  fi
  "$venv/bin/python" -m pip freeze --exclude-editable | sort > "requirements-$name.lock"
  echo "setup: $venv uses $(du -sm "$venv" | cut -f1) MB; versions in requirements-$name.lock" >&2
}

peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(tunix trl)
for p in "${peers[@]}"; do
  case "$p" in
    tunix) make_venv tunix "${TUNIX_PINS[@]}" ;;
    trl) make_venv trl "${TRL_PINS[@]}" ;;
    *) echo "setup: unknown peer '$p' (expected tunix or trl)" >&2; exit 2 ;;
  esac
done
