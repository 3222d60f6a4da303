"""A KV transfer that stalls (``debug_transfer_stall``: prefill workers hold their writes): the router
sees the write pending past the progress deadline in prefill's stats and re-dispatches the request
without that prefill worker. Its own module: the cluster has the lever on from its start, and a
module's cluster is gone before the next module's starts (Ray places both on the same CPUs).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from gray_support import (PROGRESS_S, TOPICS, check_texts, chunks, gray_cfg, pid_of, serve,
                          start_streams, stream_events, wait_for, wait_idle, wait_rejoined)


@pytest.fixture(scope="module")
def stalling(ray_local, smollm2_default):
    """1 prefill + 1 decode worker; the prefill worker holds every KV write (the lever)."""
    cfg = gray_cfg(decode=1, debug_transfer_stall=True, failover_wait_s=240.0)
    backend, server, want = serve(cfg, smollm2_default)
    yield backend, server, want
    server.stop()
    backend.close()


def test_the_only_decode_worker_killed_before_the_first_token_its_streams_wait_for_the_replacement(stalling):
    """First in the module, on the fresh cluster: there the stalled KV write holds every request
    before its first token until the progress deadline (after a stall was seen, later requests
    prefill on the decode worker at once, and on a fast machine the window with all of them opened
    and none streamed is too short to catch). 1P+1D, the one decode worker SIGKILLed with every
    request opened on it and none streamed yet: each request waits (``failover_wait_s``) for the supervisor's replacement and is routed
    there (it used to end "no live decode worker"): the healthy text, no error event, each such
    request counted re-dispatched, nothing held anywhere."""
    backend, server, want = stalling
    before = {o: _failovers(server, o) for o in ("redispatched", "resumed", "failed")}
    out: dict = {}
    ths = start_streams(server, out, "b")
    wait_for(lambda: _on_decode_none_sent(backend, len(TOPICS)), 120, "no request opened on the decode worker")
    d = backend.decodes[0]
    os.kill(pid_of(d), signal.SIGKILL)
    for th in ths:
        th.join(300)
    check_texts(out, want, "b", within=300)
    assert not d.alive and _replaced(backend, d)
    # each stream is re-dispatched (nothing reached its client before the kill: most, as pid_of
    # takes a call) or resumed (a first token was on its way), once; none fails. Which, for a
    # stream whose first token raced the kill, is the race's: the count of each is not asserted.
    got = {o: _failovers(server, o) - v for o, v in before.items()}
    assert got["redispatched"] >= 1 and got["redispatched"] + got["resumed"] == len(TOPICS), got
    assert got["failed"] == 0, got
    wait_idle(server)


def test_a_stalled_kv_transfer_is_re_dispatched_and_frees_its_pages(stalling):
    """Every prefill worker holds its KV writes forever. The router sees the write pending past
    the deadline (prefill's stats) and re-dispatches each request without that prefill worker
    (decode prefills locally): healthy text, and the stalled attempts' pages freed on both sides
    (nothing was posted)."""
    backend, server, want = stalling
    out: dict = {}
    for th in start_streams(server, out, "t"):
        th.join(90)
    check_texts(out, want, "t", within=PROGRESS_S + 45)
    ws = wait_idle(server)
    assert all(w["live_transfers"] == 0 for w in ws)
    assert backend.prefills[0].suspect_since is None   # it answers: only its transfers stalled


def test_a_stopped_decode_worker_with_no_peer_ends_its_streams_with_an_error(stalling):
    """The only decode worker stops mid-stream: no peer can take the streams, so each ends with
    an error event naming the worker within the deadline (never a silent hang); after SIGCONT it
    rejoins, serves again, and its pool is back to idle."""
    backend, server, want = stalling
    out: dict = {}
    ths = start_streams(server, out, "s")
    wait_for(lambda: all(chunks.get(f"s-{t}", 0) >= 4 for t in TOPICS), 120, "not decoding")
    d = backend.decodes[0]
    pid = pid_of(d)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        for th in ths:
            th.join(60)
        took = time.monotonic() - t0
        for t in TOPICS:
            text, finish, err, _ = out[f"s-{t}"]
            assert err is not None and f"decode worker {d.name} stopped making progress" in err, out[f"s-{t}"]
        assert took < PROGRESS_S + 15, took
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_rejoined(backend, server, d)
    again: dict = {}
    for th in start_streams(server, again, "a"):
        th.join(90)
    check_texts(again, want, "a", within=60)
    wait_idle(server)


def test_the_only_decode_worker_killed_its_streams_wait_for_the_replacement_and_resume(stalling):
    """1P+1D, the one decode worker SIGKILLed mid-stream (issue 48): no live peer, so each stream
    waits (``failover_wait_s``) for the supervisor's replacement and resumes there after what its
    client has: the healthy text, no error event; then nothing is held anywhere."""
    backend, server, want = stalling
    out: dict = {}
    ths = start_streams(server, out, "k")
    wait_for(lambda: all(chunks.get(f"k-{t}", 0) >= 4 for t in TOPICS), 120, "not decoding")
    d = backend.decodes[0]
    os.kill(pid_of(d), signal.SIGKILL)
    for th in ths:
        th.join(300)
    check_texts(out, want, "k", within=300)
    assert not d.alive and backend.decodes[0] is not d and backend.decodes[0].alive
    wait_idle(server)


def _replaced(backend, dead) -> bool:
    return bool(backend.decodes) and backend.decodes[0] is not dead and backend.decodes[0].alive


def _failovers(server, outcome: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text)
               for s in f.samples if s.name == "tandem_failovers_total"
               and s.labels == {"role": "decode", "outcome": outcome})


def _on_decode_none_sent(backend, n: int) -> bool:
    """``n`` requests opened on a decode worker, none of which sent its client anything yet."""
    ss = list(backend.streams.values())
    return len(ss) == n and not any(s.began for s in ss) and all(s.wire_rid in backend.inflight for s in ss)


def test_the_only_decode_worker_killed_past_the_wait_each_stream_ends_with_one_error(stalling, monkeypatch):
    """1P+1D, ``failover_wait_s`` 0.5 s, the one decode worker SIGKILLed with two streams decoding and
    two more opened on it (streamed or not yet: after the module's stalls they prefill on the
    decode worker at once, and the window before their first token is a few steps, which a loaded
    run missed twice): no decode worker comes within the wait, so each ends with exactly one error
    event naming the wait (to resume it, or to serve it when it had sent nothing), and once the
    replacement is up nothing is held anywhere."""
    backend, server, _ = stalling
    monkeypatch.setattr(backend, "cfg", backend.cfg.model_copy(update={"failover_wait_s": 0.5}))
    out: dict = {}
    ths = [threading.Thread(target=stream_events, args=(server, t, out, f"w-{t}")) for t in TOPICS]
    for th in ths[:2]:
        th.start()
    wait_for(lambda: all(chunks.get(f"w-{t}", 0) >= 4 for t in TOPICS[:2]), 120, "not decoding")
    for th in ths[2:]:
        th.start()

    def late_opened() -> bool:
        ss = list(backend.streams.values())
        return len(ss) == 4 and all(s.wire_rid in backend.inflight for s in ss)

    wait_for(late_opened, 120, "the late requests were not opened on the decode worker")
    d = backend.decodes[0]
    os.kill(pid_of(d), signal.SIGKILL)
    for th in ths:
        th.join(60)
    for i, t in enumerate(TOPICS):
        text, finish, errors = out[f"w-{t}"]
        assert len(errors) == 1 and "--failover-wait-s 0.5s" in errors[0], out[f"w-{t}"]
        assert f"decode worker {d.name} died" in errors[0], errors
        assert ("to resume it" if text else "before the first token") in errors[0], errors
        assert bool(text) or i >= 2, out[f"w-{t}"]
    wait_for(lambda: _replaced(backend, d), 240, "no replacement")
    wait_idle(server)
