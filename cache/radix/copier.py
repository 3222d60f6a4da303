"""KVCopier: moves rows between a device pool's ``[L, K, rows, ...]`` data and its host mirror."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

_MAX_RUNS = 64  # past this many runs one indexed copy beats a Python loop of slice copies


def _copy_runs(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
               src_slots: torch.Tensor) -> None:
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


def _pinned_index(slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(len(slots), dtype=torch.int64, pin_memory=True)
    out.copy_(slots.to(device="cpu", dtype=torch.int64))
    return out


@dataclass
class _ToHost:

    done: "torch.cuda.Event"
    staging: torch.Tensor      # pinned [L, K, n, ...]
    host_slots: torch.Tensor   # [n] int64, CPU
    gathered: torch.Tensor     # the device buffer the D2H copy reads (kept alive until done)


class KVCopier:
    """Moves rows between ``dev_data`` and ``host_data`` (``[L, K, rows,...]``, the same but for
    ``rows``)."""

    def __init__(self, dev_data: torch.Tensor, host_data: torch.Tensor):
        if dev_data.shape[:2] != host_data.shape[:2] or dev_data.shape[3:] != host_data.shape[3:]:
            raise ValueError(f"device rows {tuple(dev_data.shape)} and host rows {tuple(host_data.shape)} "
                             "differ in more than the row count")
        self.dev_data = dev_data
        self.host_data = host_data
        self.device = dev_data.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: deque[_ToHost] = deque()
        self._inflight: deque = deque()

    @property
    def _copy_stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            raise RuntimeError("the KV copier has a copy stream on CUDA only")
        return self.stream

    def to_host(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy device ``dev_slots`` [n] to host ``host_slots`` [n]. On return the device slots
        may be reused; the host rows are complete after :meth:`poll` / :meth:`synchronize`."""
        if len(dev_slots) != len(host_slots):
            raise ValueError(f"to_host: {len(dev_slots)} device slots but {len(host_slots)} host slots")
        if not self.cuda:
            _copy_runs(self.host_data, host_slots, self.dev_data, dev_slots)
            return
        if len(dev_slots) == 0:
            return
        idx = _pinned_index(dev_slots)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            gathered = self.dev_data.index_select(2, idx.to(self.device, non_blocking=True))
            read = torch.cuda.Event()
            read.record(self.stream)
            staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        read.synchronize()          # the device slots have been read: free to reuse
        self._pending.append(_ToHost(done, staging, host_slots.to(device="cpu", dtype=torch.int64),
                                     gathered))

    def to_device(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        """Copy host ``host_slots`` [n] to device ``dev_slots`` [n]. Work queued on the current
        (compute) stream after this call sees the copied KV."""
        if len(dev_slots) != len(host_slots):
            raise ValueError(f"to_device: {len(host_slots)} host slots but {len(dev_slots)} device slots")
        if not self.cuda:
            _copy_runs(self.dev_data, dev_slots, self.host_data, host_slots)
            return
        n = len(host_slots)
        if n == 0:
            return
        host_slots = host_slots.to(device="cpu", dtype=torch.int64)
        self._land_writes_to(host_slots)          # a load may read what a write-through wrote
        shape = (*self.host_data.shape[:2], n, *self.host_data.shape[3:])
        staging = torch.empty(shape, dtype=self.host_data.dtype, pin_memory=True)
        torch.index_select(self.host_data, 2, host_slots, out=staging)
        idx = _pinned_index(dev_slots)
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)          # the device slots are idle
        with torch.cuda.stream(self.stream):
            data = staging.to(self.device, non_blocking=True)
            self.dev_data.index_copy_(2, idx.to(self.device, non_blocking=True), data)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)                  # the GPU waits, the host does not
        self._inflight.append((done, staging, data))

    def _land_one(self) -> None:
        p = self._pending.popleft()
        p.done.synchronize()
        _copy_runs(self.host_data, p.host_slots, p.staging,
                   torch.arange(len(p.host_slots), dtype=torch.int64))

    def _land_writes_to(self, host_slots: torch.Tensor) -> None:
        last = -1
        for i, p in enumerate(self._pending):
            if torch.isin(p.host_slots, host_slots).any():
                last = i
        for _ in range(last + 1):
            self._land_one()

    def poll(self) -> None:
        """Retire the copies that are done, in issue order, without blocking on the GPU."""
        if not self.cuda:
            return
        while self._pending and self._pending[0].done.query():
            self._land_one()
        while self._inflight and self._inflight[0][0].query():   # one stream: done in order
            self._inflight.popleft()

    def synchronize(self) -> None:
        """Finish every copy issued so far (the host pool holds every row written to it)."""
        if not self.cuda:
            return
        while self._pending:
            self._land_one()
        while self._inflight:
            self._inflight.popleft()[0].synchronize()

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._inflight)
