"""A real multi-node Ray cluster on this machine (cluster/raynodes.py): a head and two worker nodes
started with ``ray start``, offering ``prefill`` and ``decode`` as KubeRay's groups do, Ray token
authentication on; ``tandem serve`` processes (the routers) join it and serve the real model.

In order, on one cluster (the tests share it; each step leaves the cluster as the next expects):
1. every role lands on its node, KV moves between the nodes over UCX (TCP), an unauthenticated
   client is refused;
2. the router is SIGKILLed under load: the workers keep their caches; a restarted router adopts
   them and serves the session's next turn from the same worker with cached tokens; no page leaks;
3. two routers over the one worker set agree on a session's worker, with cached tokens;
4. the prefill node is stopped: its in-flight requests settle within the transfer timeout, none
   lost (each failed before its first token, so the router routes it again without the dead
   worker), new ones are served (decode prefills locally) and the router does not hang.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")

from support.multinode import (  # noqa: E402
    CONFIG, TRANSFER_TIMEOUT_S, UCX_ENV, cached, chat, kill_under_load, wait_in_flight)
from tandem.cluster.raynodes import RayNodes, start_router  # noqa: E402

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **UCX_ENV}
    c = RayNodes(token_auth=True, env=env)
    try:
        c.prefill = c.add_node({"prefill": 1}, num_cpus=1)
        c.decode = c.add_node({"decode": 2}, num_cpus=2)
        c.work = str(tmp_path_factory.mktemp("routers"))
        c.config = {**CONFIG, "ray_address": c.address}
        c.routers = []
        yield c
    finally:
        for r in getattr(c, "routers", []):
            r.kill()
        c.close()


def _router(c):
    r = start_router(c.config, c.client_env(), c.work)
    c.routers.append(r)
    return r


def _idle_and_clean(url: str, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(f"{url}/debug/kv", timeout=30).json()
        rows = kv["workers"] if isinstance(kv, dict) else kv
        busy = [w for w in rows if w.get("running") or w.get("waiting") or w.get("detached")
                or w.get("live_transfers")]
        if not busy or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def test_roles_land_on_their_nodes_kv_moves_over_tcp_and_auth_is_required(cluster):
    a = _router(cluster)
    health = httpx.get(f"{a.url}/health", timeout=30).json()
    workers = health["workers"]
    assert sorted(workers) == ["decode-0", "decode-1", "prefill-0"]
    for name, w in workers.items():
        assert w["node_resources"].get(w["role"], 0) >= 1, (name, w)      # on its role's node
    assert workers["decode-0"]["node_id"] == workers["decode-1"]["node_id"] != workers["prefill-0"]["node_id"]
    r = chat(a.url, "s-kv", ["Say hi."])
    assert r.status_code == 200, r.text
    rows = {w["worker"]: w for w in _idle_and_clean(a.url)}
    assert rows["prefill-0"]["bytes"] > 0 and rows["prefill-0"]["ok"] >= 1        # KV left the prefill node
    assert rows[r.headers["X-Tandem-Worker"]]["remote"] >= 1                       # and reached decode
    # Ray's token authentication: a driver without the token is refused
    env = {k: v for k, v in cluster.client_env().items() if k != "RAY_AUTH_TOKEN"}
    env.update(RAY_AUTH_TOKEN="0" * 32, RAY_NUM_REDIS_GET_RETRIES="2")
    probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{cluster.address}'); print('IN')"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0 and "IN" not in probe.stdout
    assert "Authentication" in probe.stderr or "auth" in probe.stderr.lower()


def test_a_killed_router_loses_no_worker_and_its_successor_keeps_the_sessions(cluster):
    a = cluster.routers[-1]
    first = chat(a.url, "s-restart", ["Name a colour."])
    assert first.status_code == 200
    worker = first.headers["X-Tandem-Worker"]
    t_kill = kill_under_load(a, "s-load")                   # load in flight through router A
    b = _router(cluster)
    restart_s = time.monotonic() - t_kill
    health = httpx.get(f"{b.url}/health", timeout=30).json()
    assert sorted(health["workers"]) == ["decode-0", "decode-1", "prefill-0"] and health["restarts"] == 0
    nxt = chat(b.url, "s-restart", ["Name a colour.", "Another one."])
    assert nxt.status_code == 200, nxt.text
    assert nxt.headers["X-Tandem-Worker"] == worker and cached(nxt) > 0
    print(f"\nrouter restart: first request served again {restart_s:.1f}s after the kill, "
          f"cached {cached(nxt)} of {nxt.json()['usage']['prompt_tokens']} prompt tokens")
    rows = _idle_and_clean(b.url)
    assert all(w.get("leaked_tokens") == 0 and w.get("invariants") == "ok" for w in rows), rows


def test_two_routers_one_worker_set_agree_on_the_session(cluster):
    b = cluster.routers[-1]
    c = _router(cluster)
    first = chat(b.url, "s-two", ["Pick a number."])
    assert first.status_code == 200
    time.sleep(0.5)                                          # its KV events reach router C
    nxt = chat(c.url, "s-two", ["Pick a number.", "And another."])
    assert nxt.status_code == 200
    assert nxt.headers["X-Tandem-Worker"] == first.headers["X-Tandem-Worker"] and cached(nxt) > 0


def test_a_stopped_prefill_node_loses_no_request_and_new_ones_are_served(cluster):
    b = cluster.routers[-1]
    with cf.ThreadPoolExecutor(3) as pool:
        inflight = [pool.submit(chat, b.url, f"s-node-{i}", ["Write a long story. " * 30], 8, 120)
                    for i in range(3)]
        wait_in_flight(b.url, inflight)                      # the stop meets requests in flight
        t0 = time.monotonic()
        cluster.stop_node(cluster.prefill)
        outcomes, why = [], []
        for f in inflight:
            try:
                resp = f.result()
                outcomes.append(resp.status_code)
                why.append(resp.text[:400] if resp.status_code != 200 else "")
            except httpx.HTTPError as e:
                outcomes.append(type(e).__name__)
                why.append(str(e))
        settled_s = time.monotonic() - t0
    assert settled_s < TRANSFER_TIMEOUT_S + 20, (settled_s, outcomes)     # nothing hangs
    assert outcomes == [200] * len(inflight), (outcomes, why)            # re-routed, not failed
    r = chat(b.url, "s-after", ["Hello?"])                              # decode prefills locally
    assert r.status_code == 200, r.text
    h = httpx.get(f"{b.url}/health", timeout=30).json()
    assert h["workers"]["prefill-0"]["alive"] is False and h["decode_alive"] == 2, h
    print(f"prefill node stopped: its {len(outcomes)} in-flight requests settled in {settled_s:.1f}s "
          f"({outcomes}); a new request was served")
