"""Where a decode worker's next prompt is prefilled: here (local) or on a prefill worker (remote).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PRIOR_PER_TOKEN_S = 1e-3
PRIOR_OVERHEAD_S = 0.03
_ALPHA = 0.2
_SENT_PAGES = 1 << 16


@dataclass
class PrefillCosts:
    """The two measured constants of the rule: ``per_token_s`` (prefill compute per uncached prompt
    token, from the prefill worker's own ``prefill_s``) and ``overhead_s`` (a remote
    request's receive time beyond that compute: reservation, the prefill call, the KV write)."""

    per_token_s: float = PRIOR_PER_TOKEN_S
    overhead_s: float = PRIOR_OVERHEAD_S
    samples: int = 0

    def observe(self, computed: int, prefill_s: float, receive_s: float) -> None:
        """One remote request: ``computed`` prompt tokens took ``prefill_s`` on the prefill
        worker, and ``receive_s`` from the reservation to the landed KV here."""
        if computed <= 0 or prefill_s <= 0 or receive_s <= 0:
            return
        a = 1.0 if self.samples == 0 else _ALPHA
        self.per_token_s += a * (prefill_s / computed - self.per_token_s)
        self.overhead_s += a * (max(receive_s - prefill_s, 0.0) - self.overhead_s)
        self.samples += 1


def choose_local(n: int, decode_cached: int, prefill_cached: int, costs: PrefillCosts,
                 page_size: int) -> bool:
    """Prefill here when the decode worker holds tokens the prefill worker lacks (at least one page:
    the previous reply of a session) and computing the uncached suffix here takes no longer
    than what the remote path would spend beyond computing that same suffix: its handoff
    overhead plus the recompute of what this worker holds and the prefill worker does not."""
    wasted = decode_cached - prefill_cached      # tokens the remote path would recompute
    if wasted < page_size:
        return False
    local = n - decode_cached
    return costs.per_token_s * local <= costs.overhead_s + costs.per_token_s * wasted


@dataclass(frozen=True)
class LocalRule:
    """One remote-bound request's rule, decided on the engine thread as it is queued, from what
    this worker's cache holds then (decode/connector.py ``computes_here``): with a
    ``threshold``, prefill here when the uncached suffix is shorter; without, :func:`choose_local`
    over ``peer_held`` (the prefill worker's estimate, :class:`SentPrefixes`) and ``costs`` (a copy)."""

    threshold: int | None
    peer_held: int
    costs: PrefillCosts
    page_size: int

    def here(self, n: int, cached: int) -> bool:
        """Prefill the ``n``-token prompt here, ``cached`` of it held in this worker's cache."""
        if self.threshold is not None:
            return n - cached < self.threshold
        if cached < self.page_size:      # nothing held here: no prefill worker holds less
            return False
        return choose_local(n, cached, self.peer_held, self.costs, self.page_size)


class SentPrefixes:
    """Per prefill worker, the page-aligned prompt prefixes it computed for this decode worker (it
    caches them), as chained page hashes in a bounded LRU."""

    def __init__(self, page_size: int, capacity: int = _SENT_PAGES):
        self.page_size, self.capacity = page_size, capacity
        self._by_peer: dict[str, OrderedDict[int, None]] = {}

    def _hashes(self, ids) -> list[int]:
        ps, h, out = self.page_size, 0, []
        for i in range(0, len(ids) - len(ids) % ps, ps):
            h = hash((h, tuple(ids[i:i + ps])))
            out.append(h)
        return out

    def add(self, peer: str, ids) -> None:
        """``peer`` computed the prompt ``ids`` (its KV is in that worker's cache now)."""
        seen = self._by_peer.setdefault(peer, OrderedDict())
        for h in self._hashes(ids):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def held(self, peer: str, ids) -> int:
        """Tokens of ``ids`` (whole pages, a prefix) ``peer`` is estimated to hold."""
        seen = self._by_peer.get(peer)
        if not seen:
            return 0
        pages = 0
        for h in self._hashes(ids):
            if h not in seen:
                break
            pages += 1
        return pages * self.page_size
