"""Tandem's radix tree vs SGLang's Python RadixCache on the Mooncake synthetic trace.

Each trace hash id becomes 16 deterministic tokens (seeded by the id), so requests sharing a
hash-id prefix share that token prefix. Per request, both caches do: match the prompt, insert
it, evict down to the capacity (160k tokens). We compare hit rates (matched / prompt tokens)
and the time of those three calls per request (median over requests and rounds).

    .venv/bin/python bench/radix_vs_sglang.py [--rounds 3] [--page-sizes 1 16] [--limit N]

SGLang: ``pip install --no-deps sglang msgspec``. Only ``sglang.srt.mem_cache.radix_cache`` is
imported. ``sglang/__init__.py`` (which pulls in the whole runtime) is skipped by registering
the ``sglang`` and ``sglang.srt`` packages by path, and four modules the import chain touches but
the radix tree never uses are stubbed in ``sys.modules``: ``orjson``, ``pybase64``,
``sglang.srt.mem_cache.memory_pool`` (only type names are imported) and
``sglang.srt.observability.metrics_collector`` (metrics are off). ``msgspec`` is installed
(kv_events defines msgspec.Struct classes at import time).

Fairness: SGLang gets its native inputs built outside the timed region (``array('q')`` token ids
and a value tensor per request); Tandem gets a Python list and converts it inside. Tandem runs in
simulated mode (values are token-position ranges). Writes bench/out/radix_vs_sglang.json.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time
import types
from array import array
from pathlib import Path
from typing import Any

import torch

from tandem.bench.common import bench_parser, write_report
from tandem.workloads import MOONCAKE_SYNTHETIC

TRACE = MOONCAKE_SYNTHETIC
TOKENS_PER_HASH = 16
CAPACITY = 160_000


def load_requests(limit: int | None = None) -> list[list[int]]:
    blocks: dict[int, list[int]] = {}
    reqs = []
    with open(TRACE) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            toks: list[int] = []
            for h in ids:
                b = blocks.get(h)
                if b is None:
                    rng = random.Random(h)
                    b = blocks[h] = [rng.randrange(32000) for _ in range(TOKENS_PER_HASH)]
                toks += b
            reqs.append(toks)
            if limit and len(reqs) >= limit:
                break
    return reqs


def import_sglang():
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise SystemExit("sglang is not installed: .venv/bin/pip install --no-deps sglang msgspec")
    base = Path(spec.submodule_search_locations[0])
    for name, path in (("sglang", base), ("sglang.srt", base / "srt")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules.setdefault(name, mod)

    def stub(name):
        mod = types.ModuleType(name)

        def getattr_(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})           # a placeholder class for `from m import Name`
        mod.__getattr__ = getattr_
        sys.modules.setdefault(name, mod)

    for name in ("orjson", "pybase64", "sglang.srt.mem_cache.memory_pool",
                 "sglang.srt.observability.metrics_collector"):
        stub(name)
    from sglang.srt.mem_cache import radix_cache
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    return radix_cache, EvictParams, InsertParams, MatchPrefixParams


class _NullAllocator:
    """SGLang's evict() frees through the allocator; in simulation nothing is freed."""

    device = torch.device("cpu")

    def free_segment(self, *_args, **_kw):
        pass

    def free(self, *_args, **_kw):
        pass


def run_tandem(reqs, page_size):
    from tandem.cache.unified import UnifiedRadixCache

    cache = UnifiedRadixCache.simulated(page_size=page_size)
    hits = total = 0
    times = []
    pc = time.perf_counter_ns
    for toks in reqs:
        t0 = pc()
        m = cache.match(toks).prefix_len
        cache.insert(toks)
        over = cache.stats().device - CAPACITY
        if over > 0:
            cache.evict(over)
        times.append(pc() - t0)
        hits += m
        total += len(toks)
    return hits / total, times, cache.stats().device


def run_sglang(reqs, page_size, sgl):
    radix_cache, EvictParams, InsertParams, MatchPrefixParams = sgl
    RadixKey = radix_cache.RadixKey
    cache = radix_cache.RadixCache.create_simulated(mock_allocator=_NullAllocator(), page_size=page_size)
    inputs = [(array("q", t), torch.arange(len(t), dtype=torch.int64)) for t in reqs]
    hits = total = 0
    times = []
    pc = time.perf_counter_ns
    for (arr, value), toks in zip(inputs, reqs):
        t0 = pc()
        r = cache.match_prefix(MatchPrefixParams(key=RadixKey(arr)))
        cache.insert(InsertParams(key=RadixKey(arr), value=value))
        over = cache.evictable_size() + cache.protected_size() - CAPACITY
        if over > 0:
            cache.evict(EvictParams(num_tokens=over))
        times.append(pc() - t0)
        hits += r.device_prefix_len
        total += len(toks)
    return hits / total, times, cache.evictable_size() + cache.protected_size()


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, "radix_vs_sglang")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    args = ap.parse_args(argv)

    reqs = load_requests(args.limit)
    sgl = import_sglang()
    results = {"trace": str(TRACE.name), "requests": len(reqs), "tokens_per_hash": TOKENS_PER_HASH,
               "capacity_tokens": CAPACITY, "rounds": args.rounds, "policy": "lru", "runs": []}
    print(f"{len(reqs)} requests, {sum(map(len, reqs))} prompt tokens, capacity {CAPACITY}")
    print(f"{'page':>4} {'impl':>7} {'hit rate':>9} {'median us':>10} {'mean us':>8} "
          f"{'p90 us':>7} {'total s':>8}")
    for ps in args.page_sizes:
        per: dict[str, list[Any]] = {"tandem": [], "sglang": []}
        rates = {}
        for _ in range(args.rounds):
            for name in ("tandem", "sglang"):   # alternate, so machine noise hits both
                gc.collect()
                gc.disable()
                try:
                    rate, times, _size = (run_tandem(reqs, ps) if name == "tandem"
                                          else run_sglang(reqs, ps, sgl))
                finally:
                    gc.enable()
                rates[name] = rate
                per[name].append(times)
        row = {"page_size": ps}
        for name in ("tandem", "sglang"):
            flat = [t / 1000 for times in per[name] for t in times]
            flat.sort()
            stats = {"hit_rate": rates[name], "median_us": statistics.median(flat),
                     "mean_us": statistics.fmean(flat), "p90_us": flat[int(0.9 * len(flat))],
                     "total_s_per_round": statistics.median(sum(t) / 1e9 for t in per[name])}
            row[name] = stats
            print(f"{ps:>4} {name:>7} {stats['hit_rate']:>9.4f} {stats['median_us']:>10.1f} "
                  f"{stats['mean_us']:>8.1f} {stats['p90_us']:>7.1f} {stats['total_s_per_round']:>8.3f}")
        row["hit_rate_diff_points"] = 100 * abs(row["tandem"]["hit_rate"] - row["sglang"]["hit_rate"])
        row["median_ratio"] = row["tandem"]["median_us"] / row["sglang"]["median_us"]
        row["total_ratio"] = row["tandem"]["total_s_per_round"] / row["sglang"]["total_s_per_round"]
        print(f"     hit-rate gap {row['hit_rate_diff_points']:.3f} points; Tandem/SGLang time: "
              f"median {row['median_ratio']:.3f}, total {row['total_ratio']:.3f}")
        results["runs"].append(row)
    write_report(args.out, results, indent=2)
    return results


if __name__ == "__main__":
    main()
