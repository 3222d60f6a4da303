#!/usr/bin/env bash
# On the GPU machine, from the repository root (what the last device call runs):
#   bash bench/gpu_cluster_check.sh [gpu_cluster_check.py flags]
# Keeps the carried part of the cluster wheels (.gpu/cluster/part_NN, bench/gpu_stage.sh) beside the
# ones earlier calls kept in /tmp/tandem_stage, reassembles and verifies them (bench/gpu/stage.py),
# installs them offline into /tmp/site_cluster (once per warm machine), checks that every module
# the Engine and the cluster import loads, then runs bench/gpu_cluster_check.py into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
STORE=/tmp/tandem_stage WHL=/tmp/tandem_whl SITE=/tmp/site_cluster
for p in .gpu/cluster/part_*; do
  [ -d "$p" ] && { python3 bench/gpu/stage.py keep "$p" "$STORE" || exit 2; }
done
if [ ! -f "$SITE/.installed" ]; then
  python3 bench/gpu/stage.py join "$STORE" "$WHL" || { echo "gpu_cluster_check.sh: stage every part first"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links "$WHL" --target "$SITE" \
    "$WHL"/*.whl || { echo "gpu_cluster_check.sh: offline install failed"; exit 2; }
  touch "$SITE/.installed"
fi
export PYTHONPATH="$(pwd):$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
python3 - <<'PY' || { echo "gpu_cluster_check.sh: an import failed"; exit 2; }
import importlib
mods = ["ray", "nixl", "nixl._api", "llguidance", "fastapi", "uvicorn", "prometheus_client", "msgpack", "zmq", "gguf",
        "tokenizers", "jsonschema", "pydantic", "httpx", "yaml", "tandem.engine.engine", "tandem.transfer.agent",
        "tandem.cluster.launch", "tandem.cluster.cli", "tandem.prefill.actor", "tandem.decode.actor"]
for m in mods:
    importlib.import_module(m)
print(f"gpu_cluster_check.sh: {len(mods)} imports ok")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 bench/gpu_cluster_check.py --out "${OUT:-bench/out/gpu_cluster_check}" "$@"
