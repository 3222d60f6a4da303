"""The deferred-dispatch queue (router/deferred.py) and the SLO planner (router/planner.py)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.core.config import PlannerConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import Overloaded, SamplingParams
from tandem.router.deferred import DeferredDispatch
from tandem.router.dispatch import Dispatcher
from tandem.router.planner import LatencyWindow, Observation, Planner
from tandem.router.policies import AdmissionLimits


def _req(rid: str, prio: int = 0) -> GenerateRequest:
    return GenerateRequest(rid, tuple(range(32)), SamplingParams(max_tokens=4), priority=prio)


def _dispatcher(max_queue: int = 1) -> Dispatcher:
    d = Dispatcher("least_load", limits=AdmissionLimits(max_queue=max_queue, max_pending_s=1e9))
    d.add_worker(0, "prefill", "prefill-0", 1000)
    d.add_worker(1, "decode", "decode-0", 1000)
    return d


def test_a_burst_waits_in_priority_order_instead_of_429():
    async def main():
        d = _dispatcher()
        q = DeferredDispatch(d, max_size=4, ttl_s=5.0, poll_s=0.01)
        first = await q.route(_req("a"))                      # admitted at once: the worker is full now
        order = []

        async def one(rid, prio):
            r = await q.route(_req(rid, prio))
            order.append(rid)
            await asyncio.sleep(0.02)
            d.release(r)

        tasks = [asyncio.create_task(one("low", 5)), asyncio.create_task(one("high", -1)),
                 asyncio.create_task(one("mid", 0))]
        await asyncio.sleep(0.05)
        assert len(q) == 3
        d.release(first)                                       # room: the queue drains in order
        await asyncio.gather(*tasks)
        assert order == ["high", "mid", "low"] and len(q) == 0

    asyncio.run(main())


def test_a_session_in_progress_waits_ahead_of_new_sessions():
    def req(rid, sid):
        return GenerateRequest(rid, tuple(range(32)), SamplingParams(max_tokens=4), session_id=sid)

    async def main(prefer):
        d = Dispatcher("session", limits=AdmissionLimits(max_queue=1, max_pending_s=1e9))
        d.add_worker(0, "prefill", "prefill-0", 1000)
        d.add_worker(1, "decode", "decode-0", 1000)
        q = DeferredDispatch(d, max_size=8, ttl_s=5.0, poll_s=0.01, prefer_sessions=prefer)
        first = await q.route(req("t0", "old"))               # session "old" is served: the worker is full
        assert d.in_session(req("x", "old")) and not d.in_session(req("y", "new-1"))
        order = []

        async def one(rid, sid):
            r = await q.route(req(rid, sid))
            order.append(rid)
            await asyncio.sleep(0.02)
            d.release(r)

        tasks = [asyncio.create_task(one("new-1", "new-1"))]
        await asyncio.sleep(0.03)
        tasks += [asyncio.create_task(one("new-2", "new-2"))]
        await asyncio.sleep(0.03)
        tasks += [asyncio.create_task(one("t1", "old"))]       # the session's next turn, last to arrive
        await asyncio.sleep(0.03)
        assert len(q) == 3
        d.release(first)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main(True)) == ["t1", "new-1", "new-2"]
    assert asyncio.run(main(False)) == ["new-1", "new-2", "t1"]   # off: arrival order


def test_what_still_overflows_gets_overloaded_with_retry_after():
    async def main():
        d = _dispatcher()
        q = DeferredDispatch(d, max_size=1, ttl_s=0.2, poll_s=0.01)
        await q.route(_req("a"))
        waiter = asyncio.create_task(q.route(_req("b", 3)))
        await asyncio.sleep(0.02)
        with pytest.raises(Overloaded, match="queue is full") as e:
            await q.route(_req("c", 3))                        # full, and it does not outrank b
        assert e.value.retry_after_s >= 1
        outranks = asyncio.create_task(q.route(_req("d", 0)))  # outranks b: b is refused instead
        with pytest.raises(Overloaded, match="higher-priority"):
            await waiter
        with pytest.raises(Overloaded, match="within the dispatch queue's 0.2s"):
            await outranks                                     # nobody released: its TTL runs out
        no_queue = DeferredDispatch(_dispatcher(), max_size=0)
        await no_queue.route(_req("x"))
        with pytest.raises(Overloaded):
            await no_queue.route(_req("y"))                    # max_size 0: the old immediate 429

    asyncio.run(main())


def test_latency_window_forgets_and_ranks():
    t = [0.0]
    w = LatencyWindow(10.0, clock=lambda: t[0])
    for v in (0.1, 0.2, 0.3, 0.4, 5.0):
        w.ttft(v)
    assert w.percentile("ttft", 0.9) == 5.0 and w.percentile("ttft", 0.5) == 0.3
    assert w.percentile("itl", 0.9) is None
    t[0] = 11.0
    assert w.percentile("ttft", 0.9) is None


def test_planner_adds_the_role_that_misses_its_slo_and_removes_idle_workers():
    c = PlannerConfig(enabled=True, ttft_slo_s=1.0, itl_slo_s=0.05, max_prefill=4, max_decode=3,
                      scale_down_after_s=10, queue_per_prefill=4)
    p = Planner(c)
    assert p.plan(Observation(1, 1, ttft_s=0.2, itl_s=0.01), 0.0).reason == "hold"
    up = p.plan(Observation(1, 1, ttft_s=4.0, itl_s=0.01), 1.0)
    assert (up.prefill, up.decode) == (2, 1) and "ttft" in up.reason   # doubling at most
    assert p.plan(Observation(2, 1, pending=1, ttft_s=4.0), 2.0).reason == "settling"
    up = p.plan(Observation(2, 1, ttft_s=3.0, itl_s=0.2), 3.0)
    assert (up.prefill, up.decode) == (4, 2)                           # ceil(2*3) - 2 = 4, capped
    assert p.plan(Observation(4, 2, ttft_s=0.9, prefill_queue=20), 4.0).prefill == 4   # at max
    assert p.plan(Observation(2, 1, ttft_s=0.5, prefill_queue=9), 5.0).prefill == 3    # the queue
    hold = p.plan(Observation(4, 2, ttft_s=0.1, itl_s=0.001), 10.0)
    assert (hold.prefill, hold.decode) == (4, 2)                       # idle, but not for long yet
    down = p.plan(Observation(4, 2, ttft_s=0.1, itl_s=0.001), 16.0)
    assert (down.prefill, down.decode) == (3, 1) and "idle" in down.reason
    assert p.plan(Observation(1, 1), 100.0) == p.plan(Observation(1, 1), 200.0)   # floors hold
    low = p.plan(Observation(0, 1), 300.0)         # a worker out of rotation: the count read 0
    assert low.prefill == 1 and low.reason == "prefill 0 below its minimum 1", low
