"""SWA and MAMBA components: votes, tombstones, revival, component locks across splits, state
checkpoints and copy-on-claim. Real allocators for every pool; exact slot/row ids."""

from __future__ import annotations

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.radix.components import FULL, SWA, Mamba, StateCopy

from cache_support import make_cache

NONE = {"full": torch.empty(0, dtype=torch.int64), "swa": torch.empty(0, dtype=torch.int64),
        "mamba": torch.empty(0, dtype=torch.int64)}


def swa_cache(window=4, pages=64):
    swa_alloc = PagedAllocator(pages, 1)
    index_map = torch.zeros(pages + 1, dtype=torch.int64)   # engine's full slot -> SWA row
    swa = SWA(window, swa_alloc, index_map)
    cache, alloc = make_cache(pages=pages, components=(FULL, swa))
    return cache, alloc, swa_alloc, index_map


def compute(alloc, swa_alloc, index_map, n):
    """An engine computing n new tokens: full slots, SWA rows, and the map between them."""
    full, rows = alloc.alloc(n), swa_alloc.alloc(n)
    index_map[full] = rows
    return full, rows


def test_swa_window_vote_tombstones_and_released_rows():
    cache, alloc, swa_alloc, index_map = swa_cache()
    ids = list(range(100, 112))
    full, rows = compute(alloc, swa_alloc, index_map, 12)           # slots 1..12, rows 1..12
    swa_alloc.free(rows[:6])                                         # left the window while decoding
    rows[:6] = -1
    indices, node = cache.cache(ids, full, None, extra={"swa": rows})
    cache.unlock(node)
    assert indices.tolist() == list(range(1, 13))
    # [0, 6) is a tombstone (its own node), [6, 12) keeps rows 7..12.
    r = cache.match(ids)
    assert r.prefix_len == 12
    assert r.components["swa"].tolist() == [-1] * 6 + list(range(7, 13))
    # A boundary at 8 has only 2 SWA tokens behind it (window 4): rejected, and so is 6.
    assert cache.match(ids[:8] + [0, 0]).prefix_len == 0
    r = cache.match(ids[:10] + [0])
    assert r.prefix_len == 10 and r.device_indices.tolist() == list(range(1, 11))
    # SWA eviction tombstones the least recent SWA data ([10, 12)); FULL KV stays.
    assert cache.evict(2, component="swa") == 2
    assert not swa_alloc.is_allocated(11) and not swa_alloc.is_allocated(12)
    assert cache.stats().device == 12 and cache.match(ids).prefix_len == 10
    cache.check(extra_owned=NONE)


def test_swa_revival_rewrites_the_index_map():
    cache, alloc, swa_alloc, index_map = swa_cache()
    ids = list(range(100, 112))
    full, rows = compute(alloc, swa_alloc, index_map, 12)
    _, node = cache.cache(ids, full, None, extra={"swa": rows})
    cache.unlock(node)
    cache.match(ids[:10] + [0])                               # split at 10
    cache.match(ids[:10])                                     # [10, 12) least recent
    assert cache.evict(2, component="swa") == 2                      # rows 11, 12 released
    r = cache.match(ids)
    assert r.prefix_len == 10
    # A second request recomputes [10, 12) under its own slots 13, 14 and rows 13, 14.
    cache.lock(r.last_device_node)
    own_full, own_rows = compute(alloc, swa_alloc, index_map, 2)
    slots = torch.cat([r.device_indices, own_full])
    swa_rows = torch.cat([r.components["swa"], own_rows])
    indices, node = cache.cache(ids, slots, r.last_device_node, extra={"swa": swa_rows})
    cache.unlock(node)
    # FULL: the tree's slots 11, 12 stay canonical; 13, 14 were duplicates (freed).
    assert indices.tolist() == list(range(1, 13)) and not alloc.is_allocated(13)
    # SWA: the tombstone adopted rows 13, 14, reached through the tree's full slots 11, 12.
    assert index_map[11:13].tolist() == [13, 14]
    r = cache.match(ids)
    assert r.prefix_len == 12 and r.components["swa"][-2:].tolist() == [13, 14]
    cache.check(extra_owned=NONE)


def test_swa_lock_covers_the_window_and_survives_splits():
    cache, alloc, swa_alloc, index_map = swa_cache()
    ids = list(range(100, 112))
    full, rows = compute(alloc, swa_alloc, index_map, 12)
    _, node = cache.cache(ids, full, None, extra={"swa": rows})
    cache.unlock(node)
    cache.match(ids[:10] + [0])                               # nodes [0, 10), [10, 12)
    leaf = cache.match(ids).last_device_node
    cache.lock(leaf)                                         # window [8, 12)
    assert cache.stats().components["swa"][1] == 12                         # [0, 10) reaches into it
    # Split the locked [0, 10) below the window: the upper half [0, 7) is outside it.
    up = cache.match(ids[:7] + [0]).last_device_node
    assert (up.start, up.end) == (0, 7) and up.aux_lock[0] == {}
    assert cache.stats().components["swa"][1] == 5 and cache.stats().components["swa"][0] == 7
    assert cache.evict(100, component="swa") == 7                    # only [0, 7)
    assert cache.match(ids).prefix_len == 12                  # the window is intact
    cache.unlock(leaf)
    assert cache.stats().components["swa"][1] == 0 and cache.stats().protected == 0
    assert cache.evict(100) == 12 and swa_alloc.available_size() == 64
    cache.check(extra_owned=NONE)


def mamba_cache(pages=32):
    states = PagedAllocator(16, 1)
    cache, alloc = make_cache(pages=pages, components=(FULL, Mamba(states)))
    return cache, alloc, states


def test_mamba_state_only_at_exact_checkpoints():
    cache, alloc, states = mamba_cache()
    a = list(range(10, 18))
    s1 = int(states.alloc(1))                                        # the request's private row 1
    _, node = cache.cache(a, alloc.alloc(8), None, extra={"mamba": s1})
    cache.unlock(node)
    r = cache.match(a)
    assert r.prefix_len == 8 and r.components["mamba"] == StateCopy(src=1)
    # Diverging at 5 splits the edge; the state belongs to the end (8), so 5 is no checkpoint.
    r = cache.match(a[:5] + [0])
    assert r.prefix_len == 0 and r.components["mamba"] is None and r.best_match_node.end == 0
    # B computes everything (nothing reusable) and checkpoints at its own end.
    b = a[:5] + [7, 7]
    s2 = int(states.alloc(1))
    slots = alloc.alloc(7)                                           # 9..15
    indices, node = cache.cache(b, slots, None, extra={"mamba": s2})
    cache.unlock(node)
    assert indices.tolist() == [1, 2, 3, 4, 5, 14, 15]               # 9..13 were duplicates
    assert cache.match(b).components["mamba"] == StateCopy(src=2)
    # A checkpoint for a prefix that already has one is a duplicate: its row is freed.
    s3 = int(states.alloc(1))
    dup = alloc.alloc(8)
    _, node = cache.cache(a, dup, None, extra={"mamba": s3})
    cache.unlock(node)
    assert not states.is_allocated(s3) and cache.match(a).components["mamba"].src == 1
    cache.check(extra_owned=NONE)


def test_mamba_eviction_and_locks():
    cache, alloc, states = mamba_cache()
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for ids in (a, b):
        _, node = cache.cache(ids, alloc.alloc(4), None, extra={"mamba": int(states.alloc(1))})
        cache.unlock(node)
    held = cache.match(b).last_device_node
    cache.lock(held)
    assert cache.evict(5, component="mamba") == 1                    # a's state; b's is locked
    assert cache.match(a).prefix_len == 0 and cache.stats().device == 8
    assert cache.stats().components["mamba"][0] == 0 and cache.stats().components["mamba"][1] == 1
    cache.unlock(held)
    assert cache.evict(100) == 8 and states.available_size() == 16   # FULL eviction drops states
    cache.check(extra_owned=NONE)


def test_swa_and_mamba_vote_together():
    swa_alloc, states = PagedAllocator(64, 1), PagedAllocator(16, 1)
    cache, alloc = make_cache(components=(FULL, SWA(4, swa_alloc), Mamba(states)))
    ids = list(range(20, 32))
    full, rows = alloc.alloc(12), swa_alloc.alloc(12)
    _, node = cache.cache(ids[:6], full[:6], None,
                              extra={"swa": rows[:6], "mamba": int(states.alloc(1))})
    _, node = cache.cache(ids, full, node, extra={"swa": rows, "mamba": int(states.alloc(1))})
    cache.unlock(node)
    assert cache.match(ids[:9]).prefix_len == 6               # mamba: checkpoints 6, 12
    cache.lock(node)                                         # SWA window [8, 12)
    assert cache.evict(100, component="swa") == 6                    # [0, 6): outside it
    r = cache.match(ids)
    assert r.prefix_len == 12 and r.components["mamba"] == StateCopy(2)
    assert cache.match(ids[:9]).prefix_len == 0               # 6: SWA tombstone now
    cache.unlock(node)
    cache.check(extra_owned=NONE)


def test_swa_released_prefix_already_cached_by_another_request():
    cache, alloc, swa_alloc, index_map = swa_cache()
    ids = list(range(40, 50))
    # Two requests compute the same 10 tokens concurrently; the second released rows [0, 4).
    full_a, rows_a = compute(alloc, swa_alloc, index_map, 10)
    full_b, rows_b = compute(alloc, swa_alloc, index_map, 10)
    _, node = cache.cache(ids, full_a, None, extra={"swa": rows_a})
    cache.unlock(node)
    swa_alloc.free(rows_b[:4])
    rows_b[:4] = -1
    indices, node = cache.cache(ids, full_b, None, extra={"swa": rows_b})
    cache.unlock(node)
    # All of b's slots and remaining rows were duplicates: freed; a's stay canonical.
    assert indices.tolist() == full_a.tolist()
    assert not any(alloc.is_allocated(s) for s in full_b.tolist())
    assert not any(swa_alloc.is_allocated(s) for s in rows_b[4:].tolist())
    assert cache.match(ids).components["swa"].tolist() == rows_a.tolist()
    cache.check(extra_owned=NONE)


def test_a_pinned_prefix_keeps_its_swa_rows_while_anything_unpinned_is_left():
    """Issue 52 on hybrid models: component data of pinned nodes is evicted after every unpinned
    node's, so a pinned prefix keeps the SWA rows its reuse depth needs (the window's vote)."""
    cache, alloc, swa_alloc, index_map = swa_cache()
    a, b = list(range(100, 108)), list(range(200, 208))
    for ids in (a, b):
        full, rows = compute(alloc, swa_alloc, index_map, 8)
        _, node = cache.cache(ids, full, None, extra={"swa": rows})
        cache.unlock(node)
    cache.match(b)                                            # b most recent: a would go first
    assert cache.pin(cache.match(a).last_device_node, 8, 300.0) == 8
    assert cache.evict(8, component="swa") == 8               # b's rows go, not the older a's
    assert cache.match(a).prefix_len == 8 and cache.match(b).prefix_len == 0
    assert cache.evict(8, component="swa") == 8               # nothing unpinned left: a's go too
    assert cache.match(a).prefix_len == 0
    cache.check(extra_owned=NONE)
