"""Tandem's triton attention kernels on the GPU: a tuning sweep per shape (tiles, split-KV) against
the defaults, checked against a dense fp32 reference, and timed against FlashInfer when it is
importable, else against torch's ``scaled_dot_product_attention`` on the equivalent dense inputs.

Shapes (``SHAPES``): SmolLM2-135M (9 query / 3 KV heads, D 64) and Llama-3-8B (32 / 8, D 128);
decode at batch 1 / 32 / 128 over 512 and 4,096 keys; extend of one 2,048-token prompt and of
four 512-token chunks over 2,048 cached tokens. Pages of 16 slots in shuffled order. The sweep
stops at its time budget (the report says which shapes it covered).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

GEOMETRIES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


@dataclass(frozen=True)
class Shape:
    kind: str        # "decode" | "extend"
    geometry: str
    batch: int
    prefix: int      # cached keys per sequence (decode: its context)
    new: int         # new tokens per sequence (decode: 1)

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode {self.geometry} B={self.batch} ctx={self.prefix}"
        return f"extend {self.geometry} B={self.batch} new={self.new} prefix={self.prefix}"


SHAPES = [Shape("decode", g, b, c, 1) for g in GEOMETRIES for b in (1, 32, 128) for c in (512, 4096)] + \
         [Shape("extend", g, 1, 0, 2048) for g in GEOMETRIES] + \
         [Shape("extend", g, 4, 2048, 512) for g in GEOMETRIES]
SMOKE_SHAPES = [Shape("decode", "tiny", 2, 40, 1), Shape("extend", "tiny", 2, 8, 24)]
SPACES: dict[str, dict[str, Any]] = {
    "quick": {"decode": [dict(block_n=n, num_warps=w, num_stages=s) for n, w, s in
                         itertools.product((32, 64), (4, 8), (2, 3))],
              "splits": (1, 2, 4, 8, 16),
              "extend": [dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for (m, n), w, s in
                         itertools.product(((64, 64), (128, 64), (128, 32)), (4, 8), (1, 2))]},
    "full": {"decode": [dict(block_n=n, num_warps=w, num_stages=s) for n, w, s in
                        itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4))],
             "splits": (1, 2, 4, 8, 16, 32),
             "extend": [dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in
                        itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3))]},
    "smoke": {"decode": [dict(block_n=32, num_warps=1, num_stages=1)], "splits": (1, 2),
              "extend": [dict(block_m=16, block_n=16, num_warps=1, num_stages=1)]},
}


class Inputs:
    """One shape's paged inputs (bf16 on CUDA, fp32 in the interpreter) and their dense views."""

    def __init__(self, shape: Shape, device, dtype, page_size: int = 16, seed: int = 0):
        hq, hkv, d = GEOMETRIES.get(shape.geometry, (4, 2, 16))
        g = torch.Generator(device="cpu").manual_seed(seed)
        B, P, N = shape.batch, shape.prefix, shape.new
        L = P + N
        pages_per = -(-L // page_size)
        num_pages = B * pages_per
        rows = (num_pages + 1) * page_size
        self.k_buf = torch.randn(rows, hkv, d, generator=g).to(device, dtype)
        self.v_buf = torch.randn(rows, hkv, d, generator=g).to(device, dtype)
        order = (torch.randperm(num_pages, generator=g) + 1).view(B, pages_per)
        slots = (order[:, :, None] * page_size + torch.arange(page_size)).view(B, -1)[:, :L]   # [B, L]
        self.r2t = torch.zeros(B + 1, L, dtype=torch.int32)
        self.r2t[1:] = slots.to(torch.int32)
        self.r2t = self.r2t.to(device)
        self.rows = torch.arange(1, B + 1, device=device)
        self.seq_lens = torch.full((B,), L, device=device)
        self.prefix_lens = torch.full((B,), P, device=device)
        self.extend_lens = torch.full((B,), N, device=device)
        self.extend_starts = torch.arange(B, device=device) * N
        self.q = torch.randn(B * N, hq, d, generator=g).to(device, dtype)
        self.o = torch.empty_like(self.q)
        new = slots[:, P:].reshape(-1).to(device)
        self.k_new, self.v_new = self.k_buf[new], self.v_buf[new]        # the new tokens' K/V
        self.k_dense = self.k_buf[slots.to(device)].transpose(1, 2).contiguous()   # [B, H_kv, L, D]
        self.v_dense = self.v_buf[slots.to(device)].transpose(1, 2).contiguous()
        self.scale = d ** -0.5
        self.shape, self.dims = shape, (hq, hkv, d)

    def run(self, tiles: dict | None, splits: int) -> torch.Tensor:
        from tandem.engine.attention.triton_kernels import Tiles, decode_attention, extend_attention

        t = Tiles(**tiles) if tiles else None
        if self.shape.kind == "decode":
            return decode_attention(self.q, self.k_buf, self.v_buf, self.o, self.r2t, self.rows,
                                    self.seq_lens, self.scale, splits, None, None, t)
        return extend_attention(self.q, self.k_new, self.v_new, self.o, self.k_buf, self.v_buf, self.r2t,
                                self.rows, self.prefix_lens, self.extend_lens, self.extend_starts,
                                self.shape.new, self.scale, None, None, t)

    def sdpa(self) -> torch.Tensor:
        """The same attention on dense inputs: [B * N, H_q, D]."""
        B, P, N = self.shape.batch, self.shape.prefix, self.shape.new
        q = self.q.view(B, N, *self.q.shape[1:]).transpose(1, 2)         # [B, H_q, N, D]
        if N == 1 or P == 0:
            o = F.scaled_dot_product_attention(q, self.k_dense, self.v_dense, is_causal=N > 1,
                                               scale=self.scale, enable_gqa=True)
        else:
            qpos = torch.arange(P, P + N, device=q.device)[:, None]
            mask = torch.arange(P + N, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(q, self.k_dense, self.v_dense, attn_mask=mask,
                                               scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * N, *self.q.shape[1:])

    def reference(self) -> torch.Tensor:
        """fp32 dense attention."""
        B, P, N = self.shape.batch, self.shape.prefix, self.shape.new
        hq, hkv, _ = self.dims
        q = self.q.float().view(B, N, hq, -1).transpose(1, 2)
        k = self.k_dense.float().repeat_interleave(hq // hkv, 1)
        v = self.v_dense.float().repeat_interleave(hq // hkv, 1)
        s = q @ k.transpose(-1, -2) * self.scale                          # [B, H, N, L]
        qpos = torch.arange(P, P + N, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(P + N, device=q.device)[None, :] > qpos, float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(B * N, hq, -1)


def _flashinfer_decode(x: Inputs, page_size: int = 16):
    """A timing closure over FlashInfer's paged decode on the same pages, or None."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - optional
        return None
    hq, hkv, d = x.dims
    B, L = x.shape.batch, x.shape.prefix + 1
    pages = (x.r2t[1:, ::page_size].long() // page_size).to(torch.int32)          # [B, pages]
    indptr = torch.arange(0, B + 1, device=pages.device, dtype=torch.int32) * pages.shape[1]
    last = torch.full((B,), (L - 1) % page_size + 1, device=pages.device, dtype=torch.int32)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=pages.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, pages.flatten().contiguous(), last, hq, hkv, d, page_size, data_type=x.q.dtype)
    kv = (x.k_buf.view(-1, page_size, hkv, d), x.v_buf.view(-1, page_size, hkv, d))
    return lambda: w.run(x.q, kv)


def _bench(fn, cuda: bool) -> float:
    """Median microseconds of ``fn``."""
    if cuda:
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
    fn()
    t = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - t)


def sweep(space: str, device, dtype, budget_s: float, smoke: bool = False) -> dict:
    """Per shape: default / best config times, the best config, SDPA and FlashInfer times,
    and the default's error against the fp32 reference."""
    from tandem.engine.attention.split_rule import DEFAULT_SPLITS, choose_splits
    from tandem.engine.attention.triton_backend import choose_kv_splits

    cuda = torch.device(device).type == "cuda"
    sp = SPACES[space]
    t0 = time.perf_counter()
    rows, skipped = [], []
    for shape in (SMOKE_SHAPES if smoke else SHAPES):
        if time.perf_counter() - t0 > budget_s:
            skipped.append(shape.name)
            continue
        x = Inputs(shape, device, dtype)
        ref = x.reference()
        # what the backend picks: sized for the serving context limit on CUDA (8,192 here)
        default_splits = (choose_splits(DEFAULT_SPLITS, 8192, shape.batch, x.dims[1]) if cuda
                          else choose_kv_splits(shape.prefix + 1, 16, 128))
        out = x.run(None, default_splits).clone()
        err = float((out.float() - ref).norm() / ref.norm())
        row: dict[str, Any] = {"shape": shape.name, "rel_err_vs_fp32": round(err, 5),
               "default_us": round(_bench(lambda: x.run(None, default_splits), cuda), 2),
               "default_splits": default_splits if shape.kind == "decode" else None}
        best: tuple[float, Any] = (row["default_us"], "default")
        configs = sp[shape.kind]
        splits = sp["splits"] if shape.kind == "decode" else (1,)
        bad = 0
        for tiles, s in itertools.product(configs, splits):
            if time.perf_counter() - t0 > budget_s:
                row["truncated"] = True
                break
            try:
                got = x.run(tiles, s)
                if float((got.float() - ref).norm() / ref.norm()) > max(3 * err, 2e-2):
                    bad += 1
                    continue
                us = _bench(lambda: x.run(tiles, s), cuda)
            except Exception:  # noqa: BLE001 - a config the GPU cannot launch (shared memory)
                bad += 1
                continue
            if us < best[0]:
                best = (round(us, 2), dict(tiles, splits=s) if shape.kind == "decode" else tiles)
        row.update(best_us=best[0], best=best[1], configs_failed=bad,
                   speedup=round(row["default_us"] / best[0], 3))
        try:
            row["sdpa_dense_us"] = round(_bench(x.sdpa, cuda), 2)
        except Exception as e:  # noqa: BLE001 - SDPA may refuse a shape
            row["sdpa_dense_us"] = f"error: {type(e).__name__}"
        fi = _flashinfer_decode(x) if (cuda and shape.kind == "decode") else None
        if fi is not None:
            try:
                row["flashinfer_us"] = round(_bench(fi, cuda), 2)
            except Exception as e:  # noqa: BLE001
                row["flashinfer_us"] = f"error: {type(e).__name__}: {e}"[:120]
        rows.append(row)
        del x
    try:
        import flashinfer  # noqa: F401
        fi_note = "flashinfer imported"
    except Exception:  # noqa: BLE001
        fi_note = "flashinfer not importable: compared against torch SDPA on dense inputs"
    return {"space": space, "shapes": rows, "skipped": skipped, "baseline": fi_note,
            "seconds": round(time.perf_counter() - t0, 1)}
