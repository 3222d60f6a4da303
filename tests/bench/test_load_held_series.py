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


def test_series_finds_the_end_of_the_bursts_sessions():
    """A closed loop's burst outlives its arrivals: the refusals counted after the last turn of a
    session that started in the burst are the base load's alone."""
    recs = [_ok("a", 0, 1.0),
            _ok("b", 0, 12.0), _ok("b", 1, 18.0), _refused("b", 2, 27.5),   # started in the burst
            _ok("c", 0, 15.0), Record("c", 1, 24.0, ttft=0.3),              # ... its last send 27.5
            _refused("d", 0, 22.0),                                         # base load, before that
            _ok("e", 0, 28.0), _refused("f", 0, 29.0), _ok("g", 0, 29.5)]
    s = series(sorted(recs, key=lambda r: r.start), pre=10, burst=10, slo=2.0, total=30)
    assert s["burst_sessions_end_s"] == 7.5
    assert (s["refused_after_burst_sessions"], s["sent_after_burst_sessions"]) == (1, 3)   # f of e, f, g
    quiet = series([_ok("a", 0, 1.0), _ok("h", 0, 25.0)], pre=10, burst=10, slo=2.0, total=30)
    assert quiet["burst_sessions_end_s"] == 0.0 and quiet["refused_after_burst_sessions"] == 0
