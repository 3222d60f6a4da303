"""The cost of prompt logprobs against a plain prefill, on SmolLM2 (CPU, the engine's default numerics
unless --dtype), colocated.

Per prompt length N (default 128, 512, 1024): one request of N prompt tokens and one output token
(``max_tokens=1``, greedy), on an engine with the prefix cache disabled (every repeat computes the
whole prompt), timed from submit to its final chunk: plain (no prompt logprobs), with
``prompt_logprobs=0`` (each prompt token's logprob and rank) and with ``prompt_logprobs=5`` (plus 5
alternatives, what an lm-eval loglikelihood request with ``logprobs=5`` asks). The three run
interleaved in each repeat, so load drifts hit them alike; medians over ``--repeats`` and the
ratios of the medians to plain are printed, of wall time and of the process's CPU time (every
thread's; on a shared, loaded box the CPU time is the steadier of the two). What the extra costs: the vocabulary head over every
prompt position instead of the last one (``[N, V]`` logits), a float32 log_softmax over them, and
for k > 0 a top-k. All three must sample the same token.

Usage: python bench/prompt_logprobs.py [--threads 2] [--sizes 128,512,1024] [--repeats 5]
           [--dtype auto] [--out bench/out/prompt_logprobs.json]
"""

from __future__ import annotations

import random
import statistics
import time

from tandem.bench.common import bench_parser, write_report

MODES = {"plain": None, "prompt_logprobs=0": 0, "prompt_logprobs=5": 5}


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "prompt_logprobs", repeats=5, threads=2, seed=0)
    ap.add_argument("--sizes", default="128,512,1024")
    ap.add_argument("--dtype", default="auto", help="engine dtype (default auto)")
    args = ap.parse_args(argv)

    from tandem.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine

    sizes = [int(s) for s in args.sizes.split(",")]
    cfg = EngineConfig(device="cpu", dtype=args.dtype, num_threads=args.threads,
                       cache=CacheConfig(disable_prefix_cache=True, max_total_tokens=max(sizes) + 64),
                       scheduler=SchedulerConfig(chunked_prefill_size=max(sizes)))
    engine = Engine(cfg)
    rng = random.Random(args.seed)
    vocab = engine.arch.vocab_size
    rows = []
    try:
        print(f"{engine.startup_line}\n")
        print(f"{'N':>6} {'':>4} " + " ".join(f"{m:>20}" for m in MODES) + f" {'ratio k=0':>10} {'ratio k=5':>10}")
        for n in sizes:
            ids = [rng.randrange(256, vocab) for _ in range(n)]
            times: dict[str, list[float]] = {m: [] for m in MODES}
            cpu: dict[str, list[float]] = {m: [] for m in MODES}
            tokens: dict[str, set] = {m: set() for m in MODES}
            for rep in range(args.repeats + 1):          # the first round warms up, untimed
                for mode, k in MODES.items():
                    params = SamplingParams(max_tokens=1, prompt_logprobs=k)
                    t, c = time.perf_counter(), time.process_time()
                    out = engine.generate(ids, params, timeout=600)
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                    assert out.error is None, out.error
                    tokens[mode].add(tuple(out.token_ids))
                    if rep:
                        times[mode].append(dt)
                        cpu[mode].append(dc)
            same = len(set().union(*tokens.values())) == 1
            med = {m: statistics.median(v) for m, v in times.items()}
            med_cpu = {m: statistics.median(v) for m, v in cpu.items()}
            row = {"prompt_tokens": n, "median_s": med, "median_cpu_s": med_cpu, "samples_s": times,
                   "samples_cpu_s": cpu, "same_token": same,
                   **{f"{kind}_ratio_k{k}": m[f"prompt_logprobs={k}"] / m["plain"]
                      for kind, m in (("wall", med), ("cpu", med_cpu)) for k in (0, 5)}}
            rows.append(row)
            for kind, m in (("wall", med), ("cpu", med_cpu)):
                print(f"{n:>6} {kind:>4} " + " ".join(f"{m[x] * 1e3:>18.1f}ms" for x in MODES)
                      + f" {row[kind + '_ratio_k0']:>10.2f} {row[kind + '_ratio_k5']:>10.2f}"
                      + ("" if same else "  TOKENS DIFFER"))
    finally:
        engine.shutdown()
    write_report(args.out, {"threads": args.threads, "dtype": args.dtype, "repeats": args.repeats,
                            "startup": engine.startup_line, "rows": rows})
    return 0 if all(r["same_token"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
