"""Extend (prefill) attention: a chunk of new tokens per sequence attends over the sequence's
cached prefix plus the new tokens themselves, causally."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.attention.triton_kernels.common import (
    LOG2E, Tiles, block_d, check_device, cuda_capability, dot_precision)


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, O, K_buf, V_buf,
    Req_to_token, Req_pool_idx, Prefix_lens, Extend_lens, Extend_starts, Index_map,
    qk_scale, window,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_INDEX_MAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)

    ext_len = tl.load(Extend_lens + b).to(tl.int32)
    m_start = mb * BLOCK_M
    if m_start >= ext_len:
        return
    prefix = tl.load(Prefix_lens + b).to(tl.int32)
    t0 = tl.load(Extend_starts + b).to(tl.int64)
    row = tl.load(Req_pool_idx + b).to(tl.int64)
    kv_head = h // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + (t0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m_start - window + 1, 0)
    for n0 in range(lo, prefix, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix
        slot = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        if HAS_INDEX_MAP:
            slot = tl.load(Index_map + slot, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_buf + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)           # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = mask_n[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)           # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    lo_e = 0
    if HAS_WINDOW:
        lo_e = tl.maximum(m_start - window + 1, 0)
    hi_e = tl.minimum(ext_len, m_start + BLOCK_M)
    for n0 in range(lo_e, hi_e, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi_e
        k = tl.load(K_new + (t0 + offs_n)[None, :] * stride_knt + kv_head * stride_knh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > offs_m[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_new + (t0 + offs_n)[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + (t0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def default_tiles(head_dim: int, elem_size: int, device: torch.device) -> Tiles:
    """Tiles when the caller gives none."""
    major, minor = cuda_capability(device)
    if major == 0:
        return Tiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
    big_smem = major >= 9 or (major, minor) == (8, 0)
    small_d = head_dim <= 128
    if major < 8:
        m, n, stages = (64 if small_d else 32), 32, 1
    elif elem_size <= 2:
        if big_smem:
            m, n, stages = (128, 64, 2) if small_d else (64, 64, 1)
        else:
            m, n, stages = (64, 64, 2) if small_d else (32, 64, 1)
    else:
        if big_smem:
            m, n, stages = (64, 64, 2) if small_d else (32, 64, 1)
        else:
            m, n, stages = (32, 32, 1) if small_d else (16, 32, 1)
    warps = 4 if head_dim <= 64 or m <= 32 else 8
    return Tiles(block_m=m, block_n=n, num_warps=warps, num_stages=stages)


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    scale: float,
    sliding_window: int | None = None,
    index_map: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Extend attention into ``o``."""
    check_device(_extend_kernel, q)
    T, H_q, D = q.shape
    H_kv = k_buf.shape[1]
    B = extend_lens.shape[0]
    if T == 0 or B == 0 or max_extend_len == 0:
        return o
    if H_q % H_kv != 0:
        raise ValueError(f"num_q_heads={H_q} is not a multiple of num_kv_heads={H_kv}")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("o", o),
                    ("k_buf", k_buf), ("v_buf", v_buf)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    cfg = tiles or default_tiles(D, q.element_size(), q.device)
    if not cfg.block_m:
        raise ValueError(f"extend_attention needs tiles with block_m, got {cfg}")
    has_map = index_map is not None
    grid = (B, H_q, triton.cdiv(max_extend_len, cfg.block_m))
    _extend_kernel[grid](
        q, k_new, v_new, o, k_buf, v_buf,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_starts,
        index_map if has_map else req_pool_indices,
        scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), o.stride(0), o.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        GROUP=H_q // H_kv, HEAD_DIM=D,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d(D),
        HAS_WINDOW=sliding_window is not None, HAS_INDEX_MAP=has_map,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o
