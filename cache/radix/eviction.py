"""Eviction policies (which unlocked leaf goes first) and the heap of evictable leaves they order."""

from __future__ import annotations

import time
from heapq import heapify, heappop, heappush
from operator import attrgetter
from typing import Any, Callable, Hashable

POLICIES = ("lru", "lfu", "fifo", "priority", "slru", "session")


class EvictionPolicy:
    """``key(node)``: smaller is evicted first. Must be cheap: it runs on every leaf touch."""

    name = "base"
    time_dependent = False
    key: Callable[[Any], Any]

    def touch_session(self, session_id: Hashable) -> None:
        """A request of ``session_id`` used the cache now (only the session policy cares)."""

    def begin_pass(self) -> None:
        """Called before an eviction pass (time-dependent policies fix ``now`` here)."""


class _KeyPolicy(EvictionPolicy):
    def __init__(self, name: str, key: Callable[[Any], Any]):
        self.name = name
        self.key = key


class SessionPolicy(EvictionPolicy):
    """Entries of sessions touched within ``ttl_s`` are evicted after those of ended sessions."""

    name = "session"
    time_dependent = True

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"session_ttl_s={ttl_s} must be positive")
        self.ttl_s = ttl_s
        self.clock = clock
        self.last_seen: dict[Hashable, float] = {}
        self._now = clock()

    def touch_session(self, session_id: Hashable) -> None:
        self.last_seen[session_id] = self.clock()

    def end_session(self, session_id: Hashable) -> None:
        """The session is over (the router knows): its entries go first from now on."""
        self.last_seen.pop(session_id, None)

    def active(self, session_id: Hashable | None) -> bool:
        seen = self.last_seen.get(session_id) if session_id is not None else None
        return seen is not None and self._now - seen <= self.ttl_s

    def begin_pass(self) -> None:
        self._now = self.clock()
        if len(self.last_seen) > 4096:
            horizon = self._now - 2 * self.ttl_s
            self.last_seen = {s: t for s, t in self.last_seen.items() if t >= horizon}

    def key(self, node) -> tuple[int, int]:
        return (1 if self.active(node.session) else 0, node.access)


def make_policy(name: str, *, session_ttl_s: float = 300.0, slru_threshold: int = 2,
                clock: Callable[[], float] = time.monotonic) -> EvictionPolicy:
    if name == "lru":
        return _KeyPolicy(name, attrgetter("access"))
    if name == "lfu":
        return _KeyPolicy(name, attrgetter("hits", "access"))
    if name == "fifo":
        return _KeyPolicy(name, attrgetter("created"))
    if name == "priority":
        return _KeyPolicy(name, attrgetter("priority", "access"))
    if name == "slru":
        return _KeyPolicy(name, lambda n: (n.hits >= slru_threshold, n.access))
    if name == "session":
        return SessionPolicy(session_ttl_s, clock)
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")


class LeafHeap:
    """A tree's evictable leaves (device data, unlocked, no child with device data) in policy
    order: ``nodes`` is the set, ``heap`` / ``pheap`` lazy heaps of ``(key, id, node)`` for
    unpinned / pinned ones (an entry is live while ``node.hk`` equals its key; stale ones are
    skipped and the heaps rebuilt when they pass twice the live count)."""

    def __init__(self, key: Callable[[Any], Any]):
        self.key = key
        self.nodes: set = set()
        self.heap: list[tuple[Any, int, Any]] = []
        self.pheap: list[tuple[Any, int, Any]] = []     # pinned: popped only when ``heap`` is empty

    def update(self, nd) -> None:
        """File ``nd`` by its state now: in (at its current key) if it is an evictable leaf, else out."""
        if nd.value is not None and nd.lock_ref == 0 and nd.ndc == 0:
            k = self.key(nd)
            hk = nd.hk
            if hk is None:
                self.nodes.add(nd)
            elif hk == k:
                return
            nd.hk = k
            heappush(self.pheap if nd.pin else self.heap, (k, nd.id, nd))
            if len(self.heap) + len(self.pheap) > 2 * len(self.nodes) + 256:
                self.rebuild()
        elif nd.hk is not None:
            self.discard(nd)

    def discard(self, nd) -> None:
        """``nd`` is no evictable leaf any more (its heap entries go stale)."""
        nd.hk = None
        self.nodes.discard(nd)

    def refile(self, nd) -> None:
        """``nd``'s pin changed: file it again in the heap it now belongs to."""
        if nd.hk is not None:
            self.discard(nd)
            self.update(nd)

    def rebuild(self) -> None:
        """Both heaps anew from ``nodes`` at today's keys (a time-dependent policy's keys move)."""
        key = self.key
        heap: list[tuple[Any, int, Any]] = []
        pheap: list[tuple[Any, int, Any]] = []
        for nd in self.nodes:
            nd.hk = key(nd)
            (pheap if nd.pin else heap).append((nd.hk, nd.id, nd))
        heapify(heap)
        heapify(pheap)
        self.heap, self.pheap = heap, pheap

    def pop(self):
        """The next evictable leaf: every unpinned one (policy order) before any pinned one; None
        when there is none."""
        heap = self.heap
        while heap:
            k, _, nd = heappop(heap)
            if nd.hk == k and not nd.pin:
                return nd
        heap = self.pheap
        while heap:
            k, _, nd = heappop(heap)
            if nd.hk == k and nd.pin:
                return nd
        return None
