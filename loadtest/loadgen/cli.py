"""``tandem bench``: drive a running server over its HTTP API and write a report."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_OUT = "tandem-bench-out"


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, metavar="agent|vllm-multiturn|trace:FILE",
                   help="agent loop, vLLM's multi-turn generator shape, or a trace "
                        "(Mooncake .jsonl or Azure .csv)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default ./{DEFAULT_OUT})")
    c = p.add_argument_group("client")
    c.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    c.add_argument("--model", default=None, help="model name (default: the first in /v1/models)")
    c.add_argument("--concurrency", type=int, default=None,
                   help="sessions in flight (default: all); for traces, requests in flight (default: no cap)")
    c.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (agent default 32); caps the trace / vllm-multiturn lengths")
    c.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    c.add_argument("--seed", type=int, default=0,
                   help="workload seed (also the sampling seed when temperature > 0; default 0)")
    c.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    c.add_argument("--max-requests", type=int, default=None, help="stop after this many requests")
    c.add_argument("--disable-session-header", action="store_true",
                   help="do not send X-Session-Id (session-aware routing sees anonymous requests)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    w = p.add_argument_group("workload")
    w.add_argument("--num-sessions", type=int, default=None,
                   help="sessions / conversations (agent default 4, vllm-multiturn 24)")
    w.add_argument("--turns", type=int, default=None,
                   help="requests per session (agent default 3; vllm-multiturn: from its config)")
    w.add_argument("--think-time", default=None,
                   help="seconds between a reply and the next turn: a distribution spec "
                        "(64, uniform:A,B, lognormal:MEAN[,MAX], exp:MEAN; agent default 0.2)")
    w.add_argument("--tool-result-tokens", default="uniform:32,96",
                   help="agent tool-result length in tokens, a distribution spec (default uniform:32,96)")
    w.add_argument("--system-prompt-tokens", type=int, default=200,
                   help="agent shared system prompt, tokens of prose before the tool schemas (default 200)")
    w.add_argument("--scale", type=float, default=1.0,
                   help="multiply vllm-multiturn and Azure token counts by this (e.g. 0.1 on a CPU)")
    w.add_argument("--workload-config", default=None,
                   help="vLLM generate_conversations JSON (default: the vendored "
                        "workloads/vllm_generate_multi_turn.json)")
    w.add_argument("--speedup", type=float, default=1.0, help="trace replay: divide arrival times by this")
    w.add_argument("--block-size", type=int, default=16,
                   help="Mooncake replay: tokens per hash id (the trace's 512-token blocks; default 16)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``tandem`` subcommands; ``args.func(args)`` runs it."""
    p = subparsers.add_parser("bench", help="load-test a running server over its HTTP API",
                              description=__doc__.split("\n\n")[0])
    add_bench_flags(p)
    p.set_defaults(func=run)
    return p


def build_workload(args):
    from tandem.loadtest.loadgen.traces import load_trace
    from tandem.loadtest.loadgen.workloads import (AgentConfig, Dist, agent_workload, load_vllm_config,
                                                   vllm_multiturn_workload)

    think = Dist.parse(args.think_time) if args.think_time is not None else None
    if args.workload == "agent":
        d = AgentConfig()
        return agent_workload(AgentConfig(
            num_sessions=args.num_sessions or d.num_sessions, turns=args.turns or d.turns,
            system_prompt_tokens=args.system_prompt_tokens,
            tool_result_tokens=Dist.parse(args.tool_result_tokens),
            think_time_s=think or d.think_time_s, max_tokens=args.max_tokens or d.max_tokens, seed=args.seed))
    if args.workload == "vllm-multiturn":
        return vllm_multiturn_workload(load_vllm_config(args.workload_config), scale=args.scale, seed=args.seed,
                                       num_sessions=args.num_sessions, turns=args.turns,
                                       max_tokens=args.max_tokens, think_time_s=think or Dist("const", 0.0))
    if args.workload.startswith("trace:"):
        path = args.workload[len("trace:"):]
        if not Path(path).is_file():
            raise ValueError(f"trace file {path!r} not found")
        return load_trace(path, block_size=args.block_size, speedup=args.speedup, scale=args.scale,
                          seed=args.seed, max_tokens=args.max_tokens, max_requests=args.max_requests)
    raise ValueError(f"unknown workload {args.workload!r} (agent, vllm-multiturn, trace:FILE)")


async def _bench(args, workload) -> tuple[list, dict, str]:
    import httpx

    from tandem.loadtest.loadgen.client import (ClientConfig, StreamClient, fetch_metrics, make_http,
                                                resolve_model, run_sessions, run_timed)
    from tandem.loadtest.loadgen.report import parse_metrics, worker_hit_ratios

    cfg = ClientConfig(url=args.url, model=args.model, api_key=args.api_key, temperature=args.temperature,
                       seed=args.seed if args.temperature > 0 else None, timeout_s=args.timeout,
                       session_header=not args.disable_session_header)
    async with make_http(cfg) as http:
        try:
            model = cfg.model or await resolve_model(http)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot list models at {args.url}/v1/models: {type(e).__name__}: {e}") from None
        before = await fetch_metrics(http)
        client = StreamClient(http, cfg, model, time.perf_counter())
        kw = dict(concurrency=args.concurrency, max_requests=args.max_requests, progress=not args.no_progress)
        if workload.sessions:
            records = await run_sessions(client, workload.sessions, **kw)
        else:
            records = await run_timed(client, workload.requests, **kw)
        after = await fetch_metrics(http)
    server = {"metrics_available": after is not None, "worker_hit_ratio": {}}
    if after is not None:
        server["worker_hit_ratio"] = worker_hit_ratios(parse_metrics(before or ""), parse_metrics(after))
    return records, server, model


def run(args) -> int:
    """Run the benchmark in ``args``; 0 when at least one request succeeded, else 1."""
    from tandem.loadtest.loadgen import plots
    from tandem.loadtest.loadgen.report import by_turn, format_table, format_turns, summarize, write_json

    for name in ("concurrency", "max_requests", "num_sessions", "turns", "max_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    workload = build_workload(args)
    out = Path(args.out)
    print(f"tandem bench: {workload.name}: {workload.notes}; {workload.num_requests} requests planned"
          + (f" (at most {args.max_requests})" if args.max_requests else ""), file=sys.stderr)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    records, server, model = asyncio.run(_bench(args, workload))
    summary = summarize(records)
    title = f"{workload.name}, {model}"
    config = {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"}
    config |= {"model": model, "started": started, "workload_notes": workload.notes}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", config=config, summary=summary, records=records, server=server)
    figures = plots.write_all(records, server["worker_hit_ratio"], out, title)
    print(format_table(summary, f"tandem bench {title}"))
    if workload.sessions:
        print("prompt tokens computed vs ideal (new tokens only), TTFT by turn:")
        print(format_turns(by_turn(records)))
    print(f"report: {out / 'report.json'}; figures: {', '.join(f.name for f in figures)}")
    return 0 if summary["ok"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__.split("\n\n")[0])
    add_bench_flags(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"tandem bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
