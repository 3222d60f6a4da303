"""FusedLlamaLayer: a whole Llama layer in one checked C call (``torch.ops.tandem.llama_layer``)
where its four projections are Avx512Linear and the backend is CpuKernelAttentionBackend."""

from __future__ import annotations

import torch

from tandem.engine.attention.cpu_backend import fused_layer_args
from tandem.engine.quant.avx512 import Avx512Linear
from tandem.engine.quant.native_lib import kernel_ops


class FusedLlamaLayer:
    def __init__(self, layer, weights: list[torch.Tensor], meta: list[int]):
        self.layer = layer
        self.weights, self.meta = weights, meta      # [qkv, o, gate_up, down] packed; 4 kinds, n_q, n_kv, d
        self.eps, self.scale = float(layer.eps), float(layer.spec.scale)
        self._op = kernel_ops().llama_layer.default

    @classmethod
    def build(cls, layer) -> "FusedLlamaLayer | None":
        ks = [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        if (kernel_ops() is None or not all(isinstance(k, Avx512Linear) and k.packed is not None for k in ks)
                or layer.qkv_bias is not None or layer.qk_norm is not None
                or layer.input_norm.dtype != torch.bfloat16 or layer.post_norm.dtype != torch.bfloat16
                or layer.d % 32 or layer.d > 256 or layer.n_q % layer.n_kv):
            return None
        return cls(layer, [k.packed for k in ks], [*(k.kind_id for k in ks), layer.n_q, layer.n_kv, layer.d])

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb,
                 backend) -> torch.Tensor | None:
        """x: [T, H] bf16 -> the layer's output [T, H], or None (run it unfused)."""
        args = fused_layer_args(backend, self.layer.spec, x, cos, sin, fb)
        if args is None:
            return None
        layer = self.layer
        return self._op(self.weights, self.meta, layer.input_norm, layer.post_norm, self.eps, self.scale,
                        x, cos, sin, *args)

