"""RMSNorm variants of the hybrid families, numerically matched to transformers.

- :func:`offset_rms_norm`: Gemma's ``(1 + w)`` RMSNorm (``Gemma3RMSNorm``): statistics *and* the
  scale in float32, cast to the input dtype last ("(x * w).to(dtype)", unlike Llama's
  "w * x.to(dtype)"). The caller passes ``1 + w`` precomputed in float32 (:func:`offset_weight`):
  transformers adds the 1 in float32 on every call, so the result is the same bit for bit.
- :func:`gated_group_rms_norm`: Mamba2's gated RMSNorm (``MambaRMSNormGated``, ``norm_before_gate
  =False``): ``y * silu(z)``, then RMSNorm over groups of ``group_size`` channels.

The Llama-style RMSNorm is ``tandem.engine.layers.rms_norm``.
"""

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
