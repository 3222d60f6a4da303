"""PrefillWorker + DecodeWorker in one process (no Ray): real engines, real NIXL, real model.

Each test ends with both KV pools back at their baseline (no page owned by a request), so a leak
anywhere on either side fails the test that caused it. The last two run both roles with overlap
scheduling on (engine/overlap.py) against the colocated engine with it off.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_support import LocalClient, at_baseline, collect

from tandem.core.config import CacheConfig, EngineConfig
from tandem.core.kv_messages import KVTransferRequest, PrefillResult, RegionPages
from tandem.core.messages import GenerateRequest
from tandem.core.transfer_state import TransferState
from tandem.core.types import SamplingParams

PAGE = 4
CFG = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=PAGE, max_total_tokens=768,
                                                                  max_running_requests=6))
PROMPT = "What is the capital of France?"


class HangingClient:
    """A prefill worker that never writes: answers only once told to abort (or ``release``d)."""

    def __init__(self, name: str, answer_abort: bool = True):
        self.name, self.answer_abort = name, answer_abort
        self.release = asyncio.Event()
        self.aborts: list[str] = []

    async def prefill(self, req_wire, xfer, dst_prefix_len):
        await self.release.wait()
        tid = KVTransferRequest.decode(xfer).transfer_id
        return PrefillResult(tid, TransferState.ABORTED, self.name, error="aborted")

    async def abort(self, rid, reason):
        self.aborts.append(rid)
        if self.answer_abort:
            self.release.set()


class DeadClient:
    """A prefill worker that dies mid-call (Ray raises ActorDiedError there)."""

    def __init__(self, name: str):
        self.name = name

    async def prefill(self, req_wire, xfer, dst_prefix_len):
        await asyncio.sleep(0.2)
        raise RuntimeError("The actor died unexpectedly before finishing this task.")

    async def abort(self, rid, reason):
        raise RuntimeError("actor is dead")


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _pair(cfg: EngineConfig, loaded, loop, name: str):
    """A prefill and a decode worker of ``cfg``, peered."""
    from tandem.decode.worker import DecodeWorker
    from tandem.prefill.worker import PrefillWorker

    async def make():
        p = PrefillWorker(f"{name}-prefill", cfg, loaded=loaded, transfer_timeout_s=20)
        d = DecodeWorker(f"{name}-decode", cfg, loaded=loaded, transfer_timeout_s=20)
        p.add_peer(d.handshake())
        d.add_peer(p.handshake())
        return p, d

    return loop.run_until_complete(make())


@pytest.fixture(scope="module")
def workers(smollm2_default, loop):
    from tandem.engine.engine import Engine

    p, d = _pair(CFG, smollm2_default, loop, "t")
    colocated = Engine(CFG, loaded=smollm2_default)
    yield p, d, colocated
    for w in (p, d):
        w.close()
    colocated.shutdown()


@pytest.fixture(scope="module")
def overlap_workers(smollm2_default, loop, workers):
    """Both roles with overlap scheduling forced on (engine/overlap.py), beside the colocated
    engine of ``workers`` (overlap off: "auto" on the CPU)."""
    p, d = _pair(CFG.model_copy(update={"overlap_schedule": "on"}), smollm2_default, loop, "o")
    yield p, d, workers[2]
    for w in (p, d):
        w.close()


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 120))




def request(engine, rid: str, **params) -> GenerateRequest:
    params.setdefault("max_tokens", 12)
    return engine.make_request(PROMPT, SamplingParams(**params), chat=True, rid=rid)


def test_decode_workers_back_up_to_a_host_pool_by_default(workers):
    p, d, col = workers
    assert d.engine.host_pool_tokens == 4 * d.engine.allocator.size      # CFG sets none
    assert p.engine.host_pool_tokens == 0 and col.host_pool_tokens == 0
    assert "host KV pool" in d.engine.startup_line and d.name in d.engine.startup_line


def test_greedy_output_equals_colocated_and_pools_return_to_baseline(workers, loop):
    p, d, col = workers
    ref = col.generate(PROMPT, SamplingParams(max_tokens=12), chat=True)
    chunks = run(loop, collect(d.generate(request(col, "g1"), LocalClient(p))))
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    last = chunks[-1]
    assert last.finish_reason == ref.finish_reason and last.error is None
    assert last.prompt_tokens == ref.prompt_tokens
    ps, ds = run(loop, at_baseline(p, d))
    n = ref.prompt_tokens
    assert ps["pages"] >= -(-n // PAGE) and ps["bytes"] > 0
    t = ds["last_timings"]
    assert t["bytes"] == -(-n // PAGE) * PAGE * d.engine.kv_pool.bytes_per_token
    assert set(t) >= {"reserve_s", "prefill_s", "transfer_s", "receive_s", "activate_s"}


def test_seeded_sampling_disaggregated_equals_colocated(workers, loop):
    """The first token is drawn on the prefill worker, the rest on the decode worker: a seeded
    draw depends on the seed and the token's position only, so the whole output equals the
    colocated engine's."""
    p, d, col = workers
    params = dict(max_tokens=12, temperature=1.3, seed=1234, ignore_eos=True)
    ref = col.generate(PROMPT, SamplingParams(**params), chat=True)
    chunks = run(loop, collect(d.generate(request(col, "s1", **params), LocalClient(p))))
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    run(loop, at_baseline(p, d))


class NoPromptLogprobsClient(LocalClient):
    """The real prefill worker, its results stripped of the prompt logprobs (a broken peer)."""

    async def prefill(self, req_wire, xfer, dst_prefix_len):
        import dataclasses

        return dataclasses.replace(await super().prefill(req_wire, xfer, dst_prefix_len), prompt_logprobs=())


def _prompt_logprobs(chunks) -> tuple:
    assert chunks[-1].error is None, chunks[-1].error
    assert [bool(c.prompt_logprobs) for c in chunks] == [True] + [False] * (len(chunks) - 1)
    return chunks[0].prompt_logprobs


def test_prompt_logprobs_cross_the_handoff_and_equal_colocated(workers, loop):
    """The prefill worker computes the prompt's logprobs, PrefillResult carries them, decode
    streams them with the first token: equal to the colocated engine's, also on a second run whose
    prompt both workers hold in their prefix caches; a result without them fails the request."""
    p, d, col = workers
    params = dict(max_tokens=6, prompt_logprobs=2)
    ref = []
    col.submit(request(col, "plp-ref", **params), ref.append)
    end = time.monotonic() + 120
    while not (ref and ref[-1].finish_reason) and time.monotonic() < end:
        time.sleep(0.05)
    want = _prompt_logprobs(ref)
    ref_ids = [t for c in ref for t in c.token_ids]
    assert len(want) == ref[0].prompt_tokens - 1
    for rid in ("plp-1", "plp-2"):      # the second finds the prompt cached on both sides
        chunks = run(loop, collect(d.generate(request(col, rid, **params), LocalClient(p))))
        got = _prompt_logprobs(chunks)
        assert [(a.token_id, a.rank, [t for t, _ in a.top]) for a in got] == \
            [(b.token_id, b.rank, [t for t, _ in b.top]) for b in want]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 1e-5
        assert [t for c in chunks for t in c.token_ids] == ref_ids
    chunks = run(loop, collect(d.generate(request(col, "plp-3", **params), NoPromptLogprobsClient(p))))
    assert chunks[-1].finish_reason == "abort" and "prompt logprobs" in chunks[-1].error
    run(loop, at_baseline(p, d))


@pytest.mark.parametrize("pair", ["workers", "overlap_workers"])
def test_abort_mid_decode_frees_every_page_on_both_sides(pair, request, loop):
    p, d, col = request.getfixturevalue(pair)
    req = col.make_request(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), chat=True, rid="a1")
    chunks = run(loop, collect(d.generate(req, LocalClient(p)), stop_after=3))
    assert len(chunks) == 3 and chunks[-1].finish_reason is None
    run(loop, at_baseline(p, d))


def test_abort_during_transfer_reaches_prefill_and_frees_both_sides(workers, loop):
    p, d, col = workers
    client = LocalClient(p, delay_s=0.3)   # the abort lands while decode waits for prefill
    req = request(col, "a2", max_tokens=20)

    async def go():
        gen = d.generate(req, client)
        task = asyncio.ensure_future(collect(gen))
        await asyncio.sleep(0.1)
        assert await d.abort("a2", "client went away")
        return await task

    t0 = time.monotonic()
    chunks = run(loop, go())
    assert time.monotonic() - t0 < 5
    assert chunks[-1].finish_reason == "abort" and "client went away" in chunks[-1].error
    run(loop, at_baseline(p, d))
    assert client.aborts == ["a2"]
    assert run(loop, d.stats())["aborted"] >= 1


def test_transfer_timeout_fails_fast_but_frees_pages_only_after_prefill_answers(workers, smollm2_default, loop):
    from tandem.decode.worker import DecodeWorker

    p = workers[0]
    d = DecodeWorker("t-decode-timeout", CFG, loaded=smollm2_default, transfer_timeout_s=1.0)
    d.add_peer(p.handshake())
    try:
        hang = HangingClient(p.name, answer_abort=False)   # a known agent that never writes
        req = request(d.engine, "t1", max_tokens=5)

        async def go():
            t0 = time.monotonic()
            chunks = await collect(d.generate(req, hang))
            took = time.monotonic() - t0
            await asyncio.sleep(0.3)
            held = await d.stats()             # prefill has not answered: pages stay reserved
            hang.release.set()                 # ... now it does
            await d.drain()
            return chunks, took, held

        chunks, took, held = run(loop, go())
        assert chunks[-1].finish_reason == "abort" and "timed out" in chunks[-1].error
        assert 0.9 < took < 3.0
        assert held["reserved"] == 1 and held["available_tokens"] < held["total_tokens"]
        assert hang.aborts == ["t1"]
        run(loop, at_baseline(d))
    finally:
        d.close()


def test_dead_prefill_fails_the_request_fast_and_frees_pages(workers, loop):
    p, d, col = workers
    dead = DeadClient(p.name)   # same name: decode knows the agent; the call itself dies
    t0 = time.monotonic()
    chunks = run(loop, collect(d.generate(request(col, "x1"), dead)))
    assert time.monotonic() - t0 < 5
    assert chunks[-1].finish_reason == "abort" and "died" in chunks[-1].error
    run(loop, at_baseline(p, d))


def test_short_uncached_suffix_is_prefilled_locally(workers, loop):
    p, d, col = workers
    ref = col.generate(PROMPT, SamplingParams(max_tokens=8), chat=True)
    before = run(loop, p.stats())["ok"]
    d.local_prefill_threshold = 10_000
    try:
        chunks = run(loop, collect(d.generate(request(col, "l1", max_tokens=8), LocalClient(p))))
    finally:
        d.local_prefill_threshold = 0
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert run(loop, p.stats())["ok"] == before
    assert run(loop, d.stats())["local"] >= 1
    run(loop, at_baseline(p, d))


def test_prefill_refuses_a_page_list_that_does_not_fit_the_prompt(workers, loop):
    p, d, col = workers
    req = request(col, "bad1")
    xfer = KVTransferRequest(99, d.name, (RegionPages("kv", (1, 2)),), deadline=time.time() + 10)
    res = run(loop, p.prefill(req.to_wire(), xfer.encode(), 0))
    assert res.status is TransferState.FAILED and "need" in res.error and "pages" in res.error
    res = run(loop, p.prefill(req.to_wire(), xfer.encode(), 3))
    assert res.status is TransferState.FAILED and "multiple of page_size" in res.error
    run(loop, at_baseline(p, d))


def test_abort_before_the_prefill_request_arrives_is_remembered(workers, loop):
    p, d, col = workers
    req = request(col, "early1")
    run(loop, p.abort("early1", "decode gave up"))
    n = len(req.prompt_ids)
    xfer = KVTransferRequest(100, d.name, (RegionPages("kv", tuple(range(1, 1 + -(-n // PAGE)))),),
                             deadline=time.time() + 10)
    res = run(loop, p.prefill(req.to_wire(), xfer.encode(), 0))
    assert res.status is TransferState.ABORTED and "before it reached" in res.error
    run(loop, at_baseline(p, d))


def test_kv_digest_verifies_the_handoff_and_catches_a_corrupted_page(workers, loop):
    """--kv-digest: prefill sends a digest of the pages it wrote; decode verifies it before
    decoding. With the test lever that corrupts a received page, the request fails with a clear
    error, its pages are freed, the counter moves, and the worker keeps serving."""
    from prometheus_client.parser import text_string_to_metric_families

    from tandem.decode.worker import DecodeWorker

    p, _, col = workers
    ref = col.generate(PROMPT, SamplingParams(max_tokens=6), chat=True)
    good = DecodeWorker("t-decode-digest", CFG, engine=None, loaded=p.engine.loaded,
                        transfer_timeout_s=20, kv_digest=True)
    bad = DecodeWorker("t-decode-corrupt", CFG, loaded=p.engine.loaded, transfer_timeout_s=20,
                       kv_digest=True, debug_corrupt_kv=True)
    try:
        for d in (good, bad):
            d.add_peer(p.handshake())
            p.add_peer(d.handshake())
        ok = run(loop, collect(good.generate(request(col, "dg1", max_tokens=6), LocalClient(p))))
        assert [t for c in ok for t in c.token_ids] == ref.token_ids and ok[-1].error is None
        chunks = run(loop, collect(bad.generate(request(col, "dg2", max_tokens=6), LocalClient(p))))
        assert chunks[-1].finish_reason == "abort" and "KV digest mismatch" in chunks[-1].error
        run(loop, at_baseline(p, good, bad))
        fams = {f.name: f for f in text_string_to_metric_families(bad.metrics_text().decode())}
        assert fams["tandem_kv_digest_failures"].samples[0].value == 1
        assert run(loop, bad.stats())["digest_failures"] == 1
        bad.debug_corrupt_kv = False              # the same worker still serves
        again = run(loop, collect(bad.generate(request(col, "dg3", max_tokens=6), LocalClient(p))))
        assert [t for c in again for t in c.token_ids] == ref.token_ids
        run(loop, at_baseline(p, good, bad))
    finally:
        for d in (good, bad):
            p.remove_peer(d.name)
            d.close()


# ---------------------------------------------------------------------------------- overlap on
OVERLAP_PROMPTS = [PROMPT, "Name three colors.", "Count to five."]


def test_disaggregated_with_overlap_equals_colocated_without(overlap_workers, loop):
    p, d, col = overlap_workers
    assert p.engine.overlap and d.engine.overlap and not col.overlap
    params = [SamplingParams(max_tokens=6 + 4 * i) for i in range(len(OVERLAP_PROMPTS))]
    refs = [col.generate(q, sp, chat=True) for q, sp in zip(OVERLAP_PROMPTS, params)]

    async def all_at_once():
        reqs = [col.make_request(q, sp, chat=True, rid=f"ov{i}")
                for i, (q, sp) in enumerate(zip(OVERLAP_PROMPTS, params))]
        return await asyncio.gather(*(collect(d.generate(r, LocalClient(p))) for r in reqs))

    for chunks, ref in zip(run(loop, all_at_once()), refs):
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        assert "".join(c.text for c in chunks) == ref.text
        assert chunks[-1].finish_reason == ref.finish_reason and chunks[-1].error is None
    run(loop, at_baseline(p, d))

