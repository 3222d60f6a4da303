"""StateLayout: several named state tensors of one recurrent layer packed into one flat state
row."""

from __future__ import annotations

import math

import torch


class StateLayout:
    """Named segments of a flat state row."""

    def __init__(self, segments: dict[str, tuple[int, ...]]):
        self.shapes = {k: tuple(int(d) for d in v) for k, v in segments.items()}
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            self.offsets[name] = (off, off + n)
            off += n
        self.numel = off

    def view(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """rows: [B, numel] -> segment ``name`` as [B, *shape] (a view: writes reach ``rows``)."""
        lo, hi = self.offsets[name]
        return rows[:, lo:hi].view(rows.shape[0], *self.shapes[name])

    def pack(self, **parts: torch.Tensor) -> torch.Tensor:
        """Segments ``{name: [B, *shape]}`` (all of them) -> rows [B, numel]."""
        if set(parts) != set(self.shapes):
            raise ValueError(f"pack needs exactly the segments {list(self.shapes)}, got {list(parts)}")
        b = next(iter(parts.values())).shape[0]
        return torch.cat([parts[k].reshape(b, -1) for k in self.shapes], dim=1)
