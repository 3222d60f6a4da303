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
