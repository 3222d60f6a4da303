"""StateLayout: several named state tensors of one recurrent layer packed into one flat state row.

The engine's ``StatePool`` keeps one row per request and layer, ``[num_slots + 1, *state_shape]``,
and treats a row as opaque: it zeroes it at admission, copies it to make or claim a checkpoint,
and hands ``fb.state_indices`` to the model. A Mamba2 layer needs two tensors per request (the
causal-conv window and the SSM state), so a model with such layers declares
``state_shape = (layout.numel,)`` and views its segments of each row::

    row [numel] float32 = | conv window [C, K-1] | ssm state [H, P, N] |
                          ^ offset 0             ^ offset C * (K-1)

Zeroing a row zeroes every segment (a fresh request: zero conv padding, zero SSM state, as in
transformers) and copying a row copies all of them (a checkpoint is the complete state after its
last token), so the pool needs no per-tensor knowledge.
"""

from __future__ import annotations

import math

import torch


class StateLayout:
    """Named segments of a flat state row. ``segments``: ``{name: shape}`` in row order."""

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
