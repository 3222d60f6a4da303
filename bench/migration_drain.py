"""Draining a decode worker by live migration vs waiting for its requests to finish.

On a 1 prefill + 2 decode cluster (SmolLM2, CPU, Ray): ``--streams`` greedy requests of one
session (session affinity puts them on one decode worker), ``--output-tokens`` each; once every
one has streamed ``--after`` tokens the worker is drained (``Migrator.drain``: every live request
moves to the other worker). Reported, medians over ``--repeats``: how long the drain took to
empty the worker (every request streaming on the other one, nothing left to copy), and how long the streams still ran after it began (what waiting for them would
have taken, at least). Every migrated text must equal its unmigrated run.

    .venv/bin/python -m tandem.bench.migration_drain [--streams 8] [--output-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from tandem.bench.common import bench_parser, write_report


def main(argv=None) -> int:
    import ray

    from tandem.cluster.launch import launch_disaggregated
    from tandem.core.config import CacheConfig, EngineConfig, MigrationConfig, ServeConfig
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams
    from tandem.engine.loader import load_model

    ap = bench_parser(__doc__, "migration_drain", repeats=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--after", type=int, default=8, help="tokens every stream has before the drain")
    args = ap.parse_args(argv)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    loaded = load_model("smollm2", device="cpu")
    engine = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=16, max_total_tokens=8192,
                                                                         max_running_requests=16))
    cfg = ServeConfig(prefill=1, decode=2, transfer_timeout_s=30.0, engine_config=engine,
                      migration=MigrationConfig(policy="off"))
    backend = launch_disaggregated(cfg, loaded=loaded)
    tok = backend.tokenizer
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    rows, bad = [], 0

    async def stream(greq, counts, texts):
        out = []
        async for c in backend.generate(greq):
            if c.error:
                raise RuntimeError(f"{greq.rid}: {c.error}")
            counts[greq.rid] = counts.get(greq.rid, 0) + len(c.token_ids)
            out.append(c.text)
        texts[greq.rid] = "".join(out)
        return time.perf_counter()

    async def one(r: int, drain: bool):
        reqs = [GenerateRequest(f"{'d' if drain else 'w'}{r}-{i}", tuple(tok.encode(tok.apply_chat_template(
                    [{"role": "user", "content": f"Story {i}: a lighthouse keeper's night."}]))), params,
                                session_id=f"drain-{r}-{drain}") for i in range(args.streams)]
        counts: dict[str, Any] = {}
        texts: dict[str, Any] = {}
        tasks = [asyncio.ensure_future(stream(g, counts, texts)) for g in reqs]
        while len(counts) < len(reqs) or min(counts.values()) < args.after:
            await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        took = None
        if drain:
            name = backend.inflight[reqs[0].rid].name
            res = await backend.migrator.drain(name)
            took = time.perf_counter() - t0
            if res["remaining"]:
                raise RuntimeError(f"drain left {res['remaining']}")
            await backend.migrator.undrain(name)
        ends = await asyncio.gather(*tasks)
        return took, max(ends) - t0, [texts[g.rid] for g in reqs]

    try:
        for r in range(args.repeats):
            _, wait_s, want = asyncio.run(one(r, False))
            took, rest, got = asyncio.run(one(r, True))
            bad += got != want
            rows.append({"drain_s": took, "streams_ran_on_s": rest, "waiting_s": wait_s})
            print(f"  run {r}: drain {took:.2f} s; the streams ran {rest:.2f} s more "
                  f"(unmigrated: {wait_s:.2f} s)", flush=True)
    finally:
        backend.close()
        ray.shutdown()
    m = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    print(f"drain {m['drain_s']:.2f} s vs waiting {m['waiting_s']:.2f} s for {args.streams} streams "
          f"({m['waiting_s'] / m['drain_s']:.1f}x)")
    write_report(args.out, {"summary": m, "runs": rows, "mismatches": bad})
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
