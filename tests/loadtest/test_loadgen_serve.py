"""``tandem bench`` end to end against a real ``tandem serve --mode colocated`` (SmolLM2 on the CPU),
started once for this module as a subprocess on 127.0.0.1."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from support.serve import ServeProcess
from tandem.loadtest.loadgen.cli import register

NO_CACHE_REASON = ("the server reports cached_tokens = 0 for every request: prefix-cache hits are not "
                   "reported by this build (the radix cache is being integrated)")


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    proc = ServeProcess(["--mode", "colocated", "--device", "cpu", "--max-total-tokens", "4096",
                         "--max-running-requests", "8"], tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield proc.url()
    finally:
        proc.stop()


def _bench(argv: list[str]) -> tuple[int, str]:
    """Run ``tandem bench ARGV`` through register() as tandem/cli.py wires it; (exit code, stdout)."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv, "--no-progress"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = args.func(args)
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def agent_run(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-agent")
    rc, table = _bench(["--url", server, "--workload", "agent", "--out", str(out), "--num-sessions", "2",
                        "--turns", "2", "--max-tokens", "8", "--system-prompt-tokens", "64",
                        "--tool-result-tokens", "16", "--think-time", "0"])
    return rc, table, out, json.loads((out / "report.json").read_text())


def test_every_request_succeeds(agent_run):
    rc, table, _, doc = agent_run
    assert rc == 0
    s = doc["summary"]
    assert (s["requests"], s["ok"], s["errors"]) == (4, 4, 0), doc["records"]
    assert "4 requests (4 ok, 0 errors)" in table and "TTFT ms" in table
    assert sorted((r["session"], r["turn"]) for r in doc["records"]) == [
        ("agent-0-0000", 0), ("agent-0-0000", 1), ("agent-0-0001", 0), ("agent-0-0001", 1)]
    for r in doc["records"]:
        assert r["status"] == 200 and r["ttft"] > 0 and r["e2e"] >= r["ttft"]
        assert 1 <= r["completion_tokens"] <= 8 and len(r["itl"]) <= r["completion_tokens"] - 1
    first = {r["session"]: r["prompt_tokens"] for r in doc["records"] if r["turn"] == 0}
    for r in doc["records"]:
        if r["turn"] == 1:    # turn 2 carries turn 1, its reply, a tool result and an instruction
            assert r["prompt_tokens"] > first[r["session"]] + 16
    assert s["ttft_s"]["p50"] > 0 and s["output_tokens_per_s"] > 0


def test_second_turns_report_cached_tokens(agent_run):
    doc = agent_run[3]
    if all(not r["cached_tokens"] for r in doc["records"]):
        pytest.xfail(NO_CACHE_REASON)
    for r in doc["records"]:
        if r["turn"] == 1:
            assert r["cached_tokens"] > 0, r
    assert doc["summary"]["cached_token_ratio"] > 0


def test_report_and_figures_exist(agent_run):
    out, doc = agent_run[2], agent_run[3]
    assert doc["config"]["workload"] == "agent" and doc["config"]["model"] == "smollm2"
    assert doc["server"]["metrics_available"] is True
    for name in ("ttft_by_turn.png", "ttft_cdf.png", "throughput.png", "hit_ratio.png"):
        assert (out / name).stat().st_size > 5000, name


def test_mooncake_replay_shares_prefixes(server, tmp_path):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [7, 8]}\n'
                     '{"timestamp": 1500, "input_length": 1536, "output_length": 50, "hash_ids": [7, 8, 9]}\n')
    rc, _ = _bench(["--url", server, "--workload", f"trace:{trace}", "--out", str(tmp_path / "out"),
                    "--block-size", "16", "--max-tokens", "3"])
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rc == 0 and doc["summary"]["ok"] == 2, doc["records"]
    a, b = doc["records"]
    assert (a["prompt_tokens"], b["prompt_tokens"]) == (32, 48)
    assert (a["completion_tokens"], b["completion_tokens"]) == (2, 3)   # exact lengths, capped by --max-tokens
    assert b["start"] >= 1.4
    if not a["cached_tokens"] and not b["cached_tokens"]:
        pytest.xfail(NO_CACHE_REASON)
    assert b["cached_tokens"] >= 16
