"""The radix tree's component data on the device (an object the tree owns: ``tree.aux``): each
component's sizes by lock state, its unlocked nodes (what ``evict`` may take) and the values
dropped (queued for the cache to free).

``nd.aux[i]`` is component ``i``'s value on node ``nd`` (None: none, or a tombstone); its locks
are ``nd.aux_lock[i]`` (``{floor: count}``, cache/radix/components.py): a node
whose ``aux_lock[i]`` is empty is unlocked for component ``i``. Every change of a value or a lock
goes through :meth:`out` before and :meth:`into` after, so ``evictable[i] + protected[i]`` is
always the sum of the values' sizes (the recount in sanity.py checks it).
"""

from __future__ import annotations

from heapq import heapify, heappop
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.cache.radix.node import Node, TreePort


class AuxData:
    def __init__(self, tree: TreePort):
        self.tree = tree
        self.components = tree.components
        n = len(self.components)
        self.evictable = [0] * n
        self.protected = [0] * n
        self.unlocked: list[set[Node]] = [set() for _ in range(n)]
        self.frees: list[tuple[int, Any]] = []

    def out(self, nd: Node, i: int) -> None:
        """Take ``nd``'s component-``i`` value out of the sizes (before changing it or its lock)."""
        v = nd.aux[i]
        if v is None:
            return
        sz = self.components[i].size(v)
        if nd.aux_lock[i]:
            self.protected[i] -= sz
        else:
            self.evictable[i] -= sz
            self.unlocked[i].discard(nd)

    def into(self, nd: Node, i: int) -> None:
        """Put ``nd``'s component-``i`` value back into the sizes (after the change)."""
        v = nd.aux[i]
        if v is None:
            return
        sz = self.components[i].size(v)
        if nd.aux_lock[i]:
            self.protected[i] += sz
        else:
            self.evictable[i] += sz
            self.unlocked[i].add(nd)

    def set(self, nd: Node, i: int, value: Any) -> None:
        """Give ``nd`` component ``i``'s device data ``value`` (None: a tombstone); sizes follow."""
        self.out(nd, i)
        nd.aux[i] = value
        self.into(nd, i)

    def insert(self, nd: Node, aux_values: list | None, a: int, b: int, n: int) -> None:
        """Tokens ``[a, b)`` of an inserted key of ``n`` tokens landed on ``nd``: each component
        reconciles its incoming value with the node's (what it replaces is queued in ``frees``)."""
        if aux_values is None:
            return
        for i, c in enumerate(self.components):
            incoming = aux_values[i]
            if incoming is None:
                continue
            cur = nd.aux[i]
            keep, free = c.reconcile(nd, cur, incoming, a, b, b == n)
            if keep is not cur:
                self.set(nd, i, keep)
            if free is not None:
                self.frees.append((i, free))

    def split(self, up: Node, child: Node, m: int) -> None:
        """``up`` was cut from the top ``m`` tokens of ``child``: each value and the locks whose
        floor is above the cut go with it."""
        s = child.start
        for i, c in enumerate(self.components):
            up.aux_lock[i] = {f: k for f, k in child.aux_lock[i].items() if f < s}
            v = child.aux[i]
            if v is None:
                continue
            self.out(child, i)
            up.aux[i], child.aux[i] = c.split(v, m)
            self.into(up, i)
            self.into(child, i)

    def drop(self, nd: Node) -> None:
        """``nd`` loses its device data: every component value is freed."""
        for i, v in enumerate(nd.aux):
            if v is not None:
                self.set(nd, i, None)
                self.frees.append((i, v))

    def evict(self, i: int, num: int, backup=None) -> int:
        """Tombstone component ``i``'s data on unlocked nodes (unpinned ones first, then policy
        order) until ``num`` units are freed. The nodes stay; their FULL data is untouched."""
        t = self.tree
        t.policy.begin_pass()
        c, key = self.components[i], t.policy.key
        heap = [(nd.pin > 0, key(nd), nd.id, nd) for nd in self.unlocked[i]]
        heapify(heap)
        freed = 0
        while freed < num and heap:
            *_, nd = heappop(heap)
            v = nd.aux[i]
            if backup is not None:
                backup(nd, i)
            if t.spills is not None and nd.aux_host[i] is None:      # its last copy
                t.spill(nd, None, False, [(i, v, False)])
            freed += c.size(v)
            self.set(nd, i, None)
            self.frees.append((i, v))
        return freed
