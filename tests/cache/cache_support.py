"""Helpers for the cache tests (imported as ``cache_support``): a real allocator + cache with invariants checked after every
operation (CacheConfig.debug_invariants), and a fake clock for the session policy."""

from __future__ import annotations

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import CacheConfig


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_cache(page_size: int = 1, pages: int = 64, policy: str = "lru", components=None,
               host=None, clock=None, **cfg) -> tuple[UnifiedRadixCache, PagedAllocator]:
    from tandem.cache.radix.components import FULL

    alloc = PagedAllocator(pages, page_size)
    config = CacheConfig(page_size=page_size, eviction_policy=policy, debug_invariants=True, **cfg)
    kw = {"clock": clock} if clock is not None else {}
    cache = UnifiedRadixCache(config, alloc, components=components or (FULL,), host=host, **kw)
    return cache, alloc


def run_request(cache, alloc, ids, *, session_id=None, priority=0, extra=None):
    """Engine-style: match, lock, allocate the rest, cache, free the unaligned tail, unlock.
    Returns the canonical slots the tree holds for the page-aligned prefix."""
    r = cache.match(ids, session_id=session_id)
    cache.lock(r.last_device_node)
    own = alloc.alloc(len(ids) - r.prefix_len)
    assert own is not None, "test allocator too small"
    slots = torch.cat([r.device_indices, own])
    indices, node = cache.cache(ids, slots, r.last_device_node, session_id=session_id,
                                    priority=priority, extra=extra)
    aligned = len(indices)
    if len(ids) > aligned:
        alloc.free(slots[aligned:])
    cache.unlock(node)
    return indices
