"""The fused elementwise kernels of a Llama layer's GPU path (engine/models/llama_gpu.py): one
launch each where torch needs several."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.attention.triton_kernels.common import check_device


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Out, stride_x, stride_r, stride_o, N, eps,
                        HAS_X: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
    if HAS_X:
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        r = (r.to(tl.float32) + x.to(tl.float32)).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + offs, r, mask=mask)
    rf = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(rf * rf, 0) / N + eps)
    y = (rf * inv).to(Out.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + offs, (y.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty),
             mask=mask)


def add_rmsnorm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """``residual += x`` in place (``x`` None: unchanged); returns ``rmsnorm(residual) * weight``.
    x, residual: ``[T, N]``; weight ``[N]``."""
    check_device(_add_rmsnorm_kernel, residual)
    T, N = residual.shape
    out = torch.empty_like(residual)
    if T == 0:
        return out
    if residual.stride(-1) != 1 or (x is not None and (x.shape != residual.shape or x.stride(-1) != 1)):
        raise ValueError(f"add_rmsnorm: x {None if x is None else tuple(x.shape)} and residual "
                         f"{tuple(residual.shape)} must match, last dim contiguous")
    block = triton.next_power_of_2(N)
    _add_rmsnorm_kernel[(T,)](
        x if x is not None else residual, residual, weight, out,
        x.stride(0) if x is not None else 0, residual.stride(0), out.stride(0), N, eps,
        HAS_X=x is not None, BLOCK=block, num_warps=_warps(block, residual))
    return out


def add_rmsnorm_reference(x, residual, weight, eps):
    """The unfused ops (engine/layers.py's ``rms_norm`` after a torch add)."""
    from tandem.engine.layers import rms_norm

    if x is not None:
        residual += x
    return rms_norm(residual, weight, eps)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_g, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + I + offs, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + offs, (s.to(tl.float32) * u.to(tl.float32)).to(Out.dtype.element_ty),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up ``[T, 2I]`` (gate first) -> ``silu(gate) * up`` ``[T, I]``."""
    check_device(_silu_mul_kernel, gate_up)
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_mul: gate_up must be contiguous in its last dim")
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
        num_warps=_warps(block, gate_up))
    return out


def silu_mul_reference(gate_up):
    import torch.nn.functional as F

    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


@triton.jit
def _rope_store_kernel(QK, V, Cos, Sin, Pos, K_buf, V_buf, Loc, Index_map,
                       stride_qkt, stride_qkh, stride_vt, stride_vh, stride_cs,
                       stride_kbt, stride_kbh, stride_vbt, stride_vbh,
                       NQ: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_INDEX_MAP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(Cos + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < NQ + NKV
    m = mask_h[:, None] & mask_d[None, :]
    base = QK + t * stride_qkt + offs_h[:, None] * stride_qkh + offs_d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(QK.dtype.element_ty)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(QK.dtype.element_ty)
    tl.store(base, o1, mask=m)
    tl.store(base + HALF, o2, mask=m)
    slot = tl.load(Loc + t).to(tl.int64)
    if HAS_INDEX_MAP:
        slot = tl.load(Index_map + slot).to(tl.int64)
    kh = offs_h - NQ
    mk = m & (offs_h >= NQ)[:, None]
    kb = K_buf + slot * stride_kbt + kh[:, None] * stride_kbh + offs_d[None, :]
    tl.store(kb, o1.to(K_buf.dtype.element_ty), mask=mk)
    tl.store(kb + HALF, o2.to(K_buf.dtype.element_ty), mask=mk)
    mv = (offs_h < NKV)[:, None] & mask_d[None, :]
    vs = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    vb = V_buf + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(vb, tl.load(vs, mask=mv, other=0.0).to(V_buf.dtype.element_ty), mask=mv)
    tl.store(vb + HALF, tl.load(vs + HALF, mask=mv, other=0.0).to(V_buf.dtype.element_ty), mask=mv)


def rope_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, num_q_heads: int, k_buf: torch.Tensor, v_buf: torch.Tensor,
               loc: torch.Tensor, index_map: torch.Tensor | None = None) -> None:
    """qk ``[T, Hq + Hkv, D]`` rotated in place (q heads first); rows ``loc`` (through
    ``index_map``) of k_buf / v_buf ``[rows, Hkv, D]`` get the rotated k and ``v`` ``[T, Hkv, D]``.
    cos, sin: the rotary tables ``[max_position, D/2]``; positions ``[T]``."""
    check_device(_rope_store_kernel, qk)
    T, H, D = qk.shape
    if T == 0:
        return
    n_kv = H - num_q_heads
    if v.shape != (T, n_kv, D) or k_buf.shape[1:] != (n_kv, D) or D % 2:
        raise ValueError(f"rope_store: qk {tuple(qk.shape)}, v {tuple(v.shape)}, pool rows "
                         f"{tuple(k_buf.shape[1:])} do not fit {num_q_heads} q heads")
    for name, t in (("qk", qk), ("v", v), ("k_buf", k_buf), ("v_buf", v_buf), ("cos", cos)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_store: {name} must be contiguous in its last dim")
    has_map = index_map is not None
    _rope_store_kernel[(T,)](
        qk, v, cos, sin, positions, k_buf, v_buf, loc, index_map if has_map else loc,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NQ=num_q_heads, NKV=n_kv, HALF=D // 2, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_D=triton.next_power_of_2(D // 2), HAS_INDEX_MAP=has_map,
        num_warps=4 if qk.is_cuda else 1)


def rope_store_reference(qk, v, cos, sin, positions, num_q_heads, k_buf, v_buf, loc, index_map=None):
    """The unfused ops: engine/layers.py's ``Rotary.apply``, then the KV store."""
    from tandem.engine.layers import Rotary

    qk.copy_(Rotary.apply(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))
    rows = loc if index_map is None else index_map[loc]
    k_buf[rows] = qk[:, num_q_heads:].to(k_buf.dtype)
    v_buf[rows] = v.to(v_buf.dtype)


def _warps(block: int, t: torch.Tensor) -> int:
    if not t.is_cuda:
        return 1
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


@triton.jit
def _sample_kernel(Logits, Out, Temp, TopP, TopK, Seed, stride, V, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    lo = float("inf")
    am = V
    for off in range(0, V, BLOCK):
        x = tl.load(base + off + offs, mask=off + offs < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        bi = tl.min(tl.where(x == bm, off + offs, V), 0)
        am = tl.where(bm > m, bi, am)
        m = tl.maximum(m, bm)
        lo = tl.minimum(lo, tl.min(tl.where(off + offs < V, x, float("inf")), 0))
    temp = tl.load(Temp + row)
    if temp <= 0.0:
        tl.store(Out + row, am.to(tl.int64))
    else:
        top_k = tl.load(TopK + row)
        top_p = tl.load(TopP + row)
        t_k = lo
        if top_k > 0:
            a, b = lo, m
            for _ in range(ITERS):
                mid = (a + b) * 0.5
                n = 0
                for off in range(0, V, BLOCK):
                    x = tl.load(base + off + offs, mask=off + offs < V, other=float("-inf")).to(tl.float32)
                    n += tl.sum((x >= mid).to(tl.int32), 0)
                a = tl.where(n >= top_k, mid, a)
                b = tl.where(n >= top_k, b, mid)
            t_k = a
        denom = 0.0
        for off in range(0, V, BLOCK):
            x = tl.load(base + off + offs, mask=off + offs < V, other=float("-inf")).to(tl.float32)
            denom += tl.sum(tl.where(x >= t_k, tl.exp((x - m) / temp), 0.0), 0)
        t_p = 0.0
        if top_p < 1.0:
            a, b = 0.0, 1.0
            for _ in range(ITERS):
                mid = (a + b) * 0.5
                mass = 0.0
                for off in range(0, V, BLOCK):
                    x = tl.load(base + off + offs, mask=off + offs < V, other=float("-inf")).to(tl.float32)
                    p = tl.where(x >= t_k, tl.exp((x - m) / temp) / denom, 0.0)
                    mass += tl.sum(tl.where(p >= mid, p, 0.0), 0)
                a = tl.where(mass >= top_p, mid, a)
                b = tl.where(mass >= top_p, b, mid)
            t_p = a
        seed = tl.load(Seed + row)
        best = float("-inf")
        tok = am
        for off in range(0, V, BLOCK):
            idx = off + offs
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            z = (x - m) / temp
            keep = (idx < V) & (x >= t_k) & (tl.exp(z) / denom >= t_p)
            u = tl.rand(seed, idx)
            g = z - tl.log(-tl.log(tl.maximum(u, 1e-20)))
            g = tl.where(keep, g, float("-inf"))
            bg = tl.max(g, 0)
            bi = tl.min(tl.where(g == bg, idx, V), 0)
            tok = tl.where(bg > best, bi, tok)
            best = tl.maximum(best, bg)
        tl.store(Out + row, tok.to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seeds: torch.Tensor, iters: int = 24) -> torch.Tensor:
    """One token per row of logits ``[B, V]``, in one launch: temperature 0 is greedy (the first
    maximal index, as ``argmax``); otherwise softmax(logits / temperature) cut to the top-k logits
    (``top_k`` 0: off) and then to the top-p mass (``top_p`` 1: off), drawn by Gumbel-max with noise
    from ``seeds[b]`` and the token index only (a row's draw does not depend on its batch)."""
    check_device(_sample_kernel, logits)
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if logits.stride(-1) != 1:
        raise ValueError("sample: logits must be contiguous in their last dim")
    block = min(1024, triton.next_power_of_2(V))
    _sample_kernel[(B,)](logits, out, temperature, top_p, top_k, seeds, logits.stride(0), V,
                         ITERS=iters, BLOCK=block, num_warps=4 if logits.is_cuda else 1)
    return out


def sample_reference_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The distribution :func:`sample` draws a row from (engine/sampler.py's ``_one`` cuts)."""
    row = logits.float() / temperature
    if 0 < top_k < row.shape[-1]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sp, -1) - sp) > top_p
        sp[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return probs / probs.sum()
