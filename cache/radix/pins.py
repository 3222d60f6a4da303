"""The radix tree's pins (a mixin of :class:`~tandem.cache.radix.tree.RadixTree`): prefixes a
client asked to keep (Anthropic ``cache_control``, OpenAI ``prompt_cache_retention``) until a
clock time.

A pin covers a whole prefix, root..n, so a pinned node's parent is pinned at least as long
(``parent.pin >= nd.pin``; the recount checks it). A pinned evictable leaf waits in the tree's
``pheap``, which ``pop_leaf`` reaches only when no unpinned leaf is left; host eviction takes
unpinned host copies first too. A pin never blocks anything: past every unpinned page, pinned
pages are evicted (demoted to the host tier when there is one, whose eviction spills to L3).
Each pinned node's tokens are charged to one tenant (``pin_tenant``, the first to pin it);
``pin_tokens[tenant]`` is their sum, kept exact as nodes split, expire and leave the tree.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.cache.radix.node import Node


class Pins:
    leaves: set[Node]       # RadixTree's

    if TYPE_CHECKING:       # RadixTree's methods
        def path(self, node: Node) -> list[Node]: ...
        def _split(self, child: Node, m: int) -> Node: ...
        def _upd(self, nd: Node) -> None: ...

    def reset_pins(self) -> None:
        self.pinned: set[Node] = set()
        self.pin_tokens: dict[str, int] = {}
        self.pin_expiry: list[tuple[float, int, Node]] = []     # lazy: stale entries are skipped

    def pin_path(self, node: Node, n: int, until: float, tenant: str, cap: int | None) -> int | None:
        """Pin root..``n`` (page-aligned, at most ``node.end``) of ``node``'s path until ``until``;
        a pin already there lasts the longer of the two. Returns the tokens newly charged to
        ``tenant``, or None (nothing changed) when that would take it past ``cap`` tokens."""
        path = self.path(node)
        k = 0
        while k < len(path) and path[k].end <= n:
            k += 1
        if k < len(path) and path[k].start < n:          # the boundary is inside this edge
            self._split(path[k], n - path[k].start)
            path = self.path(node)
            k += 1
        path = path[:k]
        new = sum(len(nd.key) for nd in path if not nd.pin)
        if cap is not None and new and self.pin_tokens.get(tenant, 0) + new > cap:
            return None
        for nd in path:
            if not nd.pin:
                nd.pin_tenant = tenant
                self.pinned.add(nd)
                self.pin_tokens[tenant] = self.pin_tokens.get(tenant, 0) + len(nd.key)
                nd.pin = until
                self._requeue(nd)
            elif until > nd.pin:
                nd.pin = until
            else:
                continue
            heappush(self.pin_expiry, (nd.pin, nd.id, nd))
        return new

    def expire_pins(self, now: float) -> int:
        """End every pin whose time is past ``now``. Returns how many nodes it unpinned."""
        heap, n = self.pin_expiry, 0
        while heap and heap[0][0] <= now:
            until, _, nd = heappop(heap)
            if nd.pin == until and nd in self.pinned:
                self.unpin(nd)
                n += 1
        return n

    def unpin(self, nd: Node) -> None:
        """``nd`` is an ordinary node again (evicted in policy order among the unpinned)."""
        self.forget_pin(nd)
        self._requeue(nd)

    def forget_pin(self, nd: Node) -> None:
        """Release ``nd``'s pin and its tenant's charge (``nd`` leaves the tree, or is unpinned)."""
        self.pinned.discard(nd)
        t = nd.pin_tenant
        if t is not None:       # pin_path() charged it
            left = self.pin_tokens[t] - len(nd.key)
            if left:
                self.pin_tokens[t] = left
            else:
                del self.pin_tokens[t]
        nd.pin, nd.pin_tenant = 0.0, None

    def pin_split(self, up: Node, child: Node) -> None:
        """``up`` was cut from the top of pinned ``child``: it holds the same pin (the charge is
        unchanged: the tokens only moved)."""
        up.pin, up.pin_tenant = child.pin, child.pin_tenant
        self.pinned.add(up)
        heappush(self.pin_expiry, (up.pin, up.id, up))

    def pinned_prefixes(self) -> list[Node]:
        """The deepest pinned nodes (each names one pinned prefix: root..it)."""
        return [nd for nd in self.pinned if not any(c.pin for c in nd.children.values())]

    def _requeue(self, nd: Node) -> None:
        """``nd``'s pin changed: file it again in the heap it now belongs to."""
        if nd.hk is not None:
            nd.hk = None
            self.leaves.discard(nd)
            self._upd(nd)
