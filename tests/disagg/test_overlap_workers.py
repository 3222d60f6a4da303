"""Overlap scheduling (engine/overlap.py) on both roles: PrefillWorker + DecodeWorker in one
process (no Ray; real engines, real NIXL, real model), their engines with overlap forced on.
The oracle is a colocated engine with it off: the same greedy tokens and text; an abort
mid-decode and every finished handoff give back every page on both sides."""

from __future__ import annotations

import asyncio

import pytest

from serve_support import LocalClient, at_baseline, collect

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.types import SamplingParams

PAGE = 4
CACHE = CacheConfig(page_size=PAGE, max_total_tokens=768, max_running_requests=6)
ON = EngineConfig(device="cpu", num_threads=1, overlap_schedule="on", cache=CACHE)
OFF = EngineConfig(device="cpu", num_threads=1, overlap_schedule="off", cache=CACHE)
PROMPTS = ["What is the capital of France?", "Name three colors.", "Count to five."]


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def workers(smollm2_default, loop):
    from tandem.decode.worker import DecodeWorker
    from tandem.engine.engine import Engine
    from tandem.prefill.worker import PrefillWorker

    async def make():
        p = PrefillWorker("o-prefill", ON, loaded=smollm2_default, transfer_timeout_s=20)
        d = DecodeWorker("o-decode", ON, loaded=smollm2_default, transfer_timeout_s=20)
        p.add_peer(d.handshake())
        d.add_peer(p.handshake())
        return p, d

    p, d = loop.run_until_complete(make())
    colocated = Engine(OFF, loaded=smollm2_default)
    yield p, d, colocated
    for w in (p, d):
        w.close()
    colocated.shutdown()


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 180))


def test_disaggregated_with_overlap_equals_colocated_without(workers, loop):
    p, d, col = workers
    assert p.engine.overlap and d.engine.overlap and not col.overlap
    params = [SamplingParams(max_tokens=6 + 4 * i) for i in range(len(PROMPTS))]
    refs = [col.generate(q, sp, chat=True) for q, sp in zip(PROMPTS, params)]

    async def all_at_once():
        reqs = [col.make_request(q, sp, chat=True, rid=f"ov{i}")
                for i, (q, sp) in enumerate(zip(PROMPTS, params))]
        return await asyncio.gather(*(collect(d.generate(r, LocalClient(p))) for r in reqs))

    for chunks, ref in zip(run(loop, all_at_once()), refs):
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        assert "".join(c.text for c in chunks) == ref.text
        assert chunks[-1].finish_reason == ref.finish_reason and chunks[-1].error is None
    run(loop, at_baseline(p, d))


def test_abort_mid_decode_with_overlap_frees_every_page(workers, loop):
    """The stream closes after 3 chunks (the worker aborts the request): both pools go back."""
    p, d, col = workers
    req = col.make_request("Count from one to one hundred:", SamplingParams(max_tokens=200, ignore_eos=True),
                           chat=True, rid="ov-abort")
    chunks = run(loop, collect(d.generate(req, LocalClient(p)), stop_after=3))
    assert len(chunks) == 3 and chunks[-1].finish_reason is None
    run(loop, at_baseline(p, d))
