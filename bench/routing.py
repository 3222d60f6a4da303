"""Routing policies on the Mooncake synthetic trace, in the simulator, side by side.

Three parts (all by default; flags pick some):

- ``--grid``: the trace at block size 512 with 4 and 8 prefill workers (and as many decode
  workers) of 3M cached tokens each, replayed at its own arrival rate and at 2x: every policy's
  hit rate, mean/p50/p99 TTFT and max/min worker load, beside one global cache of the summed
  capacity (routed least-load: with one shared cache, where a request goes does not change what
  it hits). Then the goals for the default ``session`` policy, checked.
- ``--mooncake-compare``: 10 prefill nodes x 3M tokens, per-node caches (prefix-oblivious and
  prefix-aware routing) vs one global cache, beside Mooncake's published ~27% vs ~63%.
- ``--latency``: decision latency of every policy with 10,000 sessions in the session table and
  the prefix indexes (a multi-turn workload shaped like vLLM's generate_multi_turn.json, token
  ids, 16-token pages, 8 prefill + 8 decode workers).

    python bench/routing.py [--grid] [--mooncake-compare] [--latency] [--profile NAME]

Prints tables; writes JSON to bench/out/routing.json (parts not run keep their old entry).
The simulator is deterministic: the grid's numbers do not depend on this machine's load; the
latency part does (it reports wall-clock and thread-CPU percentiles).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import time
from typing import Any
from pathlib import Path

from tandem.bench.common import bench_parser, write_report
from tandem.router.policies import POLICIES, PolicyConfig, RouterState, choose
from tandem.router.prefix_index import KVEvent, block_hashes
from tandem.router.view import ClusterView, RouteRequest, WorkerView, DECODE, PREFILL
from tandem.sim.cost_model import DEFAULT_PROFILE, get_profile
from tandem.sim.replay.simulate import DEFAULT_TRACE, load_trace, simulate

CAPACITY = 3_000_000
BLOCK = 512
MOONCAKE: dict[str, Any] = {"per_node_hit_rate": 0.27, "global_hit_rate": 0.63, "nodes": 10,
            "capacity_tokens_per_node": 3_000_000,
            "source": "Mooncake, USENIX FAST'25 (see workloads/README.md)"}


# -- the grid ------------------------------------------------------------------------------------
def _row(s: dict) -> dict:
    t = s["ttft_s"]
    return {"hit_rate": s["hit_rate"], "ttft_mean_s": t["mean"], "ttft_p50_s": t["p50"],
            "ttft_p90_s": t["p90"], "ttft_p99_s": t["p99"], "tpot_mean_s": s["tpot_s"]["mean"],
            "busy_max_over_min": s["load_imbalance"]["busy_max_over_min"],
            "requests_max_over_min": s["load_imbalance"]["requests_max_over_min"],
            "utilization": [round(w["utilization"], 3) for w in s["prefill_workers"]],
            "decisions": s["decisions"], "completed": s["completed"], "wall_s": s["wall_s"]}


def run_grid(trace, workers=(4, 8), speedups=(1.0, 2.0), profile=DEFAULT_PROFILE) -> list[dict]:
    cells = []
    for n in workers:
        for sp in speedups:
            rows = {}
            for pol in POLICIES:
                rows[pol] = _row(simulate(trace, prefill=n, decode=n, policy=pol, block_size=BLOCK,
                                          capacity_tokens=CAPACITY, speedup=sp, profile=profile))
            rows["global_cache"] = _row(simulate(trace, prefill=n, decode=n, policy="least_load",
                                                 block_size=BLOCK, capacity_tokens=CAPACITY,
                                                 speedup=sp, profile=profile, global_cache=True))
            cell = {"prefill": n, "decode": n, "speedup": sp, "rows": rows, "goals": _goals(rows)}
            _print_cell(cell)
            cells.append(cell)
    return cells


def _goals(rows: dict) -> dict:
    s, rr, g = rows["session"], rows["round_robin"], rows["global_cache"]
    best = min(r["ttft_mean_s"] for k, r in rows.items() if k != "global_cache")
    return {
        "hit_within_5pct_of_global": s["hit_rate"] >= 0.95 * g["hit_rate"],
        "hit_vs_global": s["hit_rate"] / g["hit_rate"],
        "mean_ttft_le_half_rr": s["ttft_mean_s"] <= 0.5 * rr["ttft_mean_s"],
        "mean_ttft_vs_rr": s["ttft_mean_s"] / rr["ttft_mean_s"],
        "p99_ttft_le_rr": s["ttft_p99_s"] <= rr["ttft_p99_s"],
        "lowest_mean_ttft_within_5pct": s["ttft_mean_s"] <= 1.05 * best,
        "mean_ttft_vs_best_policy": s["ttft_mean_s"] / best,
    }


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _print_cell(cell: dict) -> None:
    rows = cell["rows"]
    g, rr = rows["global_cache"], rows["round_robin"]
    print(f"\n{cell['prefill']}P+{cell['decode']}D, 3M tokens/worker, arrival rate x{cell['speedup']:g}")
    print(f"{'policy':<13}{'hit':>7}{'/global':>9}{'TTFT mean':>11}{'p50':>8}{'p99':>8}"
          f"{'/RR mean':>10}{'busy max/min':>14}{'req max/min':>13}")
    for name, r in rows.items():
        print(f"{name:<13}{r['hit_rate']:>7.3f}{r['hit_rate'] / g['hit_rate']:>9.3f}"
              f"{r['ttft_mean_s']:>11.3f}{r['ttft_p50_s']:>8.3f}{r['ttft_p99_s']:>8.3f}"
              f"{r['ttft_mean_s'] / rr['ttft_mean_s']:>10.3f}{_fmt(r['busy_max_over_min'], '.2f'):>14}"
              f"{_fmt(r['requests_max_over_min'], '.2f'):>13}")
    gl = cell["goals"]
    print("session goals: hit >= 0.95 x global: {} ({:.3f}); mean <= 0.5 x RR: {} ({:.3f}); "
          "p99 <= RR: {}; lowest mean (within 5%): {} ({:.3f} x best)".format(
              gl["hit_within_5pct_of_global"], gl["hit_vs_global"], gl["mean_ttft_le_half_rr"],
              gl["mean_ttft_vs_rr"], gl["p99_ttft_le_rr"], gl["lowest_mean_ttft_within_5pct"],
              gl["mean_ttft_vs_best_policy"]))


# -- Mooncake's local-vs-global figure -----------------------------------------------------------
def mooncake_compare(trace, profile=DEFAULT_PROFILE) -> dict:
    n = MOONCAKE["nodes"]
    out: dict[str, Any] = {"published": MOONCAKE, "ours": {}}
    for label, pol, glob in [("per-node, round_robin", "round_robin", False),
                             ("per-node, random", "random", False),
                             ("per-node, least_load", "least_load", False),
                             ("per-node, cache_aware", "cache_aware", False),
                             ("per-node, session", "session", False),
                             ("global pool (30M)", "least_load", True)]:
        s = simulate(trace, prefill=n, decode=n, policy=pol, block_size=BLOCK,
                     capacity_tokens=CAPACITY, profile=profile, global_cache=glob)
        out["ours"][label] = {"hit_rate": s["hit_rate"], "ttft_mean_s": s["ttft_s"]["mean"]}
    unbounded = simulate(trace, prefill=1, decode=1, policy="round_robin", block_size=BLOCK,
                         capacity_tokens=None, profile=profile)
    one = simulate(trace, prefill=1, decode=1, policy="round_robin", block_size=BLOCK,
                   capacity_tokens=CAPACITY, profile=profile)
    out["ours"]["one cache, unbounded"] = {"hit_rate": unbounded["hit_rate"]}
    out["ours"]["one cache, 3M tokens"] = {"hit_rate": one["hit_rate"]}
    print(f"\nMooncake synthetic trace, {n} prefill nodes x 3M tokens: per-node vs global cache hit rate")
    print(f"{'setting':<28}{'ours':>8}{'Mooncake (published)':>24}")
    pub = {"per-node, round_robin": "~27% (local cache)", "global pool (30M)": "~63% (global cache)",
           "one cache, unbounded": "~65% (max)", "one cache, 3M tokens": "~31% (48% of max)"}
    for label, r in out["ours"].items():
        print(f"{label:<28}{r['hit_rate']:>8.1%}{pub.get(label, ''):>24}")
    rr = out["ours"]["per-node, round_robin"]["hit_rate"]
    gl = out["ours"]["global pool (30M)"]["hit_rate"]
    print(f"global / per-node (round_robin): ours {gl / rr:.2f}x, Mooncake 2.36x")
    return out


# -- decision latency ----------------------------------------------------------------------------
def decision_latency(n_sessions: int = 10_000, n_decisions: int = 20_000, prefill: int = 8,
                     decode: int = 8, page: int = 16, seed: int = 0, rounds: int = 5) -> dict:
    """Time ``choose`` alone (views and requests are built beforehand) for every policy."""
    rng = random.Random(seed)
    vocab = 128_000
    common = [rng.randrange(vocab) for _ in range(500)]          # shared by all conversations

    def toks(n):
        return [rng.randrange(vocab) for _ in range(n)]

    convs = []
    for _ in range(n_sessions):                                   # 0..11 turns already done
        c = common + toks(rng.randint(800, 1200))
        for _ in range(rng.randint(0, 11)):
            c += toks(rng.randint(120, 160)) + toks(rng.randint(80, 120))
        convs.append(tuple(c))       # immutable keys, as a front door would hand them over

    def views(k: int) -> list[ClusterView]:
        out = []
        for _ in range(k):
            ws = [WorkerView(i, PREFILL, True, q := rng.randint(0, 8), q + rng.randint(0, 1),
                             rng.randint(0, 40_000), rng.uniform(0, 3.0))
                  for i in range(prefill)]
            ws += [WorkerView(prefill + j, DECODE, True, 0, rng.randint(0, 64),
                              rng.randint(0, 400_000), 0.0, 427_000) for j in range(decode)]
            out.append(ClusterView.of(ws, now=rng.uniform(0, 100)))
        return out

    cfg = PolicyConfig(seed=seed, kv_block_size=page, index_page_size=page,
                       index_capacity=CAPACITY)
    state = RouterState(cfg)
    t = time.perf_counter()
    warm_views = views(64)
    for i, c in enumerate(convs):                                 # route every session once
        d = choose(warm_views[i % 64], RouteRequest(str(i), c, len(c), session_id=f"s{i}"),
                   state, "session")
        state.kv.apply(KVEvent(d.prefill_worker, "stored", tuple(block_hashes(c, page)),
                               len(c) // page * page))
    warm_s = time.perf_counter() - t

    reqs = []
    for k in range(n_decisions):
        i = rng.randrange(n_sessions)
        key = convs[i] + tuple(toks(rng.randint(120, 160)))
        reqs.append(RouteRequest(f"r{k}", key, len(key), session_id=f"s{i}"))
    vs = views(256)
    result: dict[str, Any] = {"sessions": len(state.sessions), "index_nodes": state.approx.num_nodes(),
              "index_tokens": sum(state.approx.size(w) for w in range(prefill)),
              "kv_blocks": state.kv.num_blocks(), "warm_s": warm_s,
              "mean_prompt_tokens": sum(r.prompt_tokens for r in reqs) / len(reqs), "policies": {}}
    variants = [(p, p, False) for p in POLICIES] + [("kv_events+prehashed", "kv_events", True)]
    hashed = {r.request_id: tuple(block_hashes(r.key, page)) for r in reqs}
    per = n_decisions // rounds
    wall: dict[str, list[float]] = {v[0]: [] for v in variants}
    cpu: dict[str, list[float]] = {v[0]: [] for v in variants}
    round_p99: dict[str, list[float]] = {v[0]: [] for v in variants}
    for rnd in range(rounds):               # interleaved rounds: a noisy spell hits every policy
        for j in range(len(variants)):
            label, pol, prehash = variants[(j + rnd) % len(variants)]
            ws, cs = [], []
            for k in range(rnd * per, (rnd + 1) * per):
                r = reqs[k]
                if prehash:
                    r = dataclasses.replace(r, block_hashes=hashed[r.request_id])
                v = vs[k % len(vs)]
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                choose(v, r, state, pol)
                c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
                ws.append(t1 - t0)
                cs.append(c1 - c0)
            wall[label] += ws
            cpu[label] += cs
            round_p99[label].append(sorted(ws)[int(len(ws) * 0.99)] / 1e3)

    def q(xs, p):
        xs = sorted(xs)
        return xs[min(int(len(xs) * p), len(xs) - 1)] / 1e3

    for label, *_ in variants:
        result["policies"][label] = {
            "wall_us": {"p50": q(wall[label], 0.5), "p99": q(wall[label], 0.99), "max": q(wall[label], 1.0),
                        "best_round_p99": min(round_p99[label])},
            "cpu_us": {"p50": q(cpu[label], 0.5), "p99": q(cpu[label], 0.99)}}
    print(f"\nDecision latency: {result['sessions']} sessions in the table, {result['index_nodes']} "
          f"index nodes ({result['index_tokens'] / 1e6:.1f}M tokens), {result['kv_blocks']} KV "
          f"blocks; {n_decisions} decisions, mean prompt {result['mean_prompt_tokens']:.0f} tokens, "
          f"{prefill}P+{decode}D, {page}-token pages")
    print(f"{'policy':<22}{'p50 us':>9}{'p99 us':>9}{'best-round p99':>16}{'max us':>10}"
          f"{'cpu p50':>9}{'cpu p99':>9}")
    for label, r in result["policies"].items():
        w, c = r["wall_us"], r["cpu_us"]
        print(f"{label:<22}{w['p50']:>9.1f}{w['p99']:>9.1f}{w['best_round_p99']:>16.1f}{w['max']:>10.1f}"
              f"{c['p50']:>9.1f}{c['p99']:>9.1f}")
    print(f"(wall = perf_counter around choose(); cpu = this thread's CPU time; best-round p99 = the "
          f"lowest p99 of {rounds} interleaved rounds of {per} decisions, the least disturbed by other "
          f"processes on this shared machine)")
    return result


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "routing")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--mooncake-compare", action="store_true")
    ap.add_argument("--latency", action="store_true")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--sessions", type=int, default=10_000)
    args = ap.parse_args(argv)
    everything = not (args.grid or args.mooncake_compare or args.latency)
    get_profile(args.profile)
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    trace = load_trace(args.trace)
    result["setup"] = {"trace": args.trace, "requests": len(trace), "block_size": BLOCK,
                       "capacity_tokens_per_worker": CAPACITY, "profile": args.profile}
    if everything or args.grid:
        result["grid"] = run_grid(trace, profile=args.profile)
    if everything or args.mooncake_compare:
        result["mooncake_compare"] = mooncake_compare(trace, profile=args.profile)
    if everything or args.latency:
        gc.collect()
        result["decision_latency"] = decision_latency(args.sessions)
    print()
    write_report(out_path, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
