"""CpuKernelAttentionBackend: paged attention in one C call per layer (``tq_attention`` in
engine/quant/avx512_kernels.c, as the typed op ``torch.ops.tandem.attention``, which checks the
tensors' shapes, dtypes and index ranges first), the CPU default where the AVX512 kernels build.

One call writes the step's new K/V into the layer's pool and attends every query over its keys,
read in place through ``req_to_token`` (and ``LayerKV.index_map``): no gather, no padding, no
per-width groups. Each query row is computed by the same instruction sequence whatever else is in
the step (keys in blocks of 16 absolute positions, online softmax in float32; the C file says the
exact order), so a query's output is bitwise the same in a prompt chunk, after a cached prefix, or
as a decode row in any batch, at any thread count, for full and sliding-window layers alike: the
prefix cache on/off, retraction-recompute and disaggregated-vs-colocated oracles hold exactly.

Per step (``init_forward``): for every new token t, its sequence's ``req_to_token`` row and the
end of its key range ``hi[t] = position + 1`` (``[T]`` int64 each); a window W makes the range
``[max(0, hi - W), hi)``. Layers whose shapes or dtypes the kernel does not take (pool dtype other
than q's, head_dim not a multiple of 16 or above 256) go to :class:`TorchAttentionBackend`.
"""

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
        if fb.is_decode:                                     # T == B, one token each
            self.rows, self.hi = fb.req_pool_indices, fb.seq_lens
        else:
            ext = fb.extend_lens
            self.rows = torch.repeat_interleave(fb.req_pool_indices, ext)
            # hi of sequence i's new tokens: prefix_i + 1 .. seq_len_i
            offs = torch.arange(fb.num_tokens, device=ext.device) - torch.repeat_interleave(fb.extend_starts, ext)
            self.hi = torch.repeat_interleave(fb.prefix_lens, ext) + offs + 1
        self.rows = self.rows.to(torch.int64).contiguous()
        self.hi = self.hi.to(torch.int64).contiguous()
        self.lo: dict[int | None, torch.Tensor] = {None: torch.zeros_like(self.hi)}
        self.wrows: dict[int, torch.Tensor] = {}   # index map address -> this step's write rows
        self.imaps: dict[int, torch.Tensor] = {}   # index map address -> it as int64, contiguous

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

    name = "cpu_kernel"   # what the startup line calls it

    def __init__(self) -> None:
        if (why := kernel_unavailable()) is not None:
            raise RuntimeError(f"the CPU attention kernel cannot run here: {why}")
        self._attention = kernel_ops().attention.default
        self._torch = TorchAttentionBackend()       # for layers the kernel does not take

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
        take the layer (its pool's dtype or layout, the head dim). They live in ``fb`` for the step."""
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
        if _TORCH_META not in fb.attn_meta:               # the first such layer this step
            self._torch.init_forward(fb)
        return self._torch.forward(q, k, v, spec, fb)


def fused_layer_args(backend, spec: AttnSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     fb: ForwardBatch) -> tuple | None:
    """A fused layer op's attention arguments this step (:meth:`CpuKernelAttentionBackend.kernel_args`),
    or None where the step does not fit one: another backend, x not contiguous bf16 [T, H], cos /
    sin not bf16 rows of unit stride sharing strides, or a layer the backend gives to torch."""
    if (not isinstance(backend, CpuKernelAttentionBackend) or x.dtype != torch.bfloat16
            or not x.is_contiguous() or cos.dtype != torch.bfloat16 or cos.stride(-1) != 1
            or sin.stride() != cos.stride()):
        return None
    return backend.kernel_args(spec, fb, x.dtype)
