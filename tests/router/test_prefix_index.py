"""The router's prefix indexes: the approximate per-worker radix (cache_aware, session) and the
exact global block index fed by KV events (kv_events). Exact expectations throughout."""

from __future__ import annotations

import random

import pytest

from tandem.router.prefix_index import (DEVICE, HOST, ApproxPrefixIndex, GlobalBlockIndex, KVEvent,
                                        block_hashes)


def check(idx: ApproxPrefixIndex) -> None:
    """Invariants: holdings are prefix-closed (a holder of a node holds its parent), edges are
    whole pages, no empty leaf lingers, and the per-worker sizes are the sums of held edges."""
    sizes: dict[int, int] = {}
    nodes: dict[int, int] = {}
    stack = list(idx.root.children.values())
    while stack:
        nd = stack.pop()
        assert len(nd.key) % idx.page_size == 0 and nd.key, nd.key
        assert nd.workers or nd.children, "an unheld leaf was not unlinked"
        if nd.parent is not idx.root:
            assert set(nd.workers) <= set(nd.parent.workers), "a hole: child held without parent"
        assert nd.end == (nd.parent.end if nd.parent is not idx.root else 0) + len(nd.key)
        for w in nd.workers:
            sizes[w] = sizes.get(w, 0) + len(nd.key)
            nodes[w] = nodes.get(w, 0) + 1
        stack.extend(nd.children.values())
    for w in set(sizes) | set(idx._size):
        assert idx.size(w) == sizes.get(w, 0), (w, idx.size(w), sizes.get(w, 0))
        assert idx._nodes.get(w, 0) == nodes.get(w, 0)
    if idx.capacity is not None:
        assert all(s <= idx.capacity for s in sizes.values())


# -- approximate index ---------------------------------------------------------------------------
def test_match_is_per_worker_longest_prefix():
    idx = ApproxPrefixIndex()
    idx.insert(0, [1, 2, 3, 4])
    idx.insert(1, [1, 2, 9])
    assert idx.match([1, 2, 3, 4, 5]) == {0: 4, 1: 2}
    assert idx.match([1, 2, 9, 9]) == {0: 2, 1: 3}
    assert idx.match([7]) == {}
    assert idx.match([]) == {}
    assert idx.size(0) == 4 and idx.size(1) == 3 and idx.size(5) == 0
    check(idx)


def test_match_mid_edge_and_short_key():
    idx = ApproxPrefixIndex()
    idx.insert(0, list(range(10)))
    assert idx.match([0, 1, 2]) == {0: 3}
    assert idx.match([0, 1, 2, 99]) == {0: 3}
    assert idx.num_nodes() == 1                 # match does not split
    idx.insert(1, [0, 1, 2, 99])
    assert idx.num_nodes() == 3                 # [0,1,2] -> {[3..9], [99]}
    assert idx.match(list(range(10))) == {0: 10, 1: 3}
    check(idx)


def test_pages_are_whole():
    idx = ApproxPrefixIndex(page_size=4)
    idx.insert(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])           # the trailing [9, 10] is dropped
    assert idx.size(0) == 8
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 0]) == {0: 4}     # divergence inside page 2
    assert idx.match([1, 2, 3, 0]) == {}                      # inside page 1: nothing
    idx.insert(1, [1, 2, 3, 4, 5, 6, 7, 0])
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 8]) == {0: 8, 1: 4}
    check(idx)


def test_accepts_tuples_and_lists_alike():
    idx = ApproxPrefixIndex()
    idx.insert(0, (5, 6, 7))
    assert idx.match([5, 6, 7]) == {0: 3}
    idx.insert(1, [5, 6])
    assert idx.match((5, 6, 7)) == {0: 3, 1: 2}


def test_eviction_lru_leaf_first_per_worker():
    idx = ApproxPrefixIndex(capacity=6)
    idx.insert(0, [1, 2, 3])            # t1
    idx.insert(0, [1, 2, 4])            # t2: [1,2] shared, leaves [3] (t1) and [4] (t2)
    idx.insert(1, [1, 2, 3])            # worker 1 does not count against worker 0
    assert idx.size(0) == 4
    idx.insert(0, [8, 9, 10])           # 7 > 6: the oldest leaf of worker 0 ([3], t1) goes
    assert idx.size(0) == 6
    assert idx.match([1, 2, 3]) == {0: 2, 1: 3}
    assert idx.match([1, 2, 4]) == {0: 3, 1: 2}
    idx.insert(0, [1, 2, 4, 5, 6])      # +2 -> 8: [8,9,10] (t3) is now the oldest
    assert idx.match([8, 9, 10]) == {}
    assert idx.size(0) == 5
    check(idx)


def test_touch_protects_parents_and_reorders():
    idx = ApproxPrefixIndex(capacity=5)
    idx.insert(0, [1, 2, 3])
    idx.insert(0, [7, 8])
    idx.insert(0, [1, 2, 3])            # touched again: [7, 8] is older now
    idx.insert(0, [1, 2, 5])            # 6 > 5: [7, 8] goes, not [1, 2]
    assert idx.match([7, 8]) == {}
    assert idx.match([1, 2, 3]) == {0: 3} and idx.match([1, 2, 5]) == {0: 3}
    check(idx)


def test_a_key_longer_than_capacity_keeps_its_prefix():
    idx = ApproxPrefixIndex(capacity=4)
    idx.insert(0, [1, 2, 3, 4, 5, 6])   # one edge of 6 > 4: the whole (leaf) edge goes
    assert idx.size(0) == 0 and idx.match([1, 2]) == {}
    check(idx)


def test_remove_worker():
    idx = ApproxPrefixIndex()
    idx.insert(0, [1, 2, 3])
    idx.insert(1, [1, 2, 4])
    idx.remove_worker(0)
    assert idx.match([1, 2, 3]) == {1: 2}
    assert idx.size(0) == 0 and idx.num_nodes() == 2
    idx.remove_worker(1)
    assert idx.num_nodes() == 0
    idx.remove_worker(7)                # unknown: no-op
    check(idx)


def test_insert_after_match_uses_the_walk_and_stays_exact():
    idx = ApproxPrefixIndex(capacity=50)
    rng = random.Random(0)
    for step in range(400):
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        w = rng.randrange(3)
        if rng.random() < 0.5:
            idx.match(key)              # insert right after a match reuses its walk
        idx.insert(w, key)
        if step % 50 == 49:
            idx.remove_worker(rng.randrange(3))
        check(idx)
        got = idx.match(key)
        assert got.get(w) == len(key) or idx.size(w) < len(key) or len(key) > 50


def test_bad_arguments():
    with pytest.raises(ValueError):
        ApproxPrefixIndex(page_size=0)
    with pytest.raises(ValueError):
        ApproxPrefixIndex(page_size=4, capacity=2)


# -- exact global index --------------------------------------------------------------------------
def test_block_hashes_match_the_cache_publisher():
    from tandem.cache.radix.events import page_hashes

    toks = list(range(100, 140))
    assert block_hashes(toks, 16) == page_hashes(toks, 16)
    assert len(block_hashes(toks, 16)) == 2                      # the partial block is ignored
    hs = block_hashes(toks, 8)
    assert block_hashes(toks[16:], 8, parent=hs[1]) == hs[2:]   # the chain continues
    assert block_hashes([5, 6, 7], 1) == page_hashes([5, 6, 7], 1)


def test_apply_store_remove_overlap():
    g = GlobalBlockIndex()
    g.apply(KVEvent(0, "stored", (11, 12, 13), 48))
    g.apply(KVEvent(1, "stored", (11, 12), 32))
    g.apply(KVEvent(2, "stored", (11, 12, 13), 48, HOST))
    assert g.overlap([11, 12, 13, 14]) == {0: (3, 0), 1: (2, 0), 2: (0, 3)}
    assert g.overlap([12, 13]) == {0: (2, 0), 1: (1, 0), 2: (0, 2)}   # a hash names its prefix
    assert g.overlap([99, 11]) == {}
    g.apply(KVEvent(0, "removed", (13,), 16))
    assert g.overlap([11, 12, 13]) == {0: (2, 0), 1: (2, 0), 2: (0, 3)}
    assert g.holders(13) == {2: HOST}
    assert g.blocks_held(0) == 2 and g.blocks_held(2, HOST) == 3
    g.apply(KVEvent(1, "removed", (99,), 16))                      # unknown block: ignored
    assert g.applied == 5


def test_device_run_then_host_blocks():
    g = GlobalBlockIndex()
    g.apply(KVEvent(3, "stored", (1, 2), 32))
    g.apply(KVEvent(3, "stored", (2, 3), 32, HOST))                # 2 on both tiers
    assert g.holders(2) == {3: DEVICE}
    assert g.overlap([1, 2, 3]) == {3: (2, 1)}
    g.apply(KVEvent(3, "removed", (1,), 16))                       # a device hole at block 0
    assert g.overlap([1, 2, 3]) == {}
    g.apply(KVEvent(3, "stored", (1,), 16, HOST))
    assert g.overlap([1, 2, 3]) == {3: (0, 3)}


def test_cleared_and_remove_worker():
    g = GlobalBlockIndex()
    g.apply(KVEvent(0, "stored", (1, 2), 32))
    g.apply(KVEvent(1, "stored", (1,), 16))
    g.apply(KVEvent(0, "cleared"))
    assert g.overlap([1, 2]) == {1: (1, 0)}
    g.remove_worker(1)
    assert g.overlap([1, 2]) == {} and g.num_blocks() == 0


def test_vllm_wire_events_and_errors():
    from tandem.router.kv_wire import parse_event

    e = parse_event(4, ["BlockStored", [7, 8], 6, [0] * 32, 16, None, "CPU", None])
    assert e == KVEvent(4, "stored", (7, 8), 32, HOST, 6)
    assert parse_event(1, ["BlockRemoved", [7], "GPU"]) == KVEvent(1, "removed", (7,), 0, DEVICE)
    assert parse_event(1, ["BlockRemoved", [b"\x00" * 24 + (7).to_bytes(8, "big")], None]).block_hashes == (7,)
    assert parse_event(1, ["AllBlocksCleared"]).kind == "cleared"
    for bad in (["BlockMoved"], {"type": "stored"}, ["BlockStored", [1], None, [0], 1, None, "disk"],
                ["BlockRemoved", [True]]):
        with pytest.raises(ValueError):
            parse_event(1, bad)
    g = GlobalBlockIndex()
    with pytest.raises(ValueError):
        g.apply(KVEvent(0, "stored", (1,), 16, "disk"))
    with pytest.raises(ValueError):
        g.apply(KVEvent(-1, "stored", (1,), 16))


def test_overlap_matches_the_cache_events_end_to_end():
    """A simulated cache publishing to the index through the wire format (the cache's encoder,
    the router's decoder): overlap equals what the cache matches."""
    from tandem.cache.radix.events import encode
    from tandem.cache.unified import UnifiedRadixCache
    from tandem.router.kv_wire import decode_payload

    g = GlobalBlockIndex()

    class Sink:
        def publish(self, events):
            g.apply_all(decode_payload(0, encode(0.0, events)))

    cache = UnifiedRadixCache.simulated(page_size=2, capacity_tokens=8, events=Sink())
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 9, 9])
    for key in ([1, 2, 3, 4, 5, 6], [1, 2, 9, 9], [1, 2, 3, 4]):
        want = len(cache.match(key).device_indices) // 2
        assert g.overlap(block_hashes(key, 2)).get(0, (0, 0))[0] == want


@pytest.mark.parametrize("page_size", [1, 2])
def test_match_agrees_with_brute_force(page_size):
    """Without eviction, a worker's match is the longest page-aligned common prefix of the
    query with any key routed to it."""
    rng = random.Random(page_size)
    idx = ApproxPrefixIndex(page_size=page_size)
    routed: dict[int, list[list[int]]] = {}
    for _ in range(300):
        key = [rng.randrange(3) for _ in range(rng.randrange(0, 14))]
        if rng.random() < 0.6:
            w = rng.randrange(4)
            idx.match(key)
            idx.insert(w, key)
            routed.setdefault(w, []).append(key)
        want = {}
        for w, keys in routed.items():
            best = 0
            for k in keys:
                n = 0
                while n < min(len(k), len(key)) and k[n] == key[n]:
                    n += 1
                best = max(best, n - n % page_size)
            if best:
                want[w] = best
        assert idx.match(key) == want
    check(idx)
