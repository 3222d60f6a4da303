"""Kernel launches of one decode step (bench/gpu_check.py's ``decode_launches`` phase).

torch.profiler over ``steps`` eager decode steps of a ModelRunner (the kernels a CUDA graph
captures are the same ones): device kernels per step and per layer, and the GPU-busy time per
step against the step's wall time. On the CPU (the smoke run) it counts the profiler's
top-level CPU ops instead, so the phase runs anywhere.
"""

from __future__ import annotations

import time

import torch

from tandem.bench.gpu.throughput import _runner, _sync


@torch.no_grad()
def decode_launches(pair, batch: int, prompt_len: int, steps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    r = _runner(pair, batch, prompt_len + steps + 2, None)
    cuda = r.device.type == "cuda"
    V = pair.loaded.arch.vocab_size
    g = torch.Generator().manual_seed(7)
    seqs = [r.new_seq() for _ in range(batch)]
    for s in seqs:
        r.extend([s], [torch.randint(0, V, (prompt_len,), generator=g).tolist()])
    toks = r.decode(seqs, [1] * batch).argmax(-1).tolist()        # warm up (compiles)
    _sync(r.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            toks = r.decode(seqs, toks).argmax(-1).tolist()
        _sync(r.device)
        wall = time.perf_counter() - t
    layers = pair.loaded.arch.num_layers
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    else:
        kernels = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
        busy_us = None
    n = len(kernels) / steps
    top: dict[str, int] = {}
    for e in kernels:
        top[e.name] = top.get(e.name, 0) + 1
    return {"batch": batch, "kernels_per_step": round(n, 1), "per_layer": round(n / layers, 2),
            "wall_ms_per_step": round(1e3 * wall / steps, 3),
            "busy_ms_per_step": None if busy_us is None else round(busy_us / 1e3 / steps, 3),
            "what": "cuda kernels" if cuda else "top-level aten ops (CPU smoke)",
            "top": sorted(((k[:60], v // steps) for k, v in top.items()), key=lambda kv: -kv[1])[:12]}
