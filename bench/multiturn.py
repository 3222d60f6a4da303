"""Issue 37: the agent workload with long replies on colocated and 1P+1D serving, before and after
local prefill on the decode worker (means a) and the reply push to the prefill worker (means b).

Three configurations, each a fresh ``tandem serve`` subprocess (bench/agent_cache.py ``Server``)
running the same seeded agent workload (loadtest/loadgen), one after another:

- ``colocated``        ``--mode colocated``
- ``1p1d-before``      ``--mode disaggregated --prefill 1 --decode 1 --local-prefill-threshold 0
                       --reply-push off`` (every prompt prefilled on the prefill worker, which never
                       holds a reply: the path before issue 37)
- ``1p1d-local``       ``--reply-push off``: means (a) alone (the measured cost rule, decode/local_prefill.py)
- ``1p1d-after``       the defaults: means (a) and (b) (decode/reply_push.py)
- ``2p2d``             ``--prefill 2 --decode 2``, the defaults

Reported per configuration and turn (loadtest/loadgen/report.py ``by_turn``): prompt tokens
computed (prompt - cached, from the usage) against the ideal (turn t > 0: its new tokens only),
TTFT p50 and mean; and the cluster's own ``tandem_worker_prompt_tokens_computed_total`` over the
whole run, the tokens the reply push stored on prefill workers
(``tandem_prefill_stored_tokens_total``), and the router's ``tandem_route_cached_tokens_error`` (the share of requests within
one page). Prints a table and writes JSON to ``--out`` (default bench/out/multiturn.json).

    .venv/bin/python -m tandem.bench.multiturn [--num-sessions 3] [--turns 3] [--max-tokens 256] [--kv-store mooncake]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import httpx

from tandem.bench.agent_cache import Server, _run_workload
from tandem.bench.common import bench_parser, write_report

CONFIGS: dict[str, list[str]] = {
    "colocated": ["--mode", "colocated"],
    "1p1d-before": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                    "--local-prefill-threshold", "0", "--reply-push", "off"],
    "1p1d-local": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--reply-push", "off"],
    "1p1d-after": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"],
    "2p2d": ["--mode", "disaggregated", "--prefill", "2", "--decode", "2"],
}
DEFAULT_CONFIGS = ("colocated", "1p1d-before", "1p1d-local", "1p1d-after", "2p2d")


def _metrics(url: str) -> dict:
    from tandem.loadtest.loadgen.report import parse_metrics

    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def _total(m: dict, metric: str) -> float:
    return sum(v for (name, _), v in m.items() if name == metric)


def _computed_total(m: dict) -> float:
    return _total(m, "tandem_worker_prompt_tokens_computed_total")


def _l3_counters(before: dict, after: dict) -> dict[str, float]:
    """The L3 tier's counters over the run, summed over workers (``--kv-store`` only)."""
    out: dict[str, float] = {}
    for (name, lab), v in after.items():
        if name.startswith("tandem_l3_") and name.endswith("_total"):
            key = name[len("tandem_l3_"):-len("_total")]
            out[key] = out.get(key, 0.0) + v - before.get((name, lab), 0.0)
    return out


def _route_error(before: dict, after: dict) -> dict[str, float]:
    """``tandem_route_cached_tokens_error`` over the run: requests, and the share within each
    bucket bound (tokens)."""
    name = "tandem_route_cached_tokens_error_bucket"
    d = {dict(lab)["le"]: after[(n, lab)] - before.get((n, lab), 0.0) for (n, lab) in after if n == name}
    total = d.get("+Inf", 0.0)
    return {"requests": total, **{f"le_{k}": v / total for k, v in d.items() if total and k != "+Inf"}}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "multiturn", seed=0)
    p.add_argument("--num-sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--kv-store", default="off", help="passed to every configuration's tandem serve "
                   "(mooncake: the shared L3 tier, issue 37 (c))")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    args = p.parse_args(argv)

    from tandem.loadtest.loadgen.report import by_turn, format_turns, summarize
    from tandem.loadtest.loadgen.workloads import AgentConfig, agent_workload

    workload = agent_workload(AgentConfig(num_sessions=args.num_sessions, turns=args.turns,
                                          max_tokens=args.max_tokens, seed=args.seed))
    names = [c for c in args.configs.split(",") if c]
    if set(names) - set(CONFIGS):
        p.error(f"unknown configs {sorted(set(names) - set(CONFIGS))}; choose from {', '.join(CONFIGS)}")
    results: dict[str, dict] = {}
    logdir = Path(tempfile.mkdtemp(prefix="multiturn-"))
    l3 = ["--kv-store", args.kv_store] if args.kv_store != "off" else []
    for name in names:
        with Server(CONFIGS[name] + l3, args, logdir / f"{name}.log") as srv:
            print(f"[{name}] healthy on {srv.url}; running the workload", file=sys.stderr)
            before = _metrics(srv.url)
            records, model = asyncio.run(_run_workload(srv.url, workload, args))
            after = _metrics(srv.url)
        computed = _computed_total(after) - _computed_total(before)
        stored = _total(after, "tandem_prefill_stored_tokens_total") - _total(before, "tandem_prefill_stored_tokens_total")
        s = summarize(records)
        results[name] = {"flags": CONFIGS[name] + l3, "model": model, "ok": s["ok"], "requests": s["requests"],
                         "worker_prompt_tokens_computed": computed, "prefill_stored_tokens": stored,
                         "by_turn": by_turn(records),
                         "route_cached_tokens_error": _route_error(before, after),
                         "l3": _l3_counters(before, after) if l3 else None,
                         "records": [r.to_json() for r in records]}
        print(f"[{name}] {s['ok']}/{s['requests']} ok; workers computed {computed:.0f} prompt tokens",
              file=sys.stderr)
    out = write_report(args.out, {"config": vars(args), "workload_notes": workload.notes,
                                  "server_logs": str(logdir), "results": results}, default=str)
    print(f"\nagent workload ({workload.notes}; max_tokens {args.max_tokens}, temperature 0)")
    for name, r in results.items():
        print(f"\n{name}: {r['ok']}/{r['requests']} ok, workers computed "
              f"{r['worker_prompt_tokens_computed']:.0f} prompt tokens (warm-up included); reply push "
              f"stored {r['prefill_stored_tokens']:.0f} tokens on prefill workers")
        print(format_turns(r["by_turn"]))
        e = r["route_cached_tokens_error"]
        if e["requests"]:
            print(f"route cached-tokens error: {e['requests']:.0f} requests; share <= 1 token "
                  f"{e.get('le_1.0', 0):.0%}, <= 16 tokens {e.get('le_16.0', 0):.0%}")
        if r["l3"]:
            print("L3: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["l3"].items())))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
