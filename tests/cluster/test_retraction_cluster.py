"""Retraction on a disaggregated decode worker, through a real 1P+1D cluster (Ray, NIXL, SmolLM2,
HTTP), and the chaos harness against it.

The case that found the bug (issue 11): ``--page-size 16 --decode-max-total-tokens 1200``, 8
concurrent greedy chat requests of ~76 prompt tokens and 96 output tokens (``ignore_eos``), each
with its own session, then the same 8 alone. Here: 64 output tokens and a 640-token decode pool
(40 pages for 8 requests of 9): with 1200, staggered prefills let early requests finish before
the last ones grow, and on a quiet machine the pool may never run short. The decode worker
retracts; every request's text must equal its uncontended text (the 8 run once on a colocated
engine whose pool holds them all: no retraction). Once with the decode worker's default host pool
(restores, no recompute); once with ``host_pool_tokens=0`` and forced retraction
(``debug_retract_every``: recomputes only), followed on that cluster by a bounded chaos run (client
aborts before the first token and mid-stream, forced retraction): no mismatch against a fresh
engine, no leak, invariants clean.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")

from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig, ServeConfig  # noqa: E402

from serve_support import Server as _Server  # noqa: E402

TOPICS = ["violins", "glaciers", "bicycles", "volcanoes", "lighthouses", "bees", "chess", "tea"]


def _messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": (
        f"I am writing a long school report about {topic}. Please describe in detail where {topic} "
        f"come from, how people use them today, why they matter, and one surprising fact about "
        f"{topic} that most readers would not know. Write several full paragraphs.")}]


OUT = 64


def _cfg(host_pool_tokens: int | None, retract_every: int = 0) -> ServeConfig:
    engine = EngineConfig(device="cpu", num_threads=1,
                          cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=16,
                                            host_pool_tokens=host_pool_tokens),
                          scheduler=SchedulerConfig(debug_retract_every=retract_every))
    return ServeConfig(prefill=1, decode=1, transfer_timeout_s=20.0, decode_max_total_tokens=640,
                       engine_config=engine)


def _chat(server, topic: str) -> str:
    out = server.client.chat.completions.create(
        model="smollm2", messages=_messages(topic), max_tokens=OUT, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": f"s-{topic}"})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == OUT
    return out.choices[0].message.content


def _retraction_counters(server) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {"tandem_retractions", "tandem_retraction_restores", "tandem_retraction_recomputes"}
    out = dict.fromkeys(names, 0.0)
    for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        if f.name in names:
            out[f.name] += sum(s.value for s in f.samples if s.name.endswith("_total"))
    return out


def _cluster(cfg: ServeConfig, loaded):
    from tandem.cluster.launch import launch_disaggregated

    backend = launch_disaggregated(cfg, loaded=loaded)
    return backend, _Server(backend, cfg)


@pytest.fixture(scope="module")
def uncontended(smollm2_default):
    """The 8 requests' texts on a colocated engine that holds them all at once (no retraction)."""
    from tandem.engine.engine import Engine
    from tandem.router.backend import LocalEngineBackend

    cfg = _cfg(None)
    e = Engine(cfg.engine_config, loaded=smollm2_default)
    server = _Server(LocalEngineBackend(e), cfg)
    try:
        with ThreadPoolExecutor(len(TOPICS)) as pool:
            texts = list(pool.map(lambda t: _chat(server, t), TOPICS))
        assert e.scheduler.stats["retractions"] == 0
        return texts
    finally:
        server.stop()
        e.shutdown()


def _the_case(server, uncontended) -> dict[str, float]:
    before = _retraction_counters(server)
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        contended = list(pool.map(lambda t: _chat(server, t), TOPICS))
    c = {k: v - before[k] for k, v in _retraction_counters(server).items()}
    assert c["tandem_retractions"] > 0, "the decode pool was never short: the case does not test retraction"
    for topic, a, b in zip(TOPICS, contended, uncontended):
        assert a == b, f"{topic}: text under retraction differs from its uncontended text"
    return c


def test_retraction_restores_from_the_default_host_pool(ray_local, smollm2_default, uncontended):
    backend, server = _cluster(_cfg(None), smollm2_default)
    try:
        c = _the_case(server, uncontended)
        assert c["tandem_retraction_restores"] > 0 and c["tandem_retraction_recomputes"] == 0, c
    finally:
        server.stop()
        backend.close()


def test_retraction_recomputes_without_a_host_pool_and_a_chaos_run_loses_nothing(ray_local, smollm2_default,
                                                                                uncontended):
    from tandem.loadtest.chaos.cli import options, run_chaos, verdict
    from tandem.loadtest.chaos.oracle import Oracle
    from tandem.loadtest.chaos.plan import make_plan

    backend, server = _cluster(_cfg(0, retract_every=5), smollm2_default)
    oracle = Oracle("smollm2", "auto", threads=1, loaded=smollm2_default)
    try:
        c = _the_case(server, uncontended)
        assert c["tandem_retraction_recomputes"] > 0 and c["tandem_retraction_restores"] == 0, c
        assert make_plan(7, 4, 3) == make_plan(7, 4, 3)            # the schedule is the seed's
        rep = asyncio.run(run_chaos(options(server.url, seed=7, sessions=4, turns=4, max_tokens=12,
                                            settle_s=20.0), oracle=oracle))
    finally:
        oracle.close()
        server.stop()
        backend.close()
    assert rep["requests"] == 16 and rep["completed"] > 0
    assert rep["aborted_early"] + rep["aborted_mid"] > 0 and rep["failed"] == 0, rep["failure_reasons"]
    assert rep["retractions"] > 0 and rep["recomputes"] > 0
    assert not verdict(rep), verdict(rep)
    assert rep["leaked_tokens"] == 0 and rep["mismatches"] == []
