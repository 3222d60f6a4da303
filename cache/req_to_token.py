"""ReqToTokenPool: which KV slot holds position ``pos`` of in-flight request row ``r``."""

from __future__ import annotations

import torch

from tandem.cache.allocator import SlotError


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu"):
        if max_reqs <= 0 or max_context <= 0:
            raise ValueError(f"max_reqs={max_reqs} and max_context={max_context} must be positive")
        self.size = max_reqs
        self.max_context = max_context
        self.device = torch.device(device)
        # req_to_token: [max_reqs + 1, max_context] int32
        self.req_to_token = torch.zeros((max_reqs + 1, max_context), dtype=torch.int32, device=device)
        self._host = self.req_to_token if self.device.type == "cpu" else torch.zeros(
            (max_reqs + 1, max_context), dtype=torch.int32)
        self._free_rows = list(range(max_reqs, 0, -1))
        self._in_use = [False] * (max_reqs + 1)

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row index (>= 1), or None when every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        if not (1 <= row <= self.size):
            raise SlotError(f"request row {row} does not belong to this pool (valid 1..{self.size})")
        if not self._in_use[row]:
            raise SlotError(f"double free of request row {row}")
        self._in_use[row] = False
        self._free_rows.append(row)

    def rows_in_use(self) -> list[int]:
        return [r for r in range(1, self.size + 1) if self._in_use[r]]

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        end = start + len(slots)
        if end > self.max_context:
            raise ValueError(f"write to positions {start}..{end} exceeds max_context={self.max_context}")
        self._host[row, start:end] = slots.to("cpu", torch.int32)
        if self._host is not self.req_to_token:
            self.req_to_token[row, start:end] = slots.to(self.req_to_token.device, torch.int32, non_blocking=True)

    def write_many(self, rows: list[int], starts: list[int], slots: list[torch.Tensor]) -> None:
        """``write(rows[i], starts[i], slots[i])`` for every i; on a GPU one host-to-device copy
        and one scatter for all of them."""
        n = [len(sl) for sl in slots]
        for start, k in zip(starts, n, strict=True):
            if start + k > self.max_context:
                raise ValueError(f"write to positions {start}..{start + k} exceeds "
                                 f"max_context={self.max_context}")
        if not rows:
            return
        r = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor(n))
        c = torch.tensor([p for st, k in zip(starts, n, strict=True) for p in range(st, st + k)],
                         dtype=torch.int64)
        v = torch.cat([sl.to("cpu", torch.int64) for sl in slots])
        self._host[r, c] = v.to(torch.int32)
        if self._host is self.req_to_token:
            return
        rcv = torch.stack([r, c, v]).to(self.req_to_token.device, non_blocking=True)   # [3, total]: one copy
        self.req_to_token[rcv[0], rcv[1]] = rcv[2].to(torch.int32)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``start.. end-1`` as int64, on the CPU (no device sync)."""
        return self._host[row, start:end].to(torch.int64)

    def slot(self, row: int, pos: int) -> int:
        """The slot of position ``pos`` of ``row`` (no device sync)."""
        return int(self._host[row, pos])
