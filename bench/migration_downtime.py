"""A live migration's stop (downtime) against context length, with and without pre-copy.

On a 1 prefill + 2 decode cluster (SmolLM2, CPU, Ray): one greedy request of ``L`` prompt tokens
(random ids, a fresh prompt per run so neither decode worker has it cached) decodes; after
``--after`` tokens the router moves it to the other decode worker. With pre-copy the target
first takes the prompt's and the generated tokens' KV into its cache (the prefill worker, whose
cache holds the prompt, computes the generated part) while the source keeps decoding, and the
stop copies only the generated tail since; without it, the stop copies the whole context.
``--generated G1,G2,..`` compares instead the prompt-only pre-copy (``precopy_generated`` off:
the stop copies every generated token) with the generated one, the move after ``G`` tokens and
``--tail`` (at least ``1.5 G``) more after it. Reported per row, medians over ``--repeats`` (the two modes
alternating): the stop as the router measures it (``tandem_decode_migration_downtime_seconds``:
the last token on the source to the first on the target), the KV bytes the stop copied
(``tandem_decode_migration_bytes_total``), the pre-copy (the move asked to the request frozen on
its source: ``migrate`` returned), the whole move (asked to the first token after the client's
largest inter-token gap: the stop, unless the source stalled longer while it decoded on), that
largest gap, and the median inter-token gap (one decode step at
that context: the stop includes one). Every run's tokens must equal the same prompt's unmigrated
run (run after the migrated one: its cache holds nothing the move could use); a mismatch fails
the bench.

    .venv/bin/python -m tandem.bench.migration_downtime [--lengths 256,1024,2048,4096] [--repeats 3]
    .venv/bin/python -m tandem.bench.migration_downtime --lengths 1024 --generated 8,256,1024 --repeats 2
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from tandem.bench.common import bench_parser, write_report


async def _one(backend, greq, move_after: int | None) -> tuple[list[int], list[float], float, float]:
    """The request's tokens, its token stamps, when the move was asked and when the router's
    ``migrate`` returned (the pre-copy and the freeze done; both 0 without a move)."""
    ids, stamps, asked, task, frozen = [], [], 0.0, None, [0.0]
    async for c in backend.generate(greq):
        if c.error:
            raise RuntimeError(f"{greq.rid} failed: {c.error}")
        ids += c.token_ids
        stamps += [time.perf_counter()] * len(c.token_ids)
        if move_after is not None and task is None and len(ids) >= move_after:
            asked = time.perf_counter()
            task = asyncio.ensure_future(backend.migrate(greq.rid))
            task.add_done_callback(lambda _: frozen.__setitem__(0, time.perf_counter()))
    if task is not None:
        await task
    return ids, stamps, asked, frozen[0]


def _downtime_sum() -> tuple[float, float]:
    from prometheus_client import REGISTRY

    s = REGISTRY.get_sample_value("tandem_decode_migration_downtime_seconds_sum") or 0.0
    n = REGISTRY.get_sample_value("tandem_decode_migration_downtime_seconds_count") or 0.0
    return s, n


def _worker_sums(backend) -> dict[str, float]:
    """The decode workers' migration bytes and reused tokens, summed (their /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {"tandem_decode_migration_bytes_total": "bytes", "tandem_decode_migration_reused_tokens_total": "reused"}
    out = dict.fromkeys(want.values(), 0.0)
    for f in text_string_to_metric_families(backend.metrics_text().decode()):
        for smp in f.samples:
            if smp.name in want:
                out[want[smp.name]] += smp.value
    return out


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
    ap.add_argument("--generated", default="", help="comma list of tokens generated before the move: "
                    "compare the prompt-only pre-copy with the pre-copy of the generated tokens too "
                    "(instead of whole copy vs pre-copy after --after tokens)")
    ap.add_argument("--tail", type=int, default=256, help="with --generated: tokens decoded after the move, "
                    "at least 1.5 G (the pre-copy computes the G generated tokens: it must end before the request)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.generated:   # (label, moved after, output tokens, pre-copy, of the generated tokens too)
        gens = [int(x) for x in args.generated.split(",")]
        modes = ("prompt", "generated")
        cases = [(g, g + max(args.tail, 3 * g // 2)) for g in gens]
        conf = {"prompt": (True, False), "generated": (True, True)}
    else:
        modes = ("whole", "pre")
        cases = [(args.after, args.output_tokens)]
        conf = {"whole": (False, True), "pre": (True, True)}
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    loaded = load_model("smollm2", device="cpu")
    tokens = (max(lengths) + max(out for _, out in cases)) * 2 + 1024
    engine = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(
        page_size=16, max_total_tokens=tokens, max_running_requests=8))
    cfg = ServeConfig(prefill=1, decode=2, transfer_timeout_s=60.0, engine_config=engine,
                      migration=MigrationConfig(policy="off", precopy_min_tokens=0, precopy_timeout_s=60.0))
    backend = launch_disaggregated(cfg, loaded=loaded)
    rng = random.Random(args.seed)
    vocab = backend.vocab_size
    rows: list[dict[str, Any]] = []
    bad: list[Any] = []
    try:
        for n in lengths:
            for after, out_tokens in cases:
                params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
                for r in range(args.repeats):
                    for mode in (modes if r % 2 == 0 else modes[::-1]):
                        precopy, generated = conf[mode]
                        backend.migrator.cfg = MigrationConfig(policy="off", precopy=precopy, precopy_min_tokens=0,
                                                               precopy_generated=generated, precopy_timeout_s=60.0)
                        prompt = tuple(rng.randrange(100, vocab) for _ in range(n))
                        tag = f"{n}-{after}-{r}-{mode}"
                        s0, c0 = _downtime_sum()
                        w0, r0 = _worker_sums(backend), dict(backend.migrator.counts)
                        ids, stamps, asked, frozen = asyncio.run(_one(backend, GenerateRequest(f"mig-{tag}", prompt,
                                                                                               params), after))
                        s1, c1 = _downtime_sum()
                        w1 = _worker_sums(backend)
                        ref, _, _, _ = asyncio.run(_one(backend, GenerateRequest(f"ref-{tag}", prompt, params), None))
                        if ids != ref:
                            bad.append(tag)
                        if c1 - c0 != 1:
                            raise RuntimeError(f"{tag}: {c1 - c0:.0f} migrations recorded, not 1")
                        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                        stop_end = stamps[gaps.index(max(gaps)) + 1]   # the first token after the longest gap
                        rows.append({"tokens": n, "after": after, "mode": mode, "stop_ms": 1e3 * (s1 - s0),
                                     "stop_mb": (w1["bytes"] - w0["bytes"]) / 1e6,
                                     "reused_tokens": w1["reused"] - w0["reused"],
                                     "precopy_rounds": backend.migrator.counts["precopy_rounds"] - r0["precopy_rounds"],
                                     "move_ms": 1e3 * (stop_end - asked), "precopy_ms": 1e3 * (frozen - asked),
                                     "max_gap_ms": 1e3 * max(gaps),
                                     "itl_p50_ms": 1e3 * statistics.median(gaps)})
                        x = rows[-1]
                        print(f"  L={n:>5} after {after:>5} {mode:<9} stop {x['stop_ms']:7.1f} ms  "
                              f"copied {x['stop_mb']:6.1f} MB  reused {x['reused_tokens']:6.0f}  "
                              f"rounds {x['precopy_rounds']}  pre-copy {x['precopy_ms']:7.1f} ms  "
                              f"max gap {x['max_gap_ms']:6.1f} ms", flush=True)
    finally:
        backend.close()
        ray.shutdown()
    summary = []
    a, b = modes
    print(f"{'tokens':>7}{'after':>7}{'stop ' + a:>16}{'stop ' + b:>16}{'MB ' + a:>14}{'MB ' + b:>14}"
          f"{'pre-copy ' + a:>20}{'pre-copy ' + b:>20}{'max gap ' + a:>20}{'max gap ' + b:>20}{'ITL p50':>9}")
    for n in lengths:
        for after, _ in cases:
            m = {p: {k: statistics.median(x[k] for x in rows if x["tokens"] == n and x["after"] == after
                                          and x["mode"] == p)
                     for k in ("stop_ms", "stop_mb", "reused_tokens", "precopy_ms", "move_ms", "max_gap_ms",
                               "itl_p50_ms")}
                 for p in modes}
            summary.append({"tokens": n, "after": after, **m})
            print(f"{n:>7}{after:>7}{m[a]['stop_ms']:>16.1f}{m[b]['stop_ms']:>16.1f}{m[a]['stop_mb']:>14.1f}"
                  f"{m[b]['stop_mb']:>14.1f}{m[a]['precopy_ms']:>20.1f}{m[b]['precopy_ms']:>20.1f}"
                  f"{m[a]['max_gap_ms']:>20.1f}{m[b]['max_gap_ms']:>20.1f}{m[b]['itl_p50_ms']:>9.1f}")
    write_report(args.out, {"summary": summary, "runs": rows, "mismatches": bad})
    if bad:
        print(f"MISMATCH: migrated tokens differ from unmigrated in {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
