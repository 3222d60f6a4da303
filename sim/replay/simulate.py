"""Discrete-event replay of a Mooncake-format trace through a router policy."""

from __future__ import annotations

import heapq
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.cache.unified import UnifiedRadixCache
from tandem.router.policies import POLICIES, PolicyConfig, RouterState, choose
from tandem.router.view import ClusterView, RouteRequest
from tandem.sim.cost_model import DEFAULT_PROFILE, get_profile
from tandem.sim.workers import DecodeWorker, EventSink, PrefillWorker, SimRequest
from tandem.workloads import MOONCAKE_SYNTHETIC

TRACE_BLOCK = 512
DEFAULT_TRACE = MOONCAKE_SYNTHETIC

_ARRIVE, _PREFILL_DONE, _TRANSFER_DONE, _DECODE_STEP = range(4)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            o = json.loads(line)
            out.append(TraceRecord(float(o["timestamp"]), int(o["input_length"]),
                                   int(o["output_length"]), tuple(o["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def trace_key(rec: TraceRecord, block_size: int) -> list[int]:
    """One int per page of ``block_size`` tokens (see the module docstring)."""
    n_pages = max(-(-rec.input_length // block_size), 1)
    ids = rec.hash_ids
    if block_size <= TRACE_BLOCK:
        if TRACE_BLOCK % block_size:
            raise ValueError(f"block_size={block_size} must divide {TRACE_BLOCK} or be a multiple of it")
        k = TRACE_BLOCK // block_size
        if k == 1:
            return list(ids[:n_pages])
        return [h * k + j for h in ids for j in range(k)][:n_pages]
    if block_size % TRACE_BLOCK:
        raise ValueError(f"block_size={block_size} must divide {TRACE_BLOCK} or be a multiple of it")
    m = block_size // TRACE_BLOCK
    return [ids[min(i * m + m - 1, len(ids) - 1)] for i in range(n_pages)]


def _pct(xs: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile of sorted ``xs``."""
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"mean": sum(xs) / len(xs), "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9),
            "p99": _pct(xs, 0.99), "max": xs[-1]}


def _ratio(xs: Sequence[float]) -> float | None:
    lo = min(xs) if xs else 0
    return (max(xs) / lo) if lo > 0 else None


def simulate(trace: list[TraceRecord], *, prefill: int = 8, decode: int = 8, policy: str = "session",
             block_size: int = TRACE_BLOCK, capacity_tokens: int | None = 3_000_000,
             speedup: float = 1.0, profile: str = DEFAULT_PROFILE, global_cache: bool = False,
             decode_capacity_tokens: int | None = None, seed: int = 0,
             policy_config: PolicyConfig | None = None, routers: int = 1,
             kv_events: bool | None = None) -> dict:
    """Replay ``trace``; returns the JSON-able summary (see ``summarize``).

    ``routers``: that many independent routers (each its own RouterState: session table,
    approximate index), request ``i`` through router ``i % routers``, as behind a load balancer;
    ``kv_events`` (default: with the kv_events policy, or several routers): every cache's KV events
    reach every router's exact index, as every router subscribes to every worker."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if prefill < 1 or decode < 1:
        raise ValueError(f"need at least one prefill and one decode worker (got {prefill}, {decode})")
    if speedup <= 0:
        raise ValueError(f"speedup={speedup} must be > 0")
    prof = get_profile(profile)
    cap_pages = None if capacity_tokens is None else max(capacity_tokens // block_size, 1)
    cfg = policy_config or PolicyConfig(seed=seed, kv_block_size=1, estimator=prof.estimator(),
                                        index_capacity=cap_pages)
    if routers > 1 and policy_config is None:
        cfg = PolicyConfig(seed=seed, kv_block_size=1, estimator=prof.estimator(), index_capacity=cap_pages,
                           rendezvous=True)
    states = [RouterState(cfg) for _ in range(max(routers, 1))]
    state = states[0]
    t_wall = time.perf_counter()

    p_ids = list(range(prefill))
    use_events = (policy == "kv_events" or routers > 1) if kv_events is None else kv_events

    class _Everyone:
        """One cache's events to every router's index."""

        def __init__(self, ids):
            self.sinks = [EventSink(st, ids) for st in states]

        def publish(self, events):
            events = list(events)
            for sk in self.sinks:
                sk.publish(events)

    def make_cache(ids: list[int], pages: int | None):
        sink = _Everyone(ids) if use_events else None
        return UnifiedRadixCache.simulated(page_size=1, capacity_tokens=pages, eviction="lru",
                                           events=sink)

    if global_cache:
        shared = make_cache(p_ids, None if cap_pages is None else cap_pages * prefill)
        caches = [shared] * prefill
    else:
        caches = [make_cache([i], cap_pages) for i in p_ids]
    pws = [PrefillWorker(i, prof, caches[i], block_size) for i in p_ids]
    dcap = decode_capacity_tokens or prof.decode_kv_tokens
    dws = [DecodeWorker(prefill + j, prof, dcap) for j in range(decode)]
    dmap = {d.id: d for d in dws}
    nic_free = [0.0] * prefill

    t0 = trace[0].timestamp_ms if trace else 0.0
    reqs = [SimRequest(i, (r.timestamp_ms - t0) / 1000.0 / speedup, r.input_length,
                       max(r.output_length, 1), trace_key(r, block_size))
            for i, r in enumerate(trace)]
    heap: list = []
    seq = 0

    def push(t: float, kind: int, obj) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, obj))
        seq += 1

    for r in reqs:
        push(r.arrival, _ARRIVE, r)

    def start_prefill(pw: PrefillWorker, now: float) -> None:
        end = pw.start(now)
        if end is not None:
            push(end, _PREFILL_DONE, pw)

    def start_transfer(r: SimRequest, now: float) -> None:
        p = r.prefill_worker
        begin = max(now, nic_free[p])
        nic_free[p] = begin + prof.kv_transfer_s(r.prompt_tokens)
        push(nic_free[p], _TRANSFER_DONE, r)

    reasons: Counter = Counter()
    decision_ns: list[int] = []
    now = 0.0
    while heap:
        now, _, kind, obj = heapq.heappop(heap)
        if kind == _ARRIVE:
            r = obj
            view = ClusterView(tuple(w.view(now) for w in pws), tuple(d.view(now) for d in dws), now)
            rq = RouteRequest(str(r.rid), r.key, r.prompt_tokens, block_size, max_tokens=r.output_tokens)
            t = time.perf_counter_ns()
            dec = choose(view, rq, states[r.rid % len(states)], policy)
            decision_ns.append(time.perf_counter_ns() - t)
            r.prefill_worker, r.decode_worker, r.reason = dec.prefill_worker, dec.decode_worker, dec.reason
            reasons[dec.reason] += 1
            pw = pws[dec.prefill_worker]
            pw.enqueue(r, now, dec.matched_tokens)
            start_prefill(pw, now)
        elif kind == _PREFILL_DONE:
            pw = obj
            r = pw.finish(now)
            if dmap[r.decode_worker].reserve(r):
                start_transfer(r, now)
            start_prefill(pw, now)
        elif kind == _TRANSFER_DONE:
            r = obj
            r.ttft_at = now
            if dmap[r.decode_worker].join(r, now):
                push(now, _DECODE_STEP, dmap[r.decode_worker])
        else:
            dw = obj
            _, admitted, nxt = dw.step(now)
            for a in admitted:
                start_transfer(a, now)
            if nxt is not None:
                push(nxt, _DECODE_STEP, dw)

    summary = summarize(reqs, pws, dws, now)
    decision_ns.sort()
    summary["config"] = {"policy": policy, "prefill": prefill, "decode": decode,
                         "block_size": block_size, "capacity_tokens": capacity_tokens,
                         "global_cache": global_cache, "speedup": speedup, "profile": prof.name,
                         "decode_capacity_tokens": dcap, "seed": seed, "routers": len(states),
                         "kv_events": use_events}
    summary["decisions"] = dict(sorted(reasons.items()))
    summary["decision_us"] = {"p50": _pct(decision_ns, 0.5) / 1e3, "p99": _pct(decision_ns, 0.99) / 1e3}
    summary["wall_s"] = time.perf_counter() - t_wall
    return summary


def summarize(reqs: list[SimRequest], pws: list[PrefillWorker], dws: list[DecodeWorker],
              end: float) -> dict:
    done = [r for r in reqs if r.finish >= 0]
    prompt = sum(r.prompt_tokens for r in reqs)
    hit = sum(r.cached_tokens for r in reqs)
    out_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.finish - r.decode_join) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    t_first = min((r.arrival for r in reqs), default=0.0)
    span = max(end - t_first, 1e-9)
    busy = [w.stats.busy_s for w in pws]
    nreq = [w.stats.requests for w in pws]
    shared = len(pws) > 1 and pws[0].cache is pws[1].cache
    return {
        "requests": len(reqs),
        "completed": len(done),
        "hit_rate": hit / prompt if prompt else 0.0,
        "ttft_s": _dist([r.ttft for r in reqs if r.ttft_at >= 0]),
        "tpot_s": _dist(tpot),
        "e2e_s": _dist([r.finish - r.arrival for r in done]),
        "queue_s": _dist([r.prefill_start - r.arrival for r in reqs if r.prefill_start >= 0]),
        "makespan_s": span,
        "throughput": {"requests_per_s": len(done) / span, "input_tokens_per_s": prompt / span,
                       "output_tokens_per_s": out_tokens / span},
        "load_imbalance": {"busy_max_over_min": _ratio(busy), "requests_max_over_min": _ratio(nreq)},
        "prefill_workers": [
            {"id": w.id, "requests": w.stats.requests, "prompt_tokens": w.stats.prompt_tokens,
             "hit_tokens": w.stats.hit_tokens,
             "hit_rate": w.stats.hit_tokens / w.stats.prompt_tokens if w.stats.prompt_tokens else 0.0,
             "busy_s": w.stats.busy_s, "utilization": w.stats.busy_s / span,
             "max_queue": w.stats.max_queue,
             "cached_tokens_end": None if shared else w.cache.stats().device * w.unit}
            for w in pws],
        "global_cache_tokens_end": pws[0].cache.stats().device * pws[0].unit if shared else None,
        "decode_workers": [
            {"id": d.id, "requests": d.stats.requests, "tokens_out": d.stats.tokens_out,
             "busy_s": d.stats.busy_s, "utilization": d.stats.busy_s / span,
             "peak_kv_tokens": d.peak_reserved, "max_waiting": d.stats.max_queue}
            for d in dws],
    }
