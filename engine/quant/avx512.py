"""Avx512Linear: a GGUF weight's own quantized blocks times bf16 activations on AVX512 BF16 + VNNI
(the checked op ``torch.ops.tandem.linear_``; native_lib.py builds it)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.quant.blocks import GROUP, QuantParts, QuantWeight
from tandem.engine.quant.native_lib import kernel_ops, kernel_unavailable
from tandem.engine.quant.preop import PreOp

KIND_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_0": 4, "Q5_1": 4, "Q5_K": 4, "Q6_K": 5}
_KQ = ("Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
Q8_BF16 = 6
_CODE_BIAS = {"Q5_0": 16, "Q6_K": 32, "Q8_0": 128}
_PRE_IDS = {None: 0, "rmsnorm": 1, "silu_mul": 2, "rmsnorm_f32": 3, "gelu_mul": 4}


def avx512_reason(w: QuantWeight, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when :class:`Avx512Linear` can run ``w`` with ``dtype`` activations on ``device``, else
    why not."""
    n, k = w.shape
    if torch.device(device).type != "cpu":
        return f"{w.kind} on {torch.device(device).type}: the AVX512 kernels are CPU ones"
    if dtype != torch.bfloat16:
        return f"{w.kind} with {str(dtype).removeprefix('torch.')} activations (the AVX512 kernels: bfloat16)"
    if w.kind not in KIND_IDS:
        return f"{w.kind} has no AVX512 kernel"
    if k % GROUP or n % 16:
        return f"{w.kind} shape [{n}, {k}] (the AVX512 kernels need N % 16 == 0, K % 32 == 0)"
    return kernel_unavailable()


def _kq_parts(w: QuantWeight, p: int, nb: int) -> list[torch.Tensor]:
    u = w.codes.to(torch.int32) + _CODE_BIAS.get(w.kind, 0)                     # [N, K] 0..63 (Q8_0: 255)
    c = (u & 15).to(torch.uint8).view(p, 16, nb, 4, 8).permute(0, 2, 3, 1, 4)    # [P, nb, i, 16, 8]
    lane = torch.stack([c[..., 0] | (c[..., 2] << 4), c[..., 4] | (c[..., 6] << 4),
                        c[..., 1] | (c[..., 3] << 4), c[..., 5] | (c[..., 7] << 4)], -1)
    parts = [lane.reshape(p, nb, 256)]
    e = torch.arange(8)
    pos = (4 * (e // 2) + 16 * (e % 2))[None, :] + torch.arange(4)[:, None]       # [i, e]
    for bit in (4, 5, 6, 7)[: {"Q4_K": 0, "Q6_K": 2, "Q8_0": 4}.get(w.kind, 1)]:
        hb = ((u >> bit) & 1).to(torch.int64).view(p, 16, nb, 4, 8)               # [P, 16, nb, i, e]
        plane = (hb << pos).sum((-1, -2)).transpose(1, 2).to(torch.int32)        # [P, nb, 16]
        parts.append(plane.contiguous().view(torch.uint8).view(p, nb, 64))
    scale = w.scale                                                               # [N, K / G]
    offset = w.offset.clone()
    if w.kind in _CODE_BIAS:
        offset = -float(_CODE_BIAS[w.kind]) * scale
    halves = 2 if w.kind == "Q6_K" else 1
    for t in (scale, offset):
        v = t.view(p, 16, nb, halves).permute(0, 2, 3, 1)                         # [P, nb, half, 16]
        parts.append(v.contiguous().view(torch.uint8).view(p, nb, 64 * halves))
    return parts


def pack(w: QuantWeight, q8_bf16: bool = False) -> torch.Tensor:
    """The kernels' panel layout (see ``avx512_kernels.c``): [N / 16, K / 32, record] uint8."""
    n, k = w.shape
    p, nb = n // 16, k // GROUP
    if w.kind in _KQ or (q8_bf16 and w.kind == "Q8_0"):
        return torch.cat(_kq_parts(w, p, nb), -1).contiguous()
    parts = []
    if w.kind == "Q8_0":
        u = (w.codes.to(torch.int16) + 128).to(torch.uint8)                          # [N, K]
        codes = u.view(p, 16, nb, 8, 4).permute(0, 2, 3, 1, 4)                       # [P, nb, 8, 16, 4]
        parts.append(codes.reshape(p, nb, 512))
    else:
        # [P, nb, chunk i, column j, 8] with k = 8 i + e; lane bytes: (k0|k2<<4, k4|k6<<4, k1|k3<<4, k5|k7<<4)
        c = w.codes.to(torch.uint8).view(p, 16, nb, 4, 8).permute(0, 2, 3, 1, 4)
        lane = torch.stack([c[..., 0] | (c[..., 2] << 4), c[..., 4] | (c[..., 6] << 4),
                            c[..., 1] | (c[..., 3] << 4), c[..., 5] | (c[..., 7] << 4)], -1)
        parts.append(lane.reshape(p, nb, 256))
    d = w.scale.to(torch.float16).view(p, 16, nb).transpose(1, 2)                    # [P, nb, 16]
    parts.append(d.contiguous().view(torch.uint8).view(p, nb, 32))
    if w.kind == "Q4_1":
        m = w.offset.to(torch.float16).view(p, 16, nb).transpose(1, 2)
        parts.append(m.contiguous().view(torch.uint8).view(p, nb, 32))
    return torch.cat(parts, -1).contiguous()


def _nw(pre: PreOp | None, dtype: torch.dtype) -> torch.Tensor | None:
    if pre is None or pre.weight is None:
        return None
    want = torch.float32 if pre.kind == "rmsnorm_f32" else dtype
    return pre.weight if pre.weight.dtype == want else pre.weight.to(want)


def activations(kind: str, x: torch.Tensor, k: int, pre: PreOp | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel multiplies for x ([T, K], or [T, 2K] for silu_mul / gelu_mul; tests): Q8_0 ->
    (xq [T, K] int8, d_x [T, K/32]); others -> (bf16 rows [T, K], per-block sums [T, K/32]; Q6_K:
    per 16, [T, K/16])."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return kernel_ops().activations(KIND_IDS[kind], x, k, _PRE_IDS[pre.kind if pre is not None else None],
                                    _nw(pre, x.dtype), pre.eps if pre is not None else 0.0)


class Avx512Linear(nn.Module):
    """``y = pre(x) @ W^T (+ bias) (+ residual)`` on a GGUF weight's own blocks (see module
    docstring)."""

    def __init__(self, w: QuantWeight | QuantParts, dtype: torch.dtype, out_dtype: torch.dtype | None = None,
                 q8_bf16: bool = False):
        super().__init__()
        parts = w.parts if isinstance(w, QuantParts) else (w,)
        for p in parts:
            if (why := avx512_reason(p, dtype, torch.device("cpu"))) is not None:
                raise ValueError(f"Avx512Linear cannot hold this weight: {why}")
        self.out_features, self.in_features = w.shape
        self.kind = w.kind
        self.out_dtype = out_dtype
        def kid(p: QuantWeight) -> int:
            return Q8_BF16 if q8_bf16 and p.kind == "Q8_0" else KIND_IDS[p.kind]

        self._segments = [(kid(p), sum(q.shape[0] for q in parts[:i]), p.shape[0])
                          for i, p in enumerate(parts)]
        if len(parts) == 1:
            self.kind_id = kid(w)
            self.packed = nn.Parameter(pack(w, q8_bf16), requires_grad=False)   # [N/16, K/32, record] u8
            self.parts = None
        else:
            self.kind_id, self.packed = None, None
            self.parts = nn.ParameterList([nn.Parameter(pack(p, q8_bf16), requires_grad=False) for p in parts])

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, pre: PreOp | None = None) -> torch.Tensor:
        """x: [T, K] ([T, 2K] with a gated ``pre``: silu_mul, gelu_mul), float32 or bf16 (+ bias
        [N]) (+ residual [T, N]) -> [T, N] in ``out_dtype`` (default x's dtype)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        t, n, k = x.shape[0], self.out_features, self.in_features
        gated = pre is not None and pre.gated
        if x.dim() != 2 or x.shape[1] != (2 * k if gated else k):
            raise ValueError(f"Avx512Linear [{n}, {k}] got input {tuple(x.shape)} "
                             f"(wants [T, {2 * k if gated else k}])")
        out = torch.empty(t, n, dtype=self.out_dtype or x.dtype)
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        nw = _nw(pre, x.dtype)
        pre_id, eps = _PRE_IDS[pre.kind if pre is not None else None], pre.eps if pre is not None else 0.0
        linear_ = kernel_ops().linear_.default
        if self.packed is not None:
            linear_(self.kind_id, self.packed, x, out, pre_id, nw, eps, residual, bias)
            return out
        for (kind_id, n0, nn_), wp in zip(self._segments, self.parts):
            linear_(kind_id, wp, x, out[:, n0:n0 + nn_], pre_id, nw, eps,
                    residual[:, n0:n0 + nn_] if residual is not None else None,
                    bias[n0:n0 + nn_] if bias is not None else None)
        return out

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.packed] if self.packed is not None else list(self.parts)

    @property
    def part_kinds(self) -> list[int]:
        """The C kernel's kind of each part, in :meth:`weight_tensors`' order."""
        return [kind_id for kind_id, _, _ in self._segments]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.weight_tensors())


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotary embedding in place, bitwise what ``layers.Rotary.apply`` returns (each bf16 product
    and sum rounded as torch's separate ops round them). x: [T, H, D] (unit stride in D, heads D
    apart; rows at any stride); cos, sin: [T, 1, D/2] in x's dtype. Returns False, touching nothing,
    where the kernel does not apply (no library, another dtype or layout, D/2 % 16)."""
    t, h, d = x.shape
    if (x.dtype not in (torch.float32, torch.bfloat16) or cos.dtype != x.dtype or x.stride(2) != 1
            or x.stride(1) != d or (d // 2) % 16 or cos.stride(-1) != 1 or sin.stride() != cos.stride()
            or x.device.type != "cpu" or (ops := kernel_ops()) is None):
        return False
    ops.rope_.default(x, cos, sin)
    return True
