#!/usr/bin/env bash
# The Python packages the engine imports that the lent GPU machine's image lacks (its image has
# torch, triton, transformers, numpy, pytest, httpx, ...: /work/.library/device/KINDS.md), as
# CPython 3.12 manylinux wheels in .whl/ (git-ignored), at requirements.lock's versions, for
# bench/gpu_check.sh to install there. Found by running the GPU tests and benchmarks here in a
# virtualenv that holds only the image's packages plus these. About 10 MB; run once a session.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
for name in llguidance pydantic pydantic_core annotated-types typing-inspection fastapi starlette uvicorn; do
    pin=$(grep -i -E "^${name//[-_]/[-_]}==" requirements.lock)
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pin"
done
ls .whl
