"""PreOp: what a projection does to its input first, so a kernel can fuse it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.layers import rms_norm
from tandem.engine.models.norms import offset_rms_norm


@dataclass(frozen=True)
class PreOp:
    kind: str
    weight: torch.Tensor | None = None
    eps: float = 0.0

    @staticmethod
    def rmsnorm(weight: torch.Tensor, eps: float) -> "PreOp":
        return PreOp("rmsnorm", weight, eps)

    @staticmethod
    def rmsnorm_f32(weight: torch.Tensor, eps: float) -> "PreOp":
        return PreOp("rmsnorm_f32", weight, eps)

    @staticmethod
    def silu_mul() -> "PreOp":
        return _SILU_MUL

    @staticmethod
    def gelu_mul() -> "PreOp":
        return _GELU_MUL

    @property
    def gated(self) -> bool:
        """Whether the input is ``[T, 2K]`` (gate, up) for a ``[T, K]`` result."""
        return self.kind in ("silu_mul", "gelu_mul")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] -> [T, K] (rmsnorm, rmsnorm_f32) or [T, 2I] -> [T, I] (silu_mul: overwrites x's
        gate half; gelu_mul)."""
        if self.kind == "rmsnorm":
            return rms_norm(x, self.weight, self.eps)
        if self.kind == "rmsnorm_f32":
            return offset_rms_norm(x, self.weight, self.eps)
        inter = x.shape[-1] // 2
        if self.kind == "gelu_mul":
            return F.gelu(x[:, :inter], approximate="tanh") * x[:, inter:]
        act = F.silu(x[:, :inter], inplace=True)                     # [T, I] view of x
        return act.mul_(x[:, inter:])


_SILU_MUL = PreOp("silu_mul")
_GELU_MUL = PreOp("gelu_mul")
