"""RMSNorm variants of the hybrid families, numerically matched to transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def offset_weight(w: torch.Tensor) -> torch.Tensor:
    """Gemma's stored norm weight ``w`` [D] -> the float32 scale ``1 + w`` [D]."""
    return (1.0 + w.float()).contiguous()


def offset_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], scale: [D] float32 (``1 + w``) -> [..., D] in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * scale).to(x.dtype)


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                         eps: float) -> torch.Tensor:
    """y, z: [T, I]; weight: [I] -> ``weight * rmsnorm_groups(y * silu(z))`` [T, I] float32 (the
    caller casts to the model dtype before the output projection, as transformers does)."""
    T, i = y.shape
    h = y.float() * F.silu(z.float())
    g = h.view(T, i // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * g.view(T, i)
