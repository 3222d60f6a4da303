"""L3 read time per page on a real Mooncake Store (CPU, TCP, 127.0.0.1) vs recomputing the page.

One master and two clients (a writer and a reader, as two workers); pages of SmolLM2-135M's
geometry by default (30 layers x K/V x 3 KV heads x 64 dims x 16 tokens, bf16: 360 KiB). Reports
the median seconds of batch is_exist over the chain, of one put and of one get (digest checked),
and the read bandwidth; recompute per page is page_size / --prefill-tok-s (the default is
docs/PERFORMANCE.md's measured 2-thread prefill rate; pass this machine's). A hit is worth
fetching when get < recompute.

    .venv/bin/python bench/l3_store.py --pages 64 --repeats 5
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bench_parser, write_report  # noqa: E402
from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402
from tandem.cache.tiers.l3.store import L3Store, key_prefix  # noqa: E402
from tandem.core.page_hash import page_hashes  # noqa: E402


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "l3_store", repeats=5)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--page-bytes", type=int, default=2 * 30 * 3 * 64 * 16 * 2)
    ap.add_argument("--prefill-tok-s", type=float, default=576.0)
    args = ap.parse_args(argv)
    master = mc.MasterProcess()
    try:
        seg = max(64 << 20, 2 * args.pages * args.page_bytes)
        w = L3Store(mc.connect(master.address, segment_bytes=seg, buffer_bytes=seg), key_prefix("b", 16, "bf16", "nhd"),
                    timeout_s=5)
        r = L3Store(mc.connect(master.address, segment_bytes=seg, buffer_bytes=seg), key_prefix("b", 16, "bf16", "nhd"),
                    timeout_s=5)
        rows = []
        for rep in range(args.repeats):
            hashes = page_hashes(list(range(rep * 10**6, rep * 10**6 + args.pages * args.page_size)), args.page_size)
            payload = os.urandom(args.page_bytes)
            t = time.perf_counter()
            assert all(w.put(h, payload) for h in hashes)
            put_s = (time.perf_counter() - t) / len(hashes)
            t = time.perf_counter()
            assert r.leading_hits(hashes) == len(hashes)
            exists_s = time.perf_counter() - t
            t = time.perf_counter()
            assert all(r.get(h) == payload for h in hashes)
            get_s = (time.perf_counter() - t) / len(hashes)
            rows.append({"put_s": put_s, "exists_chain_s": exists_s, "get_s": get_s})
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        recompute_s = args.page_size / args.prefill_tok_s
        out = {**vars(args), **med, "read_MBps": args.page_bytes / med["get_s"] / 1e6,
               "recompute_s": recompute_s, "get_vs_recompute": med["get_s"] / recompute_s}
        for k in ("put_s", "exists_chain_s", "get_s", "read_MBps", "recompute_s", "get_vs_recompute"):
            print(f"{k:>18}: {out[k]:.6g}")
        write_report(args.out, out)
        w.close()
        r.close()
    finally:
        master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
