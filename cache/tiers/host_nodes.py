"""The radix tree's host-tier bookkeeping (a mixin of :class:`~tandem.cache.radix.tree.RadixTree`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Any

from tandem.cache.radix.events import HOST

if TYPE_CHECKING:
    from tandem.cache.radix.components import TreeComponent
    from tandem.cache.radix.eviction import EvictionPolicy
    from tandem.cache.radix.node import Node

# what leaves the tree with a node's last copy: (page hashes, FULL slots, on host, aux items, pin end)
Spill = tuple[list[int], Any, bool, tuple[tuple[int, Any, bool], ...], float]


class HostNodes:
    # RadixTree's (its __init__ and reset() set them; this mixin keeps the host tier's books)
    root: Node
    policy: EvictionPolicy
    _key: Callable[[Node], Any]
    components: tuple[TreeComponent, ...]
    record_events: bool
    spills: list[Spill] | None
    host_nodes: set[Node]
    host_size: int
    host_frees: list[Any]
    aux_host_nodes: list[set[Node]]
    aux_host_size: list[int]
    aux_host_frees: list[tuple[int, Any]]

    if TYPE_CHECKING:       # RadixTree's methods
        def spill(self, nd: Node, slots: Any, on_host: bool,
                  aux: Sequence[tuple[int, Any, bool]] = ()) -> None: ...
        def _delete_subtree(self, nd: Node) -> None: ...
        def _event_store(self, nd: Node, medium: str) -> None: ...
        def _event_remove(self, nd: Node, medium: str) -> None: ...

    def set_host(self, nd: Node, host_value: Any) -> None:
        nd.host = host_value
        self.host_nodes.add(nd)
        self.host_size += len(nd.key)
        if self.record_events:
            self._event_store(nd, HOST)

    def _drop_host_value(self, nd: Node) -> None:
        if self.spills is not None:
            aux = [(i, a, True) for i, a in enumerate(nd.aux_host or ())
                   if a is not None and nd.aux[i] is None]
            if nd.value is None or aux:
                self.spill(nd, nd.host if nd.value is None else None, True, aux)
        if self.components:
            for i in range(len(self.components)):
                if nd.aux_host[i] is not None:
                    self.drop_aux_host(nd, i)
        self.host_frees.append(nd.host)
        nd.host = None
        self.host_nodes.discard(nd)
        self.host_size -= len(nd.key)
        if self.record_events:
            self._event_remove(nd, HOST)

    def _host_evictable(self, nd: Node) -> bool:
        return (nd.host is not None and nd.lock_ref == 0 and nd.parent is not None
                and not any(c.host is not None for c in nd.children.values()))

    def evict_host(self, num_tokens: int) -> int:
        """Free host copies of unlocked nodes with no host child, unpinned ones first, policy order,
        cascading up. Returns host tokens freed (queued in ``host_frees``)."""
        self.policy.begin_pass()
        key = self._key
        heap = [(nd.pin > 0, key(nd), nd.id, nd) for nd in self.host_nodes if self._host_evictable(nd)]
        heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            *_, nd = heappop(heap)
            if not self._host_evictable(nd):
                continue
            parent = nd.parent
            freed += len(nd.key)
            self._drop_host_value(nd)
            if nd.value is None:
                self._delete_subtree(nd)
            if parent is not None and parent is not self.root and self._host_evictable(parent):
                heappush(heap, (parent.pin > 0, key(parent), parent.id, parent))
        return freed

    def set_aux_host(self, nd: Node, i: int, value: Any) -> None:
        """``nd``'s component-``i`` data now has a host copy ``value`` (needs ``nd.host``)."""
        if nd.host is None:
            raise ValueError(f"{nd}: a {self.components[i].name} host copy needs the FULL host copy")
        if nd.aux_host[i] is not None:
            self.drop_aux_host(nd, i)
        nd.aux_host[i] = value
        self.aux_host_size[i] += self.components[i].size(value)
        self.aux_host_nodes[i].add(nd)

    def drop_aux_host(self, nd: Node, i: int) -> None:
        v = nd.aux_host[i]
        nd.aux_host[i] = None
        self.aux_host_size[i] -= self.components[i].size(v)
        self.aux_host_nodes[i].discard(nd)
        self.aux_host_frees.append((i, v))

    def evict_host_aux(self, i: int, num: int) -> int:
        """Drop component ``i``'s host copies of nodes outside every component-``i`` lock, in
        policy order, unpinned ones first, until ``num`` units are freed (the FULL host copies stay)."""
        self.policy.begin_pass()
        c, key = self.components[i], self._key
        heap = [(nd.pin > 0, key(nd), nd.id, nd) for nd in self.aux_host_nodes[i] if not nd.aux_lock[i]]
        heapify(heap)
        freed = 0
        while freed < num and heap:
            *_, nd = heappop(heap)
            freed += c.size(nd.aux_host[i])
            if self.spills is not None and nd.aux[i] is None:           # its last copy
                self.spill(nd, None, True, [(i, nd.aux_host[i], True)])
            self.drop_aux_host(nd, i)
        return freed

    def _aux_host_split(self, up: Node, child: Node, m: int) -> None:
        for i, c in enumerate(self.components):
            v = child.aux_host[i]
            if v is None:
                continue
            self.aux_host_size[i] -= c.size(v)
            up.aux_host[i], child.aux_host[i] = c.split(v, m)
            for nd in (up, child):
                if nd.aux_host[i] is None:
                    self.aux_host_nodes[i].discard(nd)
                else:
                    self.aux_host_size[i] += c.size(nd.aux_host[i])
                    self.aux_host_nodes[i].add(nd)
