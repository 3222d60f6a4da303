"""Gemma 3 layers on the CPU kernels: the native composition and FusedGemmaLayer (one C call)."""

from __future__ import annotations

import torch

from tandem.engine.attention.cpu_backend import fused_layer_args
from tandem.engine.layers import Rotary
from tandem.engine.quant.avx512 import Avx512Linear, rope_
from tandem.engine.quant.native_lib import kernel_ops
from tandem.engine.quant.preop import PreOp

MAX_PARTS = 4
_NORMS = ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")


def native(layer) -> bool:
    """Whether ``layer`` (a Gemma3Layer) runs :func:`composed`: its four projections are
    Avx512Linear, gelu is the tanh form, the norm weights float32 and the kernels here."""
    ks = layer.kernels()
    return (len(ks) == 4 and all(isinstance(k, Avx512Linear) for k in ks) and layer.gelu == "tanh"
            and all(getattr(layer, n).dtype == torch.float32 for n in _NORMS)
            and layer.d % 16 == 0 and kernel_ops() is not None)


def composed(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb, backend) -> torch.Tensor:
    """``layer`` on x [T, H] bf16 on its native path (see the module docstring) -> [T, H] bf16."""
    ops = kernel_ops()
    T, eps, d, n_q, n_kv = x.shape[0], layer.eps, layer.d, layer.n_q, layer.n_kv
    q_end, k_end = n_q * d, (n_q + n_kv) * d
    qkv = layer.qkv_k(x, layer.qkv_bias, pre=PreOp.rmsnorm_f32(layer.input_norm, eps))   # [T, (Hq + 2Hkv) D]
    ops.head_rmsnorm_.default(qkv[:, :q_end].view(T, n_q, d), layer.q_norm, eps)
    ops.head_rmsnorm_.default(qkv[:, q_end:k_end].view(T, n_kv, d), layer.k_norm, eps)
    qk = qkv[:, :k_end].view(T, n_q + n_kv, d)
    if not rope_(qk, cos, sin):
        qk = Rotary.apply(qk, cos, sin)
    v = qkv[:, k_end:].view(T, n_kv, d)
    o = backend.forward(qk[:, :n_q], qk[:, n_q:], v, layer.spec, fb).reshape(T, q_end)
    x = ops.add_rmsnorm.default(layer.o_proj_k(o, layer.o_bias), layer.post_attn_norm, eps, x)
    gu = layer.gate_up_k(x, pre=PreOp.rmsnorm_f32(layer.pre_ff_norm, eps))            # [T, 2I]
    return ops.add_rmsnorm.default(layer.down_k(gu, pre=PreOp.gelu_mul()), layer.post_ff_norm, eps, x)


class FusedGemmaLayer:
    def __init__(self, layer, weights: list[torch.Tensor], meta: list[int]):
        self.layer = layer
        self.weights, self.meta = weights, meta
        self.norms = [getattr(layer, n) for n in _NORMS]
        self.eps, self.scale = float(layer.eps), float(layer.spec.scale)
        self._op = kernel_ops().gemma_layer.default

    @classmethod
    def build(cls, layer) -> "FusedGemmaLayer | None":
        if (not native(layer) or layer.qkv_bias is not None or layer.o_bias is not None
                or layer.d % 32 or layer.d > 256 or layer.n_q % layer.n_kv
                or not all(getattr(layer, n).is_contiguous() for n in _NORMS)):
            return None
        ks = layer.kernels()
        if any(len(k.part_kinds) > MAX_PARTS for k in ks):
            return None
        weights = [w for k in ks for w in k.weight_tensors()]
        meta = [len(k.part_kinds) for k in ks] + [kind for k in ks for kind in k.part_kinds]
        return cls(layer, weights, meta + [layer.n_q, layer.n_kv, layer.d])

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb,
                 backend) -> torch.Tensor | None:
        """x: [T, H] bf16 -> the layer's output [T, H], or None (run it unfused)."""
        args = fused_layer_args(backend, self.layer.spec, x, cos, sin, fb)
        if args is None:
            return None
        return self._op(self.weights, self.meta, self.norms, self.eps, self.scale, x, cos, sin, *args)
