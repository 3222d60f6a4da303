"""Radix tree core over token pages. The tree decides, the cache executes."""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any, Hashable, Sequence

import torch

from tandem.core.page_hash import common_pages, page_hashes

from .events import DEVICE, BlockRemoved, BlockStored, WireEvent
from .components import TreeComponent
from .eviction import EvictionPolicy, make_policy
from .node import Node, parent_of
from tandem.cache.tiers.host_nodes import HostNodes, Spill
from .pins import Pins


def _take(value: Any, a: int, b: int) -> Any:
    if value is None:
        return range(a, b)
    piece = value[a:b]
    return piece.clone() if isinstance(piece, torch.Tensor) else piece


def _cut(value: Any, m: int) -> tuple[Any, Any]:
    if isinstance(value, torch.Tensor):
        return value[:m].clone(), value[m:].clone()
    return value[:m], value[m:]


def concat_values(pieces: list) -> torch.Tensor:
    """One int64 tensor of the path's values: always a new tensor, never the tree's own."""
    if not pieces:
        return torch.empty(0, dtype=torch.int64)
    if all(type(p) is range for p in pieces):
        return torch.arange(pieces[0].start, pieces[-1].stop, dtype=torch.int64)
    return torch.cat([p if isinstance(p, torch.Tensor) else torch.as_tensor(list(p), dtype=torch.int64)
                      for p in pieces])


class RadixTree(HostNodes, Pins):
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
        self.leaves: set[Node] = set()
        self.heap: list[tuple[Any, int, Node]] = []
        # pinned evictable leaves: popped only when ``heap`` is empty
        self.pheap: list[tuple[Any, int, Node]] = []
        self.reset_pins()
        self.evictable = 0
        self.protected = 0
        self.aux_evictable = [0] * n_aux
        self.aux_protected = [0] * n_aux
        self.aux_unlocked: list[set[Node]] = [set() for _ in range(n_aux)]
        self.host_nodes: set[Node] = set()
        self.host_size = 0
        self.aux_host_size = [0] * n_aux
        self.aux_host_nodes: list[set[Node]] = [set() for _ in range(n_aux)]
        self.device_frees: list = []
        self.host_frees: list = []
        self.aux_frees: list[tuple[int, Any]] = []
        self.aux_host_frees: list[tuple[int, Any]] = []
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
                path.append(self._split(child, common_pages(ek, key, pos, n, ps)))
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
                    self._upd(nd)
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
        """``(n_dev, n_best)``: how many leading nodes of ``path`` end at the deepest boundary
        every component accepts with device data (``n_dev``) and with data on either tier
        (``n_best``: host copies of component data count, so a load-back can serve it)."""
        if not self.components:
            if not self.host_nodes:
                return len(path), len(path)
            for i, nd in enumerate(path):
                if nd.value is None:
                    return i, len(path)
            return len(path), len(path)
        validators = [c.validator() for c in self.components]
        hosted = any(self.aux_host_nodes)
        anywhere = [c.validator(host=True) for c in self.components] if hosted else None
        n_dev = n_best = 0
        on_device = True
        for i, nd in enumerate(path, 1):
            if nd.value is None:
                on_device = False
            ok = True
            for accept in validators:
                if not accept(nd):
                    ok = False
            if ok and on_device:
                n_dev = i
            if anywhere is not None:
                ok = True
                for accept in anywhere:
                    if not accept(nd):
                        ok = False
            if ok:
                n_best = i
        return n_dev, n_best

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
                child = self._split(child, L)
            child.access = t
            if priority > child.priority:
                child.priority = priority
            if session is not None:
                child.session = session
            if child.value is None:
                self.set_device(child, _take(value, pos, pos + L))
            elif cached == pos:
                cached = pos + L
            if comps:
                self._aux_insert(child, aux_values, pos, pos + L, n)
            if child.hk is not None:
                self._upd(child)
            node = child
            pos += L
        if pos >= n:
            return cached, node, False
        new = Node(self._next_id, node, key[pos:], pos, _take(value, pos, n), t, len(comps))
        self._next_id += 1
        new.hits = 1
        new.priority = priority
        new.session = session
        node.children[ck] = new
        node.ndc += 1
        self.evictable += n - pos
        self._upd(new)
        self._upd(node)
        if self.record_events:
            self._event_store(new, DEVICE)
        if comps:
            self._aux_insert(new, aux_values, pos, n, n)
        return cached, new, True

    def _split(self, child: Node, m: int) -> Node:
        up = Node(self._next_id, child.parent, child.key[:m], child.start, None, child.access,
                  len(self.components))
        self._next_id += 1
        up.created, up.hits, up.priority, up.session = child.created, child.hits, child.priority, child.session
        up.lock_ref = child.lock_ref
        if child.pin:
            self.pin_split(up, child)
        if child.value is not None:
            up.value, child.value = _cut(child.value, m)
            up.ndc = 1
        if child.host is not None:
            up.host, child.host = _cut(child.host, m)
            self.host_nodes.add(up)
            if self.components:
                self._aux_host_split(up, child, m)
        if child.hashes is not None:
            k = m // self.page_size
            up.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
        child.key = child.key[m:]
        child.start += m
        up.children = {self.child_key(child.key): child}
        parent_of(child).children[self.child_key(up.key)] = up
        child.parent = up
        if self.components:
            self._aux_split(up, child, m)
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
                        nd.hk = None
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
                    self._upd(nd)
                nd = parent_of(nd)
        if self.components:
            end = node.start + len(node.key)
            for i, c in enumerate(self.components):
                floor = max(0, end - c.lock_span)
                nd = node
                while nd is not root and nd.start + len(nd.key) > floor:
                    locks = nd.aux_lock[i]
                    self._aux_out(nd, i)
                    cnt = locks.get(floor, 0) + delta
                    if cnt:
                        locks[floor] = cnt
                    else:
                        del locks[floor]
                    self._aux_in(nd, i)
                    nd = parent_of(nd)

    def _upd(self, nd: Node) -> None:
        if nd.value is not None and nd.lock_ref == 0 and nd.ndc == 0:
            k = self._key(nd)
            hk = nd.hk
            if hk is None:
                self.leaves.add(nd)
            elif hk == k:
                return
            nd.hk = k
            heappush(self.pheap if nd.pin else self.heap, (k, nd.id, nd))
            if len(self.heap) + len(self.pheap) > 2 * len(self.leaves) + 256:
                self.rebuild_heap()
        elif nd.hk is not None:
            nd.hk = None
            self.leaves.discard(nd)

    def rebuild_heap(self) -> None:
        key = self._key
        heap: list[tuple[Any, int, Node]] = []
        pheap: list[tuple[Any, int, Node]] = []
        for nd in self.leaves:
            nd.hk = key(nd)
            (pheap if nd.pin else heap).append((nd.hk, nd.id, nd))
        heapify(heap)
        heapify(pheap)
        self.heap, self.pheap = heap, pheap

    def pop_leaf(self) -> Node | None:
        """The next evictable leaf: every unpinned one (policy order) before any pinned one."""
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
            nd.hk = None
            self.leaves.discard(nd)
        parent = parent_of(nd)
        parent.ndc -= 1
        self.device_frees.append(v)
        if self.record_events:
            self._event_remove(nd, DEVICE)
        if self.components:
            self._aux_drop(nd)
        if nd.host is None:
            if nd.children:
                self._delete_subtree(nd)
            else:
                del parent.children[nd.key[0] if self.page_size == 1 else tuple(nd.key[:self.page_size])]
                nd.parent = None
                if nd.pin:
                    self.forget_pin(nd)
        self._upd(parent)
        return L

    def set_device(self, nd: Node, value: Any) -> None:
        nd.value = value
        L = len(nd.key)
        if nd.lock_ref:
            self.protected += L
        else:
            self.evictable += L
        parent_of(nd).ndc += 1
        self._upd(nd)
        self._upd(parent_of(nd))
        if self.record_events:
            self._event_store(nd, DEVICE)

    def _delete_subtree(self, nd: Node) -> None:
        stack = [nd]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x.host is not None:
                self._drop_host_value(x)
            if self.components:
                self._aux_drop(x)
            if x.pin:
                self.forget_pin(x)
            if x is not nd:
                x.parent = None
        del parent_of(nd).children[self.child_key(nd.key)]
        nd.parent = None

    def _aux_out(self, nd: Node, i: int) -> None:
        v = nd.aux[i]
        if v is None:
            return
        sz = self.components[i].size(v)
        if nd.aux_lock[i]:
            self.aux_protected[i] -= sz
        else:
            self.aux_evictable[i] -= sz
            self.aux_unlocked[i].discard(nd)

    def _aux_in(self, nd: Node, i: int) -> None:
        v = nd.aux[i]
        if v is None:
            return
        sz = self.components[i].size(v)
        if nd.aux_lock[i]:
            self.aux_protected[i] += sz
        else:
            self.aux_evictable[i] += sz
            self.aux_unlocked[i].add(nd)

    def set_aux(self, nd: Node, i: int, value: Any) -> None:
        """Give ``nd`` component ``i``'s device data ``value`` (None: a tombstone); sizes follow."""
        self._aux_out(nd, i)
        nd.aux[i] = value
        self._aux_in(nd, i)

    def _aux_insert(self, nd: Node, aux_values: list | None, a: int, b: int, n: int) -> None:
        if aux_values is None:
            return
        for i, c in enumerate(self.components):
            incoming = aux_values[i]
            if incoming is None:
                continue
            cur = nd.aux[i]
            keep, free = c.reconcile(nd, cur, incoming, a, b, b == n)
            if keep is not cur:
                self.set_aux(nd, i, keep)
            if free is not None:
                self.aux_frees.append((i, free))

    def _aux_split(self, up: Node, child: Node, m: int) -> None:
        s = child.start
        for i, c in enumerate(self.components):
            up.aux_lock[i] = {f: k for f, k in child.aux_lock[i].items() if f < s}
            v = child.aux[i]
            if v is None:
                continue
            self._aux_out(child, i)
            up.aux[i], child.aux[i] = c.split(v, m)
            self._aux_in(up, i)
            self._aux_in(child, i)

    def _aux_drop(self, nd: Node) -> None:
        for i, v in enumerate(nd.aux):
            if v is not None:
                self.set_aux(nd, i, None)
                self.aux_frees.append((i, v))

    def evict_aux(self, i: int, num: int, backup=None) -> int:
        """Tombstone component ``i``'s data on unlocked nodes (unpinned ones first, then policy
        order) until ``num`` units are freed. The nodes stay; their FULL data is untouched."""
        self.policy.begin_pass()
        c, key = self.components[i], self._key
        heap = [(nd.pin > 0, key(nd), nd.id, nd) for nd in self.aux_unlocked[i]]
        heapify(heap)
        freed = 0
        while freed < num and heap:
            *_, nd = heappop(heap)
            v = nd.aux[i]
            if backup is not None:
                backup(nd, i)
            if self.spills is not None and nd.aux_host[i] is None:      # its last copy
                self.spill(nd, None, False, [(i, v, False)])
            freed += c.size(v)
            self.set_aux(nd, i, None)
            self.aux_frees.append((i, v))
        return freed

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

    def _event_store(self, nd: Node, medium: str) -> None:
        hs = self.hashes(nd)
        self.events.append(BlockStored(list(hs), self._last_hash(parent_of(nd)), list(nd.key),
                                       self.page_size, medium))

    def _event_remove(self, nd: Node, medium: str) -> None:
        self.events.append(BlockRemoved(list(self.hashes(nd)), medium))
