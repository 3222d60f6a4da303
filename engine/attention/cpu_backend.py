"""CpuKernelAttentionBackend: paged attention in one checked C call per layer
(``torch.ops.tandem.attention``), the CPU default where the AVX512 kernels build."""

from __future__ import annotations

import torch

from tandem.engine.attention.base import AttnSpec
from tandem.engine.attention.torch_backend import _META_KEY as _TORCH_META
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.quant.native_lib import kernel_ops, kernel_unavailable

_META_KEY = "cpu_kernel"


def cpu_kernel_unavailable() -> str | None:
    """None when this backend can run here, else why not."""
    return kernel_unavailable()


class _Step:
    """A step's per-token key ranges; per-window lows and per-index-map write rows, lazily."""

    def __init__(self, fb: ForwardBatch):
        if fb.is_decode:
            self.rows, self.hi = fb.req_pool_indices, fb.seq_lens
        else:
            ext = fb.extend_lens
            self.rows = torch.repeat_interleave(fb.req_pool_indices, ext)
            offs = torch.arange(fb.num_tokens, device=ext.device) - torch.repeat_interleave(fb.extend_starts, ext)
            self.hi = torch.repeat_interleave(fb.prefix_lens, ext) + offs + 1
        self.rows = self.rows.to(torch.int64).contiguous()
        self.hi = self.hi.to(torch.int64).contiguous()
        self.lo: dict[int | None, torch.Tensor] = {None: torch.zeros_like(self.hi)}
        self.wrows: dict[int, torch.Tensor] = {}
        self.imaps: dict[int, torch.Tensor] = {}

    def low(self, window: int | None) -> torch.Tensor:
        lo = self.lo.get(window)
        if lo is None:
            lo = self.lo[window] = (self.hi - window).clamp_(min=0).contiguous()
        return lo

    def index_map(self, index_map: torch.Tensor | None) -> torch.Tensor | None:
        """The layer's index map as the kernel reads it (int64, contiguous)."""
        if index_map is None or (index_map.dtype == torch.int64 and index_map.is_contiguous()):
            return index_map
        m = self.imaps.get(index_map.data_ptr())
        if m is None:
            m = self.imaps[index_map.data_ptr()] = index_map.to(torch.int64).contiguous()
        return m

    def write_rows(self, out_cache_loc: torch.Tensor, index_map: torch.Tensor | None) -> torch.Tensor:
        if index_map is None:
            return out_cache_loc
        key = index_map.data_ptr()
        rows = self.wrows.get(key)
        if rows is None:
            rows = self.wrows[key] = index_map[out_cache_loc].to(torch.int64).contiguous()
        return rows


class CpuKernelAttentionBackend:
    """Implements :class:`tandem.engine.attention.base.AttentionBackend` with ``tq_attention``
    (``torch.ops.tandem.attention``)."""

    name = "cpu_kernel"

    def __init__(self) -> None:
        if (why := kernel_unavailable()) is not None:
            raise RuntimeError(f"the CPU attention kernel cannot run here: {why}")
        self._attention = kernel_ops().attention.default
        self._torch = TorchAttentionBackend()

    def init_forward(self, fb: ForwardBatch) -> None:
        fb.attn_meta[_META_KEY] = _Step(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                fb: ForwardBatch) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> o: [T, Hq, D]."""
        d = q.shape[2]
        args = self.kernel_args(spec, fb, q.dtype)
        if args is None:
            return self._fallback(q, k, v, spec, fb)
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        if k.stride(0) != v.stride(0) or k.stride(1) != d or v.stride(1) != d or k.stride(2) != 1 or v.stride(2) != 1:
            k, v = k.contiguous(), v.contiguous()
        kpool, vpool, wrow, r2t, rows, lo, hi, imap = args
        return self._attention(q, kpool, vpool, k, v, wrow, r2t, rows, lo, hi, imap, spec.scale)

    def kernel_args(self, spec: AttnSpec, fb: ForwardBatch, dtype: torch.dtype) -> tuple | None:
        """The attention op's pool and key-range tensors for this layer this step: (kpool, vpool,
        write rows, req_to_token, rows, lo, hi, index map or None); None when the kernel does not
        take the layer (its pool's dtype or layout, the head dim)."""
        lkv = fb.kv_pool.layer(spec.layer_id)
        if not self._takes(lkv, dtype, spec.head_dim):
            return None
        step: _Step = fb.attn_meta[_META_KEY]
        r2t = fb.req_to_token
        if r2t.dtype != torch.int32 or r2t.stride(1) != 1:
            raise ValueError(f"req_to_token must be int32 with unit stride, got {r2t.dtype} {tuple(r2t.stride())}")
        return (lkv.k, lkv.v, step.write_rows(fb.out_cache_loc, lkv.index_map), r2t, step.rows,
                step.low(spec.sliding_window), step.hi, step.index_map(lkv.index_map))

    @staticmethod
    def _takes(lkv, dtype: torch.dtype, d: int) -> bool:
        return (lkv.k.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and lkv.k.dtype == dtype and lkv.v.dtype == dtype and d % 16 == 0 and d <= 256
                and lkv.k.is_contiguous() and lkv.v.is_contiguous())

    def _fallback(self, q, k, v, spec, fb):
        if _TORCH_META not in fb.attn_meta:
            self._torch.init_forward(fb)
        return self._torch.forward(q, k, v, spec, fb)


def fused_layer_args(backend, spec: AttnSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     fb: ForwardBatch) -> tuple | None:
    """A fused layer op's attention arguments this step (:meth:`CpuKernelAttentionBackend.kernel_args`),
    or None where the step does not fit one."""
    if (not isinstance(backend, CpuKernelAttentionBackend) or x.dtype != torch.bfloat16
            or not x.is_contiguous() or cos.dtype != torch.bfloat16 or cos.stride(-1) != 1
            or sin.stride() != cos.stride()):
        return None
    return backend.kernel_args(spec, fb, x.dtype)
