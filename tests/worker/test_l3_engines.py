"""The shared L3 tier with real engines (SmolLM2 on the CPU) and a REAL Mooncake master on
127.0.0.1: greedy output with L3 hits equals output without any cache; a prompt one engine
computed is served from L3 by another (cached_tokens > 0), as two prefill workers of a cluster
would; a page corrupted in the store is a miss, not a wrong answer; a store killed mid-run
costs recompute only (no hang, no leak). Engines attach the store the way workers do
(cache/tiers/l3/connect.py ``attach_store``)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("mooncake.store")

from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402
from tandem.cache.tiers.l3.connect import attach_store, l3_options  # noqa: E402
from tandem.core.config import CacheConfig, EngineConfig  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402

from support.l3 import join_store_threads, master_back  # noqa: E402

PAGE = 4
SYSTEM = ("You are a concise assistant for a travel agency. You answer in one short sentence, "
          "you never use lists, and you always name a city.")
QUESTIONS = ["Where should I go in spring?", "Where is the best food?", "Where can I ski?"]


@pytest.fixture(scope="module")
def master():
    m = mc.MasterProcess()
    yield m
    m.stop()


def engine(loaded, master=None, *, max_total_tokens=2048, disable=False, corrupt=False, segment_bytes=32 << 20,
           timeout_s=2.0):
    cc = CacheConfig(page_size=PAGE, max_total_tokens=max_total_tokens, debug_invariants=True,
                     disable_prefix_cache=disable, host_pool_tokens=0)
    e = Engine(EngineConfig(device="cpu", num_threads=1, cache=cc), loaded=loaded)
    if master is not None:
        opts = l3_options(master.address.url(), timeout_s=timeout_s, corrupt=corrupt)
        opts["segment_bytes"] = segment_bytes
        tier = attach_store(e.kv.cache, e.kv_pool, e.model_name, **opts)
        assert tier is not None and tier.write_through
    return e


def prompt(e, i: int, q: str) -> list[int]:
    tok = e.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "system", "content": f"Client {i}. {SYSTEM}"},
                                               {"role": "user", "content": q}]))


def answer(e, ids_list) -> list[tuple[list[int], int]]:
    outs = e.generate_many([e.make_request(ids, SamplingParams(max_tokens=8)) for ids in ids_list],
                           timeout=300)
    assert all(c.error is None for c in outs)
    return [(c.token_ids, c.cached_tokens) for c in outs]


def idle_and_exact(e) -> None:
    e.check_invariants()
    snap = e.snapshot()
    assert snap.leaked_tokens == 0 and snap.locked_tokens == 0 and snap.request_tokens == 0, snap


@pytest.fixture(scope="module")
def plain(smollm2_default):
    e = engine(smollm2_default, disable=True)
    yield e
    e.shutdown()


def flush(e) -> None:
    assert e.kv.cache.tier("l3").store.flush(10.0)


def test_a_prompt_computed_on_one_worker_is_served_from_l3_on_another(smollm2_default, master, plain):
    a, b = engine(smollm2_default, master), engine(smollm2_default, master)
    try:
        ids = [prompt(a, 1, q) for q in QUESTIONS]
        first = answer(a, ids)
        flush(a)
        second = answer(b, ids)
        want = answer(plain, ids)
        assert [t for t, _ in first] == [t for t, _ in want]
        assert [t for t, _ in second] == [t for t, _ in want], "L3 pages changed the greedy output"
        usable = [(len(x) - 1) // PAGE * PAGE for x in ids]
        assert [c for _, c in second] == usable, "b should reuse every whole page a computed"
        st = b.kv.cache.tier("l3").stats                # the first read the shared system prompt too
        assert st.hit_pages >= usable[0] // PAGE and st.miss_pages == 0, st
        assert st.prefetches >= 1, st           # queued with a cold device cache: read ahead
        assert b.kv.cache.tier("l3").store.stats.corrupt == 0
        idle_and_exact(a)
        idle_and_exact(b)
    finally:
        a.shutdown()
        b.shutdown()


def _closed_after_writing(loaded, store, ids, *, segment_bytes):
    """Engine A computes ``ids`` (writing through to ``store``), then closes its store client."""
    a = engine(loaded, store, segment_bytes=segment_bytes)
    try:
        first = answer(a, ids)
        flush(a)
        idle_and_exact(a)
    finally:
        a.kv.cache.tier("l3").store.close()
        a.shutdown()
    return first


def test_pages_in_the_storage_process_outlive_the_worker_that_wrote_them(smollm2_default, plain):
    """Workers lend nothing (``segment_bytes=0``): what A wrote is in the storage process's
    segment, so B, started after A's store client closed, reuses every whole page A computed."""
    store = mc.LocalStore(64 << 20)
    try:
        ids = [prompt(plain, 40, q) for q in QUESTIONS]
        first = _closed_after_writing(smollm2_default, store, ids, segment_bytes=0)
        b = engine(smollm2_default, store, segment_bytes=0)
        try:
            second = answer(b, ids)
            want = answer(plain, ids)
            assert [t for t, _ in first] == [t for t, _ in second] == [t for t, _ in want]
            assert [c for _, c in second] == [(len(x) - 1) // PAGE * PAGE for x in ids], second
            assert b.kv.cache.tier("l3").stats.miss_pages == 0 and b.kv.cache.tier("l3").store.stats.errors == 0
            idle_and_exact(b)
        finally:
            b.shutdown()
    finally:
        store.stop()


def test_pages_in_a_workers_own_segment_go_with_it(smollm2_default, plain):
    """The control: no storage process, A lends the only segment; once A's client closes, B
    (which lends none) finds nothing and recomputes, with the same answer."""
    store = mc.LocalStore(0)
    try:
        ids = [prompt(plain, 50, QUESTIONS[0])]
        _closed_after_writing(smollm2_default, store, ids, segment_bytes=32 << 20)
        b = engine(smollm2_default, store, segment_bytes=0)
        try:
            (toks, cached), = answer(b, ids)
            assert toks == answer(plain, ids)[0][0] and cached == 0
            assert b.kv.cache.tier("l3").stats.hit_pages == 0
            idle_and_exact(b)
        finally:
            b.shutdown()
    finally:
        store.stop()


def test_greedy_with_l3_hits_under_eviction_equals_no_cache(smollm2_default, master, plain):
    """A device pool too small for the sessions: turns evicted from the device come back from L3."""
    e = engine(smollm2_default, master, max_total_tokens=128)
    try:
        got, want = [], []
        for round_ in range(2):
            ids = [prompt(e, 10 + i, q) for i, q in enumerate(QUESTIONS)]
            for x in ids:        # one at a time: each evicts the one before
                got.append(answer(e, [x])[0])
                flush(e)
            want += answer(plain, ids)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert all(c > 0 for _, c in got[3:]), [c for _, c in got]
        st = e.kv.cache.tier("l3").stats
        assert st.hit_pages > 0 and e.stats()["evicted_tokens"] > 0
        idle_and_exact(e)
    finally:
        e.shutdown()


def test_a_corrupted_page_is_a_miss_not_a_wrong_answer(smollm2_default, master, plain):
    bad, b = engine(smollm2_default, master, corrupt=True), engine(smollm2_default, master)
    try:
        ids = [prompt(bad, 20, QUESTIONS[0])]
        answer(bad, ids)
        flush(bad)
        (toks, cached), = answer(b, ids)
        assert toks == answer(plain, ids)[0][0]
        # only pages an earlier test stored intact (the chat template's first page) are reused:
        # the first damaged page is a miss and the chain stops there (the batched read counts
        # every damaged page it read)
        assert cached <= PAGE
        assert b.kv.cache.tier("l3").store.stats.corrupt >= 1
        idle_and_exact(b)
    finally:
        bad.shutdown()
        b.shutdown()


def test_a_store_killed_mid_run_costs_recompute_only(smollm2_default, plain):
    import threading

    others = set(threading.enumerate())
    m = mc.MasterProcess()
    e = engine(smollm2_default, m, max_total_tokens=160, timeout_s=0.5)   # a dead store's calls end sooner
    try:
        ids = [prompt(e, 30 + i, q) for i, q in enumerate(QUESTIONS)]
        answer(e, ids[:1])
        flush(e)
        m.stop()
        t0 = time.monotonic()
        got = [answer(e, [x])[0] for x in ids + ids]      # evictions, L3 reads and writes fail
        assert time.monotonic() - t0 < 120
        assert [t for t, _ in got] == [t for t, _ in answer(plain, ids + ids)]
        assert e.kv.cache.tier("l3").store.stats.errors >= 1   # (up again once its backoff ran out: not asserted)
        idle_and_exact(e)
    finally:
        with master_back(m):    # the engine's store client closes, and its abandoned calls end, at once
            e.shutdown()
            join_store_threads(others)   # before the next test


def test_retraction_without_a_host_pool_restores_from_l3(smollm2_default, master):
    """A decode pool too small for its batch and no host tier: retracted requests are recomputed,
    and their re-admission reads the pages they had (written through to L3, then evicted from the
    device) back from the store; greedy output equals an uncontended run."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colors are", "Water boils at", "List three fruits:"]
    n = [24, 28, 20, 26, 22, 18]

    def run(e):
        reqs = [e.make_request(p, SamplingParams(max_tokens=k, ignore_eos=True)) for p, k in zip(prompts, n)]
        outs = e.generate_many(reqs, timeout=300)
        assert all(c.error is None for c in outs)
        return [c.token_ids for c in outs]

    alone = engine(smollm2_default, max_total_tokens=4096)
    e = engine(smollm2_default, master, max_total_tokens=96)
    try:
        want = run(alone)
        assert run(e) == want
        st = e.stats()
        assert st["retractions"] > 0 and st["retraction_recomputes"] > 0
        assert e.kv.cache.tier("l3").stats.hit_pages > 0, e.kv.cache.tier("l3").stats
        idle_and_exact(e)
    finally:
        alone.shutdown()
        e.shutdown()
