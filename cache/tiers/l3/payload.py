"""One kind of L3 value: the rows of one pool that a page (or a page's end) needs, as raw bytes."""

from __future__ import annotations

import torch


class Payload:
    """``kind``: the key's namespace; ``data``: the device pool ``[L, K, rows, *rest]``; ``units``:
    rows per value."""

    def __init__(self, kind: str, data: torch.Tensor, units: int):
        if data.dim() < 3:
            raise ValueError(f"L3 payload {kind!r}: data must be [L, K, rows, ...], got {tuple(data.shape)}")
        self.kind = kind
        self.data = data
        self.units = units
        shape = list(data.shape)
        shape[2] = units
        self.shape = tuple(shape)                                  # one value: [L, K, units, *rest]
        self.nbytes = data[:, :, :units].numel() * data.element_size()

    def gather(self, rows: torch.Tensor, src: torch.Tensor | None = None) -> list[bytes]:
        """The values of ``rows`` (int64 ``[n * units]``, value by value) of ``src`` (default:
        the device pool): ``n`` byte strings. One device -> CPU copy in all."""
        src = self.data if src is None else src
        u = self.units
        block = src[:, :, rows.to(src.device)].cpu()               # [L, K, n * units, *rest]
        return [_to_bytes(block[:, :, j:j + u]) for j in range(0, block.shape[2], u)]

    def decode(self, payload: bytes) -> torch.Tensor | None:
        """One value ``[L, K, units, *rest]`` (CPU), or None when ``payload`` has the wrong size."""
        if len(payload) != self.nbytes:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.data.dtype).reshape(self.shape)

    def scatter(self, rows: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Write decoded ``values`` into the device pool at ``rows`` (int64 ``[len(values) * units]``)."""
        if values:
            block = torch.cat(values, dim=2)                       # [L, K, n * units, *rest]
            self.data[:, :, rows.to(self.data.device)] = block.to(self.data.device)


def _to_bytes(value: torch.Tensor) -> bytes:
    return value.contiguous().view(torch.uint8).numpy().tobytes()
