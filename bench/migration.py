"""Live migration vs retraction alone, on a 1 prefill + 2 decode cluster (SmolLM2, CPU, Ray).

The load: ``--streams`` greedy requests of one agent session (so session affinity piles them onto
one decode worker), each ``--output-tokens`` long, on decode workers whose pool
(``--decode-tokens``) cannot hold them all: the loaded worker must retract (its host pool backs
the victims up) while the other one idles. Run twice, alternating, ``--repeats`` times each:
``--migration off`` (retraction alone) and ``balance`` (router/rebalance.py moves requests to the
idle worker). Reported, medians over repeats: wall time of the batch, output tok/s, inter-token
latency p50 / p99 / max as the client sees it, retractions, migrations, and each migration's pause
(the gap between a request's last token on its old worker and its first on the new one). Every
run's texts must equal the first run's (greedy): a mismatch fails the bench.

    .venv/bin/python -m tandem.bench.migration [--streams 6] [--output-tokens 96] [--repeats 2]
"""

from __future__ import annotations

import asyncio
import statistics
import time

from tandem.bench.common import bench_parser, write_report


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _counter(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def _stream(backend, greq) -> tuple[str, list[float]]:
    stamps, text = [], []
    async for c in backend.generate(greq):
        if c.error:
            raise RuntimeError(f"{greq.rid} failed: {c.error}")
        if c.token_ids:
            stamps.extend([time.perf_counter()] * len(c.token_ids))
        text.append(c.text)
    return "".join(text), stamps


def run(policy: str, args, loaded, tag: str) -> dict:
    from tandem.cluster.launch import launch_disaggregated
    from tandem.core.config import CacheConfig, EngineConfig, MigrationConfig, ServeConfig
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams

    engine = EngineConfig(device="cpu", num_threads=1,
                          cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=16))
    cfg = ServeConfig(prefill=1, decode=2, transfer_timeout_s=30.0, decode_max_total_tokens=args.decode_tokens,
                      engine_config=engine, migration=MigrationConfig(policy=policy, period_s=0.25))
    backend = launch_disaggregated(cfg, loaded=loaded)
    tok = backend.tokenizer
    try:
        params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
        reqs = [GenerateRequest(f"{tag}-{i}", tuple(tok.encode(tok.apply_chat_template(
                    [{"role": "user", "content": f"Story {i}: write about a lighthouse keeper."}]))),
                                params, session_id="one-agent") for i in range(args.streams)]

        async def go():
            t0 = time.perf_counter()
            res = await asyncio.gather(*(_stream(backend, g) for g in reqs))
            return res, time.perf_counter() - t0

        from prometheus_client import REGISTRY, generate_latest

        before = generate_latest(REGISTRY).decode()   # the router's counters live across runs
        res, wall = asyncio.run(go())
        metrics = backend.metrics_text().decode()
        router_now = generate_latest(REGISTRY).decode()
    finally:
        backend.close()
    itl = [b - a for _, st in res for a, b in zip(st, st[1:])]
    return {"policy": policy, "wall_s": wall, "out_tok_per_s": args.streams * args.output_tokens / wall,
            "itl_p50_ms": 1e3 * _pct(itl, 0.5), "itl_p99_ms": 1e3 * _pct(itl, 0.99),
            "itl_max_ms": 1e3 * max(itl, default=float("nan")),
            "retractions": _counter(metrics, "tandem_retractions_total"),
            "migrations": (_counter(router_now, "tandem_decode_migrations_total", outcome="ok")
                           - _counter(before, "tandem_decode_migrations_total", outcome="ok")),
            "pause_p50_ms": 1e3 * _pause_median(router_now, before), "texts": [t for t, _ in res]}


def _buckets(metrics: str) -> dict[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    for f in text_string_to_metric_families(metrics):
        if f.name == "tandem_decode_migration_downtime_seconds":
            return {float(s.labels["le"]): s.value for s in f.samples if s.name.endswith("_bucket")}
    return {}


def _pause_median(now: str, before: str) -> float:
    """The median migration pause of this run: the upper bound of the histogram bucket that holds
    it (tandem_decode_migration_downtime_seconds, this run's samples only)."""
    a, b = _buckets(now), _buckets(before)
    buckets = sorted((le, n - b.get(le, 0.0)) for le, n in a.items())
    total = buckets[-1][1] if buckets else 0
    return next((le for le, n in buckets if total and n >= total / 2), float("nan"))


def main(argv=None) -> int:
    import ray

    from tandem.engine.loader import load_model

    ap = bench_parser(__doc__, "migration", repeats=2)
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--decode-tokens", type=int, default=512, help="device KV tokens per decode worker")
    args = ap.parse_args(argv)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    loaded = load_model("smollm2", device="cpu")
    runs = []
    for r in range(args.repeats):
        for policy in (("off", "balance") if r % 2 == 0 else ("balance", "off")):
            runs.append(run(policy, args, loaded, f"{policy}-{r}"))
            print(f"  {policy:>8} run {r}: {runs[-1]['wall_s']:.1f} s, retractions {runs[-1]['retractions']:.0f}, "
                  f"migrations {runs[-1]['migrations']:.0f}", flush=True)
    ray.shutdown()
    ref = runs[0]["texts"]
    bad = [x["policy"] for x in runs if x["texts"] != ref]
    summary = {}
    for policy in ("off", "balance"):
        xs = [x for x in runs if x["policy"] == policy]
        summary[policy] = {k: statistics.median(x[k] for x in xs) for k in
                           ("wall_s", "out_tok_per_s", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
                            "retractions", "migrations", "pause_p50_ms")}
    print(f"{'policy':<10}{'wall s':>8}{'tok/s':>8}{'ITL p50':>9}{'ITL p99':>9}{'ITL max':>9}"
          f"{'retract':>9}{'migrate':>9}{'pause':>8}")
    for policy, s in summary.items():
        print(f"{policy:<10}{s['wall_s']:>8.1f}{s['out_tok_per_s']:>8.1f}{s['itl_p50_ms']:>9.0f}"
              f"{s['itl_p99_ms']:>9.0f}{s['itl_max_ms']:>9.0f}{s['retractions']:>9.0f}"
              f"{s['migrations']:>9.0f}{s['pause_p50_ms']:>8.0f}")
    print("texts identical across runs" if not bad else f"TEXTS DIFFER in {bad}")
    write_report(args.out, {"config": vars(args), "summary": summary,
                            "runs": [{k: v for k, v in x.items() if k != "texts"} for x in runs],
                            "texts_identical": not bad})
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
