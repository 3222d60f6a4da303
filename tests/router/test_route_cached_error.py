"""The router's predicted reuse of a chosen pair against what the workers reused (issue 37):
``Route.predicted_cached`` is the prefill match or, when larger, the decode worker's KV-event
hit (it prefills a session's later turn itself); ``Dispatcher.reused`` observes the error in
``tandem_route_cached_tokens_error``."""

from __future__ import annotations

from prometheus_client import REGISTRY

from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams
from tandem.router.dispatch import Dispatcher
from tandem.router.policies import AdmissionLimits, PolicyConfig, PrefillEstimator
from tandem.router.prefix_index import KVEvent, block_hashes

PAGE = 16


def _dispatcher() -> Dispatcher:
    d = Dispatcher("session", PolicyConfig(estimator=PrefillEstimator(overhead_s=0.0, per_token_s=1e-3,
                                                                      per_pair_s=0.0), kv_block_size=PAGE),
                   AdmissionLimits(), clock=lambda: 100.0)
    d.add_worker(0, "prefill", "rce-prefill-0", 4096)
    d.add_worker(10, "decode", "rce-decode-0", 4096)
    return d


def _req(rid: str, ids: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, tuple(ids), SamplingParams(max_tokens=8), session_id="rce")


def _observed() -> tuple[float, float]:
    name = "tandem_route_cached_tokens_error"
    return (REGISTRY.get_sample_value(f"{name}_count") or 0.0, REGISTRY.get_sample_value(f"{name}_sum") or 0.0)


def test_a_later_turn_is_predicted_from_the_decode_workers_blocks():
    d = _dispatcher()
    first = list(range(1, 101))
    r1 = d.route(_req("t1", first))
    assert r1.predicted_cached == 0                            # nothing held anywhere yet
    # the decode worker reports the first prompt and its reply (96 + 48 tokens: 9 whole pages)
    held = first + list(range(500, 548))
    with d.lock:
        d.state.kv.apply(KVEvent(10, "stored", tuple(block_hashes(held, PAGE)), len(held) // PAGE * PAGE))
    second = held + list(range(900, 920))
    r2 = d.route(_req("t2", second))
    assert (r2.prefill, r2.decode) == (0, 10)
    assert r2.predicted_cached == 144 > r2.decision.matched_tokens
    n0, s0 = _observed()
    d.reused(r2, 144)                                          # the decode worker prefilled it
    d.reused(r1, 0)
    d.reused(r2, 96)                                           # the prefill worker's hit instead
    n1, s1 = _observed()
    assert (n1 - n0, s1 - s0) == (3, 48)


def test_a_cold_prompt_is_predicted_from_the_prefill_worker_it_goes_to():
    """The decode worker holds a short shared opening the prefill worker lacks: the rest is too
    long for it to prefill itself (decode/local_prefill.py), so the prefill worker's match is
    what the pair reuses."""
    d = _dispatcher()
    opening = list(range(1, 33))
    with d.lock:
        d.state.kv.apply(KVEvent(10, "stored", tuple(block_hashes(opening, PAGE)), len(opening)))
    r = d.route(_req("cold", opening + list(range(600, 800))))
    assert (r.decode, r.decision.matched_tokens, r.predicted_cached) == (10, 0, 0)


def test_a_sharer_routed_later_waits_for_the_first_to_leave_prefill():
    """Two prompts sharing 64 tokens that no worker holds yet, routed to one prefill worker: the
    later waits (``wait_ahead``) until the first has its first token, so it reaches the worker
    second and reuses the prefix, as predicted. A prefix the worker already reported holding
    is not waited for."""
    import asyncio

    d = _dispatcher()
    shared = list(range(1000, 1064))
    with d.lock:   # the worker holds an unrelated prompt: the KV-event index is fed
        d.state.kv.apply(KVEvent(0, "stored", tuple(block_hashes(list(range(5000, 5032)), PAGE)), 32))
    a = d.route(_req("a", shared + [1, 2, 3]))
    b = d.route(_req("b", shared + [4, 5, 6]))
    assert (a.prefill, b.prefill, b.ahead) == (0, 0, a) and a.ahead is None
    assert b.predicted_cached == 64

    async def run():
        waiting = asyncio.ensure_future(d.wait_ahead(b, 30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        d.prefill_done(a)
        await asyncio.wait_for(waiting, 5.0)

    asyncio.run(run())
    with d.lock:   # now the worker reported the shared prefix: a third sharer does not wait
        d.state.kv.apply(KVEvent(0, "stored", tuple(block_hashes(shared, PAGE)), 64))
    c = d.route(_req("c", shared + [7, 8, 9]))
    assert c.prefill == 0 and c.ahead is None
