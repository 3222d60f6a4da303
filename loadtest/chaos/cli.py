"""``tandem chaos``: break a live server on purpose and prove nothing was lost."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

DEFAULT_OUT = "tandem-chaos-out"
COUNTERS = ("tandem_retractions", "tandem_retraction_restores", "tandem_retraction_recomputes",
            "tandem_kv_digest_failures")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--seed", type=int, default=0, help="the plan's seed (same seed, same schedule)")
    p.add_argument("--sessions", type=int, default=8, help="concurrent sessions (default 8)")
    p.add_argument("--turns", type=int, default=4, help="requests per session (default 4)")
    p.add_argument("--max-tokens", type=int, default=24, help="output tokens per request, at most (default 24)")
    p.add_argument("--abort-mid", type=float, default=0.15, help="share of requests hung up mid-stream")
    p.add_argument("--abort-early", type=float, default=0.1, help="share hung up before the first token")
    p.add_argument("--kill", action="append", default=[], metavar="ROLE@SECONDS",
                   help="kill a live decode/prefill worker at that time, or 'target': the decode worker a live "
                        "migration is moving to (needs --debug-endpoints on the server)")
    p.add_argument("--oracle-model", default="smollm2",
                   help="the model the server serves (default smollm2; 'none': no output check, e.g. --engine sim)")
    p.add_argument("--oracle-dtype", default="auto", help="the server's dtype (default auto, as the server's)")
    p.add_argument("--settle-s", type=float, default=15.0, help="seconds to wait for the cluster to go idle")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default ./{DEFAULT_OUT})")
    s = p.add_argument_group("soak")
    s.add_argument("--duration", default="0", help="repeat the plan (seed + 1 each round) until this long "
                                                   "has passed: 90s, 30m, 2h (default 0: one round)")
    s.add_argument("--also-url", action="append", default=[], metavar="URL",
                   help="another router over the same workers; sessions alternate between the routers")
    s.add_argument("--kill-router", action="append", default=[], metavar="I@SECONDS",
                   help="SIGKILL router I (1: the first --also-url; a process on this machine) at that time")
    s.add_argument("--stop", action="append", default=[], metavar="ROLE@SECONDS+SECONDS",
                   help="SIGSTOP a decode/prefill worker (ROLE) or the worker NAME (decode-1) on this "
                        "machine at S for D seconds, then SIGCONT")
    s.add_argument("--ray-root-pid", action="append", type=int, default=[], metavar="PID",
                   help="worker processes are also looked for under this process (a `ray start` node)")
    s.add_argument("--stall-timeout", type=float, default=120.0,
                   help="a stream with no byte for this long counts as hung (default 120 s)")
    s.add_argument("--sample-every", default=None,
                   help="sample RSS / fds / threads / KV this often (0: never; default 60s with --duration, else 0)")
    s.add_argument("--warmup", default="60s", help="growth is judged from the first sample after this")
    s.add_argument("--rss-growth-mb", type=float, default=96.0, help="RSS growth allowed per process after warm-up")
    s.add_argument("--fd-growth", type=int, default=16, help="open-fd growth allowed per process after warm-up")
    s.add_argument("--thread-growth", type=int, default=8, help="thread growth allowed per process after warm-up")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chaos", help="seeded aborts, retraction and kills against a running server, "
                                            "with an oracle and a leak check", description=__doc__.split("\n\n")[0])
    add_flags(p)
    p.set_defaults(func=run)
    return p


def _counters(text: str) -> dict[tuple[str, str], float]:
    """``{(counter, worker): value}`` of :data:`COUNTERS` in a /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for f in text_string_to_metric_families(text):
        if f.name in COUNTERS:
            for s in f.samples:
                if s.name.endswith("_total"):
                    key = (f.name, s.labels.get("worker", ""))
                    out[key] = out.get(key, 0.0) + s.value
    return out


def _migrations(text: str, family: str = "tandem_decode_migrations") -> Counter[str]:
    """The router's ``tandem_decode_migrations_total`` (or another counter ``family`` with an
    ``outcome`` label, e.g. ``tandem_failovers``) by outcome, summed over the other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Counter[str] = Counter()
    for f in text_string_to_metric_families(text):
        if f.name == family:
            for s in f.samples:
                if s.name.endswith("_total"):
                    out[s.labels.get("outcome", "")] += int(s.value)
    return out


async def _migration_target(http, wait_s: float = 10.0) -> str | None:
    """The target of the first live migration GET /debug/kv lists (waiting up to ``wait_s``)."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        moves = (await http.get("/debug/kv")).json().get("migrations", [])
        if moves:
            return moves[0]["to"]
        await asyncio.sleep(0.01)
    return None


def counter_deltas(before: dict, after: dict) -> dict[str, float]:
    """Per counter, what every worker added during the run (a worker that was killed and
    replaced restarts from 0: its replacement counts whole, the dead one's last value is lost)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for (name, worker), v in after.items():
        out[name] += max(v - before.get((name, worker), 0.0), 0.0)
    return out


def kv_problems(workers: list[dict]) -> list[str]:
    """What is wrong with idle workers' KV (empty: clean)."""
    bad = []
    for w in workers:
        name = w.get("worker", "?")
        if "error" in w:
            bad.append(f"{name}: unreachable ({w['error']})")
            continue
        for k in ("running", "waiting", "retracted", "detached", "locked_tokens", "request_tokens",
                  "leaked_tokens", "live_transfers"):
            if w.get(k, 0):
                bad.append(f"{name}: {k}={w[k]}")
        if w.get("invariants") != "ok":
            bad.append(f"{name}: invariants: {w.get('invariants')}")
    return bad


def options(url: str, **kw) -> argparse.Namespace:
    """The flags' defaults with ``kw`` on top: ``run_chaos(options(url, sessions=4))`` in code."""
    p = argparse.ArgumentParser()
    add_flags(p)
    args = p.parse_args(["--url", url])
    for k, v in kw.items():
        if not hasattr(args, k):
            raise TypeError(f"unknown chaos option {k!r}")
        setattr(args, k, v)
    return args


async def run_chaos(args, oracle=None) -> dict:
    """The run (see the module docstring) -> the report dict. ``oracle``: an
    :class:`~tandem.loadtest.chaos.oracle.Oracle` to use (else one is made from the flags)."""
    import httpx

    from tandem.loadtest.chaos import sampler, soak
    from tandem.loadtest.chaos.client import RunConfig
    from tandem.loadtest.chaos.oracle import Oracle

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=60) as http:
        try:
            r = await http.get("/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"no server answers at {args.url}/v1/models: {type(e).__name__}: {e}") from None
        model = r.json()["data"][0]["id"]
        before_text = (await http.get("/metrics")).text
        before = _counters(before_text)
        kills = []
        for spec in args.kill:
            role, _, at = spec.partition("@")
            if role not in ("decode", "prefill", "target") or not at:
                raise ValueError(f"--kill {spec!r}: expected decode@SECONDS, prefill@SECONDS or target@SECONDS")
            kills.append((float(at), role))
        killed: list[str] = []

        async def on_kill(role: str) -> None:
            if role == "target":
                victim = await _migration_target(http)
            else:
                ws = (await http.get("/debug/kv")).json()["workers"]
                victim = next((w["worker"] for w in ws if w.get("role") == role and "error" not in w), None)
            if victim is None:
                killed.append(f"(no live {role} worker)")
                return
            r = await http.post("/debug/kill", params={"worker": victim})
            if r.status_code != 200:
                raise ValueError(f"POST /debug/kill failed ({r.status_code}): {r.text[:200]} "
                                 f"(start the server with --debug-endpoints)")
            killed.append(victim)
            print(f"tandem chaos: killed {victim}", file=sys.stderr)

        t0 = time.perf_counter()
        cfg = RunConfig(args.url, model, args.api_key, kill=kills, urls=[args.url, *args.also_url],
                        stall_s=args.stall_timeout)
        outcomes, sk = await soak.run(args, cfg, http, on_kill)
        wall = time.perf_counter() - t0
        # idle: every worker back to nothing held (background cleanups may take a moment)
        end = time.monotonic() + args.settle_s
        await asyncio.sleep(1.0)
        while True:
            workers = (await http.get("/debug/kv", timeout=120)).json()["workers"]
            problems = kv_problems(workers)
            if not problems or time.monotonic() > end:
                break
            await asyncio.sleep(0.5)
        after_text = (await http.get("/metrics")).text
        after = _counters(after_text)
        if soak.sample_every_s(args) > 0:
            live = [u for i, u in enumerate(cfg.routers()) if i not in cfg.dead]
            last = await asyncio.to_thread(sampler.sample_all, live, args.ray_root_pid)
            sk.series.add(time.perf_counter() - t0, last, sampler.kv_totals(workers))
    warmup = soak.parse_seconds(args.warmup)
    if sk.series.procs:
        print(sampler.format_table(sk.series, warmup), file=sys.stderr)
    print(f"tandem chaos: {len(outcomes)} requests in {wall:.1f} s"
          + ("; checking completed ones against a fresh engine ..." if args.oracle_model != "none" or oracle
             else ""), file=sys.stderr)
    own = oracle is None and args.oracle_model != "none"
    oracle = oracle or (Oracle(args.oracle_model, args.oracle_dtype) if own else None)
    try:
        if oracle is None:
            mismatches = []
        else:
            from tqdm import tqdm

            done = sum(1 for o in outcomes if o.kind == "completed")
            with tqdm(total=done, file=sys.stderr, unit="req", desc="oracle", dynamic_ncols=True,
                      mininterval=5.0) as bar:
                mismatches = await oracle.check(outcomes, progress=lambda i, n: bar.update(1))
    finally:
        if own:
            oracle.close()
    bounds = sampler.Bounds(args.rss_growth_mb, args.fd_growth, args.thread_growth)
    kinds = Counter(o.kind for o in outcomes)
    reasons = Counter(o.reason for o in outcomes if o.kind == "failed")
    delta = counter_deltas(before, after)
    return {"seed": args.seed, "model": model, "wall_s": wall, "requests": len(outcomes),
            "completed": kinds["completed"], "aborted_early": kinds["aborted_early"],
            "aborted_mid": kinds["aborted_mid"], "failed": kinds["failed"],
            "failure_reasons": dict(reasons), "killed": killed,
            "retractions": delta["tandem_retractions"], "restores": delta["tandem_retraction_restores"],
            "recomputes": delta["tandem_retraction_recomputes"],
            "digest_failures": delta["tandem_kv_digest_failures"],
            "migrations": {o: _migrations(after_text)[o] - _migrations(before_text)[o] for o in ("ok", "failed", "aborted")},
            "failovers": {o: _migrations(after_text, "tandem_failovers")[o]
                          - _migrations(before_text, "tandem_failovers")[o]
                          for o in ("resumed", "redispatched", "failed")},
            "mismatches": [asdict(m) for m in mismatches],
            "leaked_tokens": sum(w.get("leaked_tokens", 0) for w in workers),
            "kv_problems": problems, "workers": workers,
            "hung": sum(1 for o in outcomes if o.kind == "failed" and o.reason.startswith("hung")),
            "retried": sum(o.retried for o in outcomes),
            "retried_completed": sum(o.retried and o.kind == "completed" for o in outcomes),
            "retried_failed": sum(o.retried and o.kind == "failed" for o in outcomes),
            "rounds": sk.rounds, "events": sk.events, "warmup_s": warmup, "bounds": asdict(bounds),
            "growth": sampler.growth(sk.series, warmup), "not_flat": sampler.flat(sk.series, warmup, bounds),
            "samples": sk.series.to_json(), "sample_table": sampler.format_table(sk.series, warmup),
            "outcomes": [asdict(o) | {"messages": len(o.messages)} for o in outcomes]}


def verdict(rep: dict) -> list[str]:
    """Why the run fails (empty: it passes)."""
    why = []
    if rep["mismatches"]:
        why.append(f"{len(rep['mismatches'])} output mismatch(es)")
    if rep["kv_problems"]:
        why.append(f"KV not clean once idle: {'; '.join(rep['kv_problems'][:5])}")
    if rep["failure_reasons"].get("no reason given"):
        why.append(f"{rep['failure_reasons']['no reason given']} failure(s) without a stated reason")
    if rep.get("hung"):
        why.append(f"{rep['hung']} request(s) hung (no byte within the stall timeout)")
    if rep.get("not_flat"):
        why.append("not flat: " + "; ".join(rep["not_flat"][:5]))
    return why


def format_table(rep: dict) -> str:
    rows = [("requests", rep["requests"]), ("completed", rep["completed"]),
            ("aborted by the client (before the first token)", rep["aborted_early"]),
            ("aborted by the client (mid-stream)", rep["aborted_mid"]), ("failed", rep["failed"])]
    grouped: Counter[str] = Counter()
    for r, n in rep["failure_reasons"].items():
        grouped[re.sub(r"\d+", "N", r)[:90]] += n
    rows += [(f"  - {r}", n) for r, n in grouped.most_common()]
    rows += [("workers killed", ", ".join(rep["killed"]) or "-"), ("retractions", int(rep["retractions"])),
             ("restores from the host pool", int(rep["restores"])), ("recomputes", int(rep["recomputes"])),
             ("KV digest failures", int(rep["digest_failures"])),
             ("live migrations ok / failed / aborted",
              " / ".join(str(int(rep["migrations"][o])) for o in ("ok", "failed", "aborted"))),
             ("worker deaths under a request: resumed / re-routed / failed",
              " / ".join(str(int(rep.get("failovers", {}).get(o, 0))) for o in ("resumed", "redispatched", "failed"))),
             ("rounds / faults", f"{rep['rounds']} / {len(rep['events'])}"),
             ("hung requests (no byte within the stall timeout)", rep["hung"]),
             ("resent to router 0 after their router was killed (completed)",
              f"{rep['retried']} ({rep['retried_completed']})"),
             ("output mismatches (vs alone on a fresh engine)", len(rep["mismatches"])),
             ("leaked tokens (idle)", rep["leaked_tokens"]),
             ("idle KV check", "ok" if not rep["kv_problems"] else f"{len(rep['kv_problems'])} problem(s)")]
    w = max(len(k) for k, _ in rows)
    lines = [f"tandem chaos (seed {rep['seed']}, {rep['model']}, {rep['wall_s']:.1f} s)"]
    lines += [f"  {k:<{w}}  {v}" for k, v in rows]
    if rep["samples"]["procs"]:
        lines += [f"samples (warm-up {rep['warmup_s']:g} s; first after it -> last):", rep["sample_table"]]
    return "\n".join(lines)


def run(args) -> int:
    if args.sessions < 1 or args.turns < 1 or args.max_tokens < 1:
        raise ValueError("--sessions, --turns and --max-tokens must be >= 1")
    rep = asyncio.run(run_chaos(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(rep, indent=1))
    if rep["samples"]["procs"]:
        from tandem.loadtest.chaos import sampler

        series = sampler.Series({k: [tuple(x) for x in v] for k, v in rep["samples"]["procs"].items()},
                                [tuple(x) for x in rep["samples"]["kv"]])
        sampler.plot(series, out / "soak.png", f"tandem chaos, {rep['wall_s']:.0f} s")
    print(format_table(rep))
    why = verdict(rep)
    for m in rep["mismatches"][:5]:
        print(f"  mismatch {m['sid']} turn {m['turn']} at char {m['at']}: got {m['got']!r}, "
              f"want {m['want']!r}")
    print(f"report: {out / 'chaos.json'}; " + ("FAILED: " + "; ".join(why) if why else "passed"))
    return 1 if why else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem chaos", description=__doc__.split("\n\n")[0])
    add_flags(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"tandem chaos: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
