"""``tandem bench`` flags: register() wiring and refusals that need no server."""

from __future__ import annotations

import argparse

import pytest

from tandem.loadtest.loadgen.cli import build_workload, main, register, run


def _args(*argv):
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "--url", "http://127.0.0.1:9", *argv])


def test_register_adds_bench_with_func():
    a = _args("--workload", "agent", "--turns", "5", "--think-time", "exp:1")
    assert a.command == "bench" and a.func is run
    assert (a.turns, a.temperature, a.block_size, a.speedup, a.seed) == (5, 0.0, 16, 1.0, 0)
    w = build_workload(a)
    assert w.name == "agent" and len(w.sessions) == 4 and all(len(s.turns) == 5 for s in w.sessions)
    w = build_workload(_args("--workload", "vllm-multiturn", "--scale", "0.05", "--num-sessions", "2"))
    assert len(w.sessions) == 2


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload(_args("--workload", "chatty"))
    with pytest.raises(ValueError, match="not found"):
        build_workload(_args("--workload", f"trace:{tmp_path}/missing.jsonl"))
    with pytest.raises(ValueError, match="--concurrency must be >= 1"):
        run(_args("--workload", "agent", "--concurrency", "0"))
    assert main(["--url", "http://127.0.0.1:9", "--workload", "agent", "--tool-result-tokens", "uniform:9",
                 "--out", str(tmp_path)]) == 2
    # nothing listens on port 9: a one-line error, exit 2
    assert main(["--url", "http://127.0.0.1:9", "--workload", "agent", "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
