"""A live migration's stop (downtime) against context length, with and without pre-copy.

On a 1 prefill + 2 decode cluster (SmolLM2, CPU, Ray): one greedy request of ``L`` prompt tokens
(random ids, a fresh prompt per run so neither decode worker has it cached) decodes; after
``--after`` tokens the router moves it to the other decode worker. With pre-copy the target
first takes the prompt's KV into its cache (from the prefill worker's cache) while the source
keeps decoding, and the stop copies only the generated tail; without it, the stop copies the
whole context. Reported per ``L``, medians over ``--repeats``: the stop as the router measures it
(``tandem_decode_migration_downtime_seconds``: the last token on the source to the first on the
target), the whole move (request to first token on the target), the client's largest
inter-token gap, and the median inter-token gap (one decode step at that context: the stop
includes one). Every run's tokens must equal the same prompt's unmigrated run: a mismatch fails
the bench.

    .venv/bin/python -m tandem.bench.migration_downtime [--lengths 256,1024,2048,4096] [--repeats 3]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from tandem.bench.common import bench_parser, write_report


async def _one(backend, greq, move_after: int | None) -> tuple[list[int], list[float], float]:
    """The request's tokens, its token stamps, and when the move was asked (or 0)."""
    ids, stamps, asked, task = [], [], 0.0, None
    async for c in backend.generate(greq):
        if c.error:
            raise RuntimeError(f"{greq.rid} failed: {c.error}")
        ids += c.token_ids
        stamps += [time.perf_counter()] * len(c.token_ids)
        if move_after is not None and task is None and len(ids) >= move_after:
            asked = time.perf_counter()
            task = asyncio.ensure_future(backend.migrate(greq.rid))
    if task is not None:
        await task
    return ids, stamps, asked


def _downtime_sum() -> tuple[float, float]:
    from prometheus_client import REGISTRY

    s = REGISTRY.get_sample_value("tandem_decode_migration_downtime_seconds_sum") or 0.0
    n = REGISTRY.get_sample_value("tandem_decode_migration_downtime_seconds_count") or 0.0
    return s, n


def main(argv=None) -> int:
    import ray

    from tandem.cluster.launch import launch_disaggregated
    from tandem.core.config import CacheConfig, EngineConfig, MigrationConfig, ServeConfig
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams
    from tandem.engine.loader import load_model

    ap = bench_parser(__doc__, "migration_downtime", repeats=3, seed=0)
    ap.add_argument("--lengths", default="256,1024,2048,4096", help="prompt lengths (tokens)")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--after", type=int, default=8, help="tokens streamed before the move")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    loaded = load_model("smollm2", device="cpu")
    tokens = max(lengths) * 2 + 1024
    engine = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(
        page_size=16, max_total_tokens=tokens, max_running_requests=8))
    cfg = ServeConfig(prefill=1, decode=2, transfer_timeout_s=60.0, engine_config=engine,
                      migration=MigrationConfig(policy="off", precopy_min_tokens=0, precopy_timeout_s=60.0))
    backend = launch_disaggregated(cfg, loaded=loaded)
    rng = random.Random(args.seed)
    vocab = backend.vocab_size
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    rows, bad = [], []
    try:
        for n in lengths:
            for r in range(args.repeats):
                for precopy in ((False, True) if r % 2 == 0 else (True, False)):
                    backend.migrator.cfg = MigrationConfig(policy="off", precopy=precopy, precopy_min_tokens=0,
                                                           precopy_timeout_s=60.0)
                    prompt = tuple(rng.randrange(100, vocab) for _ in range(n))
                    tag = f"{n}-{r}-{'pre' if precopy else 'whole'}"
                    ref, _, _ = asyncio.run(_one(backend, GenerateRequest(f"ref-{tag}", prompt, params), None))
                    s0, c0 = _downtime_sum()
                    ids, stamps, asked = asyncio.run(_one(backend, GenerateRequest(f"mig-{tag}", prompt, params),
                                                          args.after))
                    s1, c1 = _downtime_sum()
                    if ids != ref:
                        bad.append(tag)
                    if c1 - c0 != 1:
                        raise RuntimeError(f"{tag}: {c1 - c0:.0f} migrations recorded, not 1")
                    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                    stop_end = stamps[gaps.index(max(gaps)) + 1]   # the first token after the longest gap
                    rows.append({"tokens": n, "precopy": precopy, "stop_ms": 1e3 * (s1 - s0),
                                 "move_ms": 1e3 * (stop_end - asked),
                                 "max_gap_ms": 1e3 * max(gaps),
                                 "itl_p50_ms": 1e3 * statistics.median(gaps)})
                    print(f"  L={n:>5} {'pre-copy' if precopy else 'whole   '} stop {rows[-1]['stop_ms']:7.1f} ms"
                          f"  move {rows[-1]['move_ms']:7.1f} ms", flush=True)
    finally:
        backend.close()
        ray.shutdown()
    summary = []
    print(f"{'tokens':>7}{'stop whole':>12}{'stop pre':>10}{'move whole':>12}{'move pre':>10}{'ITL p50':>9}")
    for n in lengths:
        m = {p: {k: statistics.median(x[k] for x in rows if x["tokens"] == n and x["precopy"] is p)
                 for k in ("stop_ms", "move_ms", "max_gap_ms", "itl_p50_ms")} for p in (False, True)}
        summary.append({"tokens": n, "whole": m[False], "precopy": m[True]})
        print(f"{n:>7}{m[False]['stop_ms']:>12.1f}{m[True]['stop_ms']:>10.1f}"
              f"{m[False]['move_ms']:>12.1f}{m[True]['move_ms']:>10.1f}{m[True]['itl_p50_ms']:>9.1f}")
    write_report(args.out, {"summary": summary, "runs": rows, "mismatches": bad})
    if bad:
        print(f"MISMATCH: migrated tokens differ from unmigrated in {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
