"""QuantWeight: a GGUF tensor's own quantized blocks, unpacked but not dequantized.

GGML's 32-weight block types this file reads (``d``, ``m`` are float16 per block, ``q`` the codes):

    Q4_0  18 bytes: d, 16 bytes of nibbles   w = d * (q - 8)      q in 0..15
    Q4_1  20 bytes: d, m, 16 bytes of nibbles w = d * q + m        q in 0..15
    Q8_0  34 bytes: d, 32 int8               w = d * q            q in -128..127

A block's 16 nibble bytes hold weights 0..15 in their low nibbles and 16..31 in their high ones.
A matrix ``[N, K]`` (GGUF ``ne = [K, N]``) is N rows of K / 32 blocks. :class:`QuantWeight` keeps
the codes ``[N, K]`` and per-block ``scale`` / ``offset`` ``[N, K / 32]`` (float32, exact copies
of the float16 values), so ``dequantize()`` is bit-identical to ``gguf.quants.dequantize``. Rows
can be reordered (llama.cpp's q/k permutation) and matrices stacked along N (fused qkv) without
touching a single weight value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32                                    # weights per block, every type here
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
KINDS = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class QuantWeight:
    """A quantized ``[N, K]`` matrix. ``w[n, k] = scale[n, g] * (codes[n, k] - bias) + offset[n, g]``
    with ``g = k // 32``, ``bias`` 8 for Q4_0 and 0 otherwise, ``offset`` zero but for Q4_1.

    codes: [N, K] uint8 (Q4_*: 0..15) or int8 (Q8_0); scale, offset: [N, K / 32] float32 (CPU)."""

    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the GGUF blocks this matrix came from."""
        n, k = self.shape
        return n * (k // GROUP) * BLOCK_BYTES[self.kind]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, equal to ``gguf.quants.dequantize`` of the same blocks."""
        n, k = self.shape
        q = self.codes.to(torch.float32).view(n, k // GROUP, GROUP)
        if self.kind == "Q4_0":
            q = q - 8
        w = q * self.scale[..., None]
        if self.kind == "Q4_1":
            w = w + self.offset[..., None]
        return w.view(n, k)

    def rows(self, order: torch.Tensor | np.ndarray) -> "QuantWeight":
        """The matrix with its rows reordered: row i of the result is row ``order[i]``."""
        idx = torch.as_tensor(np.asarray(order), dtype=torch.int64)
        return QuantWeight(self.kind, self.codes[idx].contiguous(), self.scale[idx].contiguous(),
                           self.offset[idx].contiguous())

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Stack matrices of one kind and K along N (q/k/v -> qkv, gate/up -> gate_up)."""
        kinds, ks = {p.kind for p in parts}, {p.shape[1] for p in parts}
        if len(kinds) != 1 or len(ks) != 1:
            raise ValueError(f"cannot stack quantized matrices of kinds {sorted(kinds)} and "
                             f"widths {sorted(ks)}: they need one kind and one K")
        return QuantWeight(parts[0].kind, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scale for p in parts]), torch.cat([p.offset for p in parts]))

    # -- duck-typing a tensor for code that only wants the dense values ------------------------
    def to(self, device=None, dtype=None) -> torch.Tensor:
        """The dequantized matrix as a dense tensor (``cvt(get(name))`` on a QuantWeight works)."""
        return self.dequantize().to(device=device, dtype=dtype or torch.float32)


def from_gguf_blocks(kind: str, data: np.ndarray, n: int, k: int) -> QuantWeight:
    """Unpack ``data`` (the GGUF tensor's raw bytes, ``[N, K / 32 * block bytes]`` uint8 or flat)
    of a ``[N, K]`` matrix of type ``kind`` (one of :data:`KINDS`)."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"quantized type {kind!r} is not supported (supported: {', '.join(KINDS)})")
    if k % GROUP:
        raise ValueError(f"a {kind} matrix needs K divisible by {GROUP}, got K={k}")
    nb, bb = k // GROUP, BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, nb, bb)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)        # [N, nb]
    offset = np.zeros_like(d)
    if kind == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    else:
        start = 4 if kind == "Q4_1" else 2
        if kind == "Q4_1":
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., start:]                                                   # [N, nb, 16]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)        # [N, K]
    return QuantWeight(kind, torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d),
                       torch.from_numpy(offset))
