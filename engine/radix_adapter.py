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

    @property
    def has_host_tier(self) -> bool:
        return self.radix.host is not None

    def match(self, ids, session_id=None) -> tuple[torch.Tensor, object, object]:
        """The device prefix; host-only nodes on the match are loaded back first (HiCache L2)."""
        r = self.radix.match_prefix(ids, session_id=session_id)
        if r.host_hit_length and self.radix.host is not None:
            if self.radix.load_back(r.best_match_node) is not None:
                r = self.radix.match_prefix(ids, session_id=session_id)
        return r.device_indices, r.last_device_node, r.components

    def match_len(self, ids) -> int:
        """Length of the cached device prefix of ``ids`` (for queue ordering; loads nothing)."""
        return self.radix.match_prefix(ids).prefix_len

    def backup(self, ids, slots, node, session_id=None):
        """Retraction: move the request's KV to the host tier; ``(locked node, tokens freed)``."""
        return self.radix.backup(ids, slots, node, session_id=session_id)

    def host_only(self, node) -> bool:
        """True when ``node``'s KV is on the host and not on the device."""
        return node is not None and getattr(node, "value", 1) is None

    def host_used_tokens(self) -> int:
        return self.radix.total_size("host") if self.radix.host is not None else 0

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
