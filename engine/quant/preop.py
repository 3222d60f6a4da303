"""PreOp: what a projection does to its input first, so a kernel can fuse it.

``PreOp.rmsnorm(weight, eps)``: RMSNorm over the last dim with a weight (the layer's input and
post-attention norms, the final norm before the vocab head). ``PreOp.silu_mul()``: the MLP's
``silu(gate) * up`` over a ``[T, 2I]`` gate_up output, giving ``[T, I]``.

:meth:`PreOp.apply` is the plain-torch definition (the numerics the model had before kernels
fused it: ``layers.rms_norm``, in-place silu then multiply); kernels without a fused form call it.
:class:`~tandem.engine.quant.q8.Q8Linear` computes the same in float32 before quantizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.layers import rms_norm


@dataclass(frozen=True)
class PreOp:
    kind: str                          # "rmsnorm" | "silu_mul"
    weight: torch.Tensor | None = None  # rmsnorm: [K]
    eps: float = 0.0

    @staticmethod
    def rmsnorm(weight: torch.Tensor, eps: float) -> "PreOp":
        return PreOp("rmsnorm", weight, eps)

    @staticmethod
    def silu_mul() -> "PreOp":
        return _SILU_MUL

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] -> [T, K] (rmsnorm) or [T, 2I] -> [T, I] (silu_mul; overwrites x's gate half)."""
        if self.kind == "rmsnorm":
            return rms_norm(x, self.weight, self.eps)
        inter = x.shape[-1] // 2
        act = F.silu(x[:, :inter], inplace=True)                     # [T, I] view of x
        return act.mul_(x[:, inter:])                                # silu(gate) * up, in place


_SILU_MUL = PreOp("silu_mul")
