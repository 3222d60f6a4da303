"""Pins (issue 52): a pinned prefix is evicted after every unpinned page, demoted to the host tier
rather than dropped, charged to its tenant within a cap, and ends at its TTL (a fake clock: no
sleeps). Every cache here runs the invariant check after each operation (debug_invariants)."""

from __future__ import annotations

import torch

from tandem.cache.kv_pool import KVPool
from tandem.cache.tiers.host import HostTier

from cache_support import FakeClock, make_cache, run_request


def leaf(cache, ids):
    return cache.match(ids).last_device_node


def test_pinned_prefix_is_evicted_after_every_unpinned_page():
    clock = FakeClock(100.0)
    cache, alloc = make_cache(pages=32, clock=clock)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    run_request(cache, alloc, a)                 # slots 0..3: the oldest
    run_request(cache, alloc, b)                 # 4..7
    run_request(cache, alloc, c)                 # 8..11
    assert cache.pin(leaf(cache, a), 4, 300.0, tenant="t1") == 4
    assert cache.pinned_tokens == {"t1": 4}
    run_request(cache, alloc, c)                 # touch c: LRU order is now b, c, (a pinned)
    assert cache.evict(4) == 4
    assert cache.match(b).prefix_len == 0 and cache.match(a).prefix_len == 4
    assert cache.evict(4) == 4                   # c goes next, though a is older
    assert cache.match(c).prefix_len == 0 and cache.match(a).prefix_len == 4
    assert cache.evict(4) == 4                   # nothing unpinned left: the pinned page goes
    assert cache.match(a).prefix_len == 0
    assert cache.pinned_tokens == {} and cache.pins() == []
    assert sorted(alloc.allocated_pages().tolist()) == []


def test_pin_splits_the_edge_at_the_breakpoint_and_the_tail_goes_first():
    clock = FakeClock()
    cache, alloc = make_cache(page_size=2, pages=16, clock=clock)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    slots = run_request(cache, alloc, ids)
    assert slots.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]           # pages 1..4 (page 0 is reserved)
    node = leaf(cache, ids)
    assert cache.pin(node, 5, 60.0) == 4         # aligned down to 4: [0, 4) pinned
    [p] = cache.pins()
    assert (p["tokens"], p["tier"], p["expires_in_s"], p["tenant"]) == (4, "device", 60.0, "")
    assert cache.evict(2) == 4                   # the unpinned tail [4, 8) is the leaf
    assert cache.match(ids).prefix_len == 4
    assert sorted(alloc.allocated_pages().tolist()) == [1, 2]


def test_pin_expires_on_the_clock_and_the_prefix_is_ordinary_again():
    clock = FakeClock(10.0)
    cache, alloc = make_cache(pages=32, clock=clock)
    a, b = [1, 2, 3], [4, 5, 6]
    run_request(cache, alloc, a)
    run_request(cache, alloc, b)
    assert cache.pin(leaf(cache, a), 3, 300.0) == 3
    run_request(cache, alloc, b)                 # b is the more recent one
    clock.t = 309.0
    assert cache.evict(3) == 3 and cache.match(b).prefix_len == 0    # a still pinned
    run_request(cache, alloc, b)
    clock.t = 310.0                              # a's pin ends now: plain LRU again
    assert cache.evict(3) == 3
    assert cache.match(a).prefix_len == 0 and cache.match(b).prefix_len == 3
    assert cache.pins() == [] and cache.pinned_tokens == {}


def test_ttl_is_capped_and_a_longer_pin_extends_a_shorter_one():
    clock = FakeClock(0.0)
    cache, alloc = make_cache(pages=32, clock=clock, pin_max_ttl_s=100.0)
    a = [1, 2, 3, 4]
    run_request(cache, alloc, a)
    assert cache.pin(leaf(cache, a), 2, 86400.0) == 2          # 24h -> 100 s
    assert cache.pin(leaf(cache, a), 4, 10.0) == 2             # only [2, 4) is new
    assert [(p["tokens"], p["expires_in_s"]) for p in cache.pins()] == [(4, 10.0)]
    clock.t = 10.0
    assert [(p["tokens"], p["expires_in_s"]) for p in cache.pins()] == [(2, 90.0)]
    assert cache.pinned_tokens == {"": 2}


def test_tenant_cap_refuses_the_pin_and_counts_it_without_touching_the_cache():
    clock = FakeClock()
    cache, alloc = make_cache(pages=32, clock=clock, pin_share=0.25)   # cap: 8 of 32 tokens
    a, b, c = [1] * 6, [2] * 6, [3] * 6
    for ids in (a, b, c):
        run_request(cache, alloc, ids)
    assert cache.pin(leaf(cache, a), 6, 60.0, tenant="x") == 6
    assert cache.pin(leaf(cache, b), 6, 60.0, tenant="x") is None    # 12 > 8
    assert cache.pin_refused == 1 and cache.pinned_tokens == {"x": 6}
    assert cache.pin(leaf(cache, c), 6, 60.0, tenant="y") == 6       # another tenant's own cap
    assert cache.pin(leaf(cache, b), 6, 60.0, tenant="x", cap=12) == 6   # an API key's larger cap
    assert cache.pinned_tokens == {"x": 12, "y": 6}
    hits = cache.pin_hits
    cache.match(a + [7])
    cache.match([4, 4])
    assert cache.pin_hits == hits + 1            # only the match that read a pinned prefix


def test_unpin_by_hash_keeps_what_another_pinned_prefix_needs():
    clock = FakeClock()
    cache, alloc = make_cache(pages=32, clock=clock)
    base = [1, 2, 3, 4]
    run_request(cache, alloc, base + [5, 6])
    run_request(cache, alloc, base + [7, 8])
    cache.pin(leaf(cache, base + [5, 6]), 6, 60.0)
    cache.pin(leaf(cache, base + [7, 8]), 6, 60.0)
    pins = cache.pins()
    assert [p["tokens"] for p in pins] == [6, 6] and cache.pinned_tokens == {"": 8}
    assert cache.unpin("0" * 16) == 0
    assert cache.unpin(pins[0]["hash"], tenant="other") == 0
    assert cache.unpin(pins[0]["hash"]) == 2                 # its own edge; the shared [0, 4) stays
    assert [p["tokens"] for p in cache.pins()] == [6] and cache.pinned_tokens == {"": 6}
    assert cache.unpin(pins[1]["hash"]) == 6
    assert cache.pins() == [] and cache.pinned_tokens == {}


def test_pinned_page_is_demoted_to_the_host_and_the_host_keeps_it_over_unpinned_copies():
    clock = FakeClock()
    pool = KVPool(16, 1, num_layers=1, num_kv_heads=1, head_dim=2)
    host = HostTier(pool, 8, "write_back")
    cache, alloc = make_cache(pages=16, host=host, clock=clock)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    for ids in (a, b):
        run_request(cache, alloc, ids)
    cache.pin(leaf(cache, a), 4, 60.0)
    assert cache.evict(8) == 8                   # both demoted (write-back copies at eviction)
    na = cache.match(a).best_match_node
    assert na.value is None and na.host is not None and na.pin
    assert [(p["tier"], p["tokens"]) for p in cache.pins()] == [("host", 4)]
    run_request(cache, alloc, c)
    assert cache.evict(4) == 4                   # host full: b's unpinned copy goes, not a's
    assert cache.match(b).best_match_node.end == 0
    assert cache.match(a).host_hit_length == 4
    assert cache.evict(100, component="host") == 8   # pinned last, but still evictable
    assert cache.pins() == [] and cache.pinned_tokens == {}
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))


def test_locked_pinned_prefix_and_a_request_past_the_pool_never_wait():
    clock = FakeClock()
    cache, alloc = make_cache(pages=8, clock=clock, pin_share=1.0)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    run_request(cache, alloc, a)
    cache.pin(leaf(cache, a), 8, 3600.0)
    assert alloc.available_size() == 0
    r = cache.match([9] * 8)
    assert r.prefix_len == 0
    assert cache.evict(8) == 8                   # the pool is all pinned: a new request still gets room
    assert alloc.alloc(8) is not None


def test_one_tenants_pins_cannot_push_anothers_hot_prefix_out_beyond_its_cap():
    """Issue 52's fairness goal: tenant B pins as much as it asks for, but past its cap (a quarter
    of the pool) its prefixes are served unpinned; so A's hot unpinned prefix, used after B's older
    ones, survives B's burst (without the cap, B's pins would fill the pool and evict it)."""
    def admit(ids):                                         # as the scheduler does: evict, then run
        need = len(ids) - cache.match(ids).prefix_len - alloc.available_size()
        if need > 0:
            cache.evict(need)
        run_request(cache, alloc, ids)

    for share, survives in ((0.25, True), (1.0, False)):
        clock = FakeClock()
        cache, alloc = make_cache(pages=32, clock=clock, pin_share=share)
        hot = [100 + i for i in range(8)]                   # tenant A's hot prefix: 8 of 32 tokens
        admit(hot)
        for k in range(6):                                  # B: six 4-token prefixes, each pinned
            ids = [200 + 10 * k + i for i in range(4)]
            admit(ids)
            cache.pin(leaf(cache, ids), 4, 3600.0, tenant="B")
            admit(hot)                  # A keeps using its prefix
        assert cache.pinned_tokens == {"B": 8 if share == 0.25 else 24}
        assert cache.pin_refused == (4 if share == 0.25 else 0)
        for k in range(2):                                  # then 12 tokens of B's unpinned traffic
            admit([300 + 10 * k + i for i in range(6)])
        assert (cache.match(hot).prefix_len == 8) is survives
