"""Workers that outlive their router, and several routers over one worker set, with simulated
workers as Ray actors (``engine: sim``): each "router" is a RayClusterBackend in this process (its
own dispatcher, session table and KV-event feed), the workers detached named actors of one
namespace. The real multi-node cluster is tests/cluster/test_multinode.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams

pytestmark = pytest.mark.timeout(180)


def _cfg(ns: str, **kw) -> ServeConfig:
    return ServeConfig(engine="sim", prefill=2, decode=2, worker_lifetime="cluster", ray_namespace=ns,
                       sim_speedup=20.0, engine_config={"cache": {"page_size": 16}}, **kw)


async def _turn(router, rid: str, prompt: tuple, session: str):
    last = None
    async for c in router.generate(GenerateRequest(rid, prompt, SamplingParams(max_tokens=6), session)):
        last = c
    return last


def _launch(cfg):
    from tandem.cluster.launch import launch_disaggregated

    return launch_disaggregated(cfg)


def _wait_synced(router, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(router.feed.synced(w.wid) for w in router.pool.prefills):
            return
        time.sleep(0.05)
    raise AssertionError("the KV-event feed never synchronised")


def _wait_indexed(router, prompts, pages: int, timeout=10.0):
    """Until ``router``'s KV-event index holds the first ``pages`` pages of every prompt on some
    worker (what its next turn's routing reads)."""
    from tandem.core.page_hash import page_hashes

    want = [page_hashes(p, 16)[:pages] for p in prompts]
    deadline = time.monotonic() + timeout
    while True:
        with router.dispatch.lock:
            held = [max((dev for dev, _ in router.dispatch.state.kv.overlap(h).values()), default=0) for h in want]
        if min(held) >= pages:
            return
        assert time.monotonic() < deadline, f"the router's index holds {held} of the {pages} pages of each prompt"
        time.sleep(0.05)


def test_two_routers_agree_and_a_restarted_router_adopts_the_workers(ray_local):
    a = _launch(_cfg("ha-two"))
    b = c = None
    try:
        assert sorted(w.name for w in a.pool.everyone()) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
        b = _launch(_cfg("ha-two"))                       # a second router: adopts, starts nothing
        assert {w.handle._actor_id for w in b.pool.everyone()} == {w.handle._actor_id for w in a.pool.everyone()}
        sessions = {f"s{i}": tuple(range(1000 * i, 1000 * i + 200)) for i in range(4)}
        first = {s: asyncio.run(_turn(a, f"{s}-1", p, s)) for s, p in sessions.items()}
        assert all(x.finish_reason == "length" and not x.error for x in first.values())
        _wait_synced(b)
        _wait_indexed(b, sessions.values(), 12)           # the turns' KV events reached B's index
        for s, p in sessions.items():                     # the next turn through the other router
            nxt = asyncio.run(_turn(b, f"{s}-2", p + tuple(range(7, 39)), s))
            assert nxt.worker == first[s].worker and nxt.cached_tokens >= 192, (s, nxt, first[s])
        a.close()                                         # router A goes away: its workers do not
        c = _launch(_cfg("ha-two"))                       # ... and a restarted one adopts them
        assert sorted(w.name for w in c.pool.everyone()) == sorted(w.name for w in b.pool.everyone())
        _wait_synced(c)
        for s, p in sessions.items():
            nxt = asyncio.run(_turn(c, f"{s}-3", p + tuple(range(7, 39)) + (5,) * 16, s))
            assert nxt.worker == first[s].worker and nxt.cached_tokens >= 224, (s, nxt)
        report = asyncio.run(c.debug_kv())
        assert all(r.get("leaked_tokens") == 0 and r.get("invariants") == "ok" for r in report), report
    finally:
        for r in (b, c):
            if r is not None:
                r.close()
        _kill_namespace("ha-two")


def _kill_namespace(ns: str) -> None:
    import ray

    for x in ray.util.list_named_actors(all_namespaces=True):
        if x["namespace"] == ns:
            try:
                ray.kill(ray.get_actor(x["name"], namespace=ns))
            except ValueError:
                pass


def test_private_workers_die_with_their_router(ray_local):
    import ray

    r = _launch(_cfg("unused", ).model_copy(update={"worker_lifetime": "router", "prefill": 1, "decode": 1}))
    ns = r.launcher.namespace
    assert ns.startswith("tandem-") and ns != "unused"
    names = [x["name"] for x in ray.util.list_named_actors(all_namespaces=True) if x["namespace"] == ns]
    assert sorted(names) == ["decode-0", "prefill-0"]
    r.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(x["namespace"] == ns for x in ray.util.list_named_actors(all_namespaces=True)):
        time.sleep(0.1)
    assert not any(x["namespace"] == ns for x in ray.util.list_named_actors(all_namespaces=True))
