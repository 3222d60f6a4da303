"""The L3 read bound in tokens (cache/tiers/l3/budget.py): sized from the deadline and the
store's measured read rate, and past the deadline only while reading beats recomputing."""

from __future__ import annotations

import pytest

from tandem.cache.tiers.l3.budget import ReadBudget
from tandem.cache.tiers.l3.store import L3Store

from test_l3_tier import DictBackend, run, setup


def test_an_unmeasured_store_is_bounded_by_the_deadline_alone():
    b = ReadBudget(0.5, 100)
    assert (b.tokens(10_000), b.wait_s(10_000)) == (10_000, 0.5)
    assert ReadBudget(0.5, 100, max_tokens=64).tokens(10_000) == 64


def test_a_store_slower_than_prefill_gets_the_deadline_only():
    b = ReadBudget(0.5, 100, prefill_tok_s=1000.0, read_bytes_per_s=100 * 400.0)   # 400 tok/s
    assert b.wait_s(900) == 0.5
    assert b.tokens(900) == 200                          # 0.5 s at 400 tok/s


def test_a_store_faster_than_prefill_reads_the_whole_prompt():
    b = ReadBudget(0.5, 100, prefill_tok_s=500.0, read_bytes_per_s=100 * 800.0)    # 800 tok/s
    assert b.wait_s(897) == pytest.approx(897 / 500.0)   # as long as recomputing would take
    assert b.tokens(897) == 897
    assert b.tokens(100) == 100                          # the deadline alone covers it


def test_observe_moves_the_estimate_toward_new_gets():
    b = ReadBudget(0.5, 10)
    b.observe(1000, 0.01)
    assert b.read_bytes_per_s == pytest.approx(1e5)
    b.observe(1000, 0.001)
    assert 1e5 < b.read_bytes_per_s < 1e6
    b.observe(0, 0.1)
    b.observe(10, 0.0)
    assert 1e5 < b.read_bytes_per_s < 1e6


def test_probe_measures_a_store_and_a_dead_one_is_none():
    b = ReadBudget(0.5, 10)
    assert b.probe(L3Store(DictBackend(), "t"), 4096) is not None and b.read_bytes_per_s > 0
    dead = ReadBudget(0.5, 10)
    assert dead.probe(L3Store(None, "t"), 4096) is None and dead.read_bytes_per_s is None


def test_a_fetch_asks_for_what_the_budget_allows_and_the_tier_learns_the_rate():
    """A slow measured store and a fast prefill: the fetch asks for 0.2 s worth of pages; a fast
    store and a slow prefill: the whole prompt, and the gets update the estimate."""
    b = DictBackend()
    cache, alloc, pool, tier = setup(b, pages=16, policy="write_through", deadline_s=0.2,
                                     prefill_tok_s=1000.0)
    ids = list(range(1, 17))
    run(cache, alloc, pool, ids)
    tier.store.flush()
    cache.evict(16)
    tier.budget.read_bytes_per_s = tier.budget.token_bytes * 20.0            # 20 tok/s
    m = cache.match(ids)
    assert tier.lookup(ids, m) == 4 and tier.fetch(ids, m) == 4
    cache.evict(16)
    tier.budget.prefill_tok_s = 1.0
    tier.budget.read_bytes_per_s = tier.budget.token_bytes * 100.0           # 100 tok/s
    m = cache.match(ids)
    assert tier.lookup(ids, m) == 16 and tier.fetch(ids, m) == 16
    assert tier.budget.read_bytes_per_s != tier.budget.token_bytes * 100.0   # observed the gets
    assert tier.as_dict()["read_bytes_per_s"] == tier.budget.read_bytes_per_s


def test_a_get_cut_by_the_callers_deadline_is_a_miss_not_a_down_store():
    """A fetch that runs up to its wait cuts its last get: the store stays up for the next one."""
    b = DictBackend()
    store = L3Store(b, "t", timeout_s=5.0, backoff_s=60)
    assert store.put(7, b"x" * 64)
    b.delay.set()
    assert store.get(7, budget_s=0.05) is None
    assert store.up and (store.stats.late, store.stats.errors) == (1, 0)
    b.delay.clear()
    b.release.set()
    assert store.get(7) == b"x" * 64
    store.close()


def test_the_writer_skips_values_the_store_already_holds():
    """What another worker wrote is not put again (one batch exists per batch of writes)."""
    b = DictBackend()
    first, second = L3Store(b, "t"), L3Store(b, "t")
    assert first.put(1, b"a" * 8)
    assert second.put_async([(1, b"a" * 8), (2, b"b" * 8)]) == 2
    assert second.flush(5.0)
    assert (second.stats.puts, second.stats.write_skipped) == (1, 1)
    assert second.get(2) == b"b" * 8
    first.close()
    second.close()
