"""The radix tree's host copies (an object the tree owns: ``tree.hosted``): which nodes have a
host-tier copy of their FULL data and of each component's, their sizes, and the host slots freed
(queued for the cache to return to the host pool)."""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Any

from tandem.cache.radix.events import HOST

if TYPE_CHECKING:
    from tandem.cache.radix.node import Node, TreePort

# what leaves the tree with a node's last copy: (page hashes, FULL slots, on host, aux items, pin end)
Spill = tuple[list[int], Any, bool, tuple[tuple[int, Any, bool], ...], float]


class HostCopies:
    """Host copies of one tree's nodes. ``nodes`` / ``size``: nodes with a FULL host copy and
    their tokens; ``aux_nodes[i]`` / ``aux_size[i]``: component ``i``'s; ``frees`` /
    ``aux_frees``: host slots dropped, for the cache to free. A node loses its last copy through
    the tree (``spill``, ``delete_subtree``): this object keeps only the host side's books."""

    def __init__(self, tree: TreePort):
        self.tree = tree
        n_aux = len(tree.components)
        self.nodes: set[Node] = set()
        self.size = 0
        self.frees: list[Any] = []
        self.aux_nodes: list[set[Node]] = [set() for _ in range(n_aux)]
        self.aux_size = [0] * n_aux
        self.aux_frees: list[tuple[int, Any]] = []

    def set(self, nd: Node, host_value: Any) -> None:
        """``nd``'s FULL data now has a host copy ``host_value``."""
        nd.host = host_value
        self.nodes.add(nd)
        self.size += len(nd.key)
        if self.tree.record_events:
            self.tree.event_store(nd, HOST)

    def drop(self, nd: Node) -> None:
        """Drop ``nd``'s host copies (FULL and every component's; a last copy is spilled)."""
        t = self.tree
        if t.spills is not None:
            aux = [(i, a, True) for i, a in enumerate(nd.aux_host or ())
                   if a is not None and nd.aux[i] is None]
            if nd.value is None or aux:
                t.spill(nd, nd.host if nd.value is None else None, True, aux)
        for i in range(len(t.components)):
            if nd.aux_host[i] is not None:
                self.drop_aux(nd, i)
        self.frees.append(nd.host)
        nd.host = None
        self.nodes.discard(nd)
        self.size -= len(nd.key)
        if t.record_events:
            t.event_remove(nd, HOST)

    @staticmethod
    def _evictable(nd: Node) -> bool:
        return (nd.host is not None and nd.lock_ref == 0 and nd.parent is not None
                and not any(c.host is not None for c in nd.children.values()))

    def evict(self, num_tokens: int) -> int:
        """Free host copies of unlocked nodes with no host child, unpinned ones first, policy order,
        cascading up. Returns host tokens freed (queued in ``frees``)."""
        t = self.tree
        t.policy.begin_pass()
        key = t.policy.key
        heap = [(nd.pin > 0, key(nd), nd.id, nd) for nd in self.nodes if self._evictable(nd)]
        heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            *_, nd = heappop(heap)
            if not self._evictable(nd):
                continue
            parent = nd.parent
            freed += len(nd.key)
            self.drop(nd)
            if nd.value is None:
                t.delete_subtree(nd)
            if parent is not None and parent is not t.root and self._evictable(parent):
                heappush(heap, (parent.pin > 0, key(parent), parent.id, parent))
        return freed

    def set_aux(self, nd: Node, i: int, value: Any) -> None:
        """``nd``'s component-``i`` data now has a host copy ``value`` (needs ``nd.host``)."""
        c = self.tree.components[i]
        if nd.host is None:
            raise ValueError(f"{nd}: a {c.name} host copy needs the FULL host copy")
        if nd.aux_host[i] is not None:
            self.drop_aux(nd, i)
        nd.aux_host[i] = value
        self.aux_size[i] += c.size(value)
        self.aux_nodes[i].add(nd)

    def drop_aux(self, nd: Node, i: int) -> None:
        v = nd.aux_host[i]
        nd.aux_host[i] = None
        self.aux_size[i] -= self.tree.components[i].size(v)
        self.aux_nodes[i].discard(nd)
        self.aux_frees.append((i, v))

    def evict_aux(self, i: int, num: int) -> int:
        """Drop component ``i``'s host copies of nodes outside every component-``i`` lock, in
        policy order, unpinned ones first, until ``num`` units are freed (the FULL host copies stay)."""
        t = self.tree
        t.policy.begin_pass()
        c, key = t.components[i], t.policy.key
        heap = [(nd.pin > 0, key(nd), nd.id, nd) for nd in self.aux_nodes[i] if not nd.aux_lock[i]]
        heapify(heap)
        freed = 0
        while freed < num and heap:
            *_, nd = heappop(heap)
            freed += c.size(nd.aux_host[i])
            if t.spills is not None and nd.aux[i] is None:           # its last copy
                t.spill(nd, None, True, [(i, nd.aux_host[i], True)])
            self.drop_aux(nd, i)
        return freed

    def split(self, up: Node, child: Node, m: int) -> None:
        """``up`` was cut from the top ``m`` tokens of ``child``, which has a host copy (the tree
        cut the FULL host value already; the components' host values are cut here)."""
        self.nodes.add(up)
        for i, c in enumerate(self.tree.components):
            v = child.aux_host[i]
            if v is None:
                continue
            self.aux_size[i] -= c.size(v)
            up.aux_host[i], child.aux_host[i] = c.split(v, m)
            for nd in (up, child):
                if nd.aux_host[i] is None:
                    self.aux_nodes[i].discard(nd)
                else:
                    self.aux_size[i] += c.size(nd.aux_host[i])
                    self.aux_nodes[i].add(nd)

