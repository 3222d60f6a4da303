"""N-gram drafts: the longest suffix match over a request's own tokens, else a per-tenant pool."""

from __future__ import annotations

from collections import OrderedDict


class RequestIndex:
    """The n-grams (n = 1..``max_n``) of one request's tokens (prompt + output), each mapped to the
    position right after its latest occurrence that is not the request's current suffix."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0       # n-grams ending at positions < indexed are in ``after``

    def _update(self, ids: list[int]) -> None:
        end = len(ids) - 1     # the last position is the suffix being matched: never indexed yet
        for i in range(self.indexed, end):
            for n in range(1, min(self.max_n, i + 1) + 1):
                self.after[tuple(ids[i - n + 1:i + 1])] = i + 1
        self.indexed = max(self.indexed, end)

    def propose(self, ids: list[int], k: int, min_n: int = 1) -> tuple[int, ...]:
        """Up to ``k`` tokens following the latest earlier occurrence of the longest suffix of
        ``ids`` (n from ``max_n`` down to ``min_n``) that occurred before; () when none did."""
        self._update(ids)
        for n in range(min(self.max_n, len(ids) - 1), min_n - 1, -1):
            j = self.after.get(tuple(ids[len(ids) - n:]))
            if j is not None:
                return tuple(ids[j:j + k])
        return ()


class NgramPool:
    """Text of finished requests, per tenant: ``n``-gram -> the tokens that followed it (at most
    ``span``), the latest writer winning; at most ``max_entries`` n-grams per tenant (oldest
    dropped first). A tenant is ``(cache_salt, tenant)``: a draft never carries another
    tenant's text, as the prefix cache's salt keeps its pages apart."""

    def __init__(self, n: int = 3, span: int = 16, max_entries: int = 1 << 16):
        self.n, self.span, self.max_entries = n, span, max_entries
        self._pools: dict[tuple[int, str], OrderedDict[tuple[int, ...], tuple[int, ...]]] = {}

    def add(self, tenant: tuple[int, str], ids: list[int]) -> None:
        """Learn the n-grams of ``ids`` (a finished request's prompt + output)."""
        pool = self._pools.setdefault(tenant, OrderedDict())
        n = self.n
        for i in range(n, len(ids)):
            key = tuple(ids[i - n:i])
            pool[key] = tuple(ids[i:i + self.span])
            pool.move_to_end(key)
        while len(pool) > self.max_entries:
            pool.popitem(last=False)

    def propose(self, tenant: tuple[int, str], ids: list[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the last ``n`` tokens of ``ids`` in this tenant's text."""
        pool = self._pools.get(tenant)
        if not pool or len(ids) < self.n:
            return ()
        return pool.get(tuple(ids[len(ids) - self.n:]), ())[:k]

    def tenants(self) -> int:
        return len(self._pools)
