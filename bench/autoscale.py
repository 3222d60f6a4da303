"""Autoscaling through a load step: SLO attainment with the planner vs fixed replicas.

Each scenario gets a fresh Ray cluster on this machine (cluster/raynodes.py: a head started with
Ray's fake multi-node autoscaler, node types ``prefill`` and ``decode`` as KubeRay's groups, token
auth on) and ``tandem serve --engine sim`` workers (simulated Llama-3-8B on an H100, run at wall
speed, so prefill time is real waiting). The load is open-loop: ``base_rate`` requests/s, then a
step to ``step_factor`` x that, each a distinct 10,000-token prompt (no cache hits) and 8 output
tokens. Scenarios:

- ``fixed``: 1 prefill + 1 decode worker, no planner (what a fixed-replica deployment does);
- ``planner``: the same start, the planner on (TTFT target ``--ttft-slo``), prefill 1..3.

Reported per scenario, over the step's requests: SLO attainment (share with TTFT <= the target),
TTFT p50/p90/p99, failures, and the planner's history. tests/cluster/test_autoscale.py asserts a
shorter step; both drive the scenario of loadtest/autoscale.py.

    .venv/bin/python -m tandem.bench.autoscale --out bench/out/autoscale.json
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time

from tandem.bench.common import bench_parser, write_report
from tandem.cluster.raynodes import RayNodes, fake_cluster_config, start_router
from tandem.loadtest.autoscale import open_loop, serve_config


def _pct(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(int(p * len(xs)), len(xs) - 1)] if xs else None


def run_scenario(name: str, args, workdir: str) -> dict:
    planner = None
    if name == "planner":
        planner = {"ttft_slo_s": args.ttft_slo, "itl_slo_s": 0.2, "period_s": 1.0, "window_s": 4.0,
                   "min_prefill": 1, "max_prefill": 3, "min_decode": 1, "max_decode": 2,
                   "scale_down_after_s": 4.0, "percentile": 0.9}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with RayNodes(token_auth=True, env=env, autoscaling_config=fake_cluster_config()) as c:
        r = start_router(serve_config(c.address, f"tandem-as-{name}", planner), c.client_env(), workdir,
                         timeout_s=240)
        try:
            results: list = []

            async def load():
                await open_loop(r.url, args.base_rate, args.base_seconds, results, "base")
                await open_loop(r.url, args.base_rate * args.step_factor, args.step_seconds, results, "step")

            t0 = time.monotonic()
            asyncio.run(load())
            wall = time.monotonic() - t0
            import httpx

            health = httpx.get(f"{r.url}/health", timeout=30).json()
        finally:
            r.kill()
    step = [t for tag, code, t in results if tag == "step" and code == 200 and t is not None]
    n_step = sum(1 for tag, *_ in results if tag == "step")
    return {
        "scenario": name, "requests": len(results), "failed": sum(1 for _, code, _ in results if code != 200),
        "step_requests": n_step, "wall_s": round(wall, 1),
        "slo_attainment": round(sum(1 for t in step if t <= args.ttft_slo) / max(n_step, 1), 3),
        "ttft_p50_s": _pct(step, 0.5), "ttft_p90_s": _pct(step, 0.9), "ttft_p99_s": _pct(step, 0.99),
        "ttft_median_all_s": statistics.median([t for _, c, t in results if t is not None] or [0.0]),
        "planner_history": (health.get("planner") or {}).get("history", []),
    }


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "autoscale")
    ap.add_argument("--ttft-slo", type=float, default=0.8, help="TTFT target, seconds (default 0.8)")
    ap.add_argument("--base-rate", type=float, default=1.0, help="requests/s before the step (default 1)")
    ap.add_argument("--step-factor", type=float, default=4.0, help="the step's rate over the base (default 4)")
    ap.add_argument("--base-seconds", type=float, default=4.0)
    ap.add_argument("--step-seconds", type=float, default=20.0)
    ap.add_argument("--scenarios", default="fixed,planner", help="comma-separated: fixed, planner")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-autoscale-") as workdir:
        for name in args.scenarios.split(","):
            print(f"scenario {name}: {args.base_seconds:g} s at {args.base_rate:g}/s, then "
                  f"{args.step_seconds:g} s at {args.base_rate * args.step_factor:g}/s ...", file=sys.stderr)
            rows.append(run_scenario(name.strip(), args, workdir))
    print(f"\nTTFT target {args.ttft_slo:g} s, step {args.step_factor:g}x; over the step's requests:\n")
    print("| scenario | step requests | failed | SLO attainment | TTFT p50 / p90 / p99 (s) | planner changes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"| {r['scenario']} | {r['step_requests']} | {r['failed']} | {r['slo_attainment']:.0%} | "
              f"{f(r['ttft_p50_s'])} / {f(r['ttft_p90_s'])} / {f(r['ttft_p99_s'])} | "
              f"{'; '.join(f'{p}P+{d}D ({why})' for _, p, d, why in r['planner_history']) or '-'} |")
    print()
    write_report(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
