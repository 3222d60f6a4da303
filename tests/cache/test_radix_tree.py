"""Tree core through the public API: exact slot ids, splits, duplicates, locks, eviction order.

Every cache here runs check() after every public operation (debug_invariants)."""

from __future__ import annotations

import pytest
import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.req_to_token import ReqToTokenPool
from tandem.cache.null import NullCache
from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import CacheConfig

from cache_support import make_cache, run_request


def T(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_paged_insert_match_and_split_pin_slot_ids():
    cache, alloc = make_cache(page_size=4, pages=8)
    ids = list(range(100, 110))                       # 10 tokens: 2 whole pages + 2
    slots = alloc.alloc(10)                           # pages 1, 2, 3 -> slots 4..13
    assert slots.tolist() == list(range(4, 14))
    indices, node = cache.cache(ids, slots, None)
    assert indices.tolist() == list(range(4, 12))     # whole pages only
    assert (node.start, node.end) == (0, 8)
    assert cache.stats().device == 8 and cache.stats().protected == 8   # the lock moved to node
    cache.unlock(node)
    alloc.free(slots[8:])                             # the request's partial page
    assert cache.stats().evictable == 8 and cache.stats().protected == 0

    r = cache.match(ids)
    assert r.prefix_len == 8 and r.device_indices.tolist() == list(range(4, 12))
    # Diverge inside the second page: only the first page matches; the edge splits at 4.
    r = cache.match([100, 101, 102, 103, 104, 105, 0, 0, 9])
    assert r.prefix_len == 4 and r.device_indices.tolist() == [4, 5, 6, 7]
    assert (r.last_device_node.start, r.last_device_node.end) == (0, 4)
    # The old handle still names the lower half, and the whole prefix still matches.
    assert (node.start, node.end) == (4, 8) and node.parent is r.last_device_node
    assert cache.match(ids).device_indices.tolist() == list(range(4, 12))
    # Unaligned keys are truncated to whole pages.
    assert cache.match(ids[:7]).prefix_len == 4


def test_insert_reports_cached_length_and_cache_frees_duplicates():
    cache, alloc = make_cache(page_size=1, pages=16)
    a = alloc.alloc(6)                                # 1..6
    b = alloc.alloc(6)                                # 7..12 (computed the same prompt concurrently)
    ids = [5, 6, 7, 8, 9, 10]
    assert cache.insert(ids, a) == 0
    assert cache.insert(ids[:4], b) == 4              # all cached: b[:4] are duplicates
    # cache() does it for the engine: b's duplicates are freed, canonical slots returned.
    indices, node = cache.cache(ids + [11, 12], torch.cat([b, alloc.alloc(2)]), None)
    assert indices.tolist() == [1, 2, 3, 4, 5, 6, 13, 14]
    assert all(not alloc.is_allocated(s) for s in b.tolist())
    cache.unlock(node)
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))  # exact ownership


def test_insert_keeps_a_private_copy_of_the_slots():
    cache, alloc = make_cache()
    slots = alloc.alloc(3)
    cache.insert([1, 2, 3], slots)
    slots[:] = 0                                      # the caller reuses its buffer
    assert cache.match([1, 2, 3]).device_indices.tolist() == [1, 2, 3]


def test_lru_eviction_order_and_cascade():
    cache, alloc = make_cache(pages=32)
    run_request(cache, alloc, [1, 2, 3, 4])           # slots 1..4
    run_request(cache, alloc, [1, 2, 5, 6])           # shares [1, 2]; slots 5, 6
    run_request(cache, alloc, [7, 8, 9])              # slots 7..9
    cache.match([1, 2, 3, 4])                  # [3, 4] is now the most recent leaf
    # Least recent first: [5, 6], then [7, 8, 9]; [3, 4] and its parent [1, 2] survive.
    assert cache.evict(3) == 5
    assert [alloc.is_allocated(s) for s in range(1, 10)] == [True] * 4 + [False] * 5
    assert cache.match([1, 2, 5, 6]).prefix_len == 2
    # Cascade: evicting the last leaf makes [1, 2] a leaf, evicted in the same pass.
    assert cache.evict(4) == 4
    assert cache.stats().device == 0 and alloc.available_size() == 32


def test_locked_path_is_not_evicted():
    cache, alloc = make_cache()
    run_request(cache, alloc, [1, 2, 3, 4])
    run_request(cache, alloc, [1, 2, 9])
    r = cache.match([1, 2, 3, 4])
    cache.lock(r.last_device_node)
    assert (cache.stats().evictable, cache.stats().protected) == (1, 4)
    assert cache.evict(100) == 1                      # only [9]
    assert cache.match([1, 2, 3, 4]).prefix_len == 4
    cache.unlock(r.last_device_node)
    assert cache.evict(100) == 4
    with pytest.raises(ValueError, match="not in this tree"):
        cache.unlock(r.last_device_node)


def test_unlock_of_unlocked_node_raises():
    cache, alloc = make_cache()
    run_request(cache, alloc, [1, 2])
    node = cache.match([1, 2]).last_device_node
    with pytest.raises(ValueError, match="lock_ref is already 0"):
        cache.unlock(node)


@pytest.mark.parametrize("policy, order", [
    ("lru", "CAB"),           # least recently used first
    ("fifo", "ABC"),          # oldest insert first, however hot
    ("lfu", "BAC"),           # fewest hits (B: 1, A: 2, C: 3)
    ("priority", "ACB"),      # lowest priority (A: 1), then LRU
    ("slru", "BCA"),          # probationary (< 2 hits: B) first, then LRU among the protected
])
def test_policy_eviction_order(policy, order):
    cache, alloc = make_cache(policy=policy)
    held = {"A": run_request(cache, alloc, [10, 11], priority=1),
            "B": run_request(cache, alloc, [20, 21], priority=5),
            "C": run_request(cache, alloc, [30, 31], priority=5)}
    cache.match([30, 31])
    cache.match([30, 31])
    cache.match([10, 11])
    dup = alloc.alloc(2)
    assert cache.insert([20, 21], dup) == 2                  # touches B without a hit
    alloc.free(dup)
    evicted = ""
    for _ in range(3):
        assert cache.evict(1) == 2
        evicted += next(k for k, v in held.items()
                        if k not in evicted and not alloc.is_allocated(int(v[0])))
    assert evicted == order


def test_session_policy_evicts_ended_sessions_first(clock):
    cache, alloc = make_cache(policy="session", session_ttl_s=10.0, clock=clock)
    run_request(cache, alloc, [1, 1], session_id="a")        # a: oldest, but stays active
    clock.t = 5
    run_request(cache, alloc, [2, 2], session_id="b")
    run_request(cache, alloc, [3, 3])                         # no session: counts as ended
    clock.t = 12                                              # b seen 7 s ago, a 12 s ago
    cache.match([9], session_id="a")                   # a is active again
    # Ended (no session, then LRU) first; active sessions' entries are evicted last, not never.
    assert cache.evict(1) == 2 and cache.match([3, 3]).prefix_len == 0
    clock.t = 16                                              # b: 11 s > ttl -> ended
    assert cache.evict(1) == 2 and cache.match([2, 2]).prefix_len == 0
    assert cache.match([1, 1]).prefix_len == 2
    assert cache.evict(1) == 2                                # not a pin


def test_simulated_mode_positions_and_capacity():
    cache = UnifiedRadixCache.simulated(page_size=2, capacity_tokens=8, debug_invariants=True)
    assert cache.insert([1, 2, 3, 4, 5]) == 0                 # 4 tokens cached
    r = cache.match([1, 2, 3, 4, 9, 9])
    assert r.prefix_len == 4 and r.device_indices.tolist() == [0, 1, 2, 3]
    assert cache.insert([7, 7, 7, 7]) == 0
    assert cache.insert([8, 8, 8, 8]) == 0                    # over 8: evicts the LRU leaf
    assert cache.stats().device == 8
    assert cache.match([1, 2, 3, 4]).prefix_len == 0
    assert r.best_match_node is r.last_device_node is r.last_host_node and r.host_hit_length == 0


def test_null_cache_misses_keeps_nothing_and_proves_exact_ownership():
    alloc = PagedAllocator(8, 1)
    cache = NullCache(alloc)
    slots = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    assert alloc.available_size() == 8                        # the cache took and freed them
    slots = alloc.alloc(4)
    r = cache.match([1, 2, 3, 4])
    assert r.prefix_len == 0 and len(r.device_indices) == 0 and r.last_device_node is None
    called = []
    indices, node = cache.cache([1, 2, 3, 4], slots, None, extra=lambda: called.append(1))
    assert len(indices) == 0 and node is None and not called     # the request keeps its slots
    assert alloc.available_size() == 4 and cache.evict(10) == 0 and cache.peek([1, 2]) == 0
    cache.check(extra_owned=slots)
    with pytest.raises(AssertionError, match="leak"):
        cache.check(extra_owned=slots[:2])


def test_cache_moves_the_lock_and_returns_canonical_slots():
    alloc = PagedAllocator(16, 2)
    pool = ReqToTokenPool(4, 32)
    cache = UnifiedRadixCache(CacheConfig(page_size=2, debug_invariants=True), alloc)
    run_request(cache, alloc, [1, 2, 3, 4])                   # slots 2..5
    row = pool.alloc()
    r = cache.match([1, 2, 3, 4, 5, 6, 7])
    cache.lock(r.last_device_node)
    own = alloc.alloc(3)                                      # pages 3, 4 -> 6, 7, 8
    pool.write(row, 0, torch.cat([r.device_indices, own]))
    slots = pool.read(row, 0, 7)
    indices, node = cache.cache([1, 2, 3, 4, 5, 6, 7], slots, r.last_device_node)
    assert indices.tolist() == [2, 3, 4, 5, 6, 7]
    assert node.end == 6 and node.lock_ref == 1 and r.last_device_node.lock_ref == 1
    cache.check(extra_owned=T(8))                      # the partial page is the row's
    with pytest.raises(AssertionError, match="leak"):
        cache.check(extra_owned=T())
    cache.unlock(node)


def test_peek_changes_nothing_and_agrees_with_match():
    cache, alloc = make_cache()
    run_request(cache, alloc, [1, 2, 3, 4, 5, 6])
    before = cache.stats()
    nodes = len(list(_nodes(cache)))
    assert cache.peek([1, 2, 3, 9]) == 3                      # inside an edge: no split
    assert len(list(_nodes(cache))) == nodes and cache.stats() == before
    assert cache.peek([1, 2, 3, 9]) == cache.match([1, 2, 3, 9]).prefix_len
    assert len(list(_nodes(cache))) == nodes + 1              # match split the edge


def _nodes(cache):
    stack = [cache._tree.root]
    while stack:
        nd = stack.pop()
        yield nd
        stack.extend(nd.children.values())


def test_check_reports_corruption():
    cache, alloc = make_cache()
    run_request(cache, alloc, [1, 2, 3])
    cache._tree.evictable += 1
    with pytest.raises(AssertionError, match=r"evictable=4 protected=0 != recount 3/0"):
        cache.check()
    cache._tree.evictable -= 1
    node = cache.match([1, 2, 3]).last_device_node
    node.value = torch.tensor([1, 2, 60])                     # a slot the allocator has free
    with pytest.raises(AssertionError, match="free"):
        cache.check()


def test_misuse_raises_with_numbers():
    cache, alloc = make_cache()
    with pytest.raises(ValueError, match="needs the slot ids"):
        cache.insert([1, 2])
    with pytest.raises(ValueError, match="2 slots for 3"):
        cache.insert([1, 2, 3], alloc.alloc(2))
    with pytest.raises(ValueError, match="unknown component"):
        cache.evict(1, component="swa")


def test_priority_propagates_up_the_path():
    cache, alloc = make_cache(policy="priority")
    run_request(cache, alloc, [1, 2, 3], priority=0)
    run_request(cache, alloc, [1, 2, 4], priority=7)          # shares [1, 2]: it gets 7 too
    run_request(cache, alloc, [5, 6], priority=3)
    shared = cache.match([1, 2]).last_device_node
    assert shared.priority == 7
    assert cache.evict(1) == 1 and cache.match([1, 2, 3]).prefix_len == 2  # [3]: priority 0
    assert cache.evict(1) == 2 and cache.match([5, 6]).prefix_len == 0     # then [5, 6]: 3


def test_eviction_heap_is_compacted():
    cache, alloc = make_cache()
    run_request(cache, alloc, [1, 2])
    run_request(cache, alloc, [3, 4])
    for _ in range(600):                                      # every touch re-keys the leaf
        cache._debug = False
        cache.match([1, 2])
    tree = cache._tree
    assert len(tree.leaves.heap) <= 2 * len(tree.leaves.nodes) + 256
    cache.check()
    assert cache.evict(1) == 2 and cache.match([1, 2]).prefix_len == 2


def test_match_can_raise_priority():
    cache, alloc = make_cache(policy="priority")
    run_request(cache, alloc, [1, 2], priority=0)
    run_request(cache, alloc, [3, 4], priority=1)
    cache.match([1, 2], priority=9)
    assert cache.evict(1) == 2 and cache.match([3, 4]).prefix_len == 0
