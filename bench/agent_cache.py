"""The agent workload against real ``tandem serve`` processes (SmolLM2 on the CPU): what the prefix
cache buys per turn, and disaggregated vs colocated serving.

Three configurations, run one after another in this process, each on a fresh server:

- ``colocated``          ``tandem serve --mode colocated`` (prefix cache on)
- ``colocated-nocache``  the same with ``--disable-prefix-cache``
- ``disaggregated``      ``tandem serve --mode disaggregated --prefill 1 --decode 1`` (prefix cache on)

For each: start the server as a subprocess on 127.0.0.1 (a free port), wait for ``/health``, send
one short warm-up request (unrelated text, dropped), run the same seeded ``tandem bench`` agent
workload in-process (loadtest/loadgen: ``agent_workload`` + ``run_sessions`` + ``summarize``), then stop
the server with SIGINT and wait for it. Reported: mean and median TTFT per turn index for
colocated with / without the cache and their ratio, cached-token ratio, output tok/s, and
disaggregated vs colocated (mean / p90 TTFT, tok/s). Prints a table and writes JSON to ``--out``
(default bench/out/agent_cache.json).

    .venv/bin/python -m tandem.bench.agent_cache [--num-sessions 3] [--turns 4] [--max-tokens 16]
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.bench.common import bench_parser, write_report
from tandem.core.ports import free_port

CONFIGS: dict[str, list[str]] = {
    "colocated": ["--mode", "colocated"],
    "colocated-nocache": ["--mode", "colocated", "--disable-prefix-cache"],
    "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"],
}


def _free_port() -> int:
    return free_port()          # outside the ephemeral range (core/ports.py)


class Server:
    """``tandem serve`` as a subprocess; a context manager that waits for /health and stops it with SIGINT."""

    def __init__(self, flags: list[str], args, log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tandem.cluster.cli", "serve", *flags, "--host", "127.0.0.1",
                    "--port", str(self.port), "--device", "cpu", "--max-total-tokens", str(args.max_total_tokens)]
        self.log_path, self.startup_timeout = log_path, args.startup_timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.stop_s: float | None = None

    def __enter__(self) -> "Server":
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            # its own process group, so that a server which ignores SIGINT can be killed with its children
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tandem serve exited with {self.proc.returncode}:\n{self._tail()}")
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > self.startup_timeout:
                    raise RuntimeError(f"tandem serve not healthy after {self.startup_timeout} s:\n{self._tail()}")
                time.sleep(0.3)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def __exit__(self, *exc) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print(f"  server pid {p.pid} still up 60 s after SIGINT; SIGTERM to its group", file=sys.stderr)
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.stop_s = time.monotonic() - t0


async def _run_workload(url: str, workload, args) -> tuple[list, str]:
    from tandem.loadtest.loadgen.client import ClientConfig, StreamClient, make_http, resolve_model, run_sessions

    cfg = ClientConfig(url=url, temperature=0.0, timeout_s=args.timeout)
    async with make_http(cfg) as http:
        model = await resolve_model(http)
        warm = StreamClient(http, cfg, model, time.perf_counter())
        # one short request first: first-call costs (allocations, lazy init) stay out of the numbers.
        # Its text shares nothing with the workload beyond the chat template's first tokens.
        w = await warm.chat([{"role": "user", "content": "Say hello."}], max_tokens=2)
        if not w.ok:
            raise RuntimeError(f"warm-up request failed: {w.error}: {w.error_detail}")
        client = StreamClient(http, cfg, model, time.perf_counter())
        records = await run_sessions(client, workload.sessions, progress=False)
    return records, model


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _per_turn(records) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for t in sorted({r.turn for r in records}):
        ok = [r for r in records if r.turn == t and r.ok and r.ttft is not None]
        ttft = [r.ttft for r in ok]
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        cached = sum(r.cached_tokens or 0 for r in ok)
        out[t] = {"n": len(ok), "ttft_mean_s": _mean(ttft),
                  "ttft_median_s": statistics.median(ttft) if ttft else None,
                  "prompt_tokens_mean": prompt / len(ok) if ok else None,
                  "cached_token_ratio": cached / prompt if prompt else None}
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def _f(x, fmt="{:.0f}", none="-"):
    return none if x is None else fmt.format(x)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "agent_cache", seed=0)
    p.add_argument("--num-sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--system-prompt-tokens", type=int, default=200)
    p.add_argument("--tool-result-tokens", default="uniform:32,96")
    p.add_argument("--think-time", default="0.2")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    args = p.parse_args(argv)

    from tandem.loadtest.loadgen.report import summarize
    from tandem.loadtest.loadgen.workloads import AgentConfig, Dist, agent_workload

    workload = agent_workload(AgentConfig(
        num_sessions=args.num_sessions, turns=args.turns, system_prompt_tokens=args.system_prompt_tokens,
        tool_result_tokens=Dist.parse(args.tool_result_tokens), think_time_s=Dist.parse(args.think_time),
        max_tokens=args.max_tokens, seed=args.seed))
    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}")
    try:
        load_before = tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        load_before = None
    print(f"agent workload: {workload.notes}; {workload.num_requests} requests, max_tokens {args.max_tokens}, "
          f"temperature 0, seed {args.seed}; load average {load_before}", file=sys.stderr)

    results: dict[str, dict] = {}
    logdir = Path(tempfile.mkdtemp(prefix="agent_cache-"))
    for name in names:
        t0 = time.monotonic()
        with Server(CONFIGS[name], args, logdir / f"{name}.log") as srv:
            print(f"[{name}] healthy after {srv.startup_s:.1f} s on {srv.url}; running the workload", file=sys.stderr)
            records, model = asyncio.run(_run_workload(srv.url, workload, args))
        s = summarize(records)
        results[name] = {"flags": CONFIGS[name], "model": model, "startup_s": srv.startup_s, "stop_s": srv.stop_s,
                         "summary": s, "per_turn": _per_turn(records),
                         "records": [r.to_json() for r in records]}
        print(f"[{name}] {s['ok']}/{s['requests']} ok in {s['duration_s']:.1f} s (wall {time.monotonic() - t0:.1f} s "
              f"with start/stop); mean TTFT {s['ttft_s']['mean'] * 1000 if s['ttft_s']['mean'] else float('nan'):.0f} ms, "
              f"{s['output_tokens_per_s'] or 0:.2f} tok/s, cached {s['cached_token_ratio'] or 0:.1%}",
              file=sys.stderr)
        if s["errors"]:
            print(f"[{name}] errors: {s['errors_by_kind']}; server log {logdir / (name + '.log')}", file=sys.stderr)

    # ---------------------------------------------------------------- comparisons
    comp: dict = {}
    if "colocated" in results and "colocated-nocache" in results:
        a, b = results["colocated"]["per_turn"], results["colocated-nocache"]["per_turn"]
        comp["cache_by_turn"] = {t: {"ttft_mean_cache_s": a[t]["ttft_mean_s"], "ttft_mean_nocache_s": b[t]["ttft_mean_s"],
                                     "ratio_nocache_over_cache": _ratio(b[t]["ttft_mean_s"], a[t]["ttft_mean_s"]),
                                     "median_ratio": _ratio(b[t]["ttft_median_s"], a[t]["ttft_median_s"]),
                                     "prompt_tokens_mean": a[t]["prompt_tokens_mean"],
                                     "cached_token_ratio": a[t]["cached_token_ratio"]}
                                 for t in a if t in b}

        def _later(nm):
            return [r["ttft"] for r in results[nm]["records"] if r["error"] is None and r["turn"] >= 1]
        comp["turns_ge_1"] = {"ttft_mean_cache_s": _mean(_later("colocated")),
                              "ttft_mean_nocache_s": _mean(_later("colocated-nocache")),
                              "ratio_nocache_over_cache": _ratio(_mean(_later("colocated-nocache")),
                                                                 _mean(_later("colocated")))}
    if "colocated" in results and "disaggregated" in results:
        c, d = results["colocated"]["summary"], results["disaggregated"]["summary"]
        comp["disagg_vs_colocated"] = {
            "ttft_mean_s": [d["ttft_s"]["mean"], c["ttft_s"]["mean"], _ratio(d["ttft_s"]["mean"], c["ttft_s"]["mean"])],
            "ttft_p90_s": [d["ttft_s"]["p90"], c["ttft_s"]["p90"], _ratio(d["ttft_s"]["p90"], c["ttft_s"]["p90"])],
            "itl_mean_s": [d["itl_s"]["mean"], c["itl_s"]["mean"], _ratio(d["itl_s"]["mean"], c["itl_s"]["mean"])],
            "output_tokens_per_s": [d["output_tokens_per_s"], c["output_tokens_per_s"],
                                    _ratio(d["output_tokens_per_s"], c["output_tokens_per_s"])],
            "cached_token_ratio": [d["cached_token_ratio"], c["cached_token_ratio"], None],
            "_columns": ["disaggregated", "colocated", "disaggregated / colocated"]}

    try:
        load_after = tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        load_after = None
    doc = {"config": {k: v for k, v in vars(args).items()}, "workload_notes": workload.notes,
           "requests_per_config": workload.num_requests, "load_average_before": load_before,
           "load_average_after": load_after, "server_logs": str(logdir), "results": results, "comparisons": comp}
    out = write_report(args.out, doc, default=str)

    # ---------------------------------------------------------------- tables
    print(f"\nagent workload ({workload.notes}; {workload.num_requests} requests, max_tokens {args.max_tokens}), "
          f"load {load_before} -> {load_after}")
    print("\n| config | ok | duration s | mean TTFT ms | p50 TTFT ms | p90 TTFT ms | mean ITL ms | output tok/s | cached tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["summary"]
        ms = lambda x: _f(None if x is None else x * 1000)  # noqa: E731
        print(f"| {name} | {s['ok']}/{s['requests']} | {s['duration_s']:.1f} | {ms(s['ttft_s']['mean'])} | "
              f"{ms(s['ttft_s']['p50'])} | {ms(s['ttft_s']['p90'])} | {ms(s['itl_s']['mean'])} | "
              f"{_f(s['output_tokens_per_s'], '{:.2f}')} | {s['cached_tokens']}/{s['prompt_tokens']} "
              f"({_f(s['cached_token_ratio'], '{:.1%}')}) |")
    if "cache_by_turn" in comp:
        print("\n| turn | mean prompt tokens | cached (cache on) | mean TTFT ms, cache | mean TTFT ms, no cache "
              "| no cache / cache (mean) | (median) |")
        print("|---|---|---|---|---|---|---|")
        for t, r in comp["cache_by_turn"].items():
            print(f"| {t} | {_f(r['prompt_tokens_mean'])} | {_f(r['cached_token_ratio'], '{:.1%}')} | "
                  f"{_f(r['ttft_mean_cache_s'] and r['ttft_mean_cache_s'] * 1000)} | "
                  f"{_f(r['ttft_mean_nocache_s'] and r['ttft_mean_nocache_s'] * 1000)} | "
                  f"{_f(r['ratio_nocache_over_cache'], '{:.2f}x')} | {_f(r['median_ratio'], '{:.2f}x')} |")
        g = comp["turns_ge_1"]
        print(f"\nturns >= 1 (the 2nd turn on): mean TTFT {_f(g['ttft_mean_cache_s'] and g['ttft_mean_cache_s'] * 1000)} ms "
              f"with the cache vs {_f(g['ttft_mean_nocache_s'] and g['ttft_mean_nocache_s'] * 1000)} ms without "
              f"({_f(g['ratio_nocache_over_cache'], '{:.2f}x')})")
    if "disagg_vs_colocated" in comp:
        d = comp["disagg_vs_colocated"]
        print("\n| metric | disaggregated | colocated | disagg / colocated |")
        print("|---|---|---|---|")
        for key, label, k in (("ttft_mean_s", "mean TTFT ms", 1000), ("ttft_p90_s", "p90 TTFT ms", 1000),
                              ("itl_mean_s", "mean ITL ms", 1000), ("output_tokens_per_s", "output tok/s", 1)):
            x, y, rt = d[key]
            print(f"| {label} | {_f(x and x * k, '{:.1f}')} | {_f(y and y * k, '{:.1f}')} | {_f(rt, '{:.2f}')} |")
    print(f"\nJSON: {out}; server logs: {logdir}")
    return 0 if all(r["summary"]["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
