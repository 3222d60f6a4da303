"""Host tier (L2): a host KV pool mirroring the device pool's layout, its allocator, a copier,
and the cache's collaborator for moving requests' KV to the host and back.

The tree decides which nodes live where (device, host, both); :class:`UnifiedRadixCache`
executes through this object: it allocates host slots, asks the copier to move bytes, frees.
A :class:`HostTier` is bound to exactly one cache (``cache.host``); its verbs:

- ``backup(ids, slots, node)``: retraction — hand the request's KV to the tree, then move the
  nodes only that request holds to the host (device slots freed); the node stays locked;
- ``restore(node)``: bring the host-only nodes on root..node back to the device (load-back);
- ``used()``: tokens with a host copy.

Write policies:
- ``write_through``: a node is copied to the host when it is inserted; evicting it from the
  device then only drops the device copy (the node stays, host-only).
- ``write_back``: a node is copied to the host only when it is evicted from the device.
Either way, a device eviction backs up a node that has no host copy yet if the host has room
(after evicting unlocked host copies); otherwise the node is deleted.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.radix.tree import concat_values

WRITE_POLICIES = ("write_through", "write_back")



_MAX_RUNS = 64  # past this many runs one indexed copy beats a Python loop of slice copies


def _copy_runs(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
               src_slots: torch.Tensor) -> None:
    """``dst[:, :, dst_slots] = src[:, :, src_slots]`` for ``[L, 2, rows, H, D]`` pools.

    Slots come in page-contiguous runs (the allocator hands out whole pages, usually adjacent), so
    the copy is done run by run with ``copy_`` on slices: memcpy speed, and no gathered temporary
    (an indexed copy materializes one, page-faulting a fresh buffer of the whole size each time).
    """
    n = len(src_slots)
    if n == 0:
        return
    src_slots = src_slots.to(torch.int64)
    dst_slots = dst_slots.to(torch.int64)
    if n > 1:
        brk = torch.nonzero((src_slots[1:] - src_slots[:-1] != 1) |
                            (dst_slots[1:] - dst_slots[:-1] != 1)).flatten() + 1
    else:
        brk = torch.empty(0, dtype=torch.int64)
    if len(brk) >= _MAX_RUNS:
        dst[:, :, dst_slots] = src[:, :, src_slots]
        return
    starts = [0, *brk.tolist()]
    ends = [*brk.tolist(), n]
    for b, e, s0, d0 in zip(starts, ends, src_slots[starts].tolist(), dst_slots[starts].tolist()):
        dst[:, :, d0:d0 + e - b].copy_(src[:, :, s0:s0 + e - b])

class KVCopier:
    """Moves K/V between ``device_pool`` and ``host_pool`` (same layout, all layers at once).

    On the CPU both copies are plain indexed copies. On CUDA they run on a side stream ordered
    after the work already queued on the compute stream: a D2H copy gathers on the GPU and lands
    in a pinned staging buffer, scattered into the host pool once it is done (:meth:`poll`,
    :meth:`synchronize`); an H2D copy gathers on the host into pinned memory and scatters on the
    GPU, and the compute stream waits for it (no host block). The cache calls
    :meth:`synchronize` before it frees device or host slots a copy may still touch.
    """

    def __init__(self, device_pool: KVPool, host_pool: KVPool):
        self.dev = device_pool
        self.host = host_pool
        self.cuda = device_pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        self._pending: list = []                # (event, staging, host_slots) of D2H copies
        self._inflight: list = []               # (event, staging) of H2D copies

    def to_host(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        if not self.cuda:
            _copy_runs(self.host.kv_data, host_slots, self.dev.kv_data, dev_slots)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))  # KV is written
        with torch.cuda.stream(self.stream):
            idx = dev_slots.to(self.dev.device, non_blocking=True)
            gathered = self.dev.kv_data[:, :, idx]                  # [L, 2, n, H, D] on the GPU
            staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._pending.append((event, staging, host_slots, gathered))

    def to_device(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        if not self.cuda:
            _copy_runs(self.dev.kv_data, dev_slots, self.host.kv_data, host_slots)
            return
        self._flush_host()                      # a load may read what a write-through wrote
        staging = self.host.kv_data[:, :, host_slots].pin_memory()
        self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))  # slots are idle
        with torch.cuda.stream(self.stream):
            data = staging.to(self.dev.device, non_blocking=True)
            self.dev.kv_data[:, :, dev_slots.to(self.dev.device, non_blocking=True)] = data
            event = torch.cuda.Event()
            event.record(self.stream)
        torch.cuda.current_stream(self.dev.device).wait_event(event)
        self._inflight.append((event, staging))

    def _flush_host(self) -> None:
        for event, staging, host_slots, _ in self._pending:
            event.synchronize()
            self.host.kv_data[:, :, host_slots] = staging
        self._pending.clear()

    def poll(self) -> None:
        """Retire the copies that are done, without blocking."""
        if not self.cuda:
            return
        while self._pending and self._pending[0][0].query():     # in issue order
            _, staging, host_slots, _ = self._pending.pop(0)
            self.host.kv_data[:, :, host_slots] = staging
        self._inflight = [x for x in self._inflight if not x[0].query()]

    def synchronize(self) -> None:
        """Finish every copy issued so far."""
        if not self.cuda:
            return
        self._flush_host()
        for event, _ in self._inflight:
            event.synchronize()
        self._inflight.clear()


class HostTier:
    """A host KV pool (``host_pool_tokens`` slots, pinned where CUDA exists), its allocator,
    the copier and the write policy."""

    def __init__(self, device_pool: KVPool, num_tokens: int, write_policy: str = "write_through"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown host write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        ps = device_pool.page_size
        if num_tokens < ps:
            raise ValueError(f"host_pool_tokens={num_tokens} holds no page of page_size={ps}")
        num_pages = num_tokens // ps
        self.page_size = ps
        self.write_policy = write_policy
        self.pool = KVPool(num_pages * ps, ps, len(device_pool.layer_ids), device_pool.num_kv_heads,
                           device_pool.head_dim, dtype=device_pool.dtype, device="cpu",
                           layer_ids=device_pool.layer_ids, pin_memory=True)
        self.allocator = PagedAllocator(num_pages, ps)
        self.copier = KVCopier(device_pool, self.pool)

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    # -- the cache's collaborator ----------------------------------------------------------------
    # A friend of UnifiedRadixCache: it reaches the cache's tree and device allocator directly
    # (one object's two halves; nothing else does).
    def bind(self, cache) -> None:
        """Attach to the one cache whose nodes this tier holds (called by the cache)."""
        if getattr(self, "_cache", None) is not None and self._cache is not cache:
            raise ValueError("a HostTier serves one cache")
        self._cache = cache

    def used(self) -> int:
        """Tokens with a host copy."""
        return self._cache._tree.host_size

    def copy_node(self, nd) -> bool:
        """Copy ``nd``'s device KV to new host slots (evicting unlocked host copies if short).
        False when the host has no room."""
        t = self._cache._tree
        if self.allocator.available_size() < len(nd.key):
            t.evict_host(len(nd.key) - self.allocator.available_size())
            self._cache._free_host()
        host_slots = self.allocator.alloc(len(nd.key))
        if host_slots is None:
            return False
        self.copier.to_host(nd.value, host_slots)
        t.set_host(nd, host_slots)
        return True

    def backup(self, token_ids: Sequence[int], slots: torch.Tensor, last_node, *,
               session_id: Hashable | None = None) -> tuple[Any, int]:
        """Retraction: move a request's KV to the host tier and free its device slots.

        Like ``cache.cache`` (the lock moves from ``last_node`` to the returned node), then the
        nodes only this request holds are copied to the host and dropped from the device,
        bottom-up. Returns ``(node, device tokens freed)``; ``node`` stays locked (host copies
        are not evicted) until the caller's ``cache.unlock``. Restore with ``cache.match`` +
        :meth:`restore` of its ``best_match_node``. ``freed == 0`` with ``node`` still on the
        device means nothing could move (the host is full)."""
        c = self._cache
        _, node = c.cache(token_ids, slots, last_node, session_id=session_id)
        t = c._tree
        freed = 0
        nd = node
        while nd is not t.root and nd.lock_ref == 1 and nd.value is not None and nd.ndc == 0:
            if nd.host is None and not self.copy_node(nd):
                break
            freed += t.drop_device(nd)
            nd = nd.parent
        c._after()
        return node, freed

    def restore(self, node) -> torch.Tensor | None:
        """Bring the host-only nodes on root..``node`` back to the device (evicting device cache
        if short). Returns the device slots of the whole path, or None when the device has no
        room. Does not lock ``node``."""
        c = self._cache
        t = c._tree
        if node.parent is None and node is not t.root:
            raise ValueError(f"restore({node}): the node is not in the tree")
        todo = [nd for nd in t.path(node) if nd.value is None]
        if todo:
            need = sum(len(nd.key) for nd in todo)
            t.lock(node, +1)                    # keep the path while making room
            alloc = c.allocator
            if alloc.available_size() < need:
                c._evict_device(need - alloc.available_size())
                c._free_device()
            slots = alloc.alloc(need)
            t.lock(node, -1)
            if slots is None:
                c._after()
                return None
            self.copier.to_device(torch.cat([nd.host for nd in todo]), slots)
            off = 0
            for nd in todo:
                t.set_device(nd, slots[off:off + len(nd.key)])
                off += len(nd.key)
        indices = concat_values([nd.value for nd in t.path(node)])
        c._after()
        return indices

    @staticmethod
    def host_only(node) -> bool:
        """True when ``node``'s KV is on the host and not on the device."""
        return node is not None and node.value is None
