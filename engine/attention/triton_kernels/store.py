"""Store the new tokens' K and V: ``k_buf[row(t)] = k[t]`` (v alike), ``row(t) = out_cache_loc[t]``
or ``index_map[out_cache_loc[t]]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.attention.triton_kernels.common import check_device


@triton.jit
def _store_kv_kernel(
    K, V, K_buf, V_buf, Loc, Index_map,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    HAS_INDEX_MAP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    if HAS_INDEX_MAP:
        slot = tl.load(Index_map + slot).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_HEADS * HEAD_DIM
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(K_buf + slot * stride_kbt + h * stride_kbh + d, k.to(K_buf.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(V_buf + slot * stride_vbt + h * stride_vbh + d, v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
    index_map: torch.Tensor | None = None,
) -> None:
    """k, v: ``[T, H_kv, D]``; k_buf, v_buf: ``[rows, H_kv, D]``; loc: int ``[T]`` slots."""
    check_device(_store_kv_kernel, k)
    T, H, D = k.shape
    if T == 0:
        return
    if k_buf.shape[1:] != (H, D) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit a pool of rows "
                         f"{tuple(k_buf.shape[1:])}")
    for name, t in (("k", k), ("v", v), ("k_buf", k_buf), ("v_buf", v_buf)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    has_map = index_map is not None
    block = triton.next_power_of_2(H * D)
    _store_kv_kernel[(T,)](
        k, v, k_buf, v_buf, loc, index_map if has_map else loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NUM_HEADS=H, HEAD_DIM=D, BLOCK=block, HAS_INDEX_MAP=has_map,
        num_warps=(4 if block >= 512 else 1) if k.is_cuda else 1,
    )
