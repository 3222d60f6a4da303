"""The soak: ``tandem chaos --duration`` against two routers over one detached worker set, with
every fault issue 25 names, sampled as it runs.

The cluster (all on 127.0.0.1): a Ray head started with ``ray start`` (cluster/raynodes.py; it
outlives the routers), 1 prefill + 2 decode workers (real SmolLM2, fp32, CPU, page size 16, a
1024-token decode pool, forced retraction every 11 decode steps, forced live migration every
``--migrate-every`` streamed tokens, ``--debug-endpoints``), detached; router 0 starts them,
router 1 adopts them. ``tandem chaos`` (loadtest/chaos) then runs for ``--duration``:

- rounds of seeded sessions alternating between the routers, with client aborts before the
  first token and mid-stream;
- a decode worker killed (POST /debug/kill) at ``--kill-at`` (the supervisor replaces it);
- router 1 SIGKILLed at ``--kill-router-at`` (its clients resend to router 0);
- with ``--stop``, a decode worker SIGSTOPped at ``--stop-at`` for ``--stop-s`` (its requests
  must end within the stall timeout: that needs the progress deadlines of issue 25 item 1);
- every ``--sample-every``: each router's and worker's RSS, fds and threads and the KV accounting.

Pass: every completed text equal to the same request alone on a fresh engine, 0 leaked tokens,
no hung request, no failure without a reason, and each process flat after ``--warmup`` (growth
within ``--rss-growth-mb`` / ``--fd-growth`` / ``--thread-growth``); and the run did what it was
asked (:func:`missed`: clients hung up, the worker and the router were killed, the latter with a
request in flight, every resend completed, router 0 sampled all along). Writes
``bench/out/soak/chaos.json`` and ``soak.png``; prints the table; exit 1 on a failed verdict.
Not a test: ``make soak`` (30 minutes) and ``make soak-short`` (3 minutes) run it.

    .venv/bin/python -m tandem.bench.soak --duration 10m --sample-every 60s [--stop]
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
from pathlib import Path

from tandem.bench.common import OUT_DIR, bench_parser

CONFIG = {
    "mode": "disaggregated", "prefill": 1, "decode": 2, "worker_lifetime": "cluster",
    "ray_namespace": "tandem-soak", "policy": "session", "transfer_timeout_s": 20.0,
    "decode_max_total_tokens": 1024, "debug_endpoints": True,
    "engine_config": {"device": "cpu", "dtype": "float32", "num_threads": 1,
                      "cache": {"page_size": 16, "max_total_tokens": 4096, "max_running_requests": 8},
                      "scheduler": {"debug_retract_every": 11}},
}


def soak(duration: str = "2m", sample_every: str = "10s", warmup: str = "30s", sessions: int = 6,
         turns: int = 4, max_tokens: int = 24, kill_at: float | None = 20.0,
         kill_router_at: float | None = 45.0, stop_at: float | None = None, stop_s: float = 10.0,
         migrate_every: int = 16, stall_timeout: float = 60.0, out: str | Path = OUT_DIR / "soak",
         seed: int = 0, oracle=None, **bounds) -> dict:
    """Start the cluster and both routers, run the chaos soak, stop everything; the report dict
    (loadtest/chaos/cli.py ``run_chaos``) with ``verdict`` added. ``bounds``: rss_growth_mb,
    fd_growth, thread_growth."""
    from tandem.cluster.raynodes import RayNodes, start_router
    from tandem.loadtest.chaos.cli import options, run_chaos, verdict

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cfg = {**CONFIG, "migration": {"debug_migrate_every": migrate_every}}
    routers = []
    with tempfile.TemporaryDirectory(prefix="tandem-soak-") as work, \
            RayNodes(token_auth=False, env=env, head_cpus=3) as c:
        try:
            cfg["ray_address"] = c.address
            print("soak: starting router 0 (it starts the workers) and router 1 ...", file=sys.stderr)
            routers.append(start_router(cfg, c.client_env(), work))
            routers.append(start_router(cfg, c.client_env(), work))
            args = options(routers[0].url, also_url=[routers[1].url], duration=duration, seed=seed,
                           sessions=sessions, turns=turns, max_tokens=max_tokens, oracle_dtype="float32",
                           sample_every=sample_every, warmup=warmup, stall_timeout=stall_timeout,
                           ray_root_pid=[c.nodes[0].proc.pid], out=str(out), settle_s=30.0,
                           kill=[f"decode@{kill_at:g}"] if kill_at is not None else [],
                           kill_router=[f"1@{kill_router_at:g}"] if kill_router_at is not None else [],
                           stop=[f"decode@{stop_at:g}+{stop_s:g}"] if stop_at is not None else [], **bounds)
            rep = asyncio.run(run_chaos(args, oracle))
        finally:
            for r in routers:
                r.kill()
    rep["verdict"] = verdict(rep) + missed(rep, kill_at is not None, kill_router_at is not None)
    return rep


def missed(rep: dict, killed_worker: bool, killed_router: bool) -> list[str]:
    """What the run was asked to do and did not (an empty list: it did all of it): the clients
    hung up at least once; the decode worker was killed; router 1 was SIGKILLed with a request in
    flight and every resend completed; router 0 was sampled all along (every sample)."""
    why = []
    if rep["aborted_mid"] + rep["aborted_early"] < 1:
        why.append("no client hung up")
    if killed_worker and not (rep["killed"] and rep["killed"][0].startswith("decode-")):
        why.append(f"no decode worker was killed ({rep['killed']})")
    if killed_router:
        kill = next((e for e in rep["events"] if "SIGKILL router 1" in e), "")
        n = re.search(r"with (\d+) request\(s\) in flight", kill)
        if not n or int(n.group(1)) < 1:
            why.append(f"router 1 was not killed with a request in flight ({kill or 'no kill'})")
        if rep["retried"] < 1 or rep["retried_failed"]:
            why.append(f"resends: {rep['retried']} made, {rep['retried_failed']} failed")
    procs = rep["samples"]["procs"]
    if not any(k.startswith("decode@") for k in procs):
        why.append("no decode worker was sampled")
    if len(procs.get("router-0", [])) < len(rep["samples"]["kv"]):
        why.append("router 0 was not sampled all along")
    return why


def main(argv: list[str] | None = None) -> int:
    import json

    from tandem.loadtest.chaos.cli import format_table
    from tandem.loadtest.chaos.sampler import Series, plot

    ap = bench_parser(__doc__, seed=0)
    ap.add_argument("--duration", default="10m")
    ap.add_argument("--sample-every", default="60s")
    ap.add_argument("--warmup", default="2m")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kill-at", type=float, default=60.0)
    ap.add_argument("--kill-router-at", type=float, default=120.0)
    ap.add_argument("--stop", action="store_true", help="include the SIGSTOP of a decode worker")
    ap.add_argument("--stop-at", type=float, default=90.0)
    ap.add_argument("--stop-s", type=float, default=10.0)
    ap.add_argument("--migrate-every", type=int, default=16)
    ap.add_argument("--out", default=str(OUT_DIR / "soak"))
    args = ap.parse_args(argv)
    rep = soak(args.duration, args.sample_every, args.warmup, args.sessions, args.turns, args.max_tokens,
               kill_at=args.kill_at, kill_router_at=args.kill_router_at,
               stop_at=args.stop_at if args.stop else None, stop_s=args.stop_s,
               migrate_every=args.migrate_every, out=args.out, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(rep, indent=1))
    series = Series({k: [tuple(x) for x in v] for k, v in rep["samples"]["procs"].items()},
                    [tuple(x) for x in rep["samples"]["kv"]])
    plot(series, out / "soak.png", f"soak {args.duration}: 2 routers, 1P+2D SmolLM2")
    print(format_table(rep))
    print("events:", "; ".join(rep["events"]))
    print(f"wrote {out / 'chaos.json'}, {out / 'soak.png'}; "
          + ("FAILED: " + "; ".join(rep["verdict"]) if rep["verdict"] else "passed"))
    return 1 if rep["verdict"] else 0


if __name__ == "__main__":
    sys.exit(main())
