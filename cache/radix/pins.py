"""The radix tree's pins (an object the tree owns: ``tree.pins``): prefixes a client asked to
keep (Anthropic ``cache_control``, OpenAI ``prompt_cache_retention``) until a clock time.

A pin covers a whole prefix, root..n, so a pinned node's parent is pinned at least as long
(``parent.pin >= nd.pin``; the recount checks it). A pinned evictable leaf waits in the tree's
``leaves.pheap``, which ``leaves.pop`` reaches only when no unpinned leaf is left; host eviction takes
unpinned host copies first too. A pin never blocks anything: past every unpinned page, pinned
pages are evicted (demoted to the host tier when there is one, whose eviction spills to L3).
Each pinned node's tokens are charged to one tenant (``pin_tenant``, the first to pin it);
``tokens[tenant]`` is their sum, kept exact as nodes split, expire and leave the tree.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.cache.radix.node import Node, TreePort


class Pins:
    """The pinned nodes of one tree, their tenants' charges and their expiry times. Reads the
    tree's paths and splits edges through it; moves a node between the tree's heaps when its pin
    changes."""

    def __init__(self, tree: TreePort):
        self.tree = tree
        self.nodes: set[Node] = set()
        self.tokens: dict[str, int] = {}
        self.expiry: list[tuple[float, int, Node]] = []     # lazy: stale entries are skipped

    def pin(self, node: Node, n: int, until: float, tenant: str, cap: int | None) -> int | None:
        """Pin root..``n`` (page-aligned, at most ``node.end``) of ``node``'s path until ``until``;
        a pin already there lasts the longer of the two. Returns the tokens newly charged to
        ``tenant``, or None (nothing changed) when that would take it past ``cap`` tokens."""
        path = self.tree.path(node)
        k = 0
        while k < len(path) and path[k].end <= n:
            k += 1
        if k < len(path) and path[k].start < n:          # the boundary is inside this edge
            self.tree.split(path[k], n - path[k].start)
            path = self.tree.path(node)
            k += 1
        path = path[:k]
        new = sum(len(nd.key) for nd in path if not nd.pin)
        if cap is not None and new and self.tokens.get(tenant, 0) + new > cap:
            return None
        for nd in path:
            if not nd.pin:
                nd.pin_tenant = tenant
                self.nodes.add(nd)
                self.tokens[tenant] = self.tokens.get(tenant, 0) + len(nd.key)
                nd.pin = until
                self.tree.leaves.refile(nd)
            elif until > nd.pin:
                nd.pin = until
            else:
                continue
            heappush(self.expiry, (nd.pin, nd.id, nd))
        return new

    def expire(self, now: float) -> int:
        """End every pin whose time is past ``now``. Returns how many nodes it unpinned."""
        heap, n = self.expiry, 0
        while heap and heap[0][0] <= now:
            until, _, nd = heappop(heap)
            if nd.pin == until and nd in self.nodes:
                self.unpin(nd)
                n += 1
        return n

    def unpin(self, nd: Node) -> None:
        """``nd`` is an ordinary node again (evicted in policy order among the unpinned)."""
        self.forget(nd)
        self.tree.leaves.refile(nd)

    def forget(self, nd: Node) -> None:
        """Release ``nd``'s pin and its tenant's charge (``nd`` leaves the tree, or is unpinned)."""
        self.nodes.discard(nd)
        t = nd.pin_tenant
        if t is not None:       # pin() charged it
            left = self.tokens[t] - len(nd.key)
            if left:
                self.tokens[t] = left
            else:
                del self.tokens[t]
        nd.pin, nd.pin_tenant = 0.0, None

    def split(self, up: Node, child: Node) -> None:
        """``up`` was cut from the top of pinned ``child``: it holds the same pin (the charge is
        unchanged: the tokens only moved)."""
        up.pin, up.pin_tenant = child.pin, child.pin_tenant
        self.nodes.add(up)
        heappush(self.expiry, (up.pin, up.id, up))

    def prefixes(self) -> list[Node]:
        """The deepest pinned nodes (each names one pinned prefix: root..it)."""
        return [nd for nd in self.nodes if not any(c.pin for c in nd.children.values())]

    def prefix_hash(self, nd: Node) -> str:
        """How :meth:`report` and :meth:`end` name the prefix root..``nd``: its last page's chain
        hash, hex."""
        return f"{self.tree.hashes(nd)[-1] & (2**64 - 1):016x}"

    def path_hashes(self, node: Node, n: int) -> list[int]:
        """The page hashes of root..``n`` (page-aligned) of ``node``'s path."""
        out: list[int] = []
        for x in self.tree.path(node):
            out.extend(self.tree.hashes(x))
        return out[:n // self.tree.page_size]

    def report(self, now: float) -> list[dict]:
        """The live pinned prefixes: ``{"tenant", "hash", "tokens", "tier"`` ("device" or "host"),
        ``"expires_in_s"}``, longest first."""
        out = [{"tenant": nd.pin_tenant, "hash": self.prefix_hash(nd), "tokens": nd.end,
                "tier": "device" if nd.value is not None else "host", "expires_in_s": round(nd.pin - now, 3)}
               for nd in self.prefixes()]
        return sorted(out, key=lambda d: (-d["tokens"], d["hash"]))

    def end(self, prefix_hash: str, tenant: str | None) -> tuple[int, list[int]] | None:
        """End the pins of the prefix :meth:`prefix_hash` names (only ``tenant``'s when given), up
        to where another pinned prefix needs the rest: ``(tokens unpinned, their page hashes)``,
        or None when no such prefix is pinned."""
        for nd in self.prefixes():
            if self.prefix_hash(nd) == prefix_hash and tenant in (None, nd.pin_tenant):
                n, gone = 0, []
                for x in reversed(self.tree.path(nd)):
                    if any(c.pin for c in x.children.values()):
                        break
                    n += len(x.key)
                    gone.extend(self.tree.hashes(x))
                    self.unpin(x)
                return n, gone
        return None
