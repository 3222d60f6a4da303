"""bench/retraction.py's core on a tiny size: both measurements run and their oracles hold."""

from __future__ import annotations

from tandem.bench import retraction


def test_retraction_bench_tiny(smollm2_default, one_torch_thread):
    args = retraction.parse_args(["--sizes", "32", "--repeats", "2", "--recompute-repeats", "1",
                                  "--no-profile", "--requests", "3", "--prompt-tokens", "8",
                                  "--output-tokens", "12", "--load-repeats", "1"])
    res = retraction.run(args, loaded=smollm2_default, log=lambda *a: None)

    d = res["restore_vs_recompute"]["sizes"]["32"]
    assert d["tokens"] == d["restored_tokens"] == 32 and d["backup_copy_tokens"] == 32
    assert d["tokens_match"], "the restored request sampled another token than a re-prefill"
    assert d["recompute_s"] > 0 and d["restore_s"] > 0 and d["memcpy_s"] > 0
    assert len(d["samples"]) == 2 and "recompute_s" not in d["samples"][1]

    p = res["memory_pressure"]
    assert p["device_pool_tokens"] < p["tokens_needed"]
    h, c = p["host"], p["recompute"]
    assert h["retractions"] > 0 and h["restores"] > 0 and h["recomputes"] == 0
    assert c["retractions"] > 0 and c["restores"] == 0 and c["recomputes"] > 0
    assert not h["errors"] and not c["errors"] and h["idle_clean"] and c["idle_clean"]
    assert p["outputs_identical"]
    assert h["itl_p99_ms"] >= h["itl_p50_ms"] > 0

    retraction.print_report(res)   # the table renders


def test_recovery_bench_tiny(smollm2_default, one_torch_thread):
    """bench/retraction_recovery.py: a storm retracts, nothing errs or leaks, and the decode
    batch is as full after the storm as before (tokens per model step)."""
    from tandem.bench import retraction_recovery as rr

    for host in (4096,):      # the recompute path: tests/engine/test_scheduler_fake.py
        r = rr.run_once(smollm2_default, host_pool_tokens=host, concurrency=2, storm=10, phase_s=1.0,
                        out_tokens=24, threads=1, log=lambda *a: None)
        assert r["retractions"] > 0 and r["errors"] == 0
        assert r["idle_leak_tokens"] == 0 and r["idle_locked_tokens"] == 0
        assert (r["restores"] > 0) == bool(host) and (r["recomputes"] > 0) == (not host)
        assert r["step_recovery"] >= 0.9, r
