"""The L3 prefetch: a queued request's pages read from the store into host staging off the
engine thread, then placed by its admission's fetch without asking the store again.

The cache-level rigs of tests/cache/test_l3_tier.py (KV of a slot holding token t is filled with
t) and tests/cache/test_l3_hybrid.py (every pool's row names its token's whole prefix), an
in-memory store; the wiring through the real scheduler with the KVEchoModel stand-in
(tests/engine/fake_model.py: a misplaced or wrong KV value changes the output). Oracles: a fetch
after a prefetch places what a fetch without one places, with no store read; a hanging store
never holds the caller; the staging bound holds; invariants and every pool's ownership are
checked after each case, and the prefetch thread ends with its tier.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.cache.tiers.l3.staging import Jobs, Staging
from tandem.cache.tiers.l3.store import L3Store
from tandem.cache.tiers.l3.tier import L3Tier
from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams

from test_l3_hybrid import PS, W, Rig
from test_l3_tier import HANG_S, NONE, DictBackend, kv_tokens, run, setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from fake_model import oracle  # noqa: E402
from test_scheduler_fake import Driver, make, prompt  # noqa: E402

IDLE_S = 10.0   # a prefetch job over a few in-memory pages: far less, even on a loaded box


class Counting:
    """Wraps a backend's ``get`` and ``batch_is_exist`` to count the calls (``gets``, ``asks``)."""

    def __init__(self, backend):
        self.gets, self.asks = 0, 0
        get, ask = backend.get, backend.batch_is_exist

        def counted_get(key):
            self.gets += 1
            return get(key)

        def counted_ask(keys):
            self.asks += 1
            return ask(keys)

        backend.get, backend.batch_is_exist = counted_get, counted_ask


def written(pages=8, ids=tuple(range(1, 9)), policy="write_through"):
    """A backend holding ``ids``'s pages, written through by a cache that computed them."""
    b = DictBackend()
    cache, alloc, pool, tier = setup(b, policy=policy, pages=pages)
    run(cache, alloc, pool, list(ids))
    assert tier.store.flush()
    return b


def ended(tier) -> None:
    """The tier closes; its prefetch thread (if it started one) ends."""
    thread = tier._jobs.thread
    tier.close()
    if thread is not None:
        thread.join(IDLE_S)
        assert not thread.is_alive()


def test_a_finished_prefetch_makes_the_fetch_read_nothing_from_the_store():
    ids = list(range(1, 9))
    b = written(ids=ids)
    want_cache, want_alloc, want_pool, want_tier = setup(b)           # fetch, no prefetch
    m = want_cache.match(ids + [9])
    assert want_tier.fetch(ids + [9], m) == 8
    cache, alloc, pool, tier = setup(b)
    m = cache.match(ids + [9])
    assert tier.prefetch(ids + [9], m) and tier.prefetch_idle(IDLE_S)
    assert tier.stats.prefetched_pages == 4 and tier.as_dict()["staged_bytes"] == 4 * tier._full.nbytes
    calls = Counting(b)
    assert tier.fetch(ids + [9], m) == 8
    assert (calls.gets, calls.asks) == (0, 0)                         # every value was staged
    got, want = cache.match(ids), want_cache.match(ids)
    assert kv_tokens(pool, got.device_indices) == ids
    assert got.device_indices.tolist() == want.device_indices.tolist()
    assert torch.equal(pool.kv_data, want_pool.kv_data)                # the same pages, placed alike
    st = tier.stats
    assert (st.hit_pages, st.miss_pages) == (want_tier.stats.hit_pages, want_tier.stats.miss_pages)
    assert st.prefetch_used_pages == 4 and tier.as_dict()["staged_bytes"] == 0   # each used once
    for c, a in ((cache, alloc), (want_cache, want_alloc)):
        c.check(extra_owned=NONE)
        assert a.available_size() + c.stats().evictable == a.size
    ended(tier)
    ended(want_tier)


def test_a_prefetch_past_the_device_match_stages_only_the_pages_after_it():
    ids = list(range(1, 9))
    b = written(ids=ids)
    cache, alloc, pool, tier = setup(b)
    assert run(cache, alloc, pool, ids[:4] + [0]) == 4                 # pages 1-2 via a plain fetch
    m = cache.match(ids + [9])
    assert m.prefix_len == 4 and tier.prefetch(ids + [9], m) and tier.prefetch_idle(IDLE_S)
    assert tier.stats.prefetched_pages == 2
    calls = Counting(b)
    assert run(cache, alloc, pool, ids + [9]) == 8
    assert calls.gets == 0 and tier.stats.prefetch_used_pages == 2
    assert kv_tokens(pool, cache.match(ids).device_indices) == ids
    cache.check(extra_owned=NONE)
    ended(tier)


def test_a_hanging_store_never_holds_the_caller_and_the_fetch_recomputes_within_its_bound():
    """Every get hangs: prefetch returns at once; a fetch while the prefetch's get hangs ends
    within the store's bounds (its exists waits behind that get at most a timeout), reads nothing
    and the request recomputes; the store is down for its backoff."""
    ids = list(range(1, 9))
    b = written(ids=ids)
    gets = []
    slow_get = b.get
    b.get = lambda key: (gets.append(key), b.release.wait(HANG_S), slow_get(key))[-1]
    cache, alloc, pool, tier = setup(b)
    try:
        m = cache.match(ids + [9])
        t0 = time.monotonic()
        assert tier.prefetch(ids + [9], m)
        assert time.monotonic() - t0 < 0.5                             # the caller is never blocked
        end = time.monotonic() + IDLE_S
        while not gets and time.monotonic() < end:                      # the prefetch's get hangs now
            time.sleep(0.005)
        assert len(gets) == 1
        t0 = time.monotonic()
        assert run(cache, alloc, pool, ids + [9]) == 0                  # recomputed
        assert time.monotonic() - t0 < HANG_S / 3                       # never waited out the hang
        assert len(gets) == 1 and not tier.store.up                     # the fetch read nothing
        assert tier.prefetch_idle(IDLE_S)                               # the job ended at its deadline
        assert tier.stats.prefetched_pages == 0 and tier.stats.prefetch_used_pages == 0
        assert not tier.prefetching and not tier.prefetch([50, 51, 52], cache.match([50, 51, 52]))
    finally:
        b.release.set()
    assert kv_tokens(pool, cache.match(ids).device_indices) == ids
    cache.check(extra_owned=NONE)
    assert alloc.available_size() + cache.stats().evictable == alloc.size
    ended(tier)


def test_a_stopped_job_starts_no_store_read_and_the_fetch_reads_the_rest():
    """The handle's ``stop`` (what an admission calls): a job stopped while its ``exists`` is in
    flight gets nothing after it; the fetch then reads every page itself, once."""
    ids = list(range(1, 9))
    b = written(ids=ids)
    asking, gate = threading.Event(), threading.Event()
    ask = b.batch_is_exist
    b.batch_is_exist = lambda keys: (asking.set(), gate.wait(HANG_S), ask(keys))[-1]
    cache, alloc, pool, tier = setup(b)
    tier.store.timeout_s = HANG_S                                      # the gate, not a timeout, ends it
    calls = Counting(b)
    try:
        job = tier.prefetch(ids + [9], cache.match(ids + [9]))
        assert job is not None and asking.wait(IDLE_S)
        job.stop()
    finally:
        gate.set()
    assert tier.prefetch_idle(IDLE_S)
    assert calls.gets == 0 and tier.stats.prefetched_pages == 0 and len(tier._staging) == 0
    assert run(cache, alloc, pool, ids + [9]) == 8 and calls.gets == 4
    assert kv_tokens(pool, cache.match(ids).device_indices) == ids
    cache.check(extra_owned=NONE)
    ended(tier)


def test_the_staging_bound_holds_and_drops_the_oldest():
    prompts = [[10 * k + i for i in range(1, 5)] for k in range(1, 5)]  # 4 prompts of 2 pages
    b = DictBackend()
    w_cache, w_alloc, w_pool, w_tier = setup(b, policy="write_through")
    for ids in prompts:
        run(w_cache, w_alloc, w_pool, ids)
    assert w_tier.store.flush()
    page = w_tier._full.nbytes
    cache, alloc, pool, tier = setup(b, staging_bytes=3 * page)         # three pages
    seen = []
    put = tier._staging.put
    tier._staging.put = lambda ref, payload: (put(ref, payload), seen.append(tier._staging.nbytes))[0]
    for ids in prompts:
        assert tier.prefetch(ids + [0], cache.match(ids + [0]))
    assert tier.prefetch_idle(IDLE_S)
    assert len(seen) == 8 and max(seen) <= 3 * page                    # never past the bound
    st = tier.stats
    assert (st.prefetched_pages, st.prefetch_dropped_pages, len(tier._staging)) == (8, 5, 3)
    calls = Counting(b)
    assert run(cache, alloc, pool, prompts[0] + [0]) == 4              # dropped: read from the store
    assert calls.gets == 2 and st.prefetch_used_pages == 0
    assert run(cache, alloc, pool, prompts[3] + [0]) == 4              # the newest: staged
    assert calls.gets == 2 and st.prefetch_used_pages == 2
    for ids in prompts[::3]:
        assert kv_tokens(pool, cache.match(ids).device_indices) == ids
    cache.check(extra_owned=NONE)
    ended(tier)
    ended(w_tier)


def test_staging_keeps_each_value_once_and_never_one_larger_than_the_bound():
    s = Staging(10)
    assert s.put("a", b"12345") == 0 and s.put("a", b"123456") == 0    # replaced, not added
    assert s.nbytes == 6 and s.put("big", b"x" * 11) == 1 and s.holds(["big", "a"]) == [False, True]
    assert s.put("b", b"1234") == 0 and s.put("c", b"1") == 1           # "a" (oldest) dropped
    assert s.take("a") is None and s.take("b") == b"1234" and s.take("b") is None
    assert s.nbytes == 1 and len(s) == 1


def test_jobs_refuse_past_their_bound_survive_a_failing_job_and_end_on_close():
    gate, done = threading.Event(), []

    def job(x):
        gate.wait(IDLE_S)
        if x == "bad":
            raise RuntimeError("a job's bug")
        done.append(x)

    jobs = Jobs(job, max_pending=2, name="test-jobs")
    assert jobs.submit(("bad",))
    end = time.monotonic() + IDLE_S
    while jobs._queue.qsize() and time.monotonic() < end:              # the thread took the first
        time.sleep(0.002)
    assert jobs.submit(("a",)) and jobs.submit(("b",)) and not jobs.submit(("c",))
    assert not jobs.idle(0.05)
    gate.set()
    assert jobs.idle(IDLE_S) and done == ["a", "b"]                    # the failure was logged only
    jobs.close()
    jobs.thread.join(IDLE_S)
    assert not jobs.thread.is_alive() and not jobs.submit(("d",))


@pytest.mark.parametrize("comps", [("swa",), ("mamba",), ("swa", "mamba")])
def test_a_prefetch_stages_the_component_values_too(comps):
    """A fresh hybrid cache: the prefetch stages the FULL pages and the values the components
    need at the deepest end (SWA: the window's pages; MAMBA: the state at the end), so the fetch
    (Rig.run checks every reused value) reads nothing from the store; the same match and counts
    as a fetch without a prefetch."""
    b = DictBackend()
    ids = list(range(100, 112))                                        # 6 pages
    Rig(b, comps).run(ids)
    want, fresh = Rig(b, comps), Rig(b, comps)
    probe = ids + [1]                                                  # the same 6 pages (no new write)
    assert fresh.tier.prefetch(probe, fresh.cache.match(probe))
    assert fresh.tier.prefetch_idle(IDLE_S)
    n_aux = (W // PS if "swa" in comps else 0) + ("mamba" in comps)
    assert fresh.tier.stats.prefetched_pages == 6 + n_aux
    m_want = want.run(probe)
    calls = Counting(b)
    m = fresh.run(probe)
    assert calls.gets == 0 and fresh.tier.stats.prefetch_used_pages == 6 + n_aux
    assert m.prefix_len == m_want.prefix_len == 12
    assert m.device_indices.tolist() == m_want.device_indices.tolist()
    for f in ("hit_pages", "miss_pages", "aux_hits", "aux_misses"):
        assert getattr(fresh.tier.stats, f) == getattr(want.tier.stats, f), f
    fresh.check()
    want.check()
    ended(fresh.tier)
    ended(want.tier)


def _engine(backend):
    """A stopped engine over KVEchoModel with one row and a write-through L3 tier (the test steps it)."""
    e = make(rows=1)
    tier = L3Tier(L3Store(backend, "p", timeout_s=5), e.kv_pool.kv_data, e.kv_pool.page_size,
                  write_policy="write_through")
    e.kv.cache.add_tier(tier)
    return e, tier


def _engine_wrote(ids) -> DictBackend:
    """A backend holding what an engine wrote through after computing ``ids`` (2 tokens more)."""
    b = DictBackend()
    writer, tier = _engine(b)
    d = Driver(writer)
    d.submit("w", ids, 2)
    d.run()
    assert tier.store.flush()
    ended(tier)
    return b


def test_a_queued_request_is_read_ahead_while_another_runs_and_decodes_the_same():
    """The engine: a request queued behind a running one (one row) has its L3 pages staged by
    then; its admission places them without a store read, and its output is the oracle's."""
    long_ = prompt(1, 24)
    b = _engine_wrote(long_)
    e, tier = _engine(b)
    d = Driver(e)
    d.submit("busy", prompt(2, 8), 6)
    d.step()                                                           # takes the one row
    d.submit("a", long_, 3)
    d.step()                                                           # queued: prefetch starts
    assert tier.stats.prefetches == 2 and e.scheduler.waiting          # busy's asked too (a miss)
    assert tier.prefetch_idle(IDLE_S)
    calls = Counting(b)
    d.run()
    assert d.tokens("a") == oracle(long_, 3) and d.tokens("busy") == oracle(prompt(2, 8), 6)
    assert d.final("a").cached_tokens == 20                           # (24 - 1) // 4 whole pages
    assert calls.gets == 0 and tier.stats.prefetch_used_pages == 5
    e.check_invariants()
    ended(tier)


def test_a_request_admitted_at_once_stops_its_prefetch():
    """Queued and admitted in the same step: the admission stops the job before its fetch, so
    the pages are read once by the fetch, plus at most the job's one batch in flight when it was
    stopped (reads go in batches of READ_BATCH values), and the output is the oracle's."""
    long_ = prompt(3, 24)
    b = _engine_wrote(long_)
    e, tier = _engine(b)
    calls = Counting(b)
    d = Driver(e)
    d.submit("a", long_, 3)
    d.step()                                                           # queued, then admitted
    sr = e.scheduler.running["a"]
    assert sr.prefetches is None and tier.stats.prefetches == 1      # stopped and cleared
    assert tier.prefetch_idle(IDLE_S)
    d.run()
    assert d.tokens("a") == oracle(long_, 3) and d.final("a").cached_tokens == 20
    assert 5 <= calls.gets <= 2 * 5 and tier.stats.hit_pages == 5   # the fetch's 5, and the job's batch
    e.check_invariants()
    ended(tier)
