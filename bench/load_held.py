"""Load held: the highest request rate a cluster sustains under a TTFT SLO, and what happens above.

Each configuration is a real ``tandem serve`` on 127.0.0.1 (cluster/raynodes.py ``start_router``),
driven by the agent workload of ``tandem bench`` (loadtest/loadgen: sessions of ``--turns`` turns
sharing a system prompt and tools, each turn after the previous reply plus its think time), with
sessions *arriving* as a Poisson process (loadgen ``run_arrivals``): the offered request rate is
sessions per second x turns.

1. **sweep**: rates in ``--rates`` (requests/s), ``--step-s`` seconds each; per rate P50/P99 TTFT
   of the served turns, the share refused with 429, 5xx and other errors. The sustained rate is
   the highest rate with P99 TTFT <= ``--slo-s`` and no refusal.
2. **burst**: ``--base`` x the sustained rate for ``--pre-s``, ``--burst`` x for ``--burst-s``,
   then the base rate again for ``--post-s``; a refused turn is retried once after its
   Retry-After (``--no-retry``: never, so that what follows the burst is the offered load alone,
   not the burst's refusals coming back). Per second: turns sent, served, refused, P99 TTFT; from the burst's end, the
   seconds until every later second's P99 TTFT is under the SLO again (latency) and until the
   last 429 (the burst's retried and follow-up turns served); served turns per second before,
   during and after the burst; the retries' success share says whether Retry-After was honest;
   the sessions the burst cut mid-way (a later turn refused for good) against the new ones it
   turned away (a first turn refused), which says whether admission kept the work it had started
   (``dispatch_prefer_sessions``, on by default; ``--no-prefer-sessions`` turns it off); and,
   since a closed loop's burst outlives its arrivals, when the last session that started in the
   burst sent its last turn and the 429s among the turns sent after that (the base load alone).

Every configuration splits the SLO between admission and the deferred queue, so that a served
turn's TTFT stays under it: ``admission_max_pending_s`` = ``--admit-share`` x ``--slo-s`` (a
prefill worker predicted to queue longer takes no new request; for the simulated engine times
``--sim-speedup``, its dispatcher's clock being simulated) and ``dispatch_queue_ttl_s`` =
``--queue-share`` x ``--slo-s`` (the router's deferred queue holds the rest that long, then 429). Configurations (``--configs``):
``sim-1p1d``, ``sim-1p2d`` (the simulated engine, ``--sim-speedup`` slows its H100 profile so
that its capacity, not the 2-core router, is the limit) and ``real-1p1d`` (SmolLM2 on the CPU;
``--real-rates``). Writes ``bench/out/load_held.json`` and ``bench/out/load_held.png``.

    .venv/bin/python -m tandem.bench.load_held [--configs sim-1p1d,sim-1p2d,real-1p1d] [--slo-s 2]
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tandem.bench.common import bench_parser, write_report

SIM = {"engine": "sim", "prefill": 1, "decode": 1, "policy": "session"}
REAL = {"prefill": 1, "decode": 1, "policy": "session",
        "engine_config": {"device": "cpu", "dtype": "float32", "num_threads": 1,
                          "cache": {"page_size": 16}}}
CONFIGS = {"sim-1p1d": SIM, "sim-1p2d": {**SIM, "decode": 2}, "real-1p1d": REAL}


def _agent(n: int, turns: int, seed: int, max_tokens: int):
    from tandem.loadtest.loadgen.workloads import AgentConfig, agent_workload

    return agent_workload(AgentConfig(num_sessions=max(n, 1), turns=turns, max_tokens=max_tokens,
                                      seed=seed)).sessions


def schedule(phases: list[tuple[float, float]], turns: int, seed: int) -> list[float]:
    """Poisson session start times over ``phases`` of (seconds, requests/s)."""
    rng, t0, out = random.Random(seed), 0.0, []
    for dur, rate in phases:
        t, lam = t0, rate / turns
        while lam > 0:
            t += rng.expovariate(lam)
            if t >= t0 + dur:
                break
            out.append(t)
        t0 += dur
    return out


async def drive(url: str, starts: list[float], turns: int, seed: int, max_tokens: int,
                retry_429: bool) -> list:
    from tandem.loadtest.loadgen.client import (ClientConfig, StreamClient, make_http, resolve_model,
                                                run_arrivals)

    cfg = ClientConfig(url=url, timeout_s=120.0)
    sessions = _agent(len(starts), turns, seed, max_tokens)[:len(starts)]
    async with make_http(cfg) as http:
        model = await resolve_model(http)
        client = StreamClient(http, cfg, model, time.perf_counter())
        return await run_arrivals(client, sessions, starts, retry_429=retry_429)


def _p(xs: list[float], q: float) -> float | None:
    from tandem.loadtest.loadgen.report import percentile

    return percentile(xs, q)


def point(records: list, rate: float, dur: float) -> dict:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    n = len(records)
    r429 = [r for r in records if r.status == 429]
    return {"rate": rate, "sent": n, "served": len(ok), "served_per_s": len(ok) / dur,
            "refused_429": len(r429), "share_429": len(r429) / n if n else 0.0,
            "http_5xx": sum(1 for r in records if (r.status or 0) >= 500),
            "other_errors": sum(1 for r in records if not r.ok and r.status != 429 and (r.status or 0) < 500),
            "retry_after_missing": sum(1 for r in r429 if not (r.retry_after or "").isdigit()),
            "errors": dict(Counter(f"{r.error}: {(r.error_detail or '')[:80]}" for r in records
                                   if not r.ok and r.status != 429)),
            "ttft_p50": _p(ttft, 50), "ttft_p99": _p(ttft, 99)}


def series(records: list, pre: float, burst: float, slo: float, total: float) -> dict:
    """Per-second bins of the burst run, the recovery time and the retries' outcome."""
    bins = []
    for s in range(int(math.ceil(total))):
        inb = [r for r in records if s <= r.start < s + 1]
        ttft = [r.ttft for r in inb if r.ok and r.ttft is not None]
        bins.append({"t": s, "sent": len(inb), "served": sum(r.ok for r in inb),
                     "refused": sum(r.status == 429 for r in inb), "ttft_p99": _p(ttft, 99),
                     "http_5xx": sum((r.status or 0) >= 500 for r in inb)})
    end = pre + burst

    def after(bad_bins: list[int]) -> float:
        return (max(bad_bins) + 1 - end) if bad_bins else 0.0

    slow = [b["t"] for b in bins if b["t"] >= end and (b["ttft_p99"] or 0) > slo]
    refused = [b["t"] for b in bins if b["t"] >= end and b["refused"]]
    retries = [r for r in records if r.scheduled is not None]
    final: dict[tuple[Any, int], Any] = {}   # (session, turn) -> its last Record
    for r in records:                    # a turn's last record (its retry, when it had one)
        final[(r.session, r.turn)] = r
    lost = [r for r in final.values() if r.status == 429]
    ras = [int(r.retry_after) for r in records if r.status == 429 and (r.retry_after or "").isdigit()]

    first: dict[str, float] = {}         # a session's first send (its first turn's first try)
    last: dict[str, float] = {}          # its last send (a later turn, or a retry)
    for r in records:
        first[r.session] = min(first.get(r.session, r.start), r.start)
        last[r.session] = max(last.get(r.session, r.start), r.start)
    burst_tail = max((last[s] for s, t in first.items() if pre <= t < end), default=end)

    def served_per_s(lo: float, hi: float) -> float:
        return sum(b["served"] for b in bins if lo <= b["t"] < hi) / max(hi - lo, 1.0)

    return {"bins": bins, "recovery_s": max(after(slow), after(refused)),
            "latency_recovery_s": after(slow), "refusals_end_s": after(refused),
            "served_per_s": {"pre": served_per_s(0, pre), "burst": served_per_s(pre, end),
                             "post": served_per_s(end, total)},
            "retries": len(retries), "retries_served": sum(r.ok for r in retries),
            "sessions_cut": sum(1 for r in lost if r.turn > 0),
            "sessions_turned_away": sum(1 for r in lost if r.turn == 0),
            "retry_after_s": sorted(set(ras)), "http_5xx": sum(b["http_5xx"] for b in bins),
            # the closed loop's tail: the burst's sessions send later turns until this long after
            # the burst, and the refusals once none of them sends any more
            "burst_sessions_end_s": max(burst_tail - end, 0.0),
            "refused_after_burst_sessions": sum(1 for r in records if r.status == 429 and r.start > burst_tail),
            "sent_after_burst_sessions": sum(1 for r in records if r.start > burst_tail)}


def run_config(name: str, args, work: str) -> dict:
    from tandem.cluster.raynodes import start_router

    pending_s = args.slo_s * args.admit_share
    cfg = {**CONFIGS[name], "admission_max_pending_s": pending_s,
           "dispatch_queue_ttl_s": args.slo_s * args.queue_share,
           "dispatch_prefer_sessions": not args.no_prefer_sessions}
    if cfg.get("engine") == "sim":
        cfg["sim_speedup"] = args.sim_speedup
        # the simulated dispatcher predicts in simulated seconds: the wall seconds, converted
        cfg["admission_max_pending_s"] = pending_s * args.sim_speedup
    rates = [float(x) for x in (args.real_rates if name.startswith("real") else args.rates).split(",")]
    step = args.real_step_s if name.startswith("real") else args.step_s
    print(f"{name}: starting tandem serve ...", file=sys.stderr)
    router = start_router(cfg, dict(os.environ), work)
    try:
        asyncio.run(drive(router.url, [0.0], args.turns, 999, args.max_tokens, False))    # warm-up
        sweep = []
        for i, rate in enumerate(rates):
            recs = asyncio.run(drive(router.url, schedule([(step, rate)], args.turns, args.seed + i),
                                     args.turns, args.seed + i, args.max_tokens, False))
            sweep.append(point(recs, rate, step))
            print(f"{name} {rate:g} req/s: {sweep[-1]}", file=sys.stderr)
            time.sleep(1.0)
        good = [p for p in sweep if p["ttft_p99"] is not None and p["ttft_p99"] <= args.slo_s
                and p["refused_429"] == 0 and p["other_errors"] == 0]
        sustained = max((p["rate"] for p in good), default=None)
        out: dict[str, Any] = {"config": cfg, "sweep": sweep, "sustained_rate": sustained}
        if sustained and not name.startswith("real"):
            base, high = args.base * sustained, args.burst * sustained
            phases = [(args.pre_s, base), (args.burst_s, high), (args.post_s, base)]
            total = args.pre_s + args.burst_s + args.post_s
            recs = asyncio.run(drive(router.url, schedule(phases, args.turns, args.seed + 100),
                                     args.turns, args.seed + 100, args.max_tokens, not args.no_retry))
            out["burst"] = {"base_rate": base, "burst_rate": high,
                            **series(recs, args.pre_s, args.burst_s, args.slo_s, total + 10)}
            b = out["burst"]
            print(f"{name} burst {base:g} -> {high:g} req/s: P99 TTFT within the SLO "
                  f"{b['latency_recovery_s']:g} s after it, last 429 {b['refusals_end_s']:g} s after it, "
                  f"served/s {b['served_per_s']}, retries "
                  f"{b['retries_served']}/{b['retries']} served, Retry-After {b['retry_after_s']}, "
                  f"sessions cut mid-way {b['sessions_cut']}, turned away {b['sessions_turned_away']}, "
                  f"the burst's sessions sent until {b['burst_sessions_end_s']:.1f} s after it, then "
                  f"{b['refused_after_burst_sessions']}/{b['sent_after_burst_sessions']} refused",
                  file=sys.stderr)
        return out
    finally:
        router.kill()


def plot(results: dict, slo: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, r in results.items():
        xs = [p["rate"] for p in r["sweep"]]
        ax[0].plot(xs, [p["ttft_p99"] or float("nan") for p in r["sweep"]], "o-", label=name)
        ax[1].plot(xs, [100 * p["share_429"] for p in r["sweep"]], "o-", label=name)
    ax[0].axhline(slo, ls="--", c="grey", label=f"SLO {slo:g} s")
    ax[0].set(xlabel="offered requests/s", ylabel="P99 TTFT (s)", yscale="log", title="rate vs P99 TTFT")
    ax[1].set(xlabel="offered requests/s", ylabel="% refused (429)", title="rate vs 429 share")
    ax[0].legend()
    ax[1].legend()
    burst = next(((n, r["burst"]) for n, r in results.items() if "burst" in r), None)
    if burst:
        n, b = burst
        t = [x["t"] for x in b["bins"]]
        ax[2].bar(t, [x["served"] for x in b["bins"]], color="tab:green", label="served /s")
        ax[2].bar(t, [x["refused"] for x in b["bins"]], bottom=[x["served"] for x in b["bins"]],
                  color="tab:red", label="429 /s")
        tw = ax[2].twinx()
        tw.plot(t, [x["ttft_p99"] or float("nan") for x in b["bins"]], "k.-", label="P99 TTFT")
        tw.axhline(slo, ls="--", c="grey")
        tw.set_ylabel("P99 TTFT (s)")
        ax[2].set(xlabel="seconds", ylabel="turns started per second",
                  title=f"{n}: burst {b['base_rate']:g} -> {b['burst_rate']:g} req/s, "
                        f"last 429 {b['refusals_end_s']:g} s after")
        ax[2].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "load_held", seed=0)
    ap.add_argument("--configs", default="sim-1p1d,sim-1p2d,real-1p1d")
    ap.add_argument("--slo-s", type=float, default=2.0, help="P99 TTFT SLO (default 2 s)")
    ap.add_argument("--rates", default="1,2,3,4,6,8", help="sim sweep, requests/s")
    ap.add_argument("--real-rates", default="0.25,0.5,1", help="real-model sweep, requests/s")
    ap.add_argument("--step-s", type=float, default=12.0)
    ap.add_argument("--real-step-s", type=float, default=30.0)
    ap.add_argument("--sim-speedup", type=float, default=0.02)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--base", type=float, default=0.5, help="burst run: base rate / sustained")
    ap.add_argument("--burst", type=float, default=3.0, help="burst run: burst rate / sustained")
    ap.add_argument("--pre-s", type=float, default=10.0)
    ap.add_argument("--burst-s", type=float, default=10.0)
    ap.add_argument("--post-s", type=float, default=30.0)
    ap.add_argument("--no-retry", action="store_true",
                    help="burst run: a refused turn is not sent again (its session ends)")
    ap.add_argument("--no-prefer-sessions", action="store_true",
                    help="dispatch_prefer_sessions off: the deferred queue in arrival order only")
    ap.add_argument("--admit-share", type=float, default=0.25,
                    help="admission limit (a prefill worker's predicted queue) as a share of the SLO")
    ap.add_argument("--queue-share", type=float, default=0.25,
                    help="the deferred queue's TTL as a share of the SLO")
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="tandem-load-held-") as work:
        for name in args.configs.split(","):
            results[name] = run_config(name, args, work)
    print(f"\nP99 TTFT SLO {args.slo_s:g} s; admission_max_pending_s {args.slo_s * args.admit_share:g}, "
          f"dispatch_queue_ttl_s {args.slo_s * args.queue_share:g}\n")
    print("| config | rate req/s | served/s | P50 TTFT s | P99 TTFT s | 429 | 5xx | other errors |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for p in r["sweep"]:
            f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            print(f"| {name} | {p['rate']:g} | {p['served_per_s']:.2f} | {f(p['ttft_p50'])} | {f(p['ttft_p99'])} "
                  f"| {p['refused_429']}/{p['sent']} | {p['http_5xx']} | {p['other_errors']} |")
    for name, r in results.items():
        line = f"{name}: sustained {r['sustained_rate']} req/s"
        if "burst" in r:
            b = r["burst"]
            line += (f"; burst {b['base_rate']:g} -> {b['burst_rate']:g} req/s: P99 TTFT within the SLO "
                     f"{b['latency_recovery_s']:g} s after it, last 429 {b['refusals_end_s']:g} s after it, "
                     f"5xx {b['http_5xx']}, retries after Retry-After served {b['retries_served']}/{b['retries']}, "
                     f"Retry-After values {b['retry_after_s']}, served/s before/during/after "
                     f"{b['served_per_s']['pre']:.2f}/{b['served_per_s']['burst']:.2f}/{b['served_per_s']['post']:.2f}, "
                     f"sessions cut mid-way {b['sessions_cut']}, turned away {b['sessions_turned_away']}, "
                     f"refused once the burst's sessions stopped sending ({b['burst_sessions_end_s']:.1f} s "
                     f"after it) {b['refused_after_burst_sessions']}/{b['sent_after_burst_sessions']}")
        print(line)
    out = Path(args.out)
    write_report(out, {"args": vars(args), "results": results})
    plot(results, args.slo_s, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
