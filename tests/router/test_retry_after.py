"""The 429's Retry-After is derived from the deferred-dispatch queue (router/deferred.py): the
requests still waiting over the queue's recent admission rate, never less than the workers' own
prediction; and it reaches the client on the wire (the front door over the simulated engine)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tandem.core.config import ServeConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import Overloaded, SamplingParams
from tandem.router.deferred import DeferredDispatch
from tandem.router.dispatch import Dispatcher
from tandem.router.policies import AdmissionLimits


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, tuple(range(32)), SamplingParams(max_tokens=4))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_retry_after_is_the_waiting_queue_over_its_admission_rate():
    async def main():
        d = Dispatcher("least_load", limits=AdmissionLimits(max_queue=1, max_pending_s=1e9))
        d.add_worker(0, "prefill", "prefill-0", 1000)
        d.add_worker(1, "decode", "decode-0", 1000)
        clock = Clock()
        q = DeferredDispatch(d, max_size=4, ttl_s=5.0, poll_s=0.01, clock=clock)
        routes = []
        for i in range(4):                  # admissions 2 s apart: 0.5 requests per second
            routes.append(await q.route(_req(f"a{i}")))
            d.release(routes[-1])
            clock.t += 2.0
        assert q.admission_rate() == pytest.approx(0.5)
        held = await q.route(_req("held"))  # the worker is full from here on
        waiters = [asyncio.create_task(q.route(_req(f"w{i}"))) for i in range(4)]
        await asyncio.sleep(0.05)
        assert len(q) == 4
        with pytest.raises(Overloaded, match="queue is full") as e:
            await q.route(_req("late"))
        # 4 waiting / (4 admissions in 8 s = 0.5/s) = 8 s (the worker's own guess is 1 s)
        assert e.value.retry_after_s == 8 and "retry in 8s" in str(e.value)
        # the next refusals are promised the slots after it, one admission (2 s) apart
        for want in (10, 12):
            with pytest.raises(Overloaded) as e:
                await q.route(_req(f"late-{want}"))
            assert e.value.retry_after_s == want
        clock.t += 40.0                     # nothing admitted for longer than the rate's horizon
        with pytest.raises(Overloaded) as e:
            await q.route(_req("later"))
        assert e.value.retry_after_s == 5   # a stuck queue: its TTL, by when every waiter has left
        for w in waiters:                   # the TTL passes: each is refused, counting the others
            w.cancel()
        d.release(held)
        await asyncio.gather(*waiters, return_exceptions=True)
        assert len(q) == 0
        assert q.retry_after_s() == 1       # nobody waiting: the floor

    asyncio.run(main())


def test_a_ttl_refusal_does_not_count_itself():
    async def main():
        d = Dispatcher("least_load", limits=AdmissionLimits(max_queue=1, max_pending_s=1e9))
        d.add_worker(0, "prefill", "prefill-0", 1000)
        d.add_worker(1, "decode", "decode-0", 1000)
        q = DeferredDispatch(d, max_size=4, ttl_s=0.1, poll_s=0.01)
        await q.route(_req("held"))
        with pytest.raises(Overloaded, match="0 waiting in the dispatch queue") as e:
            await q.route(_req("alone"))    # expires with nobody else waiting
        assert e.value.retry_after_s >= 1

    asyncio.run(main())


def test_the_front_door_sends_retry_after_with_every_429_and_no_5xx(serve, smollm2_gguf):
    from tandem.cluster.launch import load_tokenizer
    from tandem.sim.backend import SimServingBackend

    # one slow simulated prefill worker (the H100 profile 50x slower), a 2-deep worker queue and
    # a 4-deep router queue with a 1 s TTL: a burst of 24 must overflow
    cfg = ServeConfig(engine="sim", prefill=1, decode=1, sim_speedup=0.02, admission_max_queue=2,
                      dispatch_queue_size=4, dispatch_queue_ttl_s=1.0)
    backend = SimServingBackend(cfg, load_tokenizer(cfg.engine_config.model))
    srv = serve(backend, cfg)

    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        return await http.post("/v1/completions", json={"model": "smollm2", "prompt": f"{i} " * 200,
                                                        "max_tokens": 2})

    async def burst():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(24)))

    try:
        rs = asyncio.run(burst())
    finally:
        backend.close()
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 3, codes
    for r in rs:
        if r.status_code == 429:
            ra = r.headers.get("retry-after")
            assert ra is not None and ra.isdigit() and 1 <= int(ra) <= 60, r.headers
            err = r.json()["error"]
            assert err["code"] == "overloaded" and f"retry in {ra}s" in err["message"], err
