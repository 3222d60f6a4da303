"""Disaggregated (1 prefill + 1 decode Ray actor, KV over NIXL) vs colocated (one engine) serving.

Two measurements, both through the serving backends the HTTP front door uses
(``RayClusterBackend`` / ``LocalEngineBackend``), so HTTP parsing is left out:

1. TTFT of one ``--prompt-tokens`` prompt (fresh random ids each repeat: no prefix-cache hit),
   broken down from the decode worker's timings:
   queue+reserve (decode takes a row and pages) | prefill (prefill engine: arrival -> first token,
   its own queue included) | transfer (NIXL WRITE posted -> done) | rpc+notify (the rest of
   "dispatch -> both the notification and the result are in") | activate | driver (Ray streaming
   back to the caller) | first decode step (first -> second token). Colocated TTFT alongside.
2. Throughput with ``--concurrency`` requests at once (``--tp-prompt-tokens`` in,
   ``--output-tokens`` out, ignore_eos): output tokens/s, request latency and TTFT percentiles.

Both modes get the same CPUs: the colocated engine uses every core; each actor gets its share.
Prints a table and writes JSON to ``--out`` (default bench/out/serve.json).

    .venv/bin/python -m tandem.bench.serve [--prompt-tokens 1024] [--concurrency 16]
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid

from tandem.bench.common import bench_parser, medians, write_report


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, min(vocab, 40000)) for _ in range(n))


async def _one(backend, greq) -> dict:
    t0 = time.perf_counter()
    first = None
    times = []
    last = None
    async for c in backend.generate(greq):
        now = time.perf_counter()
        if c.token_ids:
            times.append(now)
            if first is None:
                first = now - t0
        last = c
    if last is None or last.error:
        raise RuntimeError(f"{greq.rid} failed: {last.error if last else 'no chunk'}")
    return {"ttft_s": first, "latency_s": time.perf_counter() - t0, "tokens": last.completion_tokens,
            "second_token_s": (times[1] - times[0]) if len(times) > 1 else None}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def ttft_breakdown(disagg, colocated, args, vocab: int) -> dict:
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams

    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    rows, coloc = [], []
    for i in range(args.repeats + 1):   # the first round warms both paths up and is dropped
        greq = GenerateRequest(f"ttft-{uuid.uuid4().hex[:8]}", _ids(rng, args.prompt_tokens, vocab), params)
        r = await _one(disagg, greq)
        stats = await disagg.stats()
        t = next(s["last_timings"] for s in stats.values() if s["role"] == "decode" and s["last_timings"])
        greq2 = GenerateRequest(f"ttft-c-{uuid.uuid4().hex[:8]}", _ids(rng, args.prompt_tokens, vocab), params)
        c = await _one(colocated, greq2)
        if i == 0:
            continue
        overhead = t["receive_s"] - t["prefill_s"] - t["transfer_s"]
        rows.append({"ttft_s": r["ttft_s"], "queue_reserve_s": t["reserve_s"], "prefill_s": t["prefill_s"],
                     "transfer_s": t["transfer_s"], "rpc_notify_s": overhead, "activate_s": t["activate_s"],
                     "driver_s": r["ttft_s"] - t["reserve_s"] - t["receive_s"] - t["activate_s"],
                     "first_decode_step_s": r["second_token_s"], "bytes": t["bytes"]})
        coloc.append({"ttft_s": c["ttft_s"], "first_decode_step_s": c["second_token_s"]})
    return {"prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "disaggregated": medians(rows),
            "colocated": medians(coloc), "runs": rows}


async def throughput(backend, args, vocab: int, tag: str) -> dict:
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams

    rng = random.Random(f"{args.seed}-{tag}")   # fresh prompts per round: no prefix-cache hits
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    reqs = [GenerateRequest(f"{tag}-{i}-{uuid.uuid4().hex[:6]}", _ids(rng, args.tp_prompt_tokens, vocab), params)
            for i in range(args.concurrency)]
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_one(backend, g) for g in reqs))
    wall = time.perf_counter() - t0
    out_tokens = sum(r["tokens"] for r in res)
    ttft = [r["ttft_s"] for r in res]
    lat = [r["latency_s"] for r in res]
    return {"requests": len(res), "wall_s": wall, "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / wall,
            "total_tok_per_s": (out_tokens + args.tp_prompt_tokens * len(res)) / wall,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
            "latency_p50_s": _pct(lat, 0.5), "latency_p90_s": _pct(lat, 0.9)}


def _table(result: dict) -> str:
    b = result["ttft"]
    d, c = b["disaggregated"], b["colocated"]
    lines = [f"TTFT breakdown, {b['prompt_tokens']}-token prompt (median of {b['repeats']}, ms)",
             f"{'stage':<22}{'disaggregated':>14}{'colocated':>12}"]
    for k in ("queue_reserve_s", "prefill_s", "transfer_s", "rpc_notify_s", "activate_s", "driver_s"):
        lines.append(f"{k[:-2]:<22}{d[k] * 1e3:>14.1f}{'':>12}")
    lines.append(f"{'= TTFT':<22}{d['ttft_s'] * 1e3:>14.1f}{c['ttft_s'] * 1e3:>12.1f}")
    lines.append(f"{'first decode step':<22}{d['first_decode_step_s'] * 1e3:>14.1f}"
                 f"{c['first_decode_step_s'] * 1e3:>12.1f}")
    lines.append(f"KV moved: {d['bytes'] / 1e6:.1f} MB at {d['bytes'] / max(d['transfer_s'], 1e-9) / 1e9:.2f} GB/s")
    t = result["throughput"]
    lines += ["", f"Throughput: {result['config']['concurrency']} concurrent requests, "
                  f"{result['config']['tp_prompt_tokens']} in / {result['config']['output_tokens']} out",
              f"{'mode':<15}{'out tok/s':>10}{'total tok/s':>12}{'TTFT p50':>10}{'TTFT p90':>10}"
              f"{'lat p50':>9}{'lat p90':>9}"]
    for mode in ("disaggregated", "colocated"):
        r = t[mode]
        lines.append(f"{mode:<15}{r['output_tok_per_s']:>10.1f}{r['total_tok_per_s']:>12.1f}"
                     f"{r['ttft_p50_s']:>10.2f}{r['ttft_p90_s']:>10.2f}{r['latency_p50_s']:>9.2f}"
                     f"{r['latency_p90_s']:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "serve", repeats=3, seed=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tp-prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    args = ap.parse_args(argv)

    import ray

    from tandem.cluster.launch import launch_disaggregated
    from tandem.core.config import CacheConfig, EngineConfig, ServeConfig
    from tandem.engine.engine import Engine
    from tandem.engine.loader import load_model
    from tandem.router.backend import LocalEngineBackend

    cores = os.cpu_count() or 1
    cache = CacheConfig(page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                        max_running_requests=max(args.concurrency, 8))
    ec = EngineConfig(model=args.model, cache=cache)
    cfg = ServeConfig(prefill=1, decode=1, transfer_timeout_s=300, engine_config=ec)
    loaded = load_model(args.model, device="cpu")
    ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
    disagg = launch_disaggregated(cfg, loaded=loaded, restart=False)
    engine = Engine(ec.model_copy(update={"num_threads": cores}), loaded=loaded)
    colocated = LocalEngineBackend(engine)
    vocab = engine.arch.vocab_size
    try:
        async def run() -> dict:
            ttft = await ttft_breakdown(disagg, colocated, args, vocab)
            await throughput(disagg, args, vocab, "warm-d")      # warm-up rounds, not reported
            await throughput(colocated, args, vocab, "warm-c")
            tp = {"disaggregated": await throughput(disagg, args, vocab, "tp-d"),
                  "colocated": await throughput(colocated, args, vocab, "tp-c")}
            return {"ttft": ttft, "throughput": tp}

        result = asyncio.run(run())
    finally:
        disagg.close()
        engine.shutdown()
        ray.shutdown()
    result["config"] = {**vars(args), "cpu_cores": cores, "device": "cpu", "dtype": "float32",
                        "actors": "1 prefill + 1 decode, each cores/2 CPUs", "colocated_threads": cores}
    print(_table(result))
    print()
    write_report(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
