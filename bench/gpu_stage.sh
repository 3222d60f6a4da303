#!/usr/bin/env bash
# Prepare, on this machine, what the GPU machine lacks, in .gpu/ (git-ignored), each part under one
# device call's 64 MiB:
#   .gpu/whl/            the wheels the Engine needs beyond the GPU image (pydantic & co., gguf,
#                        llguidance: engine/grammar.py imports it; stage.py closure --engine)  ~7 MB
#   .gpu/gguf_a/         first half of the SmolLM2 GGUF (part_00)                         ~47 MB
#   .gpu/gguf_b/         second half (part_01) and the file's SHA256                      ~47 MB
#   .gpu/cluster/part_NN what the disaggregated cluster adds (Ray 2.60.0, nixl + nixl-cu13 1.5.1,
#                        fastapi, uvicorn, pyzmq, ... : bench/gpu/stage.py closure), as one tar cut
#                        in 45 MiB chunks with a sha256 manifest (bench/gpu/stage.py split)   ~4 parts
# Usage, from the repository root:  bash bench/gpu_stage.sh [PYTHON]     (SKIP_CLUSTER=1: no cluster parts)
#   PYTHON: an interpreter with pip, packaging and Tandem's dependencies installed (default .venv/bin/python);
#   the versions staged are the ones installed there (the ones the suite runs with).
# Then, for bench/gpu_check.sh, two device calls, back to back (the machine keeps /tmp for ~30 s between calls):
#   run(carry=[".gpu/gguf_a"], timeout_s=120,
#       command="mkdir -p /tmp/tandem_gguf && cp .gpu/gguf_a/part_00 /tmp/tandem_gguf/ && ls -l /tmp/tandem_gguf")
#   run(carry=[".gpu/gguf_b", ".gpu/whl"], timeout_s=600, command="bash bench/gpu_check.sh")
# (If the machine went cold in between, gpu_check.sh says so and runs on random-smollm2.)
# For bench/gpu_cluster_check.sh, one call per cluster part but the last, back to back:
#   run(carry=[".gpu/cluster/part_00"], timeout_s=120,
#       command="python3 bench/gpu/stage.py keep .gpu/cluster/part_00 /tmp/tandem_stage")
#   ... part_01, part_02 likewise; the last part (the closure holds the Engine's wheels too) runs the check:
#   run(carry=[".gpu/cluster/part_03"], timeout_s=600, command="bash bench/gpu_cluster_check.sh")
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${1:-.venv/bin/python}
PLATFORMS=(--platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)
download() {  # download DIR NAME==VERSION: one wheel for the GPU machine's CPython 3.12, no dependencies
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$1" "$2"
}
rm -rf .gpu && mkdir -p .gpu/whl .gpu/gguf_a .gpu/gguf_b
PYTHONPATH=. "$PY" bench/gpu/stage.py closure --engine --python 3.12 > .gpu/engine.txt
while read -r w; do download .gpu/whl "$w"; done < .gpu/engine.txt
GGUF=$(PYTHONPATH=. "$PY" -c "from tandem.engine.loader import smollm2_path; print(smollm2_path())")
split -n 2 -d "$GGUF" .gpu/part_
mv .gpu/part_00 .gpu/gguf_a/ && mv .gpu/part_01 .gpu/gguf_b/
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > .gpu/gguf_b/SHA256
du -sh .gpu/whl .gpu/gguf_a .gpu/gguf_b
if [ "${SKIP_CLUSTER:-0}" != 1 ]; then
  mkdir -p .gpu/cluster_whl
  PYTHONPATH=. "$PY" bench/gpu/stage.py closure --python 3.12 > .gpu/cluster.txt
  while read -r w; do download .gpu/cluster_whl "$w"; done < .gpu/cluster.txt
  PYTHONPATH=. "$PY" bench/gpu/stage.py split .gpu/cluster_whl .gpu/cluster
  rm -rf .gpu/cluster_whl
  du -sh .gpu/cluster/part_*
fi
