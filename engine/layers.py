"""Small building blocks shared by model definitions: RMSNorm and rotary embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalize over the last dim. x: [..., D], weight: [D] or None -> [..., D] in x's dtype
    (statistics in float32, then ``weight * normalized.to(x.dtype)`` as transformers does)."""
    d = (x.shape[-1],)
    if x.dtype == torch.float32:
        if x.numel() < _RMS_NORM_FUSED_MAX:
            return F.rms_norm(x, d, weight, eps)
        y = torch.mul(x, torch.mul(x, x).mean(-1, keepdim=True).add_(eps).rsqrt_())
        return y if weight is None else y.mul_(weight)
    y = F.rms_norm(x.float(), d, None, eps).to(x.dtype)
    return y if weight is None else y * weight


_RMS_NORM_FUSED_MAX = 64 * 1024


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with llama3/linear scaling or llama.cpp's
    per-dimension ``rope_freqs`` factors applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        inv = inv / freq_factors.float().flatten()[: inv.numel()]
    if not scaling:
        return inv
    kind, factor = scaling["rope_type"], float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unknown rope_type {kind!r}")


class Rotary:
    """Precomputed cos/sin tables; rotates the two halves of each head ("rotate_half" layout)."""

    def __init__(self, inv_freq: torch.Tensor, max_position: int, device, dtype: torch.dtype):
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2], float32 like transformers
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        self.max_position = max_position

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, 1, D/2] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] -> [T, H, D] (new tensor)."""
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=o1)
        o1.sub_(x2 * sin)
        torch.mul(x2, cos, out=o2)
        o2.add_(x1 * sin)
        return out
