"""One kind of L3 value: the rows of one pool that a page (or a page's end) needs, as raw bytes.

Every pool the cache keeps is laid out like the host tier's (cache/tiers/host.py ``HostStore``):
``data [L, K, rows, *rest]``, rows on axis 2. A :class:`Payload` names one of them and how many
rows a value holds:

- FULL (kind ``""``): the device KV pool ``kv_data [L_full, 2, slots, H_kv, D]``, ``units =
  page_size``: a page's value is ``[L_full, 2, page_size, H_kv, D]``;
- SWA (``"swa"``): the SWA KV pool ``[L_swa, 2, rows, H_kv, D]``, ``units = page_size``: the
  SWA rows of a page's tokens, in token order;
- MAMBA (``"mamba"``): the state pool ``data.unsqueeze(1)``, ``[L_m, 1, slots + 1, *state]``,
  ``units = 1``: the state after a page's last token.

A value is the pool's dtype, C order, no header (the store adds and checks a digest); a value of
the wrong size decodes to None (a miss). The same codec reads a host pool of the same layout
(write-back of a host copy): :meth:`gather` takes the source tensor.
"""

from __future__ import annotations

import torch


class Payload:
    """``kind``: the key's namespace (``cache/tiers/l3/store.py`` ``page_key``); ``data``: the device
    pool ``[L, K, rows, *rest]``; ``units``: rows per value."""

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
    """The raw bytes of a CPU tensor (any dtype, bf16 included)."""
    return value.contiguous().view(torch.uint8).numpy().tobytes()
