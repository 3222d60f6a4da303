"""Host tier (L2): a host KV pool mirroring the device pool's layout, its allocator, a copier.

The tree decides which nodes live where (device, host, both); :class:`UnifiedRadixCache`
executes through this object: it allocates host slots, asks the copier to move bytes, frees.

Write policies:
- ``write_through``: a node is copied to the host when it is inserted; evicting it from the
  device then only drops the device copy (the node stays, host-only).
- ``write_back``: a node is copied to the host only when it is evicted from the device.
Either way, a device eviction backs up a node that has no host copy yet if the host has room
(after evicting unlocked host copies); otherwise the node is deleted.
"""

from __future__ import annotations

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool

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

    @classmethod
    def from_config(cls, device_pool: KVPool, config) -> "HostTier | None":
        """The host tier a :class:`CacheConfig` asks for, or None when ``host_pool_tokens == 0``."""
        if config.host_pool_tokens == 0:
            return None
        return cls(device_pool, config.host_pool_tokens, config.host_write_policy)

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"
