"""What ``--kv-digest`` costs per transferred MB, against the transfer it protects, in one run.

A prefill worker and a decode worker in one process (real engines, SmolLM2 fp32 on the CPU, real
NIXL over UCX, page size 16, decode with ``kv_digest=True``) serve prompts of each ``--sizes``
length (one request at a time, each prompt new so the whole prompt moves). For every request:
the NIXL write's time (post -> DONE, the prefill worker's ``transfer_s``) and bytes, and the
digest of the same pages timed on each side (BLAKE2b over the gathered K/V of every layer:
worker/kv_digest.py). Medians over ``--repeats``; the figure is digest seconds per MB and the
digest's share of (transfer + digests).

Usage: python bench/kv_digest.py [--sizes 256,1024,2048] [--repeats 5] [--threads 1]
           [--out bench/out/kv_digest.json]
"""

from __future__ import annotations

import asyncio
import time

from tandem.bench.common import bench_parser, medians, write_report


async def _run(sizes: list[int], repeats: int, threads: int) -> list[dict]:
    import torch

    from tandem.core.config import CacheConfig, EngineConfig
    from tandem.core.types import SamplingParams
    from tandem.decode.worker import DecodeWorker
    from tandem.worker.kv_digest import page_digest
    from tandem.engine.loader import load_model
    from tandem.prefill.worker import PrefillWorker

    loaded = load_model("smollm2", device="cpu", dtype="float32")
    cfg = EngineConfig(device="cpu", dtype="float32", num_threads=threads,
                       cache=CacheConfig(page_size=16, max_total_tokens=max(sizes) * 4, host_pool_tokens=0,
                                         disable_prefix_cache=True))
    p = PrefillWorker("bench-prefill", cfg, loaded=loaded, transfer_timeout_s=120)
    d = DecodeWorker("bench-decode", cfg, loaded=loaded, transfer_timeout_s=120, kv_digest=True)
    p.add_peer(d.handshake())
    d.add_peer(p.handshake())

    class Client:
        name = p.name

        async def prefill(self, req_wire, xfer, start):
            return await p.prefill(req_wire, xfer, start)

        async def abort(self, rid, reason):
            await p.abort(rid, reason)

    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for n in sizes:
            samples = []
            for r in range(repeats):
                ids = torch.randint(100, loaded.arch.vocab_size - 100, (n,), generator=g).tolist()
                greq = d.engine.make_request(ids, SamplingParams(max_tokens=1), rid=f"d{n}-{r}")
                async for _ in d.generate(greq, Client()):
                    pass
                t = d.last_timings
                pages = tuple(range(1, -(-n // 16) + 1))          # the same number of pages
                kv = d.engine.kv_pool.kv_data
                t0 = time.perf_counter()
                page_digest(kv, pages, 16)
                one = time.perf_counter() - t0
                samples.append({"bytes": t["bytes"], "transfer_s": t["transfer_s"], "digest_s": one})
            med = medians(samples, ("bytes", "transfer_s", "digest_s"))
            mb = med["bytes"] / 2**20
            rows.append({"prompt_tokens": n, "mb": mb, "transfer_ms": med["transfer_s"] * 1e3,
                         "digest_ms_per_side": med["digest_s"] * 1e3,
                         "digest_ms_per_mb": med["digest_s"] * 1e3 / mb,
                         "digest_share": 2 * med["digest_s"] / (med["transfer_s"] + 2 * med["digest_s"]),
                         "samples": samples})
    finally:
        p.close()
        d.close()
    return rows


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "kv_digest", repeats=5, threads=1)
    ap.add_argument("--sizes", default="256,1024,2048")
    a = ap.parse_args(argv)
    rows = asyncio.run(_run([int(x) for x in a.sizes.split(",")], a.repeats, a.threads))
    write_report(a.out, rows)
    print(f"{'prompt':>7} {'MB':>7} {'transfer ms':>12} {'digest ms/side':>15} {'ms per MB':>10} {'share':>7}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['mb']:>7.1f} {r['transfer_ms']:>12.2f} {r['digest_ms_per_side']:>15.2f} "
              f"{r['digest_ms_per_mb']:>10.3f} {r['digest_share']:>7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
