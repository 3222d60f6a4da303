"""The port a :class:`~tandem.cache.unified.UnifiedRadixCache` offers its tiers."""

from __future__ import annotations

from typing import Sequence


class TierPort:
    """The one port a :class:`UnifiedRadixCache` offers its tiers: what a tier may read and the
    verbs it may call, each executing what the tree decided before it returns."""

    def __init__(self, cache):
        self._cache = cache
        self.page_size = cache.page_size
        self.allocator = cache.allocator
        self.components = cache._aux
        self.tree = cache._tree

    @property
    def host(self):
        return self._cache.host

    def now(self) -> float:
        """The cache's clock (the one pins end on)."""
        return self._cache._clock()

    def key(self, token_ids: Sequence[int]) -> list:
        return self._cache._key(token_ids)

    def make_room(self, n: int) -> None:
        self._cache._evict_device(n)
        self._cache._free_device()

    def make_room_aux(self, i: int, n: int) -> None:
        host = self._cache.host
        self.tree.aux.evict(i, n, backup=host.copy_aux if host is not None else None)
        self._cache._free_aux()

    def make_room_host(self, n: int, i: int | None = None) -> None:
        if i is None:
            self.tree.hosted.evict(n)
        else:
            self.tree.hosted.evict_aux(i, n)
        self._cache._free_host()

    def insert_loaded(self, key: list, value, extra, session_id=None) -> int:
        return self._cache._insert(key, value, extra, session_id, 0)[0]

    def cache(self, token_ids, slots, last_node, *, extra=None, session_id=None):
        return self._cache.cache(token_ids, slots, last_node, extra=extra, session_id=session_id)

    def settle(self) -> None:
        self._cache._after()

    def record_spills(self) -> None:
        if self.tree.spills is None:
            self.tree.spills = []
