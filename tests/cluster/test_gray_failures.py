"""Gray failures through the whole cluster: a worker that hangs (SIGSTOP: alive, not answering) and a
KV transfer that stalls. 1 prefill + 2 decode Ray actors behind the HTTP front door, a short
progress deadline (3 s). Every in-flight stream ends within the deadline with the text the same request
gets on a healthy cluster (greedy: re-dispatched from the prompt, or resumed on a decode peer after
what it streamed), new requests are served meanwhile, and once the worker runs again it rejoins and
nothing is leaked or locked anywhere.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from gray_support import (PROGRESS_S, TOPICS, check_texts, chunks, gray_cfg, pid_of, serve,
                          start_streams, wait_for, wait_idle, wait_rejoined)


@pytest.fixture(scope="module")
def cluster(ray_local, smollm2_default):
    cfg = gray_cfg()
    backend, server, want = serve(cfg, smollm2_default)
    yield backend, server, want
    server.stop()
    backend.close()


def test_a_stopped_decode_worker_s_streams_resume_on_its_peer_and_it_rejoins(cluster):
    """SIGSTOP the decode worker holding streams mid-decode: they finish on the other decode
    worker (resumed after what they streamed) with the healthy text; new requests are served
    while it is stopped; after SIGCONT it rejoins and both pools are back to idle."""
    backend, server, want = cluster
    out: dict = {}
    ths = start_streams(server, out, "d")
    # every stream has text out: they are decoding
    wait_for(lambda: all(chunks.get(f"d-{t}", 0) >= 4 for t in TOPICS), 60, "not decoding")
    on = {}
    for rid, w in list(backend._inflight.items()):
        on.setdefault(w.name, []).append(rid)
    victim_name = max(on, key=lambda n: len(on[n]))
    victim = backend.pool.named(victim_name)
    pid = pid_of(victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        fresh: dict = {}
        late = start_streams(server, fresh, "n")   # new requests while it is stopped
        for th in ths + late:
            th.join(90)
        check_texts(out, want, "d", within=PROGRESS_S + 45)
        check_texts(fresh, want, "n", within=PROGRESS_S + 45)
        assert victim.suspect_since is not None and victim.alive
        assert len(victim.stale) >= len(on[victim_name])
        h = httpx.get(server.url + "/health", timeout=30).json()
        assert h["workers"][victim_name]["suspect"] and h["status"] == "ok", h
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_rejoined(backend, server, victim)
    assert not victim.stale
    wait_idle(server)
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text)
               for s in f.samples}
    assert samples[("tandem_stall_redispatches_total", (("how", "resume"), ("stalled", "decode")))] >= len(on[victim_name])
    assert samples[("tandem_decode_migrations_total", (("outcome", "ok"), ("reason", "prestop")))] >= len(on[victim_name])
    assert samples[("tandem_worker_stalls_total", (("event", "rejoined"), ("role", "decode")))] >= 1


def test_a_stopped_prefill_worker_s_requests_are_re_dispatched(cluster):
    """SIGSTOP the prefill worker, then send requests: routed to it before it is found stuck, they
    are re-dispatched from the prompt (decode prefills locally) within the deadline, with the
    healthy text; after SIGCONT the prefill worker rejoins and nothing is held anywhere (the
    stuck attempts' pages are freed once their prefill calls provably ended)."""
    backend, server, want = cluster
    p = backend.prefills[0]
    pid = pid_of(p)
    os.kill(pid, signal.SIGSTOP)
    try:
        out: dict = {}
        for th in start_streams(server, out, "p"):
            th.join(90)
        check_texts(out, want, "p", within=PROGRESS_S + 45)
        assert p.suspect_since is not None
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_rejoined(backend, server, p)
    wait_idle(server)


def test_a_worker_stuck_past_the_replace_deadline_is_killed_and_replaced(cluster):
    """A prefill worker that stays stopped past ``progress_replace_s`` is declared dead, its
    process killed and a replacement started (``prefill-0-r1``); requests are served meanwhile
    (decode prefills locally) and by the replacement once it is up."""
    backend, server, want = cluster
    sup = backend.supervisor
    old_replace, sup.progress_replace_s = sup.progress_replace_s, 4.0
    p = backend.prefills[0]
    pid = pid_of(p)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not p.alive, 60, f"{p.name} was not declared dead")
        assert "made no progress" in p.error, p.error
        out: dict = {}
        for th in start_streams(server, out, "r"):
            th.join(90)
        check_texts(out, want, "r", within=60)
        wait_for(lambda: backend.prefills[0] is not p and backend.prefills[0].alive, 120, "not replaced")

        def gone() -> bool:
            try:
                os.kill(pid, 0)
                return False
            except ProcessLookupError:
                return True
        wait_for(gone, 60, f"the stuck process {pid} still exists")
    finally:
        sup.progress_replace_s = old_replace
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert backend.prefills[0].name == p.name + "-r1" or backend.prefills[0].name.startswith(p.name)
    out = {}
    for th in start_streams(server, out, "r2"):
        th.join(90)
    check_texts(out, want, "r2", within=60)
    wait_idle(server)
