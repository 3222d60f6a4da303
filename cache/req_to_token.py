"""ReqToTokenPool: which KV slot holds position ``pos`` of in-flight request row ``r``.

``req_to_token``: int32 ``[max_reqs + 1, max_context]``. Row 0 is padding (padded batches point
there harmlessly); rows ``1 .. max_reqs`` are handed out by :meth:`alloc`.
"""

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
        self._free_rows = list(range(max_reqs, 0, -1))  # pop() hands out 1, 2, ... first
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
        """``req_to_token[row, start:start+len(slots)] = slots``."""
        end = start + len(slots)
        if end > self.max_context:
            raise ValueError(f"write to positions {start}..{end} exceeds max_context={self.max_context}")
        self.req_to_token[row, start:end] = slots.to(self.req_to_token.device, torch.int32)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``start .. end-1`` as int64."""
        return self.req_to_token[row, start:end].to(torch.int64)
