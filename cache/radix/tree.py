"""Radix tree core over token pages. The tree decides, the cache executes."""

from __future__ import annotations

from typing import Any, Hashable, Sequence

from tandem.core.page_hash import common_pages, page_hashes

from tandem.cache.tiers.host_nodes import HostCopies, Spill

from .aux import AuxData
from .components import TreeComponent, vote
from .events import DEVICE, BlockRemoved, BlockStored, WireEvent
from .eviction import EvictionPolicy, LeafHeap, make_policy
from .node import Node, concat_values, cut_value, parent_of, take_value  # noqa: F401 (concat_values: re-exported)
from .pins import Pins


class RadixTree:
    """One tree over token pages: device data on nodes (``value``) and locks; and the objects it
    owns, each with its own books: ``leaves`` (evictable leaves in policy order), ``aux``
    (components' device data), ``hosted`` (host-tier copies), ``pins`` (prefixes kept until a time)."""

    def __init__(self, page_size: int = 1, policy: EvictionPolicy | None = None,
                 components: Sequence[TreeComponent] = (), record_events: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.page_size = page_size
        self.policy = policy or make_policy("lru")
        self._key = self.policy.key
        self.components = tuple(components)
        for i, c in enumerate(self.components):
            c.index = i
        self.record_events = record_events
        self.spills: list[Spill] | None = None     # None: nothing records them (no L3 tier)
        self.reset()

    def reset(self) -> None:
        n_aux = len(self.components)
        self._next_id = 1
        self.tick = 0
        self.root = Node(0, None, [], 0, (), 0, n_aux)
        self.root.lock_ref = 1
        self.leaves = LeafHeap(self._key)
        self.evictable = 0
        self.protected = 0
        self.device_frees: list = []
        self.aux = AuxData(self)
        self.hosted = HostCopies(self)
        self.pins = Pins(self)
        self.events: list[WireEvent] = []
        if self.spills is not None:
            self.spills = []

    def child_key(self, key: list) -> Hashable:
        return key[0] if self.page_size == 1 else tuple(key[:self.page_size])

    def match(self, key: list, session: Hashable | None = None,
              priority: int | None = None) -> list[Node]:
        """Nodes covering the longest cached prefix of ``key`` (page-aligned), on any tier. A
        mid-edge divergence splits that edge so the last node ends inside ``key``."""
        ps = self.page_size
        pos, n = 0, len(key)
        path = []
        children = self.root.children
        while pos < n:
            child = children.get(key[pos] if ps == 1 else tuple(key[pos:pos + ps]))
            if child is None:
                break
            ek = child.key
            L = len(ek)
            if key[pos:pos + L] != ek:
                path.append(self.split(child, common_pages(ek, key, pos, n, ps)))
                break
            path.append(child)
            pos += L
            children = child.children
        if path:
            self.tick += 1
            t = self.tick
            for nd in path:
                nd.access = t
                nd.hits += 1
                if session is not None:
                    nd.session = session
                if priority is not None and priority > nd.priority:
                    nd.priority = priority
                if nd.hk is not None:
                    self.leaves.update(nd)
        return path

    def peek(self, key: list) -> int:
        """Depth of the deepest device boundary of ``key`` every component accepts, changing nothing
        (no split, no touch)."""
        ps = self.page_size
        pos, n = 0, len(key)
        path: list[Node] = []
        tail, partial = None, 0
        children = self.root.children
        while pos < n:
            child = children.get(key[pos] if ps == 1 else tuple(key[pos:pos + ps]))
            if child is None:
                break
            ek = child.key
            L = len(ek)
            if key[pos:pos + L] != ek:
                tail, partial = child, common_pages(ek, key, pos, n, ps)
                break
            path.append(child)
            pos += L
            children = child.children
        n_dev, _ = self.vote(path)
        depth = path[n_dev - 1].end if n_dev else 0
        if tail is not None and n_dev == len(path) and not self.components and tail.value is not None:
            depth += partial
        return depth

    def vote(self, path: list[Node]) -> tuple[int, int]:
        """``(n_dev, n_best)`` of ``path`` (:func:`~tandem.cache.radix.components.vote`)."""
        return vote(self.components, path, self.hosted)

    def path(self, node: Node) -> list[Node]:
        out = []
        root = self.root
        while node is not root:
            out.append(node)
            node = parent_of(node)
        out.reverse()
        return out

    def insert(self, key: list, value: Any, aux_values: list | None = None,
               session: Hashable | None = None, priority: int = 0) -> tuple[int, Node, bool]:
        """Store ``key`` with ``value[i]`` the slot of ``key[i]`` (``value`` None: positions). Returns
        ``(cached, last, created)``: the prefix that already had device data (the caller's slots there
        are duplicates, its to free), the node ending at ``len(key)``, whether a leaf was made."""
        ps = self.page_size
        self.tick += 1
        t = self.tick
        comps = self.components
        node = self.root
        pos, n, cached = 0, len(key), 0
        ck = None
        while pos < n:
            ck = key[pos] if ps == 1 else tuple(key[pos:pos + ps])
            child = node.children.get(ck)
            if child is None:
                break
            ek = child.key
            L = len(ek)
            if key[pos:pos + L] != ek:
                L = common_pages(ek, key, pos, n, ps)
                child = self.split(child, L)
            child.access = t
            if priority > child.priority:
                child.priority = priority
            if session is not None:
                child.session = session
            if child.value is None:
                self.set_device(child, take_value(value, pos, pos + L))
            elif cached == pos:
                cached = pos + L
            if comps:
                self.aux.insert(child, aux_values, pos, pos + L, n)
            if child.hk is not None:
                self.leaves.update(child)
            node = child
            pos += L
        if pos >= n:
            return cached, node, False
        new = Node(self._next_id, node, key[pos:], pos, take_value(value, pos, n), t, len(comps))
        self._next_id += 1
        new.hits = 1
        new.priority = priority
        new.session = session
        node.children[ck] = new
        node.ndc += 1
        self.evictable += n - pos
        self.leaves.update(new)
        self.leaves.update(node)
        if self.record_events:
            self.event_store(new, DEVICE)
        if comps:
            self.aux.insert(new, aux_values, pos, n, n)
        return cached, new, True

    def split(self, child: Node, m: int) -> Node:
        """Cut ``child``'s edge after its first ``m`` tokens; returns the new upper node."""
        up = Node(self._next_id, child.parent, child.key[:m], child.start, None, child.access,
                  len(self.components))
        self._next_id += 1
        up.created, up.hits, up.priority, up.session = child.created, child.hits, child.priority, child.session
        up.lock_ref = child.lock_ref
        if child.pin:
            self.pins.split(up, child)
        if child.value is not None:
            up.value, child.value = cut_value(child.value, m)
            up.ndc = 1
        if child.host is not None:
            up.host, child.host = cut_value(child.host, m)
            self.hosted.split(up, child, m)
        if child.hashes is not None:
            k = m // self.page_size
            up.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
        child.key = child.key[m:]
        child.start += m
        up.children = {self.child_key(child.key): child}
        parent_of(child).children[self.child_key(up.key)] = up
        child.parent = up
        if self.components:
            self.aux.split(up, child, m)
        return up

    def lock(self, node: Node, delta: int) -> None:
        """Add ``delta`` (+1/-1) to the lock of every node from ``node`` up to the root. Sizes move
        between evictable and protected when a node's lock crosses zero."""
        root = self.root
        if node is root:
            return
        if node.parent is None:
            raise ValueError(f"{node} is not in this tree (it was evicted, or belongs to another)")
        if delta < 0 and node.lock_ref <= 0:
            raise ValueError(f"unlock of {node}: its lock_ref is already {node.lock_ref}")
        nd = node
        if delta > 0:
            while nd is not root:
                if nd.lock_ref == 0:
                    if nd.value is not None:
                        L = len(nd.key)
                        self.evictable -= L
                        self.protected += L
                    if nd.hk is not None:
                        self.leaves.discard(nd)
                nd.lock_ref += 1
                nd = parent_of(nd)
        else:
            while nd is not root:
                nd.lock_ref -= 1
                if nd.lock_ref == 0 and nd.value is not None:
                    L = len(nd.key)
                    self.evictable += L
                    self.protected -= L
                    self.leaves.update(nd)
                nd = parent_of(nd)
        if self.components:
            end = node.start + len(node.key)
            aux = self.aux
            for i, c in enumerate(self.components):
                floor = max(0, end - c.lock_span)
                nd = node
                while nd is not root and nd.start + len(nd.key) > floor:
                    locks = nd.aux_lock[i]
                    aux.out(nd, i)
                    cnt = locks.get(floor, 0) + delta
                    if cnt:
                        locks[floor] = cnt
                    else:
                        del locks[floor]
                    aux.into(nd, i)
                    nd = parent_of(nd)

    def drop_device(self, nd: Node) -> int:
        """Release ``nd``'s device data (queued in ``device_frees``). With a host copy the node
        stays, host-only; without, it is deleted with its (host-only) subtree. Returns tokens."""
        v = nd.value
        L = len(nd.key)
        if self.spills is not None:
            aux = [(i, a, False) for i, a in enumerate(nd.aux or ())
                   if a is not None and nd.aux_host[i] is None]
            if nd.host is None or aux:
                self.spill(nd, v if nd.host is None else None, False, aux)
        nd.value = None
        if nd.lock_ref:
            self.protected -= L
        else:
            self.evictable -= L
        if nd.hk is not None:
            self.leaves.discard(nd)
        parent = parent_of(nd)
        parent.ndc -= 1
        self.device_frees.append(v)
        if self.record_events:
            self.event_remove(nd, DEVICE)
        if self.components:
            self.aux.drop(nd)
        if nd.host is None:
            if nd.children:
                self.delete_subtree(nd)
            else:
                del parent.children[nd.key[0] if self.page_size == 1 else tuple(nd.key[:self.page_size])]
                nd.parent = None
                if nd.pin:
                    self.pins.forget(nd)
        self.leaves.update(parent)
        return L

    def set_device(self, nd: Node, value: Any) -> None:
        nd.value = value
        L = len(nd.key)
        if nd.lock_ref:
            self.protected += L
        else:
            self.evictable += L
        parent_of(nd).ndc += 1
        self.leaves.update(nd)
        self.leaves.update(parent_of(nd))
        if self.record_events:
            self.event_store(nd, DEVICE)

    def delete_subtree(self, nd: Node) -> None:
        """Remove ``nd`` and everything under it (no device data is left there: host copies are
        dropped, pins forgotten)."""
        stack = [nd]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x.host is not None:
                self.hosted.drop(x)
            if self.components:
                self.aux.drop(x)
            if x.pin:
                self.pins.forget(x)
            if x is not nd:
                x.parent = None
        del parent_of(nd).children[self.child_key(nd.key)]
        nd.parent = None

    def spill(self, nd: Node, slots: Any, on_host: bool, aux: Sequence[tuple[int, Any, bool]] = ()) -> None:
        """Record data of ``nd`` whose last copy leaves the tree (the L3 tier's write-back): FULL
        ``slots`` (None: only component data), on the host pool or the device, and
        ``aux``: ``(component index, value, on_host)`` items; last, the node's pin (its end on the
        cache's clock, 0: none), which the L3 store keeps as the entry's expiry."""
        if self.spills is None:
            raise RuntimeError("spill() with no spill record (the cache has no L3 tier)")
        self.spills.append((self.hashes(nd), slots, on_host, tuple(aux), nd.pin))

    def hashes(self, nd: Node) -> list[int]:
        todo = []
        x = nd
        while x is not self.root and x.hashes is None:
            todo.append(x)
            x = parent_of(x)
        for y in reversed(todo):
            y.hashes = page_hashes(y.key, self.page_size, self._last_hash(parent_of(y)))
        if nd.hashes is None:
            raise ValueError(f"{nd}: the root has no page hashes")
        return nd.hashes

    def _last_hash(self, nd: Node) -> int | None:
        return None if nd is self.root else self.hashes(nd)[-1]

    def event_store(self, nd: Node, medium: str) -> None:
        hs = self.hashes(nd)
        self.events.append(BlockStored(list(hs), self._last_hash(parent_of(nd)), list(nd.key),
                                       self.page_size, medium))

    def event_remove(self, nd: Node, medium: str) -> None:
        self.events.append(BlockRemoved(list(self.hashes(nd)), medium))
