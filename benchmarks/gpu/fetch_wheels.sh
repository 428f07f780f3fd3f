#!/usr/bin/env bash
# Run HERE (a machine with the package index), in the repository root, before the GPU run:
# downloads the runtime dependencies halserve needs that the device image lacks (it has
# torch, triton, transformers, safetensors, ...; see /work/.library/device/KINDS.md) as
# Python 3.12 x86-64 wheels into .whl/, which must be git-ignored and carried.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# halserve's dependencies missing there (pydantic and the HTTP server stack), pinned to
# versions that work together
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
    fastapi==0.121.3 starlette==0.50.0 uvicorn==0.38.0
ls -la .whl
