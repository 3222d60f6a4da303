"""The router's two views of what each worker has cached."""

from __future__ import annotations

import time
from heapq import heapify, heappop, heappush
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from tandem.core.page_hash import common_pages, page_hashes

DEVICE = "device"
HOST = "host"


class _Node:
    __slots__ = ("id", "parent", "key", "end", "children", "workers")

    def __init__(self, nid: int, parent: "_Node | None", key: tuple[Any, ...], end: int):
        self.id = nid
        self.parent = parent
        self.key = key                          # this edge's key elements (whole pages), a tuple
        self.end = end                          # depth (key elements) after this edge
        self.children: dict[Any, _Node] = {}    # first page of the child's edge -> child
        self.workers: dict[int, int] = {}       # holder -> logical time it was last routed


class ApproxPrefixIndex:
    """Per-worker approximate prefix trees, stored as one radix tree over pages."""

    def __init__(self, page_size: int = 1, capacity: int | None = None):
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        if capacity is not None and capacity < page_size:
            raise ValueError(f"capacity={capacity} holds no page of page_size={page_size}")
        self.page_size = page_size
        self.capacity = capacity
        self.root = _Node(0, None, (), 0)
        self._next_id = 1
        self._tick = 0
        self._size: dict[int, int] = {}          # worker -> key elements held
        self._nodes: dict[int, int] = {}         # worker -> nodes held
        self._heap: dict[int, list[tuple[int, int, int, _Node]]] = {}         # worker -> [(tick, -end, node id, node)]
        self._version = 0                        # bumped by every change of structure
        # match()'s (key object, its tuple, version, fully matched nodes)
        self._memo: tuple[Sequence[int], tuple[int, ...], int, list[_Node]] | None = None

    def _first(self, key: tuple[Any, ...], pos: int) -> Any:
        return key[pos] if self.page_size == 1 else tuple(key[pos:pos + self.page_size])

    def _prep(self, key: Sequence[int]) -> tuple[tuple[int, ...], int]:
        tk = key if isinstance(key, tuple) else tuple(key)
        return tk, len(tk) - len(tk) % self.page_size

    def match(self, key: Sequence[int]) -> dict[int, int]:
        """``{worker: matched key elements}`` for every worker holding a non-empty prefix of ``key``
        (page-aligned)."""
        tkey, n = self._prep(key)
        node, pos = self.root, 0
        out: dict[int, int] = {}
        live: set[int] | None = None
        path: list[_Node] = []
        while pos < n:
            child = node.children.get(self._first(tkey, pos))
            if child is None:
                break
            ek = child.key
            L = len(ek)
            if pos + L <= n and tkey[pos:pos + L] == ek:
                got = L
            else:
                got = common_pages(ek, tkey, pos, n, self.page_size)
            if live is None:
                live = set(child.workers)
            elif not live.issubset(child.workers):
                for w in live.difference(child.workers):
                    out[w] = pos
                live.intersection_update(child.workers)
            if not live:
                break
            if got < L:
                pos += got
                break
            path.append(child)
            pos += got
            node = child
        for w in live or ():
            out[w] = pos
        self._memo = (key, tkey, self._version, path)
        return out

    def insert(self, worker: int, key: Sequence[int]) -> None:
        """Record that ``worker`` now holds ``key`` (its whole pages), as most recently routed;
        then drop its oldest leaves while it holds more than ``capacity``."""
        memo = self._memo
        hit = memo is not None and memo[0] is key and memo[2] == self._version
        if memo is not None and hit:
            tkey = memo[1]
            n = len(tkey) - len(tkey) % self.page_size
        else:
            tkey, n = self._prep(key)
        self._tick += 1
        tick = self._tick
        heap = self._heap.setdefault(worker, [])
        size = self._size.get(worker, 0)
        held = 0                                # nodes newly held (a split counts itself)
        node, pos = self.root, 0
        if memo is not None and hit:
            for child in memo[3]:               # fully matched by the match() just before
                if worker not in child.workers:
                    size += len(child.key)
                    held += 1
                child.workers[worker] = tick
                heappush(heap, (tick, -child.end, child.id, child))
                node = child
            pos = node.end
        while pos < n:
            first = self._first(tkey, pos)
            found = node.children.get(first)
            if found is None:
                child = _Node(self._next_id, node, tkey[pos:n], n)
                self._next_id += 1
                node.children[first] = child
            else:
                child = found
                L = len(child.key)
                if pos + L > n or tkey[pos:pos + L] != child.key:
                    child = self._split(child, common_pages(child.key, tkey, pos, n, self.page_size))
            if worker not in child.workers:
                size += len(child.key)
                held += 1
            child.workers[worker] = tick
            heappush(heap, (tick, -child.end, child.id, child))
            pos = child.end
            node = child
        self._version += 1
        self._memo = None
        self._size[worker] = size
        self._nodes[worker] = self._nodes.get(worker, 0) + held
        if self.capacity is not None and size > self.capacity:
            self._evict(worker, size - self.capacity)
        if len(self._heap[worker]) > 2 * self._nodes[worker] + 64:
            self._compact(worker)

    def _split(self, child: _Node, m: int) -> _Node:
        parent = child.parent
        assert parent is not None, "the root is never split"
        top = _Node(self._next_id, parent, child.key[:m], child.end - len(child.key) + m)
        self._next_id += 1
        top.workers = dict(child.workers)
        parent.children[self._first(child.key, 0)] = top
        child.key = child.key[m:]
        child.parent = top
        top.children[self._first(child.key, 0)] = child
        for w, t in top.workers.items():
            heappush(self._heap[w], (t, -top.end, top.id, top))
            self._nodes[w] += 1
        return top

    def _evict(self, worker: int, amount: int) -> None:
        heap = self._heap[worker]
        freed = 0
        while freed < amount and heap:
            tick, _, _, nd = heappop(heap)
            if nd.workers.get(worker) != tick or nd.parent is None:
                continue                          # stale: touched again since, or gone
            if any(worker in c.workers for c in nd.children.values()):
                continue                          # not this worker's leaf (cannot happen; safe)
            freed += self._drop(nd, worker)
            self._nodes[worker] -= 1
        self._size[worker] -= freed

    def _drop(self, nd: _Node, worker: int) -> int:
        del nd.workers[worker]
        freed = len(nd.key)
        while not nd.workers and not nd.children and nd.parent is not None:
            parent = nd.parent
            del parent.children[self._first(nd.key, 0)]
            nd.parent = None
            nd = parent
        return freed

    def _compact(self, worker: int) -> None:
        heap = [e for e in self._heap[worker] if e[3].parent is not None and e[3].workers.get(worker) == e[0]]
        heapify(heap)
        self._heap[worker] = heap

    def remove_worker(self, worker: int) -> None:
        """Forget everything ``worker`` holds (it died or restarted with an empty cache)."""
        self._version += 1
        heap = self._heap.pop(worker, [])
        nodes = {e[3].id: e[3] for e in heap if e[3].parent is not None and worker in e[3].workers}
        for nd in sorted(nodes.values(), key=lambda x: -x.end):     # deepest first
            if worker in nd.workers:
                self._drop(nd, worker)
        self._size.pop(worker, None)
        self._nodes.pop(worker, None)

    def size(self, worker: int) -> int:
        """Key elements held for ``worker``."""
        return self._size.get(worker, 0)

    def num_nodes(self) -> int:
        n, stack = 0, [self.root]
        while stack:
            nd = stack.pop()
            n += 1
            stack.extend(nd.children.values())
        return n - 1


block_hashes = page_hashes


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One worker's store/remove/clear of blocks, in the router's own terms."""

    worker_id: int
    kind: str                           # "stored" | "removed" | "cleared" | "pinned" | "unpinned"
    block_hashes: tuple[int, ...] = ()  # a chain: each names its whole prefix
    num_tokens: int = 0                 # tokens these blocks cover
    tier: str = DEVICE                  # DEVICE or HOST
    parent_hash: int | None = None      # the block before the first one (stored only)
    ttl_s: float = 0.0                  # pinned only: seconds the pin lasts from now


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class GlobalBlockIndex:
    """Exact block index: block hash -> the workers holding it, per tier, as bitmasks over worker
    ids (ids must be >= 0); and the blocks each worker has pinned, until when (``clock`` time: a
    pin event carries its seconds left, so worker and router clocks need not agree)."""

    def __init__(self, clock=time.monotonic):
        self._tier: dict[str, dict[int, int]] = {DEVICE: {}, HOST: {}}   # tier -> hash -> mask
        self._held: dict[int, dict[str, set[int]]] = {}                   # worker -> tier -> hashes
        self._pins: dict[int, dict[int, float]] = {}                      # worker -> hash -> until
        self._clock = clock
        self.applied = 0

    def apply(self, event: KVEvent) -> None:
        w = event.worker_id
        if w < 0:
            raise ValueError(f"worker_id={w} must be >= 0 in {event}")
        if event.kind == "cleared":
            self.remove_worker(w)
        elif event.kind == "pinned":
            pins, until = self._pins.setdefault(w, {}), self._clock() + event.ttl_s
            for h in event.block_hashes:
                pins[h] = max(pins.get(h, 0.0), until)
        elif event.kind == "unpinned":
            pins = self._pins.get(w, {})
            for h in event.block_hashes:
                pins.pop(h, None)
        elif event.kind in ("stored", "removed"):
            index = self._tier.get(event.tier)
            if index is None:
                raise ValueError(f"unknown tier {event.tier!r} in {event}")
            mine = self._held.setdefault(w, {DEVICE: set(), HOST: set()})[event.tier]
            bit = 1 << w
            if event.kind == "stored":
                for h in event.block_hashes:
                    mine.add(h)
                    index[h] = index.get(h, 0) | bit
            else:
                for h in event.block_hashes:
                    mine.discard(h)
                    m = index.get(h, 0) & ~bit
                    if m:
                        index[h] = m
                    else:
                        index.pop(h, None)
        else:
            raise ValueError(f"unknown KV event kind {event.kind!r}")
        self.applied += 1

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for e in events:
            self.apply(e)

    def remove_worker(self, worker: int) -> None:
        self._pins.pop(worker, None)
        held = self._held.pop(worker, None)
        if not held:
            return
        bit = ~(1 << worker)
        for tier, hashes in held.items():
            index = self._tier[tier]
            for h in hashes:
                m = index.get(h, 0) & bit
                if m:
                    index[h] = m
                else:
                    index.pop(h, None)

    def holders(self, block_hash: int) -> dict[int, str]:
        """``{worker: tier}`` for one block (DEVICE when a worker holds it on both tiers)."""
        out = {w: HOST for w in _bits(self._tier[HOST].get(block_hash, 0))}
        out.update({w: DEVICE for w in _bits(self._tier[DEVICE].get(block_hash, 0))})
        return out

    def overlap(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """``{worker: (device_blocks, host_blocks)}``: the longest contiguous prefix of
        ``hashes`` each worker holds (on either tier), split into its leading device-resident
        run and the blocks after it (host copies to load back)."""
        dev_get = self._tier[DEVICE].get
        host = self._tier[HOST]
        host_get = host.get if host else None
        ends_all: dict[int, int] = {}
        ends_dev: dict[int, int] = {}
        live = dlive = 0
        n = 0
        for i, h in enumerate(hashes):
            dm = dev_get(h, 0)
            m = dm | host_get(h, 0) if host_get is not None else dm
            if i == 0:
                live, dlive = m, dm
            else:
                nl = live & m
                if nl != live:
                    for w in _bits(live & ~nl):
                        ends_all[w] = i
                    live = nl
                nd = dlive & dm
                if nd != dlive:
                    for w in _bits(dlive & ~nd):
                        ends_dev[w] = i
                    dlive = nd
            if not live:
                break
            n = i + 1
        for w in _bits(live):
            ends_all[w] = n
        for w in _bits(dlive):
            ends_dev[w] = n
        return {w: (ends_dev.get(w, 0), k - ends_dev.get(w, 0)) for w, k in ends_all.items()}

    def pinned_prefix(self, hashes: Sequence[int]) -> dict[int, int]:
        """``{worker: blocks}``: the longest leading run of ``hashes`` each worker has pinned now
        (workers with none are left out). A pinned page is kept on the worker's device, its host
        tier or the L3 store until its pin ends, so the run is reusable there."""
        now = self._clock()
        out = {}
        for w, pins in self._pins.items():
            n = 0
            for h in hashes:
                if pins.get(h, 0.0) <= now:
                    break
                n += 1
            if n:
                out[w] = n
            elif len(pins) > 64 and hashes:          # lazily drop ended pins
                for h in [h for h, until in pins.items() if until <= now]:
                    del pins[h]
        return out

    def has_pins(self) -> bool:
        return any(self._pins.values())

    def pinned_blocks(self, worker: int) -> int:
        """Blocks ``worker`` has pinned now."""
        now = self._clock()
        return sum(1 for until in self._pins.get(worker, {}).values() if until > now)

    def known_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` some worker holds, on either tier: with a shared L3
        store (workers write every page they cache through to it), the prefix any worker
        can read from the store."""
        dev, host = self._tier[DEVICE], self._tier[HOST]
        n = 0
        for h in hashes:
            if h not in dev and h not in host:
                break
            n += 1
        return n

    def blocks_held(self, worker: int, tier: str = DEVICE) -> int:
        held = self._held.get(worker)
        return len(held[tier]) if held else 0

    def num_blocks(self) -> int:
        """Distinct blocks held anywhere (a block on both tiers counts once per tier)."""
        return len(self._tier[DEVICE]) + len(self._tier[HOST])
