"""Engine-side spans (core/tracing.py, issue 40) on the real SmolLM2: a request that carries a
trace gets a "retraction" span in that trace for each time the scheduler retracts it (and a
"host fetch" span for each load-back from the host tier) (forced
here by the ``debug_retract_every`` lever, its KV backed up to the host pool under its cache
salt), exported over OTLP/HTTP to a receiver on 127.0.0.1; a request without a trace records
nothing. The traced request is also salted (another tenant's): retracted and restored, it
generates exactly what the same prompt unsalted does, and the invariants hold."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace

import pytest

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from otlp_support import Receiver  # noqa: E402

from tandem.core import tracing  # noqa: E402
from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from tandem.core.page_hash import cache_salt  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "List three fruits:", "Water boils at"]


def test_retractions_are_spans_of_the_requests_trace(smollm2):
    receiver = Receiver()
    assert tracing.setup("engine-test", receiver.url)
    e = Engine(EngineConfig(device="cpu", num_threads=1,
                            cache=CacheConfig(page_size=4, max_total_tokens=2048, host_pool_tokens=2048,
                                              debug_invariants=True),
                            scheduler=SchedulerConfig(debug_retract_every=3)), loaded=smollm2)
    try:
        trace_id = secrets.token_hex(16)
        parent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        reqs = [e.make_request(p, params) for p in PROMPTS + PROMPTS[:1]]
        traced = [replace(reqs[0], trace=parent, cache_salt=cache_salt("acme"))] + reqs[1:]
        outs = e.generate_many(traced, timeout=240)
        assert outs[0].token_ids == outs[-1].token_ids     # salted or not, the same greedy tokens
        tracing.flush()
        end = time.monotonic() + 20
        while not [s for s in receiver.of_trace(trace_id) if s["name"] == "retraction"]:
            assert time.monotonic() < end, "no retraction span arrived"
            time.sleep(0.1)
        every = receiver.of_trace(trace_id)     # retractions, and the host tier's loads of its restores
        assert {s["service"] for s in every} == {"engine-test"}
        assert {s["name"] for s in every} <= {"retraction", "host fetch"}
        assert all(s["attrs"]["tandem.rid"] == traced[0].rid for s in every)
        spans = [s for s in every if s["name"] == "retraction"]
        stats = e.stats()
        assert stats["retractions"] >= len(spans) >= 1 and stats["retraction_restores"] >= 1
        assert any(s["attrs"]["tandem.backed_up"] for s in spans)
        e.check_invariants()
        assert all(len(o.token_ids) == 12 for o in outs)
    finally:
        e.shutdown()
        tracing.shutdown()
        receiver.close()
    assert len(receiver.spans) == len(every)     # the untraced requests recorded nothing
