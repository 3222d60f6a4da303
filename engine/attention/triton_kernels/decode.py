"""Decode attention: one query token per sequence over its paged KV (flash-decoding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.attention.triton_kernels.common import (
    LOG2E, Tiles, block_d, check_device, cuda_capability, dot_precision)


@triton.jit
def _decode_stage1_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_idx, Seq_lens, Index_map, Mid_o, Mid_lse,
    num_kv_splits, qk_scale, window,
    stride_qb, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEADS_PER_PROG: tl.constexpr, BLOCKS_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_INDEX_MAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)

    kv_head = hb // BLOCKS_PER_KV
    offs_h = tl.arange(0, BLOCK_H)
    h_in_group = (hb % BLOCKS_PER_KV) * HEADS_PER_PROG + offs_h
    mask_h = (offs_h < HEADS_PER_PROG) & (h_in_group < GROUP)
    heads = kv_head * GROUP + h_in_group                                   # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    row = tl.load(Req_pool_idx + b).to(tl.int64)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(seq_len - lo, num_kv_splits)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kv_off_k = kv_head * stride_kh
    kv_off_v = kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        if HAS_INDEX_MAP:
            slot = tl.load(Index_map + slot, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_buf + slot[None, :] * stride_kt + kv_off_k + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slot[:, None] * stride_vt + kv_off_v + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mo = Mid_o + b.to(tl.int64) * stride_mob + split * stride_mos
    if DIRECT:
        tl.store(mo + heads[:, None] * stride_moh + offs_d[None, :], out.to(Mid_o.dtype.element_ty),
                 mask=mask_h[:, None] & mask_d[None, :])
    else:
        tl.store(mo + heads[:, None] * stride_moh + offs_d[None, :], out,
                 mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Mid_lse + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    Mid_o, Mid_lse, O,
    num_kv_splits,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_kv_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(Mid_lse + b.to(tl.int64) * stride_mlb + h * stride_mlh + offs_s,
                  mask=mask_s, other=float("-inf"))                          # [BLOCK_S]
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(lse - m)
    parts = tl.load(Mid_o + b.to(tl.int64) * stride_mob + h * stride_moh
                    + offs_s[:, None] * stride_mos + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)        # [BLOCK_S, BLOCK_D]
    w_sum = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             out.to(O.dtype.element_ty), mask=mask_d)


def default_tiles(head_dim: int, device: torch.device) -> Tiles:
    """Stage 1's tiles when the caller gives none (bench/gpu_check.py's sweep tunes them)."""
    major, _ = cuda_capability(device)
    if major >= 8:
        return Tiles(block_n=32 if head_dim <= 128 else 16, num_warps=4, num_stages=2)
    if major > 0:
        return Tiles(block_n=32 if head_dim <= 128 else 16, num_warps=4, num_stages=1)
    return Tiles(block_n=32, num_warps=1, num_stages=1)


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int,
    sliding_window: int | None = None,
    index_map: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Decode attention into ``o``."""
    check_device(_decode_stage1_kernel, q)
    B, H_q, D = q.shape
    H_kv = k_buf.shape[1]
    if B == 0:
        return o
    if H_q % H_kv != 0:
        raise ValueError(f"num_q_heads={H_q} is not a multiple of num_kv_heads={H_kv}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
    for name, t in (("q", q), ("o", o), ("k_buf", k_buf), ("v_buf", v_buf)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    group = H_q // H_kv
    block_h = max(16, min(32, triton.next_power_of_2(group)))
    heads_per_prog = min(group, block_h)
    blocks_per_kv = triton.cdiv(group, heads_per_prog)
    BD = block_d(D)

    direct = num_kv_splits == 1
    if direct:
        mid_o, mid_lse = o.unsqueeze(2), o[:, :, 0]     # [B, H_q, 1, D]; lse never written
    else:
        mid_o = torch.empty((B, H_q, num_kv_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H_q, num_kv_splits), dtype=torch.float32, device=q.device)
    cfg = tiles or default_tiles(D, q.device)
    has_map = index_map is not None
    _decode_stage1_kernel[(B, H_kv * blocks_per_kv, num_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens,
        index_map if has_map else req_pool_indices,
        mid_o, mid_lse,
        num_kv_splits, scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEADS_PER_PROG=heads_per_prog, BLOCKS_PER_KV=blocks_per_kv,
        HEAD_DIM=D, BLOCK_H=block_h, BLOCK_D=BD, BLOCK_N=cfg.block_n,
        HAS_WINDOW=sliding_window is not None, HAS_INDEX_MAP=has_map,
        DOT_PRECISION=dot_precision(q.dtype), DIRECT=direct,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if direct:
        return o
    _decode_stage2_kernel[(B, H_q)](
        mid_o, mid_lse, o,
        num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_D=BD,
        num_warps=4 if q.is_cuda else 1, num_stages=2 if q.is_cuda else 1,
    )
    return o
