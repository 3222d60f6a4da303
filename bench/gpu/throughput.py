"""The measuring half of bench/gpu_check.py: the machine's ceilings, then Tandem against
transformers and against those ceilings.

Ceilings (measured here, not datasheet): device-to-device copy bandwidth counting bytes read +
written; a bf16 GEMM's FLOP/s; pinned host <-> device copy bandwidth.

Rooflines:
- decode step floor = (weight bytes + KV bytes read + KV bytes written) / copy bandwidth
  (each weight read once per step; each sequence reads its whole KV);
- prefill floor = FLOPs (2 x matmul params x T + causal attention) / GEMM rate.

Tandem is measured twice: the runner alone (ModelRunner: batch building + forward + argmax, no
scheduler) and the Engine (its thread, scheduler, sampler, streaming); both with and without CUDA
graphs. transformers: ``generate`` (decode: the time of N new tokens minus that of 1) and a
forward of the prompt (prefill).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tandem.bench.gpu.correctness import make_engine
from tandem.core.types import SamplingParams


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int = 3) -> float:
    """Best wall time of ``fn()`` (synchronized) over ``repeats`` runs, after one warm-up."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def ceilings(device, small: bool) -> dict:
    """Copy bandwidth (GB/s, read + write), bf16 GEMM TFLOP/s, pinned H2D / D2H GB/s."""
    n = (64 << 20) if small else (2 << 30)          # bytes per buffer
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), device, 5)
    m = 512 if small else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t_mm = timed(lambda: a @ b, device, 5)
    out = {"copy_GBps": round(2 * n / t_copy / 1e9, 1), "bf16_gemm_TFLOPs": float(f"{2 * m ** 3 / t_mm / 1e12:.4g}")}   # 4 significant digits: a CPU without native bf16 is under 0.005
    if torch.device(device).type == "cuda":
        h = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
        out["h2d_GBps"] = round(n / timed(lambda: src.copy_(h, non_blocking=True), device, 3) / 1e9, 1)
        out["d2h_GBps"] = round(n / timed(lambda: h.copy_(src, non_blocking=True), device, 3) / 1e9, 1)
    del src, dst, a, b
    return out


def weight_bytes(model) -> int:
    """Bytes of every parameter (each distinct tensor once: a tied head counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        try:
            key = p.data_ptr()
        except RuntimeError:          # an opaque (oneDNN-packed, CPU) tensor
            key = id(p)
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def decode_floor_s(wbytes: int, kv_bytes_per_token: int, batch: int, ctx: int, copy_GBps: float) -> float:
    """Seconds a decode step of ``batch`` sequences of ``ctx`` keys needs at the copy bandwidth."""
    return (wbytes + kv_bytes_per_token * batch * (ctx + 1)) / (copy_GBps * 1e9)


def prefill_flops(arch, T: int) -> float:
    """Matmul FLOPs of one T-token prompt (projections, last-token head, causal attention)."""
    h, i, L = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_q_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_tok = L * 2 * (h * (q + 2 * kv) + q * h + 2 * h * i + i * h)
    attn = L * 2 * 2 * arch.num_q_heads * arch.head_dim * T * (T + 1) / 2
    return per_tok * T + attn + 2 * h * arch.vocab_size


# -- Tandem, the runner alone ---------------------------------------------------------------------
def _runner(pair, batch: int, ctx: int, graph_mode: str | None):
    from tandem.engine.cuda_graph import DecodeGraphRunner
    from tandem.engine.attention import make_attention_backend
    from tandem.engine.model_runner import ModelRunner

    dev = pair.loaded.model.device
    r = ModelRunner.create(pair.loaded, max_total_tokens=batch * (ctx + 16) + 64, page_size=16,
                           max_reqs=batch, max_context=ctx + 16, backend=make_attention_backend("auto", dev))
    if graph_mode is not None:
        r.decode_graph = DecodeGraphRunner(r, [batch], mode=graph_mode)
    return r


@torch.no_grad()
def runner_decode(pair, batch: int, prompt_len: int, steps: int, graph_mode: str | None) -> dict:
    """tok/s of ``steps`` decode steps of ``batch`` sequences after a ``prompt_len`` prefill."""
    r = _runner(pair, batch, prompt_len + steps, graph_mode)
    dev = r.device
    g = torch.Generator().manual_seed(batch)
    V = pair.loaded.arch.vocab_size
    seqs = [r.new_seq() for _ in range(batch)]
    for s in seqs:                                   # one prompt at a time: bounded activations
        r.extend([s], [torch.randint(0, V, (prompt_len,), generator=g).tolist()])
    toks = [1] * batch
    r.decode(seqs, toks)                             # warm up (compiles the decode kernels)
    _sync(dev)
    t = time.perf_counter()
    for _ in range(steps - 1):
        toks = r.decode(seqs, toks).argmax(-1).tolist()
    _sync(dev)
    dt = time.perf_counter() - t
    return {"tok_s": round(batch * (steps - 1) / dt, 1), "step_ms": round(1e3 * dt / (steps - 1), 3)}


@torch.no_grad()
def runner_prefill(pair, T: int) -> dict:
    r = _runner(pair, 1, T, None)
    V = pair.loaded.arch.vocab_size
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(0)).tolist()

    def once():
        s, _ = r.prefill(ids)
        r.release(s)
    dt = timed(once, r.device, 3)
    return {"tok_s": round(T / dt, 1), "ms": round(1e3 * dt, 2)}


# -- Tandem, the Engine ---------------------------------------------------------------------------
def engine_decode(pair, plan, batch: int, prompt_len: int, steps: int, graphs: bool,
                  overlap: str = "auto") -> dict:
    """tok/s of the Engine decoding ``batch`` requests: (time of ``steps`` tokens - time of 1);
    ``overlap``: its overlap_schedule ("auto": on for CUDA)."""
    V = pair.loaded.arch.vocab_size
    g = torch.Generator().manual_seed(batch + 1)
    prompts = [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    eng = make_engine(pair, plan, graphs=graphs, overlap=overlap, max_running_requests=max(batch, 8),
                      max_total_tokens=batch * (prompt_len + steps + 32) + 64, disable_prefix_cache=True)
    try:
        def run(n):
            reqs = [eng.make_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
            t = time.perf_counter()
            outs = eng.generate_many(reqs, timeout=600)
            assert all(c.error is None and len(c.token_ids) == n for c in outs), outs[0].error
            return time.perf_counter() - t
        run(2)                                       # warm up
        t1 = min(run(1) for _ in range(2))
        tn = run(steps)
    finally:
        eng.shutdown()
    return {"tok_s": round(batch * (steps - 1) / max(tn - t1, 1e-9), 1),
            "step_ms": round(1e3 * (tn - t1) / (steps - 1), 3)}


def engine_prefill(pair, plan, T: int) -> dict:
    from tandem.core.config import SchedulerConfig

    V = pair.loaded.arch.vocab_size
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = make_engine(pair, plan, graphs=True, disable_prefix_cache=True, max_total_tokens=4 * T + 64,
                      scheduler=SchedulerConfig(chunked_prefill_size=T, max_batch_tokens=T + 64))
    try:
        def once():
            c = eng.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True), timeout=600)
            assert c.error is None, c.error
        dt = timed(once, pair.loaded.model.device, 3)
    finally:
        eng.shutdown()
    return {"tok_s": round(T / dt, 1), "ms": round(1e3 * dt, 2)}


# -- transformers --------------------------------------------------------------------------------
@torch.no_grad()
def hf_decode(pair, batch: int, prompt_len: int, steps: int) -> dict:
    hf = pair.hf
    V = pair.loaded.arch.vocab_size
    x = torch.randint(0, V, (batch, prompt_len), generator=torch.Generator().manual_seed(2)).to(hf.device)
    mask = torch.ones_like(x)

    def gen(n):
        return lambda: hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0)
    t1 = timed(gen(1), hf.device, 2)
    tn = timed(gen(steps), hf.device, 1)
    return {"tok_s": round(batch * (steps - 1) / max(tn - t1, 1e-9), 1),
            "step_ms": round(1e3 * (tn - t1) / (steps - 1), 3)}


@torch.no_grad()
def hf_prefill(pair, T: int) -> dict:
    hf = pair.hf
    x = torch.randint(0, pair.loaded.arch.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    x = x.to(hf.device)

    def once():
        try:
            hf(x, use_cache=False, logits_to_keep=1)
        except TypeError:                            # older transformers
            hf(x, use_cache=False)
    dt = timed(once, hf.device, 3)
    return {"tok_s": round(T / dt, 1), "ms": round(1e3 * dt, 2)}


# -- host pool copies -----------------------------------------------------------------------------
def host_copies(arch, device, dtype, tokens: int, page_size: int = 16) -> dict:
    """KVCopier backup (to_host) / restore (to_device) of ``tokens`` tokens in shuffled pages,
    GB/s end to end and how long each call held the host, vs a plain pinned copy of the same
    bytes (one contiguous buffer each way)."""
    from tandem.cache.kv_pool import KVPool
    from tandem.cache.radix.copier import KVCopier

    dev = KVPool(tokens, page_size, arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype, device)
    host = KVPool(tokens, page_size, arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype, "cpu",
                  pin_memory=True)
    dev.kv_data.normal_()
    cp = KVCopier(dev.kv_data, host.kv_data)
    pages = torch.randperm(tokens // page_size, generator=torch.Generator().manual_seed(4)) + 1
    slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    hslots = torch.arange(page_size, tokens + page_size)
    nbytes = tokens * dev.bytes_per_token
    res: dict[str, Any] = {"tokens": tokens, "MB": round(nbytes / 1e6, 1)}
    for name, call in (("backup", lambda: cp.to_host(slots, hslots)),
                       ("restore", lambda: cp.to_device(hslots, slots))):
        call()
        cp.synchronize()
        _sync(device)
        t = time.perf_counter()
        call()
        held = time.perf_counter() - t
        cp.synchronize()
        _sync(device)
        total = time.perf_counter() - t
        res[name] = {"GBps": round(nbytes / total / 1e9, 2), "host_held_ms": round(1e3 * held, 3),
                     "total_ms": round(1e3 * total, 3)}
    if torch.device(device).type == "cuda":
        buf = torch.empty((arch.num_layers, 2, tokens, arch.num_kv_heads, arch.head_dim), dtype=dtype,
                          device=device)
        pin = torch.empty(buf.shape, dtype=dtype, pin_memory=True)
        res["plain_pinned"] = {
            "d2h_GBps": round(nbytes / timed(lambda: pin.copy_(buf, non_blocking=True), device, 3) / 1e9, 2),
            "h2d_GBps": round(nbytes / timed(lambda: buf.copy_(pin, non_blocking=True), device, 3) / 1e9, 2)}
    ok = torch.equal(dev.kv_data[:, :, slots.to(device)].cpu(), host.kv_data[:, :, hslots])
    res["round_trip_exact"] = bool(ok)
    return res
