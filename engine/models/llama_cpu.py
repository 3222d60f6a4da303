"""FusedLlamaLayer: a whole Llama decoder layer in one C call on the CPU (``tq_llama_layer`` in
engine/quant/avx512_kernels.c), for layers whose four projections are Avx512Linear kernels and
whose attention backend is CpuKernelAttentionBackend.

It runs exactly the composition ``LlamaLayer.forward`` runs with those kernels -- the same C
routines on the same buffers, the same roundings (qkv, attention output, the residual stream and
gate_up in bf16) -- so its output is bitwise the unfused layer's (tests/engine/test_llama_cpu.py);
what it removes is the Python -> C crossings between those routines (one call per layer).

``FusedLlamaLayer.build(layer)`` returns None where it does not apply statically (another kernel,
q/k/v biases, q/k norms, a head dim the rotary kernel does not take); ``__call__`` returns None
where a step does not fit (another backend, a layer that backend gives to torch, strides), and the
layer then runs unfused.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.engine.attention.cpu_backend import CpuKernelAttentionBackend
from tandem.engine.quant.avx512 import Avx512Linear
from tandem.engine.quant.native_lib import kernel_lib

_I64x4, _Px4 = ctypes.c_int64 * 4, ctypes.c_void_p * 4


class LayerDesc(ctypes.Structure):
    """Mirror of the C ``LayerDesc``: [0] qkv, [1] o, [2] gate_up, [3] down."""
    _fields_ = [("kind", _I64x4), ("w", _Px4), ("n", _I64x4), ("k", _I64x4),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("eps", ctypes.c_double), ("scale", ctypes.c_double),
                ("n_q", ctypes.c_int64), ("n_kv", ctypes.c_int64), ("d", ctypes.c_int64)]


class FusedLlamaLayer:
    def __init__(self, layer, desc: LayerDesc):
        self.layer, self.desc = layer, desc
        self.hidden = layer.o_proj.out_features
        self._lib = kernel_lib()

    @classmethod
    def build(cls, layer) -> "FusedLlamaLayer | None":
        ks = [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        if (kernel_lib() is None or not all(isinstance(k, Avx512Linear) and k.packed is not None for k in ks)
                or layer.qkv_bias is not None or layer.qk_norm is not None
                or layer.input_norm.dtype != torch.bfloat16 or layer.post_norm.dtype != torch.bfloat16
                or layer.d % 32 or layer.d > 256 or layer.n_q % layer.n_kv):
            return None
        spec = layer.spec
        desc = LayerDesc(
            _I64x4(*(k.kind_id for k in ks)), _Px4(*(k.packed.data_ptr() for k in ks)),
            _I64x4(*(k.out_features for k in ks)), _I64x4(*(k.in_features for k in ks)),
            layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), float(layer.eps),
            float(spec.scale), layer.n_q, layer.n_kv, layer.d)
        return cls(layer, desc)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb,
                 backend) -> torch.Tensor | None:
        """x: [T, H] bf16 -> the layer's output [T, H], or None (run it unfused)."""
        if (not isinstance(backend, CpuKernelAttentionBackend) or x.dtype != torch.bfloat16
                or not x.is_contiguous() or cos.dtype != torch.bfloat16 or cos.stride(-1) != 1
                or sin.stride() != cos.stride()):
            return None
        args = backend.kernel_args(self.layer.spec, fb, x.dtype)
        if args is None:
            return None
        kpool, vpool, wrow, r2t, r2t_stride, rows, lo, hi, imap = args
        t = x.shape[0]
        out = torch.empty(t, self.hidden, dtype=x.dtype)
        rc = self._lib.tq_llama_layer(
            ctypes.byref(self.desc), x.data_ptr(), out.data_ptr(), t, cos.data_ptr(),
            sin.data_ptr(), cos.stride(0), kpool, vpool, wrow, r2t, r2t_stride, rows, lo, hi, imap,
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"tq_llama_layer failed ({rc}) on layer {self.layer.spec.layer_id}")
        return out
