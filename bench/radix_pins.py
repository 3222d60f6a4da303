"""The cost of pins (issue 52): the radix bench's replay with 10,000 pinned prefixes in the tree
vs none.

The Mooncake synthetic trace as bench/radix_vs_sglang.py replays it (16 deterministic tokens per
hash id; per request: match the prompt, insert it, evict down to the capacity), on a simulated
cache, page size 1 and 16. ``pinned``: before the replay, ``--pins`` distinct 16-token prefixes
are inserted and pinned for an hour (the clock stands still, so none expires), and the capacity
grows by their tokens, so the trace works in the same room as ``none``. Admission (match +
insert) and eviction (the evict call, when one is needed) are timed apart, per request, median
over requests and rounds. The eviction pass sees the pinned leaves only in their own heap, so
the goal is both within 10% of ``none``.

    .venv/bin/python bench/radix_pins.py [--rounds 3] [--pins 10000] [--page-sizes 1 16] [--limit N]

Writes bench/out/radix_pins.json.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any

from tandem.bench.common import bench_parser, write_report
from tandem.bench.radix_vs_sglang import CAPACITY, load_requests

PIN_TOKENS = 16


def run(reqs: list[list[int]], page_size: int, pins: int) -> dict:
    from tandem.cache.unified import UnifiedRadixCache

    cache = UnifiedRadixCache.simulated(page_size=page_size, clock=lambda: 0.0)
    rng = random.Random(52)
    for _ in range(pins):       # vocabulary 32000..64000: never a trace prefix
        ids = [rng.randrange(32000, 64000) for _ in range(PIN_TOKENS)]
        cache.insert(ids)
        cache.pin(cache.match(ids).last_device_node, PIN_TOKENS, 3600.0, cap=1 << 40)
    capacity = CAPACITY + cache.stats().device     # pinned prefixes may share their first tokens
    admit, evict = [], []
    pc = time.perf_counter_ns
    hits = total = 0
    for toks in reqs:
        t0 = pc()
        m = cache.match(toks).prefix_len
        cache.insert(toks)
        t1 = pc()
        over = cache.stats().device - capacity
        if over > 0:
            cache.evict(over)
            evict.append(pc() - t1)
        admit.append(t1 - t0)
        hits += m
        total += len(toks)
    assert sum(p["tokens"] for p in cache.pins()) == pins * PIN_TOKENS, "a pinned prefix was evicted"
    return {"hit_rate": hits / total, "admit": admit, "evict": evict}


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, "radix_pins")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pins", type=int, default=10_000)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    args = ap.parse_args(argv)
    reqs = load_requests(args.limit)
    out = {"requests": len(reqs), "pins": args.pins, "pin_tokens": PIN_TOKENS, "capacity_tokens": CAPACITY,
           "rounds": args.rounds, "runs": []}
    print(f"{len(reqs)} requests, {args.pins} pinned prefixes of {PIN_TOKENS} tokens")
    print(f"{'page':>4} {'pins':>6} {'hit rate':>9} {'admit us':>9} {'evict us':>9} {'evictions':>9}")
    for ps in args.page_sizes:
        row = {"page_size": ps}
        modes = (("none", 0), ("pinned", args.pins))
        got: dict[str, dict[str, Any]] = {name: {"admit": [], "evict": [], "hit_rate": 0.0} for name, _ in modes}
        for _ in range(args.rounds):
            for name, n in modes:       # alternate, so machine noise hits both
                gc.collect()
                gc.disable()
                try:
                    r = run(reqs, ps, n)
                finally:
                    gc.enable()
                got[name]["admit"] += r["admit"]
                got[name]["evict"] += r["evict"]
                got[name]["hit_rate"] = r["hit_rate"]
        for name, n in modes:
            g = got[name]
            row[name] = {"hit_rate": g["hit_rate"], "admit_median_us": statistics.median(g["admit"]) / 1000,
                         "evict_median_us": statistics.median(g["evict"]) / 1000 if g["evict"] else 0.0,
                         "evictions": len(g["evict"]) // args.rounds}
            s, rate = row[name], g["hit_rate"]
            print(f"{ps:>4} {n:>6} {rate:>9.4f} {s['admit_median_us']:>9.2f} {s['evict_median_us']:>9.2f} "
                  f"{s['evictions']:>9}")
        for k in ("admit_median_us", "evict_median_us"):
            row[k.replace("median_us", "ratio")] = row["pinned"][k] / row["none"][k] if row["none"][k] else None
        print(f"     pinned/none: admission {row['admit_ratio']:.3f}, eviction {row['evict_ratio']:.3f}")
        out["runs"].append(row)
    write_report(args.out, out, indent=2)
    return out


if __name__ == "__main__":
    main()
