"""The L3 tier inside the radix cache, on the CPU with an in-memory store (the real Mooncake
master: tests/cache/test_l3_mooncake_tier.py). KV of a slot holding token t is filled with t, so
a page read into the wrong place shows up as a wrong number. Invariants are checked after every
operation (cache_support: debug_invariants), including "no spill left unwritten"."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.cache.kv_pool import KVPool
from tandem.cache.tiers.l3.budget import PRIOR_PREFILL_TOK_S
from tandem.cache.tiers.l3.store import L3Store
from tandem.cache.tiers.l3.tier import L3Tier
from tandem.cache.radix.components import FULL, SWA
from tandem.cache.tiers.host import HostTier
from tandem.core.page_hash import page_hashes

from cache_support import make_cache

NONE = torch.empty(0, dtype=torch.int64)


HANG_S = 120.0   # a hung store call: far past any deadline, so a late answer cannot count as a hit
#                 (and far past a stall of a loaded 2-core CI machine; every test releases it)


class DictBackend:
    """Mooncake's method names over a dict. ``delay`` set: every call hangs (until ``release``
    is set, at most HANG_S), a wedged store; ``hung_calls`` counts the calls that hung."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.delay = threading.Event()
        self.release = threading.Event()
        self.hung_calls = 0

    def _wait(self):
        if self.delay.is_set():
            self.hung_calls += 1
            self.release.wait(HANG_S)

    def batch_is_exist(self, keys):
        self._wait()
        return [1 if k in self.data else 0 for k in keys]

    def put(self, key, value):
        self._wait()
        self.data[key] = bytes(value)
        return 0

    def get(self, key):
        self._wait()
        return self.data.get(key, b"")


def setup(backend, *, policy="write_back", pages=8, page_size=2, host_tokens=0, **kw):
    pool = KVPool(pages * page_size, page_size, num_layers=2, num_kv_heads=1, head_dim=2)
    host = HostTier(pool, host_tokens, "write_back") if host_tokens else None
    cache, alloc = make_cache(page_size=page_size, pages=pages, host=host)
    store = L3Store(backend, "t/p2", timeout_s=0.2, backoff_s=60)
    tier = L3Tier(store, pool.kv_data, page_size, write_policy=policy, **kw)
    cache.add_tier(tier)
    return cache, alloc, pool, tier


def compute(pool, alloc, ids):
    slots = alloc.alloc(len(ids))
    pool.kv_data[:, :, slots] = torch.tensor(ids, dtype=pool.dtype)[:, None, None]
    return slots


def kv_tokens(pool, slots):
    return pool.kv_data[1, 1, slots, 0, 0].to(torch.int64).tolist()


def run(cache, alloc, pool, ids):
    """admit (match + L3 fetch) and finish a request; returns the prefix it reused."""
    m = cache.match(ids)
    if cache.tier("l3").fetch(ids, m):
        m = cache.match(ids)
    cache.lock(m.last_device_node)
    slots = torch.cat([m.device_indices, compute(pool, alloc, ids[m.prefix_len:])])
    kept, node = cache.cache(ids, slots, m.last_device_node)
    alloc.free(slots[len(kept):])                          # the unaligned tail
    cache.unlock(node)
    return m.prefix_len


def test_an_evicted_prefix_comes_back_from_l3():
    b = DictBackend()
    cache, alloc, pool, tier = setup(b)
    ids = [11, 12, 13, 14, 15, 16]
    assert run(cache, alloc, pool, ids) == 0
    assert not b.data                                      # write-back: nothing until eviction
    assert cache.evict(6) == 6
    tier.store.flush()
    assert len(b.data) == 3                                # three pages, keyed by the hash chain
    assert sorted(b.data) == sorted(f"t/p2/{h:016x}" for h in page_hashes(ids, 2))
    m = cache.match(ids + [99])
    assert m.prefix_len == 0
    assert tier.fetch(ids + [99], m) == 6
    m = cache.match(ids + [99])
    assert m.prefix_len == 6 and kv_tokens(pool, m.device_indices) == ids
    assert (tier.stats.hit_pages, tier.stats.miss_pages) == (3, 3)   # the first run missed 3
    cache.check(extra_owned=NONE)


def test_a_match_ending_on_the_device_continues_into_l3():
    b = DictBackend()
    cache, alloc, pool, tier = setup(b, policy="write_through")
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    run(cache, alloc, pool, a)
    tier.store.flush()
    assert len(b.data) == 4                                # write-through at insert
    cache.evict(8)
    run(cache, alloc, pool, a[:4])                         # [1..4] back on the device (from L3)
    assert cache.match(a).prefix_len == 4
    assert run(cache, alloc, pool, a + [9, 10]) == 8       # device 4, then L3 pages 3 and 4
    m = cache.match(a)
    assert kv_tokens(pool, m.device_indices) == a
    cache.check(extra_owned=NONE)


def test_host_evictions_write_back_to_l3():
    b = DictBackend()
    cache, alloc, pool, tier = setup(b, pages=8, host_tokens=4)
    run(cache, alloc, pool, [1, 2, 3, 4])
    run(cache, alloc, pool, [5, 6, 7, 8])
    cache.evict(8)                                         # both to the host; it holds 4 tokens
    tier.store.flush()
    assert len(b.data) == 2                                # the first, evicted from the host
    assert cache.stats().host == 4
    assert run(cache, alloc, pool, [1, 2, 3, 4, 0]) == 4
    cache.check(extra_owned=NONE)


def test_a_corrupted_page_is_a_miss_counted_and_the_rest_is_recomputed():
    b = DictBackend()
    cache, alloc, pool, tier = setup(b)
    ids = [1, 2, 3, 4, 5, 6]
    run(cache, alloc, pool, ids)
    cache.evict(6)
    tier.store.flush()
    key = f"t/p2/{page_hashes(ids, 2)[1]:016x}"
    v = bytearray(b.data[key])
    v[-1] ^= 0xFF
    b.data[key] = bytes(v)                                 # the second page's bytes damaged
    assert run(cache, alloc, pool, ids + [7]) == 2         # page 1 only; 2 and 3 recomputed
    assert tier.store.stats.corrupt == 1
    m = cache.match(ids)
    assert m.prefix_len == 6 and kv_tokens(pool, m.device_indices) == ids
    cache.check(extra_owned=NONE)


def test_a_slow_store_is_a_miss_within_the_deadline():
    b = DictBackend()
    cache, alloc, pool, tier = setup(b, policy="write_through")
    ids = [1, 2, 3, 4]
    run(cache, alloc, pool, ids)
    tier.store.flush()
    cache.evict(4)
    on_device = cache.match(ids + [5]).prefix_len
    b.delay.set()
    import time
    t0 = time.monotonic()
    try:
        assert run(cache, alloc, pool, ids + [5]) == on_device   # nothing came from the store
        assert not tier.store.up and tier.store.stats.errors == 1
        assert b.hung_calls == 1                               # one timeout, then the store is down
        run(cache, alloc, pool, [7, 8, 9, 10])                 # writes while down: dropped, no wait
        assert b.hung_calls == 1
        assert time.monotonic() - t0 < HANG_S / 3              # the caller never waited out a hang
    finally:
        b.release.set()
    cache.check(extra_owned=NONE)
    assert alloc.available_size() + cache.stats().evictable == alloc.size


def test_the_budget_and_no_room_bound_a_fetch():
    b = DictBackend()
    cache, alloc, pool, tier = setup(b, pages=4, policy="write_through", max_tokens=4)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    run(cache, alloc, pool, ids)
    tier.store.flush()
    cache.evict(8)
    m = cache.match(ids)
    assert tier.fetch(ids, m) == 4                         # two pages: the budget
    m = cache.match(ids)
    cache.lock(m.last_device_node)
    held = alloc.alloc(alloc.available_size())             # the device is full and locked
    assert tier.fetch(ids, m) == 0
    alloc.free(held)
    cache.unlock(m.last_device_node)
    cache.check(extra_owned=NONE)


def test_a_hybrid_cache_needs_the_device_data_of_every_component():
    """(The hybrid tier itself: tests/cache/test_l3_hybrid.py.)"""
    pool = KVPool(16, 2, num_layers=1, num_kv_heads=1, head_dim=2)
    swa_pool = KVPool(16, 1, num_layers=1, num_kv_heads=1, head_dim=2)
    from tandem.cache.allocator import PagedAllocator
    swa = SWA(4, PagedAllocator(16, 1), torch.zeros(20, dtype=torch.int64))
    cache, _ = make_cache(page_size=2, pages=8, components=(FULL, swa))
    with pytest.raises(ValueError, match=r"missing \['swa'\]"):
        cache.add_tier(L3Tier(L3Store(DictBackend(), "t"), pool.kv_data, 2))
    with pytest.raises(ValueError, match=r"not components \['mamba'\]"):
        cache.add_tier(L3Tier(L3Store(DictBackend(), "t"), pool.kv_data, 2,
                               aux_data={"swa": swa_pool.kv_data, "mamba": swa_pool.kv_data}))
    assert cache.tier("l3") is None
    cache.add_tier(L3Tier(L3Store(DictBackend(), "t"), pool.kv_data, 2, aux_data={"swa": swa_pool.kv_data}))
    assert cache.tier("l3") is not None


def test_slow_gets_end_a_fetch_within_the_deadline():
    """exists answers, every get hangs: the fetch returns within the deadline (one timeout in
    all, not one per page), recomputes, and the store is down for its backoff."""
    import time

    b = DictBackend()
    cache, alloc, pool, tier = setup(b, policy="write_through")
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    run(cache, alloc, pool, ids)
    tier.store.flush()
    cache.evict(8)
    slow_get, gets = b.get, []
    b.get = lambda key: (gets.append(key), b.release.wait(HANG_S), slow_get(key))[-1]
    on_device = cache.match(ids + [9]).prefix_len   # what eviction left (nothing, unless a write held a page)
    t0 = time.monotonic()
    try:
        assert run(cache, alloc, pool, ids + [9]) == on_device   # nothing came from the hanging store
        assert len(gets) == 1                         # one get timed out; the rest were not tried
        assert time.monotonic() - t0 < HANG_S / 3     # the fetch never waited out the hang
    finally:
        b.release.set()
    assert not tier.store.up and tier.stats.miss_pages >= 4
    cache.check(extra_owned=NONE)


def test_attach_store_leaves_cacheless_workers_and_hybrid_ones_without_component_data_without_l3():
    from tandem.cache.allocator import PagedAllocator
    from tandem.cache.tiers.l3.connect import attach_store, l3_options
    from tandem.cache.null import NullCache

    assert l3_options("off", 0.5) is None
    opts = l3_options("mooncake://127.0.0.1:1/2", 0.5, corrupt=True)
    assert opts == {"url": "mooncake://127.0.0.1:1/2", "timeout_s": 0.5, "corrupt": True, "segment_bytes": 0,
                    "prefill_tok_s": PRIOR_PREFILL_TOK_S}
    assert l3_options("mooncake://h:1", 0.5, segment_bytes=32 << 20)["segment_bytes"] == 32 << 20
    pool = KVPool(16, 2, num_layers=1, num_kv_heads=1, head_dim=2)
    swa = SWA(4, PagedAllocator(16, 1), torch.zeros(20, dtype=torch.int64))
    hybrid, _ = make_cache(page_size=2, pages=8, components=(FULL, swa))
    for cache in (hybrid, NullCache(PagedAllocator(8, 2))):   # returns before joining any store
        assert attach_store(cache, pool, "m", **opts) is None
        assert cache.tier("l3") is None
    assert attach_store(hybrid, pool, "m", aux_data={"mamba": pool.kv_data}, **opts) is None


class PinBackend(DictBackend):
    """DictBackend that keeps each put's option (a stand-in of Mooncake's soft-pin ReplicateConfig:
    the TTL in seconds, as ``pin_config`` makes it here) and counts upserts."""

    def __init__(self):
        super().__init__()
        self.config: dict[str, float | None] = {}
        self.upserts = 0

    def put(self, key, value, config=None):
        if key in self.data:
            return -706                      # Mooncake's OBJECT_ALREADY_EXISTS
        self.config[key] = config
        return super().put(key, value)

    def upsert(self, key, value, config=None):
        self.upserts += 1
        self.data.pop(key, None)
        return self.put(key, value, config)


def test_a_pinned_page_spilled_to_l3_carries_its_expiry():
    from cache_support import FakeClock

    clock = FakeClock(100.0)
    b = PinBackend()
    pool = KVPool(8 * 2, 2, num_layers=2, num_kv_heads=1, head_dim=2)
    cache, alloc = make_cache(page_size=2, pages=8, clock=clock)
    store = L3Store(b, "t/p2", timeout_s=0.2, backoff_s=60, clock=clock, pin_config=lambda ttl: ttl)
    tier = L3Tier(store, pool.kv_data, 2, write_policy="write_through")
    cache.add_tier(tier)
    pinned, plain = [1, 2, 3, 4], [5, 6, 7, 8]
    run(cache, alloc, pool, pinned)
    run(cache, alloc, pool, plain)
    store.flush()
    assert len(b.data) == 4 and set(b.config.values()) == {None}     # written through, unpinned
    assert cache.pin(cache.match(pinned).last_device_node, 4, 300.0, tenant="t") == 4
    clock.t += 100
    assert cache.evict(8) == 8                    # both leave the tree: the pinned one last
    store.flush()
    keys = [f"t/p2/{h:016x}" for h in page_hashes(pinned, 2)]
    assert [b.config[k] for k in keys] == [200.0, 200.0]             # rewritten with 200 s left
    assert all(b.config[f"t/p2/{h:016x}"] is None for h in page_hashes(plain, 2))
    assert b.upserts == 2 and store.stats.pinned_puts == 2
    assert run(cache, alloc, pool, pinned + [0]) == 4                 # and it reads back
    cache.check(extra_owned=NONE)
