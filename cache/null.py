"""NullCache: the prefix-cache protocol with nothing kept (``CacheConfig.disable_prefix_cache``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from tandem.cache.radix.components import FULL
from tandem.cache.radix.sanity import check_ownership
from tandem.cache.match import CacheStats, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int64)
_MISS = MatchResult(0, [])


class NullCache:
    """Every match a miss and nothing kept. ``allocator``/``components``: the pools whose
    ownership :meth:`check` proves (requests must own all of it)."""

    retains = False
    host = None
    tiers = ()

    def __init__(self, allocator=None, components: Sequence[Any] = (FULL,)):
        self.allocator = allocator
        self._aux = tuple(c for c in components if c is not FULL)

    def tier(self, name: str) -> None:
        return None

    def match(self, token_ids, *, session_id=None, priority=None) -> MatchResult:
        return _MISS

    def peek(self, token_ids) -> int:
        return 0

    def insert(self, token_ids, value=None, *, extra=None, session_id=None, priority=0) -> int:
        if value is not None and self.allocator is not None and len(value):
            n = len(token_ids) // self.allocator.page_size * self.allocator.page_size
            if n:
                self.allocator.free(torch.as_tensor(value)[:n].to(torch.int64))
        return 0

    def cache(self, token_ids, slots, last_node, *, extra=None, session_id=None, priority=0):
        return _EMPTY, None

    def lock(self, node) -> None:
        pass

    def unlock(self, node) -> None:
        pass

    def evict(self, num_tokens: int, component: str = "full") -> int:
        return 0

    pin_refused = pin_hits = 0

    @property
    def pinned_tokens(self) -> dict:
        return {}

    def pin(self, node, num_tokens: int, ttl_s: float, *, tenant: str = "", cap: int | None = None) -> int:
        return 0

    def pins(self) -> list:
        return []

    def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(components={c.name: (0, 0) for c in self._aux})

    def check(self, extra_owned: Any = None) -> None:
        """With ``extra_owned`` (a tensor of FULL slots, or a mapping of component name ->
        tensor), the requests must own exactly every allocated page of each pool."""
        if extra_owned is None or self.allocator is None:
            return
        owned: Mapping[str, Any] = (extra_owned if isinstance(extra_owned, Mapping)
                                    else {"full": extra_owned})
        errs = check_ownership("full", self.allocator, [], owned.get("full", _EMPTY))
        for c in self._aux:
            if c.allocator is not None:
                errs += check_ownership(c.name, c.allocator, [], owned.get(c.name, _EMPTY))
        if errs:
            raise AssertionError(f"{len(errs)} ownership violation(s) without a prefix cache:\n"
                                 + "\n".join(errs))
