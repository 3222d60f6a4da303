"""bench/load_held.py's burst arithmetic on records made by hand: recovery times and whether a
refusal cut a session mid-way or turned a new one away."""

from __future__ import annotations

from tandem.bench.load_held import series
from tandem.loadtest.loadgen.report import Record


def _ok(sid, turn, start, ttft=0.5):
    return Record(sid, turn, start, ttft=ttft)


def _refused(sid, turn, start, retry_after="3"):
    return Record(sid, turn, start, error="http_429", status=429, retry_after=retry_after)


def test_series_counts_recovery_and_the_sessions_a_burst_cut():
    recs = [_ok("a", 0, 0.2), _ok("a", 1, 1.5),
            _refused("b", 0, 10.5), _ok("c", 0, 11.0, ttft=4.0),     # the burst: 10-20 s
            _refused("c", 1, 21.5),                                   # cut mid-way, for good
            _refused("d", 1, 22.5), Record("d", 1, 25.5, scheduled=22.5, ttft=0.4),   # retried, served
            _refused("e", 0, 23.2),                                   # a new session turned away
            _ok("f", 0, 26.0, ttft=3.0), _ok("g", 0, 28.0)]
    s = series(sorted(recs, key=lambda r: r.start), pre=10, burst=10, slo=2.0, total=30)
    assert s["refusals_end_s"] == 4.0                  # the last 429 in second 23 -> 24 - 20
    assert s["latency_recovery_s"] == 7.0              # second 26's 3 s TTFT over the SLO
    assert s["recovery_s"] == 7.0
    assert (s["sessions_cut"], s["sessions_turned_away"]) == (1, 2)   # c; b and e (d's retry served)
    assert (s["retries"], s["retries_served"]) == (1, 1) and s["retry_after_s"] == [3]
    assert s["bins"][10]["refused"] == 1 and s["bins"][21]["refused"] == 1
