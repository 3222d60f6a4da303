"""Two routers over one worker set, one SIGKILLed under load (issue 25, item 5).

A Ray head started with ``ray start`` (cluster/raynodes.py; it outlives every router) runs detached
1P+1D workers (real SmolLM2, fp32, CPU); two ``tandem serve`` processes join it: router A starts
the workers, router B adopts them. Greedy streams run through both; A is SIGKILLed while its
streams are mid-way. Asserted:

- B's streams complete, their text equal to the same request's reference text (alone, before);
- A's clients see a connection error (retryable: no HTTP status, no partial success), and the
  same request retried on B gives the reference text;
- B's /debug/kv once idle: 0 leaked tokens, clean invariants;
- the workers stop decoding the dead router's requests: within 60 s of the kill (far less than A's
  long request needs to reach its ``max_tokens``) nothing runs or waits: Ray does not cancel a
  streaming call whose caller died, so the decode worker aborts the streams of a router whose
  lease ran out (decode/leases.py; ``router_lease_s``, short here).

The scenario runs once (a module fixture); the tests read what it saw.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")

from tandem.cluster.raynodes import RayNodes, start_router  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = {
    "mode": "disaggregated", "prefill": 1, "decode": 1, "worker_lifetime": "cluster",
    "ray_namespace": "tandem-kill", "policy": "session", "transfer_timeout_s": 20.0,
    # the lease the decode worker gives each router (sent with its heartbeat, once a second): short,
    # so the dead router's streams are aborted soon after the kill; 5x the heartbeat period, so a
    # starved but live router B keeps its own
    "router_lease_s": 5.0,
    "engine_config": {"device": "cpu", "dtype": "float32", "num_threads": 1,
                      "cache": {"page_size": 16, "max_total_tokens": 4096, "max_running_requests": 8,
                                "host_pool_tokens": 0}},
}
SHORT = 24          # output tokens of the streams whose text is checked
LONG = 1500         # A's long requests: far more than the workers emit before the idle check


def _body(topic: str, max_tokens: int) -> dict:
    return {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell me a long story about {topic}."}]}


def _stream(url: str, topic: str, max_tokens: int, started: threading.Event | None = None) -> str:
    """The streamed text; raises httpx.TransportError if the connection breaks, AssertionError
    on an HTTP error or an error event."""
    parts = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(topic, max_tokens), timeout=300,
                      headers={"X-Session-Id": f"s-{topic}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            assert not ev.get("error"), ev
            for c in ev.get("choices") or ():
                if (c.get("delta") or {}).get("content"):
                    parts.append(c["delta"]["content"])
                    if started is not None:
                        started.set()
    return "".join(parts)


def _idle(url: str, timeout: float) -> tuple[float, list[dict]]:
    t0 = time.monotonic()
    while True:
        rows = httpx.get(f"{url}/debug/kv", timeout=30).json()["workers"]
        busy = [w for w in rows if w.get("running") or w.get("waiting") or w.get("live_transfers")
                or w.get("request_tokens")]
        if not busy or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, rows
        time.sleep(0.5)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The scenario, run once: router A SIGKILLed under load; what every client saw."""
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    work = str(tmp_path_factory.mktemp("routers-kill"))
    with RayNodes(token_auth=False, env=env, head_cpus=2) as c:
        a = start_router({**CONFIG, "ray_address": c.address}, c.client_env(), work)
        b = None
        try:
            b = start_router({**CONFIG, "ray_address": c.address}, c.client_env(), work)
            topics_a, topics_b = ["owls", "rivers"], ["clocks", "maps"]
            ref = {t: _stream(b.url, t, SHORT) for t in topics_a + topics_b}   # alone, one at a time
            started = {t: threading.Event() for t in topics_a + ["long-a"]}
            with cf.ThreadPoolExecutor(6) as pool:
                fa = {t: pool.submit(_stream, a.url, t, SHORT, started[t]) for t in topics_a}
                fa["long-a"] = pool.submit(_stream, a.url, "long-a", LONG, started["long-a"])
                assert all(e.wait(120) for e in started.values()), "router A's streams never started"
                fb = {t: pool.submit(_stream, b.url, t, SHORT) for t in topics_b}
                a.kill()                                                       # SIGKILL, mid-stream
                t_kill = time.monotonic()
                got_b = {t: f.result(timeout=300) for t, f in fb.items()}
                errors_a = {}
                for t, f in fa.items():
                    try:
                        f.result(timeout=300)
                        errors_a[t] = None
                    except httpx.TransportError as e:
                        errors_a[t] = type(e).__name__
            retried = {t: _stream(b.url, t, SHORT) for t in topics_a}          # the retry on B
            _, rows = _idle(b.url, 60)
            idle_after_kill_s = time.monotonic() - t_kill
            print(f"\nrouter A killed: its streams {errors_a}; B's {len(got_b)} streams done; "
                  f"idle check {idle_after_kill_s:.1f}s after the kill")
            yield dict(ref=ref, got_b=got_b, errors_a=errors_a, retried=retried, rows=rows,
                       topics_a=topics_a, topics_b=topics_b)
        finally:
            for r in (a, b):
                if r is not None:
                    r.kill()


def test_the_other_routers_clients_see_no_error_and_the_killed_ones_can_retry(killed):
    k = killed
    assert k["got_b"] == {t: k["ref"][t] for t in k["topics_b"]}            # no error, right text
    # the long stream was cut with a transport error (no HTTP status: a client retries); a SHORT
    # one may have finished before the kill, and then its text is right
    assert k["errors_a"]["long-a"] is not None, k["errors_a"]
    for t in k["topics_a"]:
        if k["errors_a"][t] is None:
            continue
        assert k["retried"][t] == k["ref"][t], t                             # the retry on B
    assert k["retried"] == {t: k["ref"][t] for t in k["topics_a"]}
    rows = k["rows"]
    assert all(w.get("leaked_tokens") == 0 and w.get("invariants") == "ok" for w in rows), rows


def test_the_workers_stop_decoding_the_dead_routers_requests(killed):
    rows = killed["rows"]
    assert all(not w.get("running") and not w.get("waiting") and not w.get("request_tokens")
               for w in rows), [{k: w.get(k) for k in ("worker", "running", "waiting", "request_tokens")}
                                for w in rows]
