#!/usr/bin/env bash
# The GPU path of rein in one script (at most ~8 minutes): SGLang serves the converted SmolLM2,
# rein's proxy runs in front of it, and ops/gpu_check.py checks pause, abort, resume on new
# weights, /update_weights_from_disk with a trainer checkpoint and per-token versions.
#
#   deploy/gpu-check.sh OUT_DIR
#
# Writes OUT_DIR/results.json (one entry per step, ok or the error), sglang.log, proxy.log and
# setup.log. Needs an NVIDIA GPU and the package registries (PyPI, Maven Central, Debian) the
# first time; everything it installs is cached in ${REIN_CACHE:-$HOME/.cache/rein}:
# rein's venv (deploy/venv.sh), SGLang in its own venv (venv-sglang: SGLang pins its own torch),
# the model (deploy/smollm2.sh), Kafka and Redis (the launcher fetches them).
# Knobs: SGLANG_PYTHON=<python with sglang installed> skips the SGLang install;
# SGLANG_SPEC (default "sglang[all]>=0.4,<1"); GPU_CHECK_TIMEOUT (default 480 s).
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: deploy/gpu-check.sh OUT_DIR" >&2; exit 2; }
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
CACHE="${REIN_CACHE:-$HOME/.cache/rein}"
cd "$REPO"

command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || {
    echo "gpu-check: no nvidia-smi: this check needs an NVIDIA GPU" >&2; exit 1; }

{
    VENV="$(bash deploy/venv.sh)"
    MODEL="$(bash deploy/smollm2.sh)"
    if [[ -z "${SGLANG_PYTHON:-}" ]]; then
        SG="$CACHE/venv-sglang"
        if [[ ! -f "$SG/.complete" ]]; then
            rm -rf "$SG"
            python3 -m venv "$SG"
            "$SG/bin/python" -m pip install -q -U pip
            "$SG/bin/python" -m pip install "${SGLANG_SPEC:-sglang[all]>=0.4,<1}"
            touch "$SG/.complete"
        fi
        SGLANG_PYTHON="$SG/bin/python"
    fi
} > >(tee "$OUT/setup.log" >&2) 2>&1

echo "gpu-check: model $MODEL, sglang $("$SGLANG_PYTHON" -c 'import sglang; print(sglang.__version__)')" >&2
exec timeout --signal=TERM --kill-after=30s "${GPU_CHECK_TIMEOUT:-480}" \
    "$VENV/bin/python" -m ops.gpu_check "$OUT" --model "$MODEL" --sglang-python "$SGLANG_PYTHON"
