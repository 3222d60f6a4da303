"""bench/soak.py's own oracle on reports made by hand: a run that did every fault it was asked
for passes; each fault missing is named."""

from __future__ import annotations

from tandem.bench.soak import missed


def _rep(**kw) -> dict:
    rep = {"aborted_mid": 1, "aborted_early": 0, "killed": ["decode-1"], "retried": 2, "retried_failed": 0,
           "events": ["20.1s killed decode-1", "40.3s SIGKILL router 1 (http://x, pid 7) with 2 request(s) in flight"],
           "samples": {"procs": {"router-0": [[0, {}], [10, {}]], "decode@9": [[0, {}]]}, "kv": [[0, {}], [10, {}]]}}
    return rep | kw


def test_a_run_that_did_everything_passes():
    assert missed(_rep(), True, True) == []


def test_each_missing_fault_is_named():
    assert missed(_rep(aborted_mid=0), True, True) == ["no client hung up"]
    assert missed(_rep(killed=["(no live decode worker)"]), True, True)[0].startswith("no decode worker was killed")
    assert missed(_rep(killed=[]), False, True) == []                      # not asked: not judged
    idle = _rep(events=["40.3s SIGKILL router 1 (http://x, pid 7) with 0 request(s) in flight"])
    assert missed(idle, True, True)[0].startswith("router 1 was not killed with a request in flight")
    gone = _rep(events=["40.0s kill-router: nothing listens at http://x"])
    assert missed(gone, True, True)[0].startswith("router 1 was not killed")
    assert missed(_rep(retried_failed=1), True, True) == ["resends: 2 made, 1 failed"]
    short = _rep(samples={"procs": {"router-0": [[0, {}]], "decode@9": [[0, {}]]}, "kv": [[0, {}], [10, {}]]})
    assert missed(short, True, True) == ["router 0 was not sampled all along"]
