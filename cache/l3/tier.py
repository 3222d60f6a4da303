"""L3Tier: the shared store as the radix cache's third tier (the cache's collaborator, like HostTier).

Whole FULL pages only, named by the page hash chain (``core/page_hash.py``) under the store's
key prefix (model, page size, dtype, layout), so any worker with interchangeable pages reuses
them. A page's payload is its K/V for every layer of the pool, ``[L, 2, page_size, H_kv, D]``
in the pool's dtype, as raw bytes (the store adds and checks a digest).

Writes (never block the step: the bytes are gathered here, the store write is queued for the
store client's writer thread, and a full queue or a down store drops the write, counted):

- ``write_back``: a node's last copy leaving the tree (a device eviction without a host copy, a
  host eviction of a host-only node) is written before its slots are freed (the tree records it
  in ``spills``; the cache drains them before it frees anything);
- ``write_through``: also every node the tree creates, at insert.
Pages this tier wrote or read recently are not written again.

Reads: :meth:`fetch` continues a match that ends on the device (after any host load-back) into
the store: one batch ``exists`` over the next pages (at most ``budget_pages``), then the leading
run of hits is read into fresh device slots and inserted into the tree, stopping at the first
page that is absent, corrupt, or past ``deadline_s`` (all misses: the request recomputes them).

Hybrid models: not supported. A cache with auxiliary components (SWA rows, recurrent state)
refuses the tier (:meth:`bind` raises): a page fetched without its component data would fail
the components' vote anyway, so the L3 match would always stop where the device/host one does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.cache.l3.store import L3Store
from tandem.core.page_hash import page_hashes

WRITE_POLICIES = ("write_back", "write_through")


@dataclass
class L3TierStats:
    lookups: int = 0            # fetches that asked the store (a match shorter than the prompt)
    hit_pages: int = 0          # pages read from the store into the cache
    miss_pages: int = 0         # pages asked for and not fetched (absent, corrupt, late, no room)
    prefetch_s: float = 0.0     # seconds spent in fetch (exists + get + copies)
    written_pages: int = 0      # pages queued for writing (write-back spills and write-through)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class L3Tier:
    """``store``: the client; ``kv_data``: the device pool's ``[L, 2, rows, H_kv, D]``."""

    def __init__(self, store: L3Store, kv_data: torch.Tensor, page_size: int, *,
                 write_policy: str = "write_back", budget_pages: int = 256,
                 deadline_s: float | None = None, remember_pages: int = 1 << 18):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown L3 write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        self.store = store
        self.kv_data = kv_data
        self.page_size = page_size
        self.write_policy = write_policy
        self.budget_pages = budget_pages
        self.deadline_s = store.timeout_s if deadline_s is None else deadline_s
        self.stats = L3TierStats()
        self._remember = remember_pages
        self._known: dict[int, None] = {}       # hashes recently written or read (insertion order)
        L, _, _, H, D = kv_data.shape
        self._page_shape = (L, 2, page_size, H, D)
        self._page_bytes = L * 2 * page_size * H * D * kv_data.element_size()
        self._cache = None

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    def bind(self, cache) -> None:
        """Attach to one FULL-only cache (a friend: it reaches the cache's tree and allocator)."""
        if self._cache is not None and self._cache is not cache:
            raise ValueError("an L3Tier serves one cache")
        if cache._aux:
            raise ValueError(f"the L3 tier holds FULL pages only; this cache has components "
                             f"{[c.name for c in cache._aux]}")
        if cache.allocator is None or cache.page_size != self.page_size:
            raise ValueError("the L3 tier needs a device allocator with its page_size")
        self._cache = cache
        cache._tree.spills = []

    def as_dict(self) -> dict:
        """The tier's and the store client's counters (``/debug/kv``, ``/metrics``)."""
        return {**self.stats.as_dict(), **{f"store_{k}": v for k, v in self.store.stats.as_dict().items()},
                "up": self.store.up, "write_policy": self.write_policy}

    # -- writes ----------------------------------------------------------------------------------
    def _remember_pages(self, hashes) -> None:
        known = self._known
        for h in hashes:
            known[h] = None
        while len(known) > self._remember:
            del known[next(iter(known))]

    def write_node(self, nd) -> None:
        """Write-through: queue ``nd``'s device pages that the store was not given recently."""
        self._write(self._cache._tree.hashes(nd), nd.value, self.kv_data)

    def spill(self, spills: list) -> None:
        """Write-back: queue the pages of ``(hashes, slots, on_host)`` records (the tree's
        ``spills``) before the cache frees those slots."""
        host = self._cache.host
        if host is not None and any(on_host for _, _, on_host in spills):
            host.synchronize()              # host rows may still be landing (CUDA)
        for hashes, slots, on_host in spills:
            self._write(hashes, slots, host.pool.kv_data if on_host else self.kv_data)

    def _write(self, hashes: list[int], slots: torch.Tensor, src: torch.Tensor) -> None:
        ps = self.page_size
        todo = [i for i, h in enumerate(hashes) if h not in self._known]
        if not todo or not self.store.up:
            return
        idx = torch.cat([slots[i * ps:(i + 1) * ps] for i in todo]).to(src.device)
        rows = src[:, :, idx].cpu()                           # [L, 2, len(todo) * ps, H, D]
        pages = [(hashes[i], _to_bytes(rows[:, :, j * ps:(j + 1) * ps])) for j, i in enumerate(todo)]
        queued = self.store.put_async(pages)
        self.stats.written_pages += queued
        self._remember_pages(h for h, _ in pages[:queued])

    # -- reads -----------------------------------------------------------------------------------
    def fetch(self, token_ids, m, *, session_id=None) -> int:
        """Continue match ``m`` of ``token_ids`` into the store: read the leading run of stored
        pages after ``m``'s device prefix into new device slots and insert them. Returns the
        tokens added (0: nothing, e.g. a host part not restored, the store down, no room).
        Waits on the store at most ``deadline_s`` in all (each get is bounded by what is left,
        plus the batch ``exists``, bounded by the store's timeout); the caller matches again."""
        c = self._cache
        t, ps = c._tree, self.page_size
        last = m.last_device_node
        if last is None or m.best_match_node is not last or not self.store.up:
            return 0
        key = c._key(token_ids)
        start = m.prefix_len
        n_pages = min((len(key) - start) // ps, self.budget_pages)
        if n_pages <= 0:
            return 0
        t0 = time.perf_counter()
        self.stats.lookups += 1
        parent = t.hashes(last)[-1] if last is not t.root else None
        hashes = page_hashes(key[start:start + n_pages * ps], ps, parent)
        n = self.store.leading_hits(hashes)
        got = 0
        if n:
            t.lock(last, +1)                # the matched prefix stays while we make room
            try:
                got = self._read(key, start, hashes[:n], m, t0, session_id)
            finally:
                t.lock(last, -1)
                c._after()
        self.stats.hit_pages += got
        self.stats.miss_pages += n_pages - got
        self.stats.prefetch_s += time.perf_counter() - t0
        return got * ps

    def _read(self, key: list, start: int, hashes: list[int], m, t0: float, session_id) -> int:
        c, ps = self._cache, self.page_size
        alloc = c.allocator
        need = len(hashes) * ps
        if alloc.available_size() < need:
            c._evict_device(need - alloc.available_size())
            c._free_device()
        slots = alloc.alloc(need)
        if slots is None:
            return 0
        got = 0
        for i, h in enumerate(hashes):
            left = self.deadline_s - (time.perf_counter() - t0)
            if left <= 0:
                break
            payload = self.store.get(h, budget_s=left)
            page = self._from_bytes(payload) if payload is not None else None
            if page is None:
                break
            idx = slots[i * ps:(i + 1) * ps].to(self.kv_data.device)
            self.kv_data[:, :, idx] = page.to(self.kv_data.device)
            got += 1
        if got < len(hashes):
            alloc.free(slots[got * ps:])
        if got:
            self._remember_pages(hashes[:got])  # already stored: write-through skips them
            value = torch.cat([m.device_indices, slots[:got * ps]])
            c._insert(key[:start + got * ps], value, None, session_id, 0)
        return got

    def _from_bytes(self, payload: bytes) -> torch.Tensor | None:
        """A page's ``[L, 2, ps, H, D]`` tensor, or None when the payload has the wrong size."""
        if len(payload) != self._page_bytes:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.kv_data.dtype).reshape(self._page_shape)


def _to_bytes(page: torch.Tensor) -> bytes:
    """The raw bytes of a ``[L, 2, ps, H, D]`` CPU tensor (any dtype, bf16 included)."""
    return page.contiguous().view(torch.uint8).numpy().tobytes()
