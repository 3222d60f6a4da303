"""``tandem simulate``: one JSON object on stdout, with the documented shape."""

from __future__ import annotations

import argparse
import json

import pytest

from tandem.sim.replay import cli
from tandem.sim.replay.simulate import DEFAULT_TRACE


def test_simulate_several_routers_with_and_without_kv_events(capsys):
    cfgs = []
    for flag in ("--kv-events", "--no-kv-events"):
        assert cli.main(["simulate", "--limit", "40", "--prefill", "2", "--decode", "2", "--routers", "2", flag]) == 0
        cfgs.append(json.loads(capsys.readouterr().out)["config"])
    assert [(c["routers"], c["kv_events"]) for c in cfgs] == [(2, True), (2, False)]


def test_simulate_prints_one_json_object(capsys):
    rc = cli.main(["simulate", "--trace", str(DEFAULT_TRACE), "--limit", "60", "--prefill", "2",
                   "--decode", "2", "--policy", "session", "--block-size", "512",
                   "--capacity-tokens", "1000000", "--speedup", "2", "--profile", "llama3-8b-h100"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"requests", "completed", "hit_rate", "ttft_s", "tpot_s", "e2e_s", "queue_s",
                        "makespan_s", "throughput", "load_imbalance", "prefill_workers",
                        "decode_workers", "config", "decisions", "decision_us", "wall_s"}
    assert out["requests"] == out["completed"] == 60
    assert set(out["ttft_s"]) == {"mean", "p50", "p90", "p99", "max"}
    assert set(out["throughput"]) == {"requests_per_s", "input_tokens_per_s", "output_tokens_per_s"}
    assert [w["id"] for w in out["prefill_workers"]] == [0, 1]
    assert [w["id"] for w in out["decode_workers"]] == [2, 3]
    assert set(out["prefill_workers"][0]) >= {"requests", "hit_rate", "busy_s", "utilization"}
    assert out["config"] == {"policy": "session", "prefill": 2, "decode": 2, "block_size": 512,
                             "capacity_tokens": 1000000, "global_cache": False, "speedup": 2.0,
                             "profile": "llama3-8b-h100", "decode_capacity_tokens": 427000,
                             "seed": 0, "trace": str(DEFAULT_TRACE),
                             "routers": 1, "kv_events": False}


def test_global_cache_flag(capsys):
    assert cli.main(["simulate", "--limit", "30", "--prefill", "3", "--decode", "1",
                     "--global-cache", "--capacity-tokens", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["global_cache"] is True and out["config"]["capacity_tokens"] is None


def test_errors_exit_2(capsys, tmp_path):
    assert cli.main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert cli.main(["simulate", "--trace", str(bad)]) == 2
    assert "not a Mooncake-format trace" in capsys.readouterr().err


def test_register_adds_the_subcommand():
    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.register(sub)
    args = parser.parse_args(["simulate", "--policy", "kv_events"])
    assert args.func is cli.run and args.policy == "kv_events" and args.prefill == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--policy", "fastest"])
