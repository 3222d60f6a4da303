"""KVCopier: moves rows between a device pool's data and its host mirror (same layout but for
the number of rows). The host tier (host.py) decides which rows move; this module only copies.
"""

from __future__ import annotations

import torch

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
    """Moves rows between ``dev_data`` and ``host_data`` (``[L, K, rows, ...]``, the same but
    for ``rows``; all layers and kinds at once), e.g. a KV pool's ``kv_data`` ``[L, 2, rows, H, D]``.

    On the CPU both copies are plain indexed copies. On CUDA they run on a side stream ordered
    after the work already queued on the compute stream: a D2H copy gathers on the GPU and lands
    in a pinned staging buffer, scattered into the host pool once it is done (:meth:`poll`,
    :meth:`synchronize`); an H2D copy gathers on the host into pinned memory and scatters on the
    GPU, and the compute stream waits for it (no host block). The cache calls
    :meth:`synchronize` before it frees device or host slots a copy may still touch.
    """

    def __init__(self, dev_data: torch.Tensor, host_data: torch.Tensor):
        self.dev_data = dev_data
        self.host_data = host_data
        self.device = dev_data.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list = []                # (event, staging, host_slots) of D2H copies
        self._inflight: list = []               # (event, staging) of H2D copies

    def to_host(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        if not self.cuda:
            _copy_runs(self.host_data, host_slots, self.dev_data, dev_slots)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # KV is written
        with torch.cuda.stream(self.stream):
            idx = dev_slots.to(self.device, non_blocking=True)
            gathered = self.dev_data[:, :, idx]                  # [L, 2, n, H, D] on the GPU
            staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._pending.append((event, staging, host_slots, gathered))

    def to_device(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        if not self.cuda:
            _copy_runs(self.dev_data, dev_slots, self.host_data, host_slots)
            return
        self._flush_host()                      # a load may read what a write-through wrote
        staging = self.host_data[:, :, host_slots].pin_memory()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # slots are idle
        with torch.cuda.stream(self.stream):
            data = staging.to(self.device, non_blocking=True)
            self.dev_data[:, :, dev_slots.to(self.device, non_blocking=True)] = data
            event = torch.cuda.Event()
            event.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        self._inflight.append((event, staging))

    def _flush_host(self) -> None:
        for event, staging, host_slots, _ in self._pending:
            event.synchronize()
            self.host_data[:, :, host_slots] = staging
        self._pending.clear()

    def poll(self) -> None:
        """Retire the copies that are done, without blocking."""
        if not self.cuda:
            return
        while self._pending and self._pending[0][0].query():     # in issue order
            _, staging, host_slots, _ = self._pending.pop(0)
            self.host_data[:, :, host_slots] = staging
        self._inflight = [x for x in self._inflight if not x[0].query()]

    def synchronize(self) -> None:
        """Finish every copy issued so far."""
        if not self.cuda:
            return
        self._flush_host()
        for event, _ in self._inflight:
            event.synchronize()
        self._inflight.clear()
