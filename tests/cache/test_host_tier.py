"""Host tier (L2) with real KV tensors on the CPU: write-through, write-back, load-back,
host eviction, and the retraction backup/restore round trip. KV of a slot holding token t is
filled with t, so a copy in the wrong place shows up as a wrong number."""

from __future__ import annotations

import pytest
import torch

from tandem.cache.kv_pool import KVPool
from tandem.cache.tiers.host import HostTier

from cache_support import make_cache


def setup(policy: str, host_tokens: int = 16, page_size: int = 2, pages: int = 16):
    pool = KVPool(pages * page_size, page_size, num_layers=2, num_kv_heads=1, head_dim=2)
    host = HostTier(pool, host_tokens, policy)
    cache, alloc = make_cache(page_size=page_size, pages=pages, host=host)
    return cache, alloc, pool, host


def compute(pool, alloc, ids):
    slots = alloc.alloc(len(ids))
    pool.kv_data[:, :, slots] = torch.tensor(ids, dtype=pool.dtype)[:, None, None]
    return slots


def kv_tokens(kv_data, slots):
    return kv_data[0, 1, slots, 0, 0].to(torch.int64).tolist()     # layer 0, V, head 0, dim 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evict_to_host_then_restore(policy):
    cache, alloc, pool, host = setup(policy)
    ids = [11, 12, 13, 14, 15, 16, 17, 18]
    slots = compute(pool, alloc, ids)                                # pages 1..4 -> slots 2..9
    _, node = cache.cache(ids, slots, None)
    cache.unlock(node)
    assert (node.host is not None) == (policy == "write_through")
    assert cache.evict(8) == 8                                       # write_back copies here
    assert cache.stats().device == 0 and cache.stats().host == 8
    assert kv_tokens(host.pool.kv_data, node.host) == ids
    r = cache.match(ids)
    assert r.prefix_len == 0 and r.last_device_node.end == 0
    assert r.best_match_node is node and r.last_host_node is node and r.host_hit_length == 8
    indices = cache.host.restore(r.best_match_node)
    assert indices.tolist() == list(range(10, 18))                   # fresh pages 5..8
    assert kv_tokens(pool.kv_data, indices) == ids
    r = cache.match(ids)
    assert r.prefix_len == 8 and r.host_hit_length == 0
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))


def test_insert_adopts_host_only_nodes():
    cache, alloc, pool, host = setup("write_through")
    ids = [1, 2, 3, 4]
    _, node = cache.cache(ids, compute(pool, alloc, ids), None)
    cache.unlock(node)
    cache.evict(4)                                                   # host-only now
    slots = compute(pool, alloc, ids + [5, 6])                       # recomputed on the device
    indices, node2 = cache.cache(ids + [5, 6], slots, None)
    # Nothing was device-cached, so nothing is a duplicate: the host-only node took the slots.
    assert indices.tolist() == slots.tolist() and node.value.tolist() == slots[:4].tolist()
    cache.unlock(node2)
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))


def test_host_eviction_makes_room_and_deletes_host_only_leaves():
    cache, alloc, pool, host = setup("write_through", host_tokens=8)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 8, 8, 7, 7, 6, 6]
    _, na = cache.cache(a, compute(pool, alloc, a), None)
    cache.unlock(na)
    _, nb = cache.cache(b, compute(pool, alloc, b), None)        # host full: a's copy goes
    cache.unlock(nb)
    assert na.host is None and nb.host is not None
    assert kv_tokens(host.pool.kv_data, nb.host) == b
    assert cache.evict(16) == 16                                     # a deleted, b host-only
    assert na.parent is None and nb.value is None and cache.stats().host == 8
    assert cache.evict(100, component="host") == 8
    assert nb.parent is None and host.allocator.available_size() == 8
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))


def test_retraction_backup_and_restore():
    cache, alloc, pool, host = setup("write_back")
    shared = [1, 2, 3, 4]
    _, n0 = cache.cache(shared, compute(pool, alloc, shared), None)   # another request's
    ids = shared + [5, 6, 7, 8, 9, 10]
    r = cache.match(ids)
    cache.lock(r.last_device_node)
    slots = torch.cat([r.device_indices, compute(pool, alloc, ids[4:])])
    before = alloc.available_size()
    node, freed = cache.host.backup(ids, slots, r.last_device_node)
    # The request's own 6 tokens went to the host; the shared prefix (held by n0) stays.
    assert freed == 6 and alloc.available_size() == before + 6
    assert node.value is None and node.lock_ref == 1 and kv_tokens(host.pool.kv_data, node.host) == ids[4:]
    assert cache.evict(100, component="host") == 0                   # locked: kept
    cache.unlock(n0)
    assert cache.evict(100) == 0                                     # shared prefix is on node's path
    # Restore: match finds it on the host, load it back, take the lock, drop the backup's.
    r = cache.match(ids)
    assert r.prefix_len == 4 and r.host_hit_length == 6 and r.best_match_node is node
    indices = cache.host.restore(r.best_match_node)
    assert kv_tokens(pool.kv_data, indices) == ids
    cache.lock(node)
    cache.unlock(node)
    assert cache.match(ids).prefix_len == 10
    cache.unlock(node)
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))


def test_restore_without_room_returns_none():
    cache, alloc, pool, host = setup("write_through", pages=4)
    ids = [1, 2, 3, 4]
    _, node = cache.cache(ids, compute(pool, alloc, ids), None)
    cache.unlock(node)
    cache.evict(4)
    hog = alloc.alloc(8)                                             # the device is full
    assert cache.host.restore(node) is None and node.value is None
    alloc.free(hog)
    assert kv_tokens(pool.kv_data, cache.host.restore(node)) == ids


class _Sink:
    """Collects published events (the ZMQ publisher is tested in test_events.py)."""

    def __init__(self):
        self.events = []

    def publish(self, events):
        self.events += events


def test_events_name_the_tier():
    from tandem.cache.radix.events import page_hashes
    from tandem.cache.unified import UnifiedRadixCache
    from tandem.core.config import CacheConfig
    from tandem.cache.allocator import PagedAllocator

    pool = KVPool(16, 2, num_layers=1, num_kv_heads=1, head_dim=1)
    alloc = PagedAllocator(8, 2)
    sink = _Sink()
    cache = UnifiedRadixCache(CacheConfig(page_size=2, debug_invariants=True), alloc,
                              host=HostTier(pool, 8, "write_through"), events=sink)
    ids = [1, 2, 3, 4]
    _, node = cache.cache(ids, compute(pool, alloc, ids), None)
    cache.unlock(node)
    cache.evict(4)
    cache.host.restore(node)
    h = page_hashes(ids, 2)
    assert [(type(e).__name__, getattr(e, "medium", None)) for e in sink.events] == [
        ("AllBlocksCleared", None), ("BlockStored", "device"), ("BlockStored", "host"),
        ("BlockRemoved", "device"), ("BlockStored", "device")]
    assert all(e.block_hashes == h for e in sink.events[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cuda_side_stream_copies(policy):
    """The copier's CUDA path: D2H through pinned staging on a side stream, H2D waited on by
    the compute stream. Same round trip as on the CPU, with bytes checked on the device."""
    pool = KVPool(64, 2, num_layers=3, num_kv_heads=2, head_dim=4, device="cuda")
    host = HostTier(pool, 32, policy)
    assert host.pool.kv_data.is_pinned() and host.copier.stream is not None
    cache, alloc = make_cache(page_size=2, pages=32, host=host)
    ids = list(range(1, 17))
    slots = alloc.alloc(16)
    pool.kv_data[:, :, slots.cuda()] = torch.tensor(ids, dtype=pool.dtype, device="cuda")[:, None, None]
    _, node = cache.cache(ids, slots, None)
    cache.unlock(node)
    assert cache.evict(16) == 16
    pool.kv_data.zero_()                                             # the device copy is gone
    assert kv_tokens(host.pool.kv_data, node.host) == ids
    indices = cache.host.restore(node)
    assert kv_tokens(pool.kv_data, indices.cuda()) == ids           # ordered after the H2D copy
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))
