#!/usr/bin/env bash
# On the GPU machine, from the repository root (what the device call runs):
#   bash bench/gpu_check.sh [gpu_check.py flags]
# Installs the carried wheels (.gpu/whl), reassembles the SmolLM2 GGUF staged by two calls
# (bench/gpu_stage.sh) in /tmp/tandem_gguf, then runs bench/gpu_check.py into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl || { echo "gpu_check.sh: wheel install failed"; exit 2; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
G=/tmp/tandem_gguf
F=SmolLM2-135M-Instruct.Q4_1.gguf
[ -f .gpu/gguf_a/part_00 ] && mkdir -p "$G" && cp .gpu/gguf_a/part_00 "$G/"
if [ ! -f "$G/$F" ] && [ -f "$G/part_00" ] && [ -f .gpu/gguf_b/part_01 ]; then
  cat "$G/part_00" .gpu/gguf_b/part_01 > "$G/$F"
  (cd "$G" && sha256sum -c "$OLDPWD/.gpu/gguf_b/SHA256") || { echo "gpu_check.sh: GGUF checksum mismatch"; rm -f "$G/$F"; }
fi
if [ -f "$G/$F" ]; then
  echo "gpu_check.sh: SmolLM2 GGUF at $G/$F"
else
  echo "gpu_check.sh: NO SmolLM2 GGUF (part_00 missing: the machine was not warm, or not staged): random-smollm2"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
exec python3 bench/gpu_check.py --out "${OUT:-bench/out/gpu_check}" "$@"
