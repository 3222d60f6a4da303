"""core/page_hash.py: the one page hash chain and page-aligned edge compare. The hashes are a
wire contract (KV events carry them; the router matches them), so their values are pinned here:
the numbers below were captured from the cache's and the router's own copies before the two
were merged into core/, and a change to the chain fails this file."""

from __future__ import annotations

import random

import pytest

from tandem.core import page_hash
from tandem.core.page_hash import common_pages, page_hashes

# (tokens, page_size, parent) -> the chain, as published before the merge.
PINNED = [
    ((list(range(100, 140)), 16, None), [3981396939599135624, 8466188696471549218]),
    ((list(range(100, 164)), 16, None), [3981396939599135624, 8466188696471549218,
                                         10336898651711750996, 4551005050435914010]),
    (([1, 2, 3, 4, 5], 2, None), [11868681386100499350, 12340372733252014964]),
    (([1, 2, 5, 6], 2, None), [11868681386100499350, 4336945091464624589]),
    (([5, 6, 7], 1, None), [9699811644867543237, 15726718639950219793, 10768570270613531592]),
    (([3, 4], 2, 12345), [1239363859405178193]),
    (([0, -1, 2**40, 7], 2, None), [15686606282002403806, 17889993094767404697]),
    (([1, 2, 3, 4], 2, 2**64 - 1), [6693850774508069708, 9497900693603352963]),
]


@pytest.mark.parametrize("args,want", PINNED)
def test_page_hashes_are_pinned(args, want):
    assert page_hashes(*args) == want


def test_router_and_cache_hash_pages_with_the_one_function():
    from tandem.cache.radix import events
    from tandem.cache.radix.tree import RadixTree
    from tandem.router import prefix_index
    from tandem.router.prefix_index import GlobalBlockIndex, KVEvent

    assert prefix_index.block_hashes is page_hash.page_hashes
    assert events.page_hashes is page_hash.page_hashes

    # What the cache publishes for two keys sharing a page is what the router computes.
    tree = RadixTree(page_size=2, record_events=True)
    tree.insert([1, 2, 3, 4], None)
    tree.insert([1, 2, 5, 6], None)
    stored = tree.events
    assert [e.block_hashes for e in stored] == [[11868681386100499350, 12340372733252014964],
                                                [4336945091464624589]]
    assert stored[1].parent_block_hash == 11868681386100499350
    g = GlobalBlockIndex()
    for e in stored:
        g.apply(KVEvent(0, "stored", tuple(e.block_hashes), len(e.token_ids)))
    assert g.overlap(prefix_index.block_hashes([1, 2, 5, 6, 7, 8], 2)) == {0: (2, 0)}
    assert g.overlap(prefix_index.block_hashes([1, 2, 3, 4], 2)) == {0: (2, 0)}


@pytest.mark.parametrize("ps", [1, 2, 4])
def test_common_pages_is_the_page_aligned_common_prefix(ps):
    rng = random.Random(ps)
    for _ in range(300):
        edge = [rng.randrange(3) for _ in range(ps * rng.randrange(1, 8))]
        key = edge[:ps] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        pos = ps * rng.randrange(0, 3)
        key = [9] * pos + key
        key = key[:len(key) - len(key) % ps]
        for seq in (list, tuple):
            e, k = seq(edge), seq(key)
            n = min(len(e), len(k) - pos)
            m = 0
            while m < n and e[m] == k[pos + m]:
                m += 1
            want = n if m == n else m - m % ps
            assert common_pages(e, k, pos, len(k), ps) == want
