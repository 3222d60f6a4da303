"""QuantWeight: a GGUF tensor's own quantized blocks, unpacked but not dequantized."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {k: (256 if k.endswith("_K") else 32) for k in BLOCK_BYTES}
KINDS = tuple(BLOCK_BYTES)
SIGNED = ("Q8_0", "Q5_0", "Q6_K")
WITH_OFFSET = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def group_size(kind: str) -> int:
    """Weights per (scale, offset) group of ``kind``."""
    return 16 if kind == "Q6_K" else GROUP


@dataclass(frozen=True)
class QuantWeight:
    """A quantized ``[N, K]`` matrix."""

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
        return n * (k // BLOCK_WEIGHTS[self.kind]) * BLOCK_BYTES[self.kind]

    @property
    def group(self) -> int:
        return group_size(self.kind)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, equal to ``gguf.quants.dequantize`` of the same blocks."""
        n, k = self.shape
        g = self.group
        q = self.codes.to(torch.float32).view(n, k // g, g)
        if self.kind == "Q4_0":
            q = q - 8
        w = q * self.scale[..., None]
        if self.kind in WITH_OFFSET:
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

    def to(self, device=None, dtype=None) -> torch.Tensor:
        """The dequantized matrix as a dense tensor (``cvt(get(name))`` on a QuantWeight works)."""
        return self.dequantize().to(device=device, dtype=dtype or torch.float32)


@dataclass(frozen=True)
class QuantParts:
    """Quantized ``[N_i, K]`` matrices of different kinds stacked along N (a fused qkv whose v is
    Q8_0 beside Q5_0 q and k, as llama.cpp's *_M mixes write them): each part keeps its blocks; a
    kernel runs part by part into its columns of one output."""

    parts: tuple[QuantWeight, ...]

    def __post_init__(self):
        if len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError(f"cannot stack quantized matrices of widths "
                             f"{sorted({p.shape[1] for p in self.parts})}: they need one K")

    @property
    def kind(self) -> str:
        return "+".join(dict.fromkeys(p.kind for p in self.parts))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def to(self, device=None, dtype=None) -> torch.Tensor:
        return self.dequantize().to(device=device, dtype=dtype or torch.float32)

    @staticmethod
    def stack(parts: list[QuantWeight]) -> "QuantWeight | QuantParts":
        """Runs of one kind concatenated (QuantWeight.cat); one QuantWeight if a single kind."""
        runs: list[list[QuantWeight]] = []
        for p in parts:
            if runs and runs[-1][0].kind == p.kind:
                runs[-1].append(p)
            else:
                runs.append([p])
        merged = [QuantWeight.cat(r) if len(r) > 1 else r[0] for r in runs]
        return merged[0] if len(merged) == 1 else QuantParts(tuple(merged))


def from_gguf_blocks(kind: str, data: np.ndarray, n: int, k: int) -> QuantWeight:
    """Unpack ``data`` (the GGUF tensor's raw bytes, ``[N, K / B * block bytes]`` uint8 or flat) of
    a ``[N, K]`` matrix of type ``kind`` (one of :data:`KINDS`; B = 32, or 256 for K-quants)."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"quantized type {kind!r} is not supported (supported: {', '.join(KINDS)})")
    bw = BLOCK_WEIGHTS[kind]
    if k % bw:
        raise ValueError(f"a {kind} matrix needs K divisible by {bw}, got K={k}")
    nb, bb = k // bw, BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n * nb, bb)
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        codes, scale, offset = _unpack_k(kind, blocks)
    else:
        codes, scale, offset = _unpack_32(kind, blocks)
    g = group_size(kind)
    return QuantWeight(kind, torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k))),
                       torch.from_numpy(np.ascontiguousarray(scale.reshape(n, k // g))),
                       torch.from_numpy(np.ascontiguousarray(offset.reshape(n, k // g))))


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _unpack_32(kind: str, blocks: np.ndarray):
    d = _f16(blocks[:, 0:2])
    offset = np.zeros_like(d)
    if kind == "Q8_0":
        return blocks[:, 2:].copy().view(np.int8), d, offset
    if kind in ("Q4_0", "Q4_1"):
        start = 4 if kind == "Q4_1" else 2
        if kind == "Q4_1":
            offset = _f16(blocks[:, 2:4])
        return _nibbles(blocks[:, start:]), d, offset
    start = 4 if kind == "Q5_1" else 2
    if kind == "Q5_1":
        offset = _f16(blocks[:, 2:4])
    qh = blocks[:, start:start + 4].copy().view(np.uint32)                      # [B, 1]
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)          # [B, 32]
    q = _nibbles(blocks[:, start + 4:]) | (hi << 4)
    if kind == "Q5_0":
        return (q.astype(np.int16) - 16).astype(np.int8), d, offset
    return q, d, offset


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _unpack_k(kind: str, blocks: np.ndarray):
    nbk = blocks.shape[0]
    if kind == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)          # [B, 16]
        d = _f16(blocks[:, 208:210])
        lo = ql.reshape(nbk, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        lo = (lo & 0x0F).reshape(nbk, 8, 32)
        hi = qh.reshape(nbk, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        hi = (hi & 0x03).reshape(nbk, 8, 32)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(nbk, 256)
        scale = d[:, None] * sc
        return q, scale, np.zeros_like(scale)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = d[:, None] * sc.astype(np.float32)                                   # [B, 8]
    offset = -(dmin[:, None] * mn.astype(np.float32))
    if kind == "Q4_K":
        qs = blocks[:, 16:144]
        q = qs.reshape(nbk, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        return (q & 0x0F).reshape(nbk, 256), scale, offset
    qh, qs = blocks[:, 16:48], blocks[:, 48:176]
    lo = qs.reshape(nbk, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    lo = (lo & 0x0F).reshape(nbk, 8, 32)
    hi = qh.reshape(nbk, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    hi = (hi & 0x01).reshape(nbk, 8, 32)
    return (lo | (hi << 4)).reshape(nbk, 256), scale, offset
