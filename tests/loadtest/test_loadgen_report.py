"""Report: percentiles against hand-computed values, the summary, /metrics per-worker ratios, figures."""

from __future__ import annotations

import json

import pytest

from tandem.loadtest.loadgen import plots
from tandem.loadtest.loadgen.report import (Record, format_table, hit_ratio_by_turn, parse_metrics, percentile,
                                            summarize, worker_hit_ratios, write_json)


def test_percentile_hand_computed():
    xs = [10.0, 1.0, 4.0, 3.0, 2.0]          # sorted: 1 2 3 4 10
    assert percentile(xs, 50) == 3.0          # rank 0.5 * 4 = 2
    assert percentile(xs, 90) == pytest.approx(7.6)   # rank 3.6: 4 + 0.6 * (10 - 4)
    assert percentile(xs, 99) == pytest.approx(9.76)  # rank 3.96: 4 + 0.96 * 6
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)


def _records():
    return [
        Record("s0", 0, start=0.0, ttft=1.0, itl=[0.1, 0.3], e2e=1.4, prompt_tokens=100, cached_tokens=0,
               completion_tokens=3),
        Record("s0", 1, start=2.0, ttft=0.2, itl=[0.1], e2e=0.3, prompt_tokens=120, cached_tokens=90,
               completion_tokens=2),
        Record("s1", 0, start=0.5, ttft=2.0, itl=[0.2, 0.2, 0.4], e2e=2.8, prompt_tokens=80, cached_tokens=30,
               completion_tokens=4),
        Record("s1", 1, start=3.5, e2e=0.5, error="http_500", status=500, error_detail="boom"),
    ]


def test_summary_hand_computed():
    s = summarize(_records())
    assert (s["requests"], s["ok"], s["errors"]) == (4, 3, 1)
    assert s["errors_by_kind"] == {"http_500": 1}
    assert s["duration_s"] == pytest.approx(4.0)              # first send 0.0, last end 3.5 + 0.5
    assert s["ttft_s"]["p50"] == 1.0 and s["ttft_s"]["count"] == 3
    assert s["ttft_s"]["p90"] == pytest.approx(1.8)           # 1.0 + 0.8 * (2.0 - 1.0)
    assert s["ttft_s"]["mean"] == pytest.approx(3.2 / 3)
    # ITLs pooled: 0.1 0.1 0.2 0.2 0.3 0.4 -> p50 rank 2.5 = 0.2; p99 rank 4.95 = 0.3 + 0.95 * 0.1
    assert s["itl_s"]["p50"] == pytest.approx(0.2) and s["itl_s"]["p99"] == pytest.approx(0.395)
    assert s["e2e_s"]["p50"] == pytest.approx(1.4)
    assert s["output_tokens"] == 9 and s["output_tokens_per_s"] == pytest.approx(9 / 4.0)
    assert s["requests_per_s"] == pytest.approx(3 / 4.0)
    assert (s["prompt_tokens"], s["cached_tokens"]) == (300, 120)
    assert s["cached_token_ratio"] == pytest.approx(0.4)
    assert hit_ratio_by_turn(_records()) == {0: pytest.approx(30 / 180), 1: pytest.approx(0.75)}
    table = format_table(s, "bench")
    assert "4 requests (3 ok, 1 errors) in 4.00 s" in table
    assert "1000.0" in table and "http_500 x1" in table and "(40.0%)" in table


def test_summary_of_nothing():
    s = summarize([])
    assert s["requests"] == 0 and s["ttft_s"]["p50"] is None and s["output_tokens_per_s"] is None
    format_table(s, "empty")


def test_json_report(tmp_path):
    recs = _records()
    recs[0].text = "not written"
    write_json(tmp_path / "r.json", config={"workload": "agent"}, summary=summarize(recs), records=recs)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"] == {"workload": "agent"} and doc["summary"]["ok"] == 3
    r0 = doc["records"][0]
    assert "text" not in r0
    assert {"session", "turn", "start", "ttft", "itl", "e2e", "prompt_tokens", "cached_tokens",
            "completion_tokens", "error"} <= set(r0)


BEFORE = """# TYPE tandem_prompt_tokens_total counter
tandem_prompt_tokens_total{worker="prefill-0"} 100.0
tandem_prompt_tokens_total{worker="prefill-1"} 0.0
tandem_prompt_tokens_total 999.0
# TYPE tandem_cached_prompt_tokens_total counter
tandem_cached_prompt_tokens_total{worker="prefill-0"} 50.0
tandem_cached_prompt_tokens_total{worker="prefill-1"} 0.0
"""
AFTER = BEFORE.replace('prefill-0"} 100.0', 'prefill-0"} 300.0').replace('prefill-0"} 50.0', 'prefill-0"} 200.0') \
    .replace('prefill-1"} 0.0\ntandem_prompt', 'prefill-1"} 40.0\ntandem_prompt') \
    + """# TYPE tandem_radix_cache_hit_tokens_total counter
tandem_radix_cache_hit_tokens_total{worker="decode-0"} 30.0
# TYPE tandem_radix_cache_miss_tokens_total counter
tandem_radix_cache_miss_tokens_total{worker="decode-0"} 10.0
"""


def test_worker_hit_ratios_from_metrics():
    w = worker_hit_ratios(parse_metrics(BEFORE), parse_metrics(AFTER))
    assert w["prefill-0"]["hit_ratio"] == pytest.approx(150 / 200)     # deltas over the run
    assert w["prefill-1"]["hit_ratio"] == 0.0
    assert w["decode-0"] == {"hit_ratio": 0.75, "source": "hits/misses", "hits": 30.0, "misses": 10.0}
    plain = "# TYPE tandem_prompt_tokens_total counter\ntandem_prompt_tokens_total 5.0\n"
    assert worker_hit_ratios({}, parse_metrics(plain)) == {}


def test_figures_are_written(tmp_path):
    recs = _records()
    paths = plots.write_all(recs, {}, tmp_path, "unit test")
    assert [p.name for p in paths] == ["ttft_by_turn.png", "ttft_cdf.png", "throughput.png", "hit_ratio.png"]
    assert all(p.stat().st_size > 5000 for p in paths)
    p = plots.hit_ratio(recs, {"prefill-0": {"hit_ratio": 0.5}}, tmp_path / "w.png", "per worker")
    assert p.stat().st_size > 5000
