"""The soak's pieces without a server: the fault specs, the process sampler, the flatness verdict,
the KV totals, the table and the plot (loadtest/chaos/soak.py, sampler.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tandem.loadtest.chaos import sampler, soak
from tandem.loadtest.chaos.cli import options, verdict


def test_specs_parse_and_refuse():
    assert soak.parse_seconds("30m") == 1800 and soak.parse_seconds("90s") == 90
    assert soak.parse_seconds("1.5h") == 5400 and soak.parse_seconds(45) == 45
    assert soak.parse_stop("decode@30+10") == (30.0, "decode", 10.0)
    assert soak.parse_stop("decode-1@2.5+1") == (2.5, "decode-1", 1.0)
    assert soak.parse_router_kill("1@40", 2) == (40.0, 1)
    for bad in ("10 minutes", "-5s"):
        with pytest.raises(ValueError):
            soak.parse_seconds(bad)
    with pytest.raises(ValueError, match="ROLE@SECONDS"):
        soak.parse_stop("router@3+1")
    with pytest.raises(ValueError, match="router 0 must survive"):
        soak.parse_router_kill("0@5", 2)
    with pytest.raises(ValueError):
        soak.parse_router_kill("2@5", 2)                       # only routers 0 and 1 exist


def test_proc_stats_see_a_process_grow_and_stop():
    code = ("import sys, threading, time; blob = []; ev = threading.Event(); print('ready', flush=True)\n"
            "for line in sys.stdin:\n"
            "    blob.append(b'x' * (64 << 20)); [threading.Thread(target=ev.wait).start() for _ in range(4)]\n"
            "    fs = [open('/dev/null') for _ in range(8)]; blob.append(fs); print('ok', flush=True)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"   # started: its interpreter's own growth is done
        before = sampler.proc_stats(p.pid)
        p.stdin.write("grow\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"
        after = sampler.proc_stats(p.pid)
        assert after["rss_mb"] - before["rss_mb"] >= 60
        assert after["threads"] - before["threads"] == 4 and after["fds"] - before["fds"] == 8
        s = sampler.Series()
        s.add(0.0, {"p": before}, None)                         # before the warm-up: not judged
        s.add(5.0, {"p": before}, None)
        s.add(9.0, {"p": after}, None)
        why = sampler.flat(s, 2.0, sampler.Bounds(rss_mb=32, fds=4, threads=2))
        assert len(why) == 3 and why[0].startswith("p: rss_mb grew")
        assert sampler.flat(s, 2.0, sampler.Bounds(rss_mb=256, fds=16, threads=8)) == []
        assert sampler.flat(s, 6.0) == []                      # one sample after warm-up: nothing to judge
        os.kill(p.pid, signal.SIGSTOP)                          # a stopped process still reads
        try:
            assert sampler.proc_stats(p.pid) is not None
        finally:
            os.kill(p.pid, signal.SIGCONT)
    finally:
        p.kill()
        p.wait()
    time.sleep(0.1)
    assert sampler.proc_stats(p.pid) is None                    # gone


def test_kv_totals_table_and_plot(tmp_path):
    rows = [{"worker": "prefill-0", "total_tokens": 100, "available_tokens": 60, "evictable_tokens": 30,
             "running": 1, "request_tokens": 10},
            {"worker": "decode-0", "total_tokens": 50, "available_tokens": 50, "evictable_tokens": 0,
             "leaked_tokens": 2},
            {"worker": "decode-1", "error": "ActorDiedError"}]
    kv = sampler.kv_totals(rows)
    assert kv["used_tokens"] == 10 and kv["running"] == 1 and kv["leaked_tokens"] == 2
    assert kv["workers"] == 2 and kv["unreachable"] == 1
    s = sampler.Series()
    for t in range(4):
        s.add(float(t * 10), {"router-0": {"rss_mb": 500.0 + t, "fds": 40, "threads": 20},
                              "decode@7": {"rss_mb": 900.0, "fds": 30, "threads": 12} if t < 3 else None}, kv)
    table = sampler.format_table(s, 5.0)
    assert re.search(r"router-0 +4 +501 -> +503 +40 -> +40 +20 -> +20", table), table
    assert "decode@7" in table and "KV last" in table
    sampler.plot(s, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 1000


def test_the_verdict_fails_on_hung_requests_and_growth():
    base = {"mismatches": [], "kv_problems": [], "failure_reasons": {}}
    assert verdict(base) == []
    assert "hung" in verdict(base | {"hung": 2})[0]
    assert verdict(base | {"not_flat": ["router-0: fds grew 40"]})[0].startswith("not flat")
    args = options("http://127.0.0.1:1", duration="2m", stop=["decode@5+3"], also_url=["http://127.0.0.1:2"])
    assert args.duration == "2m" and args.stop == ["decode@5+3"] and soak.sample_every_s(args) == 60.0
    assert soak.sample_every_s(options("http://127.0.0.1:1")) == 0.0       # one round: no sampling
    assert soak.sample_every_s(options("http://127.0.0.1:1", sample_every="10s")) == 10.0
