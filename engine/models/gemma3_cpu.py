"""Gemma 3 layers on the CPU kernels: the native composition and FusedGemmaLayer (one C call).

On the native path -- all four projections ``Avx512Linear`` (bf16 activations on the GGUF's own
blocks), no biases, gelu-tanh, the kernels built here -- a ``Gemma3Layer`` runs :func:`composed`:
the layer as C routines, one op each: the qkv projection with the input RMSNorm fused as its
pre-op (``PreOp.rmsnorm_f32``: the float32 ``1 + w`` scale on bf16 activations), the per-head q/k
RMSNorm in place (``torch.ops.tandem.head_rmsnorm_``), rotary in place (``rope_``), attention
through the backend, then ``residual + rmsnorm(o_proj(o)) * w`` (``add_rmsnorm``), gate_up with
the pre-FF RMSNorm fused, down with ``gelu_tanh(gate) * up`` fused (``PreOp.gelu_mul``), and
``add_rmsnorm`` again. Every norm is computed in float32 and rounded to bf16 where torch's bf16
ops would round it (the normed value, then the residual sum); only the order of the sums of squares
and the activation's polynomial differ from torch's float32 ops, so the numerics stay those of a
bf16 model with the file's exact weights (tests/engine/test_gemma3_gguf.py bounds them). Each row
depends on its own input row only, at any thread count, as the kernels promise.

``FusedGemmaLayer`` runs exactly that composition in one C call (``tq_gemma_layer`` in
engine/quant/avx512_kernels.c, as the typed op ``torch.ops.tandem.gemma_layer``, which checks the
packed parts, that the projections' shapes chain, the norm weights, the activations' and pools'
dtypes and the step's index ranges before the C code runs): the same C routines on the same
buffers, so its output is bitwise :func:`composed`'s (tests/engine/test_gemma3_fused.py). A
projection of several GGUF kinds (a qkv whose v is Q8_0 beside Q5_0 q and k) is run part by part
into its columns, as ``Avx512Linear`` runs it.

``FusedGemmaLayer.build(layer)`` returns None where it does not apply statically (not the native
path, a head dim the rotary and attention kernels do not take, more than ``MAX_PARTS`` parts);
``__call__`` returns None where a step does not fit (another attention backend, a layer that
backend gives to torch, dtypes or strides), and the layer then runs :func:`composed`.
"""

from __future__ import annotations

import torch

from tandem.engine.attention.cpu_backend import fused_layer_args
from tandem.engine.layers import Rotary
from tandem.engine.quant.avx512 import Avx512Linear, rope_
from tandem.engine.quant.native_lib import kernel_ops
from tandem.engine.quant.preop import PreOp

MAX_PARTS = 4      # the C side's TQ_MAX_PARTS: parts per projection
_NORMS = ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")


def native(layer) -> bool:
    """Whether ``layer`` (a Gemma3Layer) runs :func:`composed`: its four projections are
    Avx512Linear, gelu is the tanh form, the norm weights float32 and the kernels here."""
    ks = layer.kernels()
    return (len(ks) == 4 and all(isinstance(k, Avx512Linear) for k in ks) and layer.gelu == "tanh"
            and all(getattr(layer, n).dtype == torch.float32 for n in _NORMS)
            and layer.d % 16 == 0 and kernel_ops() is not None)   # last: no build for other kernels


def composed(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb, backend) -> torch.Tensor:
    """``layer`` on x [T, H] bf16 on its native path (see the module docstring) -> [T, H] bf16."""
    ops = kernel_ops()
    T, eps, d, n_q, n_kv = x.shape[0], layer.eps, layer.d, layer.n_q, layer.n_kv
    q_end, k_end = n_q * d, (n_q + n_kv) * d
    qkv = layer.qkv_k(x, layer.qkv_bias, pre=PreOp.rmsnorm_f32(layer.input_norm, eps))   # [T, (Hq + 2Hkv) D]
    ops.head_rmsnorm_.default(qkv[:, :q_end].view(T, n_q, d), layer.q_norm, eps)
    ops.head_rmsnorm_.default(qkv[:, q_end:k_end].view(T, n_kv, d), layer.k_norm, eps)
    qk = qkv[:, :k_end].view(T, n_q + n_kv, d)
    if not rope_(qk, cos, sin):                                        # in place where it can
        qk = Rotary.apply(qk, cos, sin)
    v = qkv[:, k_end:].view(T, n_kv, d)
    o = backend.forward(qk[:, :n_q], qk[:, n_q:], v, layer.spec, fb).reshape(T, q_end)
    x = ops.add_rmsnorm.default(layer.o_proj_k(o, layer.o_bias), layer.post_attn_norm, eps, x)
    gu = layer.gate_up_k(x, pre=PreOp.rmsnorm_f32(layer.pre_ff_norm, eps))            # [T, 2I]
    return ops.add_rmsnorm.default(layer.down_k(gu, pre=PreOp.gelu_mul()), layer.post_ff_norm, eps, x)


class FusedGemmaLayer:
    def __init__(self, layer, weights: list[torch.Tensor], meta: list[int]):
        self.layer = layer
        # the projections' packed parts in order; 4 part counts, each part's kind, n_q, n_kv, d
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
