"""bench/gpu_cluster_check.py runs end to end on the CPU (issue 36): its ``--cpu-smoke`` runs the GPU
run's phases with DRAM descriptors, a tiny random model and Ray's logical GPU (the workers at
``num_gpus`` 0.5, and 0.33 for migration): 1P+1D tokens equal colocated, the NIXL handoff measured
against a copy, retraction to the host pool and live migration with equal tokens, the agent
workload against ``tandem serve`` 1P+1D and colocated. The GPU run itself is the device
machine's (bench/gpu_cluster_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("ray")
pytest.importorskip("nixl")
pytest.importorskip("transformers")


@pytest.mark.timeout(600)
def test_cpu_smoke_runs_every_phase(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_cluster_check.py"), "--cpu-smoke",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rep = json.loads((tmp_path / "gpu_cluster_check.json").read_text())
    assert rep["failed"] == []
    for key in ("pd_equals_colocated", "nixl_vram_GBps", "device_copy_GBps", "migration_ok",
                "migration_downtime_ms", "ttft_p50_ratio_pd_vs_colocated"):
        assert rep[key] not in (None, False), key
    pd = rep["pd_vs_colocated_float32"]
    assert pd["exact"] == pd["requests"] == 5
    assert pd["workers"] == {n: {"gpu": 0.5, "device": "cpu", "regions": {"kv": "DRAM"}}
                             for n in ("prefill-0", "decode-0")}
    sizes = rep["handoff"]["sizes"]
    assert [s["prompt_tokens"] for s in sizes] == [64, 256]
    assert sizes[1]["bytes"] > sizes[0]["bytes"] > 0 and 0 < sizes[1]["share_of_ttft"] < 1
    mig = rep["retraction_migration"]
    assert {w["gpu"] for w in mig["workers"].values()} == {0.33}
    assert mig["retraction"]["exact"] == 5 and mig["retraction"]["retraction_restores"] > 0
    assert mig["migration"]["exact"] == 5 and len(rep["migration_downtime_ms"]) == 5
    assert all(d > 0 for d in rep["migration_downtime_ms"])
    for name in ("pd", "colocated"):
        s = rep["serve_bench"][name]
        assert s["ok"] == s["requests"] > 0 and s["output_tok_per_s"] > 0, s
    md = (tmp_path / "gpu_cluster_check.md").read_text()
    assert "| pd_equals_colocated | True |" in md and "tandem bench agent, pd" in md
