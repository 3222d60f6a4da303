"""Linear kernels: ``y = x @ W^T (+ bias) (+ residual)`` with the weight stored in the layout the
device, the compute dtype and the weight's own format allow."""

from __future__ import annotations

import ctypes
import sys
import threading

import torch
from torch import nn

from tandem.engine.quant.blocks import GROUP, QuantParts, QuantWeight
from tandem.engine.quant.preop import PreOp
from tandem.engine.quant.avx512 import Avx512Linear, avx512_reason

PACKED_MIN_ROWS = 4
_PACK_HINT_ROWS = 32
_pad_buffers = threading.local()
_INT4_DTYPES = (torch.bfloat16, torch.float16)


def onednn_packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :class:`PackedLinear` can hold a weight of ``dtype`` on ``device``."""
    if (torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def int4_reason(w: QuantWeight, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when :class:`Int4Linear` can run ``w`` with ``dtype`` activations on ``device``, else
    why not (said in the startup line)."""
    n, k = w.shape
    if torch.device(device).type != "cpu":
        return f"{w.kind} on {torch.device(device).type}: torch's int4 kernel here is the CPU one"
    if dtype not in _INT4_DTYPES:
        return f"{w.kind} with {str(dtype).removeprefix('torch.')} activations (int4 needs bfloat16)"
    if w.kind not in ("Q4_0", "Q4_1", "Q8_0"):
        return f"{w.kind} is not mapped to int4"
    if k % GROUP or n % 16:
        return f"{w.kind} shape [{n}, {k}] (int4 needs N % 16 == 0, K % 32 == 0)"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch build has no _weight_int4pack_mm_for_cpu"
    return None


def _padded(x: torch.Tensor, role: str) -> torch.Tensor:
    """``x`` ([T, C], T < PACKED_MIN_ROWS) copied into the first rows of this thread's zeroed
    ``[PACKED_MIN_ROWS, C]`` buffer for ``role`` ("x", "residual": one GEMM's two inputs never
    share a buffer): oneDNN's packed GEMM wants at least that many rows."""
    key = (role, x.shape[1], x.dtype, x.device, torch.is_inference_mode_enabled())
    bufs = _pad_buffers.__dict__
    xp = bufs.get(key)
    if xp is None:
        xp = bufs[key] = x.new_zeros(PACKED_MIN_ROWS, x.shape[1])
    xp[:x.shape[0]] = x
    return xp


class PackedLinear(nn.Module):
    """oneDNN GEMM with the weight reordered once into oneDNN's blocked layout (fp32 or bf16)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.weight = nn.Parameter(_pack(w), requires_grad=False)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        params = dict(state["_parameters"])
        params["weight"] = nn.Parameter(params["weight"].to_dense(), requires_grad=False)
        state["_parameters"] = params
        return state

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self._parameters["weight"] = nn.Parameter(_pack(self._parameters["weight"]), requires_grad=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, pre: PreOp | None = None) -> torch.Tensor:
        """pre(x): [T, K] (+ bias [N]) (+ residual [T, N]) -> [T, N]."""
        if pre is not None:
            x = pre.apply(x)
        w, T = self.weight, x.shape[0]
        if T >= PACKED_MIN_ROWS:
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
            if bias is None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, None, "add")
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "").add_(residual)
        xp = _padded(x, "x")
        if residual is not None and bias is None:     # the fused add, as above: one rounding
            rp = _padded(residual, "residual")
            return torch.ops.mkldnn._linear_pointwise.binary(xp, rp, w, None, "add")[:T]
        y = torch.ops.mkldnn._linear_pointwise(xp, w, bias, "none", [], "")[:T]
        return y if residual is None else y.add_(residual)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.weight.element_size()


class DenseLinear(nn.Module):
    """A plain weight: input-major ``[K, N]`` (``x @ W``) or ``[N, K]`` (``F.linear``); the caller
    chooses (engine/models/llama.py keeps the MLP's down projection, K > N, as ``[N, K]``)."""

    def __init__(self, w: torch.Tensor, input_major: bool = True):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.input_major = input_major
        self.weight = nn.Parameter((w.t() if input_major else w).contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, pre: PreOp | None = None) -> torch.Tensor:
        """pre(x): [T, K] (+ bias [N]) (+ residual [T, N]) -> [T, N]."""
        if pre is not None:
            x = pre.apply(x)
        w = self.weight if self.input_major else self.weight.t()
        if residual is not None:
            y = torch.addmm(residual, x, w)
            return y if bias is None else y.add_(bias)
        return x @ w if bias is None else torch.addmm(bias, x, w)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int4Linear(nn.Module):
    """Weight-only int4 GEMM on the GGUF's own blocks (torch's ``_weight_int4pack_mm_for_cpu``:
    dequantizes a tile at a time in registers and accumulates in fp32)."""

    def __init__(self, w: QuantWeight, dtype: torch.dtype):
        super().__init__()
        if (why := int4_reason(w, dtype, torch.device("cpu"))) is not None:
            raise ValueError(f"Int4Linear cannot hold this weight: {why}")
        self.out_features, self.in_features = w.shape
        self.kind = w.kind
        d = w.scale                                                      # [N, K/32] float32
        if w.kind == "Q8_0":
            u = (w.codes.to(torch.int32) + 128)
            planes = [(u >> 4, 16 * d, torch.zeros_like(d)), (u & 15, d, 8 * d)]
        else:
            zero = w.offset + 8 * d if w.kind == "Q4_1" else torch.zeros_like(d)
            planes = [(w.codes.to(torch.int32), d, zero)]
        packed, sz = [], []
        for codes, scale, zero in planes:
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
            sz.append(torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype))  # [K/32, N, 2]
        self.packed = nn.ParameterList([nn.Parameter(p, requires_grad=False) for p in packed])  # [N, K/2] u8
        self.scale_zero = nn.ParameterList([nn.Parameter(s, requires_grad=False) for s in sz])

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, pre: PreOp | None = None) -> torch.Tensor:
        """pre(x): [T, K] (bf16) (+ bias [N]) (+ residual [T, N]) -> [T, N] in x's dtype."""
        if pre is not None:
            x = pre.apply(x)
        x = x.contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed[0], GROUP, self.scale_zero[0])
        if len(self.packed) > 1:
            y.add_(torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed[1], GROUP, self.scale_zero[1]))
        if bias is not None:
            y.add_(bias)
        return y if residual is None else y.add_(residual)

    def weight_tensors(self) -> list[torch.Tensor]:
        return list(self.packed)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (*self.packed, *self.scale_zero))


Linear = PackedLinear | DenseLinear | Int4Linear | Avx512Linear


def make_linear(w: torch.Tensor | QuantWeight | QuantParts, dtype: torch.dtype, device: torch.device,
                native: bool | str = False, input_major: bool = True,
                out_dtype: torch.dtype | None = None, q8_bf16: bool = False) -> tuple[Linear, str | None]:
    """The kernel for weight ``w`` ([N, K]; dense or the file's quantized blocks) computing in
    ``dtype`` on ``device``. Returns (kernel, why a QuantWeight was dequantized or None).
    ``input_major`` picks DenseLinear's layout (see there); ``out_dtype`` is Avx512Linear's output
    dtype (the others return ``dtype``); ``q8_bf16``: Avx512Linear runs Q8_0 with bf16 activations
    (layer weights) instead of int8 ones (the vocab head)."""
    why = None
    if isinstance(w, QuantParts):
        why = "dequant"
        if native:
            whys = [avx512_reason(p, dtype, device) for p in w.parts] if native != "int4" \
                else [f"{w.kind}: torch's int4 kernel takes one kind"]
            why = next((r for r in whys if r is not None), None)
            if why is None:
                return Avx512Linear(w, dtype, out_dtype, q8_bf16), None
        w = w.dequantize()
    if isinstance(w, QuantWeight):
        why = "dequant"
        if native:
            avx_why = avx512_reason(w, dtype, device) if native != "int4" else None
            if native != "int4" and avx_why is None:
                return Avx512Linear(w, dtype, out_dtype, q8_bf16), None
            why = int4_reason(w, dtype, device)
            if why is not None and avx_why is not None and w.kind not in ("Q4_0", "Q4_1", "Q8_0"):
                why = f"{avx_why}; {why}"
        if why is None:
            return Int4Linear(w, dtype), None
        w = w.dequantize()
    w = w.to(device=device, dtype=dtype)
    if onednn_packable(dtype, device):
        return PackedLinear(w), why
    return DenseLinear(w, input_major), why


def collapse_to_hugepages(kernels: list[nn.Module]) -> None:
    """Best effort: back the kernels' weights with 2 MiB pages (``madvise(MADV_COLLAPSE)``)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        huge = 1 << 21
        for t in (t for k in kernels for t in k.weight_tensors() if t.device.type == "cpu"):
            if t.layout == torch._mkldnn:
                ptr, n = torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
            else:
                ptr, n = t.data_ptr(), t.numel() * t.element_size()
            start, end = -(-ptr // huge) * huge, (ptr + n) // huge * huge
            if end > start and libc.madvise(start, end - start, _MADV_COLLAPSE) != 0:
                return
    except Exception:  # noqa: BLE001 - an optimization only
        return


_MADV_COLLAPSE = 25


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_HINT_ROWS)
