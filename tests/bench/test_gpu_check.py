"""bench/gpu_check.py runs end to end: its CPU smoke mode (tiny random model, tiny sizes, the CUDA
graph stand-in, the kernel sweep in triton's interpreter) passes every check and writes its JSON
and table. The GPU run itself is the device machine's (bench/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_cpu_smoke_runs_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--cpu-smoke",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["status"] == "pass"
    for name in ("engine_vs_transformers", "graphs_on_off", "retraction_restore", "overlap_on_off",
                 "decode", "decode_launches", "llama8b"):
        assert rep[name]["ok"], name
    assert rep["retraction_restore"]["stats"]["retraction_restores"] > 0
    assert [r["batch"] for r in rep["decode"]["rows"]] == [1, 2]
    sg = rep["spec_graphs"]                  # the verify graph's stand-in replayed, tokens as without drafts
    assert sg["ok"] and [r["batch"] for r in sg["rows"]] == [1, 2]
    assert all(r["tokens_equal"] and r["verify_replays"] > 0 for r in sg["rows"]), sg["rows"]
    assert rep["host_copies"]["round_trip_exact"]
    assert len(rep["kernel_sweep"]["shapes"]) == 2
    sw = rep["split_sweep"]
    assert sw["ok"] and len(sw["rows"]) == 4 and sw["table"]["spans"] == [16, 40]
    assert all(str(r["best"]) == min(r["us"], key=r["us"].get) for r in sw["rows"])
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Decode tok/s" in md and "## Triton kernels" in md and "status: **pass**" in md
    assert "## Decode attention split-K sweep" in md
    assert "## Speculative decoding on vs off, CUDA graphs on" in md
    assert "## Launches per decode step" in md and "## Llama-3.1-8B geometry" in md
    assert set(rep["decode"]["rows"][0]["engine_over_runner"]) == {"engine_graph", "engine_graph_no_overlap"}


def test_a_failed_check_fails_the_run_and_the_measurements_still_run(tmp_path, monkeypatch):
    """A correctness phase that fails is listed and marks the run failed; later phases run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    gc = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gc)     # its dataclasses look themselves up
    spec.loader.exec_module(gc)
    report: dict = {}
    gc._phase(report, "a_check", lambda: {"ok": False}, required=True)
    gc._phase(report, "a_measurement", lambda: {"ok": True, "x": 1}, required=False)
    assert report["failed"] == ["a_check"] and report["a_measurement"]["x"] == 1


def test_gpu_check_imports_no_ray_nixl_or_transfer():
    """The GPU machine has no Ray and no NIXL: the Engine and gpu_check's modules must not
    import them (nor transfer/, which imports NIXL) at import time."""
    code = ("import sys; import tandem.engine.engine, tandem.bench.gpu.correctness, tandem.bench.gpu.throughput, "
            "tandem.bench.gpu.kernels, tandem.bench.gpu.models, tandem.bench.gpu.splits, tandem.bench.gpu.spec; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'nixl') "
            "or m.startswith('tandem.transfer')); print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_timed_out_childs_output_is_logged_as_text():
    """``TimeoutExpired`` holds bytes even for a ``text=True`` run: the log gets the text, not
    ``b'...'`` (found by the type check)."""
    from tandem.bench.gpu.correctness import captured

    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        subprocess.run([sys.executable, "-c", "import time; print('line one', flush=True); time.sleep(30)"],
                       capture_output=True, text=True, timeout=2)
    assert isinstance(timed_out.value.stdout, bytes)
    assert captured(timed_out.value.stdout) == "line one\n"
    assert captured(None) == "" and captured("already text") == "already text"
