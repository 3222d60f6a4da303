"""Binds the engine's prefix-cache verbs (engine/prefix_cache.py) to cache.UnifiedRadixCache."""

from __future__ import annotations

import torch

from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import CacheConfig


class RadixPrefixCache:
    def __init__(self, config: CacheConfig, allocator, kv_pool, req_to_token_pool=None, **kw):
        """``kw``: passed to :class:`UnifiedRadixCache` (``components=(FULL, SWA(...), ...)``)."""
        self.radix = UnifiedRadixCache(config, allocator, req_to_token_pool, **kw)
        self.disabled = self.radix.disabled

    def match(self, ids, session_id=None) -> tuple[torch.Tensor, object, object]:
        r = self.radix.match_prefix(ids, session_id=session_id)
        return r.device_indices, r.last_device_node, r.components

    def lock(self, node) -> None:
        if node is not None:
            self.radix.inc_lock_ref(node)

    def unlock(self, node) -> None:
        if node is not None:
            self.radix.dec_lock_ref(node)

    def cache(self, ids, slots, node, session_id=None, extra=None):
        return self.radix.cache_req(ids, slots, node, session_id=session_id, extra=extra)

    def evict(self, n: int, component: str = "full") -> int:
        return self.radix.evict(n, component)

    def evictable_size(self, component: str = "full") -> int:
        return self.radix.evictable_size(component)

    def check(self, extra_owned=None) -> None:
        self.radix.sanity_check(extra_owned=extra_owned)
