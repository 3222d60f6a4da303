"""Decode retraction with host-pool backup, on SmolLM2 (fp32, CPU), against its baselines.

Measured in one run (medians; repeats interleaved so load drifts hit both sides alike):

1. Restore vs recompute of a retracted request of N tokens (default 512, 1024, 2048). On a
   stopped engine driven step by step (``Engine.step``) with a host tier (write_back, so every
   repeat copies all N tokens at retraction), a request of N prompt tokens is prefilled; then one
   step with the scheduler's retraction lever set (``debug_retract_every``) retracts it (its KV is
   backed up to the host pool as host-only nodes), restores it by a re-admission (prefix match +
   ``cache.host.restore``), computes the one token without KV and samples the next ("resume");
   backup and restore seconds are the scheduler's own stats, a ``SchedulerObserver`` checks the
   sequence. The baseline is a re-prefill of the
   same N + 1 tokens to that next token on an engine with the prefix cache disabled (what a
   retraction without host backup costs). Both must sample the same token. Between repeats the
   host copies are evicted and the request is re-admitted from the device cache (a 4-token tail).
   The copier's host<->device copies are timed inside the backup / restore, next to a plain
   ``copy_`` of the same bytes between two preallocated tensors (same thread count), and the
   copier's indexed copy is split: gather into a fresh temporary, scatter, a fresh buffer's
   allocate + first touch, index_select + index_copy_ through a preallocated buffer, and one
   ``copy_`` per contiguous slot run. The backup + restore of the largest N is profiled (cProfile).
2. Memory pressure: R concurrent requests (random ~P-token prompts, O output tokens, EOS ignored)
   on a device pool of ``--pool-fraction`` of what they need (page_size 4, default write_through):
   host-pool backup vs recompute-only (host_pool_tokens=0), runs alternated ABBA. Output tokens/s,
   TTFT, p50/p90/p99/max inter-token latency (per-token timestamps from the submit callbacks),
   retractions (and how many requests), restores, recomputes, new requests admitted while a
   retracted one waited ("overtakes"), and whether all runs' greedy outputs are identical.

Usage: python bench/retraction.py [--threads 1] [--sizes 512,1024,2048] [--repeats 3]
           [--recompute-repeats 2] [--requests 16] [--load-repeats 2] [--out bench/out/retraction.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import statistics
import threading
import time
from pathlib import Path

import torch

from tandem.core.types import StreamChunk
from tandem.engine.sched.sched_types import SchedulerObserver

PAGE_SIZE = 4


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _pct(xs, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def _time_median(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs where both slot lists advance by one: (src_start, dst_start, length)."""
    s, d = src.tolist(), dst.tolist()
    out = []
    i = 0
    while i < len(s):
        j = i + 1
        while j < len(s) and s[j] == s[j - 1] + 1 and d[j] == d[j - 1] + 1:
            j += 1
        out.append((s[i], d[i], j - i))
        i = j
    return out


# ---------------------------------------------------------------------------------- part 1
class _CopyTimer:
    """Times the host tier's copier (CPU copies are synchronous) and keeps the last slots."""

    def __init__(self, copier):
        self.copier = copier
        self.to_host_s = self.to_device_s = 0.0
        self.to_host_tokens = self.to_device_tokens = 0
        self.last_to_device = None
        cls = type(copier)

        def to_host(dev_slots, host_slots):
            t = time.perf_counter()
            cls.to_host(copier, dev_slots, host_slots)
            self.to_host_s += time.perf_counter() - t
            self.to_host_tokens += len(dev_slots)

        def to_device(host_slots, dev_slots):
            t = time.perf_counter()
            cls.to_device(copier, host_slots, dev_slots)
            self.to_device_s += time.perf_counter() - t
            self.to_device_tokens += len(dev_slots)
            self.last_to_device = (host_slots, dev_slots)

        copier.to_host, copier.to_device = to_host, to_device

    def reset(self):
        self.to_host_s = self.to_device_s = 0.0
        self.to_host_tokens = self.to_device_tokens = 0

    def snapshot(self) -> dict:
        return {"backup_copy_s": self.to_host_s, "backup_copy_tokens": self.to_host_tokens,
                "restore_copy_s": self.to_device_s, "restore_copy_tokens": self.to_device_tokens}

    def remove(self):
        del self.copier.to_host, self.copier.to_device


class _Restored(SchedulerObserver):
    """Where ``rid``'s restore admission started (its reused prefix) and that it was retracted."""

    def __init__(self, rid: str):
        self.rid, self.seen, self.restored_at = rid, False, None

    def retracted(self, sr) -> None:
        self.seen = self.seen or sr.rid == self.rid

    def admitted(self, sr) -> None:
        if sr.rid == self.rid and self.seen and self.restored_at is None:
            self.restored_at = sr.req.computed_len


class _RetractionTrace(SchedulerObserver):
    """Who is retracted after how many generated tokens, and which new requests were admitted
    while a retracted one still waited (an undone admission does not count)."""

    def __init__(self, s):
        self.s, self.events, self.overtakes = s, [], set()

    def retracted(self, sr) -> None:
        self.events.append((sr.rid, len(sr.req.output_ids)))

    def admitted(self, sr) -> None:
        r, s = sr.req, self.s
        if r.admissions == 1 and not r.output_ids and (
                s.retraction.retracted or any(w.req.output_ids for w in s.waiting)):
            self.overtakes.add(r.rid)

    def unadmitted(self, sr) -> None:
        if sr.req.admissions == 0:
            self.overtakes.discard(sr.rid)


def retract_and_restore(e, sr, profile=None) -> dict:
    """On a stopped engine (this thread drives ``e.step()``), ``sr`` its only decoding request:
    one step with the scheduler's retraction lever (``debug_retract_every``) set, so ``sr`` is
    retracted (its KV backed up to the host), restored (re-admitted; its match loads the backup)
    and its recompute tail runs, sampling its next token. The backup and restore seconds are the
    scheduler's own (its stats); ``resume_s`` is the rest of that step."""
    s = e.scheduler
    stats0 = dict(s.stats)
    watch = _Restored(sr.rid)
    s.observers.append(watch)
    s.debug_retract_every = 1
    try:
        if profile:
            profile.enable()
        t = time.perf_counter()
        e.step()
        step_s = time.perf_counter() - t
        if profile:
            profile.disable()
    finally:
        s.debug_retract_every = 0
        s.observers.remove(watch)
    d = {k: s.stats[k] - stats0[k] for k in ("backup_seconds", "restore_seconds", "retraction_restores",
                                             "retraction_recomputes")}
    if d["retraction_recomputes"] or not d["retraction_restores"] or watch.restored_at is None:
        raise RuntimeError(f"{sr.rid} was not backed up to the host and restored ({d})")
    return {"backup_s": d["backup_seconds"], "restore_s": d["restore_seconds"],
            "resume_s": step_s - d["backup_seconds"] - d["restore_seconds"],
            "restored_tokens": watch.restored_at}


def _host_cycle(e, ids: list[int], rid: str, mem_reps: int, profile: bool = False) -> dict:
    """On the stopped host-tier engine ``e``: prefill, then retract (backup), restore and resume
    in one step (:func:`retract_and_restore`)."""
    from tandem.core.types import Req, SamplingParams

    s, cache = e.scheduler, e.kv.cache
    timer = _CopyTimer(cache.host.copier)
    try:
        req = Req(list(ids), SamplingParams(max_tokens=8, ignore_eos=True), rid=rid)
        sr = s.add(req)
        t = time.perf_counter()
        while not req.output_ids:
            e.step()
        prefill_s = time.perf_counter() - t
        prefill_copy_tokens = timer.to_host_tokens
        cached = req.cached_len
        n = req.computed_len
        timer.reset()   # count only the copies of this backup + restore
        prof = cProfile.Profile() if profile else None
        cyc = retract_and_restore(e, sr, prof)
        backup_s, restore_s, resume_s = cyc["backup_s"], cyc["restore_s"], cyc["resume_s"]
        restored, resume_tokens = cyc["restored_tokens"], n + 1 - cyc["restored_tokens"]
        copies = timer.snapshot()
        res = {"tokens": n, "prefill_cached_tokens": cached, "prefill_s": prefill_s,
               "backup_s": backup_s, "restore_s": restore_s, "resume_s": resume_s,
               "restored_tokens": restored, "resume_tokens": resume_tokens,
               **copies, "prefill_copy_tokens": prefill_copy_tokens,
               "first_token": req.output_ids[0], "next_token": req.output_ids[1]}
        if prof:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
            res["profile"] = buf.getvalue()

        # Baselines on the same bytes, same thread, right now.
        host_slots, dev_slots = timer.last_to_device
        dev, host = e.kv.kv_pool.kv_data, cache.host.pool.kv_data
        nbytes = len(dev_slots) * e.kv.kv_pool.bytes_per_token
        src = torch.ones(nbytes // dev.element_size(), dtype=dev.dtype)
        dst = torch.empty_like(src)
        dst.copy_(src)
        res["copy_bytes"] = nbytes
        res["memcpy_s"] = _time_median(lambda: dst.copy_(src), mem_reps)
        # The copier's indexed copy split in two; rewriting the same values is harmless.
        g = host[:, :, host_slots]
        res["gather_s"] = _time_median(lambda: host[:, :, host_slots], mem_reps)
        res["scatter_s"] = _time_median(lambda: dev.__setitem__((slice(None), slice(None), dev_slots), g),
                                        mem_reps)
        res["indexed_copy_s"] = _time_median(
            lambda: dev.__setitem__((slice(None), slice(None), dev_slots), host[:, :, host_slots]), mem_reps)
        # ... the same with a preallocated buffer (no fresh temporary): index_select + index_copy_
        rows = dev.shape[2]
        dv, hv = dev.view(-1, rows, dev[0, 0, 0].numel()), host.view(-1, host.shape[2], host[0, 0, 0].numel())
        staged = torch.empty(dv.shape[0], len(dev_slots), dv.shape[2], dtype=dev.dtype)
        res["select_copy_s"] = _time_median(
            lambda: dv.index_copy_(1, dev_slots, torch.index_select(hv, 1, host_slots, out=staged)), mem_reps)
        # ... and what a fresh temporary of those bytes costs by itself (allocate + first touch)
        res["alloc_touch_s"] = _time_median(lambda: torch.empty(nbytes // dev.element_size(),
                                                                dtype=dev.dtype).fill_(0), mem_reps)
        del staged
        runs = _runs(host_slots, dev_slots)

        def run_copy():
            for h0, d0, ln in runs:
                dev[:, :, d0:d0 + ln].copy_(host[:, :, h0:h0 + ln])
        res["slot_runs"] = len(runs)
        res["run_copy_s"] = _time_median(run_copy, mem_reps)
        del src, dst, g

        s.abort(rid)
        cache.evict(1 << 40, "host")   # next repeat backs up (copies) from scratch again
        return res
    finally:
        timer.remove()


def _recompute_cycle(e, ids: list[int], rid: str) -> dict:
    """On the engine thread of a no-prefix-cache engine: prefill N + 1 tokens to the next token."""
    from tandem.core.types import Req, SamplingParams

    req = Req(list(ids), SamplingParams(max_tokens=1, ignore_eos=True), rid=rid)
    e.scheduler.add(req)
    t = time.perf_counter()
    while not req.output_ids:
        e.step()
    return {"recompute_s": time.perf_counter() - t, "next_token": req.output_ids[0]}


def restore_vs_recompute(loaded, sizes: list[int], repeats: int, recompute_repeats: int, threads: int,
                         mem_reps: int = 7, profile: bool = True, log=print) -> dict:
    from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import Engine

    top = max(sizes)
    sched = SchedulerConfig(chunked_prefill_size=top + 64, max_batch_tokens=top + 128)
    pool = -(-(2 * sum(sizes) + 4 * top) // PAGE_SIZE) * PAGE_SIZE
    # write_back: the whole N tokens are copied at retraction, in every repeat. (The engine's
    # default, write_through, copies each prompt chunk to the host as it is cached during prefill,
    # so a retraction then copies only the pages decoded since; the per-token cost is the same.)
    host_eng = Engine(EngineConfig(device="cpu", dtype="float32", num_threads=threads, scheduler=sched,
                                   cache=CacheConfig(max_total_tokens=pool, page_size=PAGE_SIZE,
                                                     host_pool_tokens=pool, host_write_policy="write_back")),
                      loaded=loaded)
    rec_eng = Engine(EngineConfig(device="cpu", dtype="float32", num_threads=threads, scheduler=sched,
                                  cache=CacheConfig(max_total_tokens=pool, page_size=PAGE_SIZE,
                                                    disable_prefix_cache=True)), loaded=loaded)
    host_eng.shutdown()   # both are driven step by step on this thread
    rec_eng.shutdown()
    g = torch.Generator().manual_seed(0)
    vocab = loaded.arch.vocab_size
    prompts = {n: torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in sizes}
    samples: dict[int, list[dict]] = {n: [] for n in sizes}
    profile_text = None
    try:
        for r in range(repeats):
            order = sizes if r % 2 == 0 else sizes[::-1]
            for n in order:
                h = _host_cycle(host_eng, prompts[n], f"h{n}-{r}", mem_reps)
                msg = ""
                if r < recompute_repeats:   # the costly side: fewer repeats, interleaved all the same
                    ids = prompts[n] + [h["first_token"]]
                    c = _recompute_cycle(rec_eng, ids, f"c{n}-{r}")
                    h.update(recompute_s=c["recompute_s"], recompute_token=c["next_token"])
                    msg = f", recompute {c['recompute_s']:.2f} s"
                samples[n].append(h)
                log(f"  N={n} repeat {r}: backup {h['backup_s'] * 1e3:.1f} ms, restore "
                    f"{h['restore_s'] * 1e3:.1f} ms, resume {h['resume_s'] * 1e3:.0f} ms{msg}")
        if profile:
            h = _host_cycle(host_eng, prompts[top], f"p{top}", 1, True)
            profile_text = h["profile"]
        stats = host_eng.stats()
    finally:
        host_eng.shutdown()
        rec_eng.shutdown()

    out: dict = {"page_size": PAGE_SIZE, "device_pool_tokens": pool, "host_pool_tokens": pool,
                 "host_write_policy": "write_back", "repeats": repeats,
                 "recompute_repeats": recompute_repeats, "sizes": {}, "scheduler_stats": stats,
                 "profile_backup_restore": profile_text}
    for n in sizes:
        xs = samples[n]
        med = {k: _median([x[k] for x in xs if k in x]) for k in
               ("backup_s", "restore_s", "resume_s", "recompute_s", "backup_copy_s", "restore_copy_s",
                "memcpy_s", "gather_s", "scatter_s", "indexed_copy_s", "run_copy_s",
                "select_copy_s", "alloc_touch_s")}
        first = xs[0]
        d = {"tokens": first["tokens"], "restored_tokens": first["restored_tokens"],
             "copy_bytes": first["copy_bytes"], "slot_runs": first["slot_runs"],
             "backup_copy_tokens": first["backup_copy_tokens"], **med,
             "uncached_prefill_s": first["prefill_s"],
             "tokens_match": all(x["next_token"] == x["recompute_token"] for x in xs if "recompute_token" in x),
             "speedup_restore_only": med["recompute_s"] / med["restore_s"],
             "speedup_restore_and_resume": med["recompute_s"] / (med["restore_s"] + med["resume_s"]),
             "backup_vs_memcpy": med["backup_s"] / med["memcpy_s"],
             "restore_vs_memcpy": med["restore_s"] / med["memcpy_s"],
             "backup_copy_vs_memcpy": med["backup_copy_s"] / med["memcpy_s"],
             "restore_copy_vs_memcpy": med["restore_copy_s"] / med["memcpy_s"],
             "memcpy_gibs": first["copy_bytes"] / med["memcpy_s"] / 2**30,
             "samples": [{k: v for k, v in x.items() if k != "profile"} for x in xs]}
        out["sizes"][str(n)] = d
    return out


# ---------------------------------------------------------------------------------- part 2
def _load_run(loaded, prompts: list[list[int]], out_tokens: int, pool: int, host_tokens: int,
              threads: int, timeout: float) -> dict:
    from tandem.core.config import CacheConfig, EngineConfig
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine

    e = Engine(EngineConfig(device="cpu", dtype="float32", num_threads=threads,
                            cache=CacheConfig(max_total_tokens=pool, page_size=PAGE_SIZE,
                                              host_pool_tokens=host_tokens,
                                              max_running_requests=max(64, len(prompts)))),
               loaded=loaded)
    trace = _RetractionTrace(e.scheduler)
    e.scheduler.observers.append(trace)   # before any request: the engine thread is idle
    events, overtakes = trace.events, trace.overtakes
    try:
        params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
        greqs = [e.make_request(p, params, rid=f"r{i}") for i, p in enumerate(prompts)]
        stamps: dict[str, list[float]] = {g.rid: [] for g in greqs}
        tokens: dict[str, list[int]] = {g.rid: [] for g in greqs}
        finals: dict[str, StreamChunk] = {}
        done = threading.Event()
        lock = threading.Lock()

        def on_chunk(c):
            now = time.perf_counter()
            with lock:
                for _ in c.token_ids:
                    stamps[c.rid].append(now)
                tokens[c.rid].extend(c.token_ids)
                if c.finish_reason is not None:
                    finals[c.rid] = c
                    if len(finals) == len(greqs):
                        done.set()

        t0 = time.perf_counter()
        for g in greqs:
            e.submit(g, on_chunk)
        if not done.wait(timeout):
            raise RuntimeError(f"load run timed out after {timeout} s ({len(finals)}/{len(greqs)} done)")
        wall = time.perf_counter() - t0
        stats = e.stats()
        snap = e.snapshot()
        idle = (snap.available_tokens + snap.evictable_tokens == snap.total_tokens,
                len(e.scheduler.retraction.backups), snap.retracted)
    finally:
        e.shutdown()
    errors = [c.error for c in finals.values() if c.error]
    itl = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    ttft = [ts[0] - t0 for ts in stamps.values() if ts]
    n_out = sum(len(t) for t in tokens.values())
    per_req: dict[str, int] = {}
    for rid, _ in events:
        per_req[rid] = per_req.get(rid, 0) + 1
    return {"host_pool_tokens": host_tokens, "wall_s": wall, "output_tokens": n_out,
            "output_tok_s": n_out / wall, "itl_samples": len(itl), "itl_p50_ms": 1e3 * _pct(itl, 50),
            "itl_p90_ms": 1e3 * _pct(itl, 90), "itl_p99_ms": 1e3 * _pct(itl, 99),
            "itl_max_ms": 1e3 * max(itl, default=float("nan")), "itl_over_1s": sum(x > 1.0 for x in itl),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "steps": stats["steps"], "retractions": stats["retractions"],
            "retracted_requests": len(per_req), "max_retractions_per_request": max(per_req.values(), default=0),
            "new_admits_past_retracted": len(overtakes), "retraction_events": events,
            "restores": stats["retraction_restores"], "recomputes": stats["retraction_recomputes"],
            "retraction_aborts": stats["retraction_aborts"], "backup_tokens": stats["backup_tokens"],
            "backup_seconds": stats["backup_seconds"], "restore_tokens": stats["restore_tokens"],
            "restore_seconds": stats["restore_seconds"], "evicted_tokens": stats["evicted_tokens"],
            "errors": errors, "idle_clean": bool(idle[0]) and idle[1:] == (0, 0),
            "tokens": [tokens[g.rid] for g in greqs]}


def memory_pressure(loaded, n_requests: int, prompt_tokens: int, out_tokens: int, pool_fraction: float,
                    host_tokens: int, repeats: int, threads: int, timeout: float = 600,
                    log=print) -> dict:
    g = torch.Generator().manual_seed(1)
    vocab = loaded.arch.vocab_size
    spread = max(1, prompt_tokens // 10)
    lens = [prompt_tokens - spread // 2 + (i * 7) % spread for i in range(n_requests)]
    prompts = [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lens]
    need = sum(lens) + n_requests * out_tokens
    pool = max(4 * PAGE_SIZE, round(need * pool_fraction / PAGE_SIZE) * PAGE_SIZE)
    pool = max(pool, -(-(max(lens) + out_tokens + 2 * PAGE_SIZE) // PAGE_SIZE) * PAGE_SIZE)
    runs: dict[str, list[dict]] = {"host": [], "recompute": []}
    for r in range(repeats):
        order = ("host", "recompute") if r % 2 == 0 else ("recompute", "host")   # ABBA
        for kind in order:
            res = _load_run(loaded, prompts, out_tokens, pool, host_tokens if kind == "host" else 0,
                            threads, timeout)
            runs[kind].append(res)
            log(f"  {kind:<9} repeat {r}: {res['output_tok_s']:.1f} tok/s, ITL p50 "
                f"{res['itl_p50_ms']:.0f} / p99 {res['itl_p99_ms']:.0f} ms, retractions "
                f"{res['retractions']} (restores {res['restores']}, recomputes {res['recomputes']})")
    ref = runs["host"][0]["tokens"]
    identical = all(x["tokens"] == ref for k in runs for x in runs[k])
    differing = sorted({i for k in runs for x in runs[k] for i, t in enumerate(x["tokens"]) if t != ref[i]})
    out: dict = {"requests": n_requests, "prompt_tokens": lens, "output_tokens": out_tokens,
                 "tokens_needed": need, "device_pool_tokens": pool, "page_size": PAGE_SIZE,
                 "host_pool_tokens": host_tokens, "repeats": repeats,
                 "outputs_identical": identical, "differing_requests": differing}
    keys = ("wall_s", "output_tok_s", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_max_ms", "itl_over_1s",
            "retracted_requests", "max_retractions_per_request", "new_admits_past_retracted", "ttft_p50_s",
            "ttft_p99_s", "steps", "retractions", "restores", "recomputes", "retraction_aborts",
            "backup_tokens", "backup_seconds", "restore_tokens", "restore_seconds", "evicted_tokens")
    for kind, xs in runs.items():
        out[kind] = {k: _median([x[k] for x in xs]) for k in keys}
        out[kind]["errors"] = [e for x in xs for e in x["errors"]]
        out[kind]["idle_clean"] = all(x["idle_clean"] for x in xs)
        out[kind]["samples"] = [{k: v for k, v in x.items() if k != "tokens"} for x in xs]
    h, c = out["host"], out["recompute"]
    out["throughput_ratio"] = h["output_tok_s"] / c["output_tok_s"]
    out["itl_p99_ratio"] = h["itl_p99_ms"] / c["itl_p99_ms"]
    return out


# ---------------------------------------------------------------------------------- report
def print_report(res: dict) -> None:
    print(f"threads={res['threads']}  load avg at start {res['load_avg_start']}  end {res['load_avg_end']}")
    p1 = res.get("restore_vs_recompute")
    if p1:
        print("\n1. restore from host vs recompute (medians; ms unless noted)")
        print(f"{'N':>6}{'backup':>9}{'copy':>8}{'restore':>9}{'copy':>8}{'memcpy':>8}{'GiB/s':>7}"
              f"{'bk/mc':>7}{'rs/mc':>7}{'resume':>8}{'recomp s':>10}{'x rest':>8}{'x r+res':>8}{'same':>6}")
        for n, d in p1["sizes"].items():
            print(f"{n:>6}{d['backup_s'] * 1e3:>9.2f}{d['backup_copy_s'] * 1e3:>8.2f}"
                  f"{d['restore_s'] * 1e3:>9.2f}{d['restore_copy_s'] * 1e3:>8.2f}{d['memcpy_s'] * 1e3:>8.2f}"
                  f"{d['memcpy_gibs']:>7.1f}{d['backup_vs_memcpy']:>7.2f}{d['restore_vs_memcpy']:>7.2f}"
                  f"{d['resume_s'] * 1e3:>8.0f}{d['recompute_s']:>10.2f}{d['speedup_restore_only']:>8.0f}"
                  f"{d['speedup_restore_and_resume']:>8.1f}{str(d['tokens_match']):>6}")
        print("\n   where the copy goes (ms, host -> device of the restored slots): the copier's indexed copy"
              "\n   = gather into a fresh temporary + scatter; alloc+touch = a fresh buffer of those bytes;"
              "\n   select+index_copy = the same into a preallocated buffer; run copy = one copy_ per slot run")
        print(f"{'N':>6}{'indexed':>9}{'gather':>8}{'scatter':>9}{'alloc+touch':>13}{'select+ic':>11}"
              f"{'runs':>6}{'run copy':>10}{'memcpy':>8}")
        for n, d in p1["sizes"].items():
            print(f"{n:>6}{d['indexed_copy_s'] * 1e3:>9.2f}{d['gather_s'] * 1e3:>8.2f}"
                  f"{d['scatter_s'] * 1e3:>9.2f}{d['alloc_touch_s'] * 1e3:>13.2f}"
                  f"{d['select_copy_s'] * 1e3:>11.2f}{d['slot_runs']:>6}{d['run_copy_s'] * 1e3:>10.2f}{d['memcpy_s'] * 1e3:>8.2f}")
        if p1.get("profile_backup_restore"):
            print("\n   cProfile of backup + restore, largest N (tottime):")
            lines = p1["profile_backup_restore"].splitlines()
            start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
            print("\n".join("   " + ln for ln in lines[start:start + 15] if ln.strip()))
    p2 = res.get("memory_pressure")
    if p2:
        print(f"\n2. memory pressure: {p2['requests']} requests x ~{_median(p2['prompt_tokens']):.0f}-token "
              f"prompts x {p2['output_tokens']} tokens, device pool {p2['device_pool_tokens']} of "
              f"{p2['tokens_needed']} tokens needed, page {p2['page_size']}; medians of {p2['repeats']}")
        print(f"{'mode':<11}{'tok/s':>7}{'ITL p50':>9}{'p90':>6}{'p99':>7}{'max':>7}{'>1s':>5}{'TTFT p99':>10}"
              f"{'steps':>7}{'retract':>9}{'(reqs)':>7}{'restore':>9}{'recomp':>8}{'backup ms':>11}"
              f"{'restore ms':>11}{'overtakes':>10}")
        for kind in ("host", "recompute"):
            d = p2[kind]
            print(f"{kind:<11}{d['output_tok_s']:>7.1f}{d['itl_p50_ms']:>9.0f}{d['itl_p90_ms']:>6.0f}"
                  f"{d['itl_p99_ms']:>7.0f}{d['itl_max_ms']:>7.0f}{d['itl_over_1s']:>5.0f}"
                  f"{d['ttft_p99_s']:>10.2f}{d['steps']:>7.0f}{d['retractions']:>9.0f}"
                  f"{d['retracted_requests']:>7.0f}{d['restores']:>9.0f}{d['recomputes']:>8.0f}{d['backup_seconds'] * 1e3:>11.1f}{d['restore_seconds'] * 1e3:>11.1f}"
                  f"{d['new_admits_past_retracted']:>10.0f}")
        print(f"host / recompute: throughput x{p2['throughput_ratio']:.2f}, ITL p99 x{p2['itl_p99_ratio']:.2f}; "
              f"greedy outputs identical: {p2['outputs_identical']}"
              + (f" (differing requests {p2['differing_requests']})" if not p2["outputs_identical"] else ""))


def run(args, loaded=None, log=print) -> dict:
    """Both measurements as ``args`` asks (the tests call this with tiny sizes)."""
    torch.set_num_threads(args.threads)
    if loaded is None:
        from tandem.engine.loader import load_model
        loaded = load_model("smollm2", device="cpu", dtype=torch.float32)
    res: dict = {"threads": args.threads, "load_avg_start": [round(x, 2) for x in os.getloadavg()],
                 "model": "smollm2", "dtype": "float32", "device": "cpu"}
    t = time.perf_counter()
    if args.sizes:
        log("1. restore vs recompute")
        res["restore_vs_recompute"] = restore_vs_recompute(
            loaded, args.sizes, args.repeats, min(args.recompute_repeats, args.repeats), args.threads,
            profile=not args.no_profile, log=log)
    if args.requests:
        log("2. memory pressure")
        res["memory_pressure"] = memory_pressure(loaded, args.requests, args.prompt_tokens, args.output_tokens,
                                                 args.pool_fraction, args.host_pool_tokens,
                                                 args.load_repeats, args.threads, log=log)
    res["elapsed_s"] = time.perf_counter() - t
    res["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the box is shared)")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[512, 1024, 2048],
                    help="retracted request sizes (tokens), multiples of 4; empty skips part 1")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of part 1's retract/restore cycle")
    ap.add_argument("--recompute-repeats", type=int, default=2,
                    help="repeats of part 1's recompute baseline (the costly side), within --repeats")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of backup + restore")
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests of part 2 (0 skips it)")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--pool-fraction", type=float, default=1 / 3,
                    help="device pool as a fraction of the tokens all requests need")
    ap.add_argument("--host-pool-tokens", type=int, default=16384)
    ap.add_argument("--load-repeats", type=int, default=2, help="repeats of part 2 (ABBA order)")
    ap.add_argument("--out", default="bench/out/retraction.json")
    args = ap.parse_args(argv)
    if any(n % PAGE_SIZE for n in args.sizes):
        ap.error(f"--sizes must be multiples of the page size {PAGE_SIZE}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    res = run(args)
    print_report(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
