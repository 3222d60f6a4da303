"""Trace replay: Mooncake hash ids -> token blocks, Azure CSV parsing, arrival scaling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tandem.loadtest.loadgen.traces import (TOKEN_ID_HI, TOKEN_ID_LO, hash_block, load_azure, load_mooncake,
                                            load_trace, mooncake_prompt)
from tandem.workloads import AZURE_CONV_2023, MOONCAKE_SYNTHETIC


def _mooncake(tmp_path, rows) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_hash_block_depends_on_the_id_only():
    b = hash_block(42, 16)
    assert len(b) == 16 and b == hash_block(42, 16)
    assert all(TOKEN_ID_LO <= t < TOKEN_ID_HI for t in b)
    assert hash_block(43, 16) != b
    assert hash_block(42, 32)[:16] == b          # a bigger block extends the same stream


def test_shared_hash_ids_give_identical_token_prefixes(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 1024, "output_length": 7, "hash_ids": [5, 6]},
            {"timestamp": 3000, "input_length": 1500, "output_length": 900, "hash_ids": [5, 6, 9]},
            {"timestamp": 4000, "input_length": 600, "output_length": 3, "hash_ids": [5, 11]},
            {"timestamp": 4000, "input_length": 20, "output_length": 3, "hash_ids": [12]}]
    w = load_mooncake(_mooncake(tmp_path, rows), block_size=16, speedup=2.0, max_tokens=64)
    a, b, c, d = w.requests
    assert len(a.prompt) == 32                                # 2 blocks of 16
    assert len(b.prompt) == math.ceil(1500 * 16 / 512) == 47  # last block partial, as in the trace
    assert len(c.prompt) == math.ceil(600 * 16 / 512) == 19
    assert len(d.prompt) == 1
    assert b.prompt[:32] == a.prompt                          # shares hash ids 5, 6
    assert c.prompt[:16] == a.prompt[:16] and c.prompt[16:] != a.prompt[16:19]
    assert b.prompt[32:] == hash_block(9, 16)[:15]
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 1.5, 1.5]   # ms -> s, from the first, / speedup
    assert [r.max_tokens for r in w.requests] == [7, 64, 3, 3] and all(r.exact_output for r in w.requests)
    w8 = load_mooncake(_mooncake(tmp_path, rows), block_size=8, max_requests=2)
    assert len(w8.requests) == 2 and len(w8.requests[0].prompt) == 16
    assert w8.requests[0].prompt == hash_block(5, 8) + hash_block(6, 8)
    assert w8.requests[1].max_tokens == 900                   # uncapped without max_tokens
    assert mooncake_prompt([5, 6], 1024, 16) == a.prompt


def test_mooncake_rejects_other_files(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a Mooncake trace record"):
        load_mooncake(p)


def test_the_vendored_mooncake_trace_parses():
    w = load_trace(str(MOONCAKE_SYNTHETIC), block_size=16, max_requests=50, speedup=1.0, scale=1.0, seed=0, max_tokens=None)
    assert len(w.requests) == 50
    assert w.requests[0].arrival_s == 0 and w.requests[-1].arrival_s > 0
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals)


def test_azure_csv(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "2023-11-16 18:16:46.6805900,10,1000\n")
    w = load_azure(p, scale=0.5, speedup=2.0, seed=1, max_tokens=100)
    a, b, c = w.requests
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.0, (4.314579) / 2, 30.0])
    assert [len(r.prompt.split()) for r in w.requests] == [187, 198, 5]
    assert [r.max_tokens for r in w.requests] == [22, 54, 100]   # round(54.5) == 54
    assert w == load_azure(p, scale=0.5, speedup=2.0, seed=1, max_tokens=100)
    assert a.prompt != b.prompt                            # no shared prefixes in this trace
    assert load_trace(str(p), scale=1.0, max_requests=1, block_size=16).requests[0].max_tokens == 44


def test_azure_and_dispatch_errors(tmp_path):
    p = tmp_path / "other.csv"
    p.write_text("time,tokens\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_azure(p)
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(str(tmp_path / "trace.txt"))


def test_the_vendored_azure_trace_parses():
    w = load_azure(AZURE_CONV_2023, scale=0.1, max_requests=20)
    assert len(w.requests) == 20 and w.requests[1].arrival_s == pytest.approx(4.314579)
