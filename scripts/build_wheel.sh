#!/usr/bin/env bash
# Build a halserve wheel that ships the cpu platform's native kernel libraries precompiled, per x86 ISA
# level, so that an installed halserve starts without g++ and without the first-use build (README:
# Installation). The wheel holds halserve/platforms/cpu_kernels/prebuilt_libs/<level>/*.so and a
# manifest.json (torch version, Python ABI, a hash of each library's sources); at run time
# platforms/cpu_kernels/prebuilt.py loads this CPU's level where all of them match, else builds as before.
#
#   scripts/build_wheel.sh                                            # all four levels, into dist/
#   HALSERVE_PREBUILD_CPU_KERNELS=avx2,avx512_bf16 scripts/build_wheel.sh /tmp/wheels
#
# HALSERVE_PREBUILD_CPU_KERNELS: the levels (avx2, avx512, avx512_bf16, amx, or all; default all)
# HALSERVE_PREBUILD_LOCK:        a file to flock around each library's compile (default /tmp/cpu.lock when
#                                it exists, so other users of a shared machine get turns; empty: none)
#
# The libraries are valid only for the torch installed here (the build does not isolate itself:
# --no-build-isolation), and the wheel is tagged for this Python and platform. About 2 minutes per level
# on 2 cores (6 libraries each).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-dist}"
export HALSERVE_PREBUILD_CPU_KERNELS="${HALSERVE_PREBUILD_CPU_KERNELS:-all}"
if [[ -z "${HALSERVE_PREBUILD_LOCK+x}" && -e /tmp/cpu.lock ]]; then
    export HALSERVE_PREBUILD_LOCK=/tmp/cpu.lock
fi
# an earlier build's files in setuptools' build folders would ride along into this wheel
rm -rf build/lib build/lib.* build/bdist.*
mkdir -p "$out"
log="$(mktemp)"
started=$SECONDS
set +e
python -m pip wheel --no-deps --no-build-isolation -v -w "$out" . 2>&1 | tee "$log" | grep --line-buffered -E '^\s*prebuilt '
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
    tail -n 40 "$log" >&2
    echo "building the wheel failed (full log: $log)" >&2
    exit "$status"
fi
rm -f "$log"
wheel="$(ls -t "$out"/halserve-*.whl | head -n 1)"
echo "built $wheel ($(du -h "$wheel" | cut -f1), $((SECONDS - started)) s; levels: $HALSERVE_PREBUILD_CPU_KERNELS)"
