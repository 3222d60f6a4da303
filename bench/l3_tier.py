"""The shared L3 tier on a multi-turn workload: hit rate and TTFT with L3 vs without, 2 workers.

Two engines (SmolLM2, CPU) stand for two prefill workers; a real ``mooncake_master`` on 127.0.0.1
(TCP) is the store. ``--sessions`` conversations of ``--turns`` turns, each with its own
``--system-words`` system prompt; turn t of session s goes to worker (s + t) % 2 (a router
without session affinity, or a worker scaled in), so a session's previous turn is always on the
other worker. Each worker's device pool is ``--pool-tokens`` (no host tier): the working set of
all sessions exceeds it. Assistant replies are canned (the same text in both modes), so both
modes see identical prompts; each request generates 1 token, so its latency is its TTFT.
Then a fresh worker (a replacement, cold device cache) replays every session's last turn: its
warm-up with and without L3. ``--route affinity`` keeps each session on one worker (with a pool
that holds them: what L3 costs when the device cache alone hits). Modes alternate ABAB over ``--repeats`` (a new master each time).
``--storage-bytes N``: a storage process beside the master lends the store N bytes and the
workers lend none (what ``--kv-store mooncake`` runs); else each worker lends 512 MiB.
``--writers-gone``: the two workers close their store clients before the fresh worker starts
(a cluster whose workers were all replaced).

    .venv/bin/python bench/l3_tier.py --sessions 8 --turns 4 --repeats 2
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bench_parser, write_report  # noqa: E402
from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402
from tandem.cache.tiers.l3.connect import attach_store, l3_options  # noqa: E402
from tandem.core.config import CacheConfig, EngineConfig  # noqa: E402
from tandem.core.types import SamplingParams  # noqa: E402
from tandem.engine.engine import Engine  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402


def prompts(tok, sessions: int, turns: int, words: int) -> list[list[list[int]]]:
    """prompts[t][s]: the token ids of session s's turn t (whole history so far)."""
    out = []
    hist = [[{"role": "system", "content": f"Session {s}. " + " ".join(f"rule{s}_{i}" for i in range(words))}]
            for s in range(sessions)]
    for t in range(turns):
        row = []
        for s in range(sessions):
            hist[s].append({"role": "user", "content": f"Question {t} of session {s}: what next?"})
            row.append(tok.encode(tok.apply_chat_template(hist[s])))
            hist[s].append({"role": "assistant", "content": f"Answer {t}: keep going with step {t + 1}."})
        out.append(row)
    return out


def make(loaded, args, master):
    cc = CacheConfig(page_size=args.page_size, max_total_tokens=args.pool_tokens, host_pool_tokens=0)
    e = Engine(EngineConfig(device="cpu", num_threads=args.threads, cache=cc), loaded=loaded)
    if master is not None:
        opts = l3_options(master.address.url(), timeout_s=2.0, segment_bytes=0 if args.storage_bytes else 512 << 20)
        assert attach_store(e.kv.cache, e.kv_pool, e.model_name, **opts)
    return e


def ask(e, ids) -> tuple[float, int]:
    t0 = time.perf_counter()
    c = e.generate(ids, SamplingParams(max_tokens=1))
    assert c.error is None
    return time.perf_counter() - t0, c.cached_tokens


def one_run(loaded, args, with_l3: bool) -> dict:
    master = mc.LocalStore(args.storage_bytes) if with_l3 else None
    workers = [make(loaded, args, master) for _ in range(2)]
    try:
        turns = prompts(workers[0].tokenizer, args.sessions, args.turns, args.system_words)
        ttft, cached, total = [], 0, 0
        for t, row in enumerate(turns):
            for s, ids in enumerate(row):
                e = workers[(s + t) % 2 if args.route == "alternate" else s % 2]
                dt, c = ask(e, ids)
                if e.kv.cache.tier("l3") is not None:
                    e.kv.cache.tier("l3").store.flush(10.0)
                if t:                                    # the first turn is cold in both modes
                    ttft.append(dt)
                    cached += c
                    total += len(ids)
        l3 = [w.kv.cache.tier("l3").as_dict() for w in workers if w.kv.cache.tier("l3") is not None]
        if args.writers_gone:
            for w in workers:
                if w.kv.cache.tier("l3") is not None:
                    w.kv.cache.tier("l3").store.close()
        fresh = make(loaded, args, master)
        try:
            warm = [ask(fresh, ids) for ids in turns[-1]]
        finally:
            fresh.shutdown()
        return {"l3": with_l3, "hit_rate": cached / total, "ttft_median_s": statistics.median(ttft),
                "ttft_mean_s": statistics.fmean(ttft),
                "warmup_hit_rate": sum(c for _, c in warm) / sum(len(x) for x in turns[-1]),
                "warmup_ttft_median_s": statistics.median(dt for dt, _ in warm),
                "l3_stats": l3}
    finally:
        for w in workers:
            w.shutdown()
        if master is not None:
            master.stop()


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "l3_tier", repeats=2, threads=1, full_doc=True)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=120)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=1024)
    ap.add_argument("--route", choices=["alternate", "affinity"], default="alternate",
                    help="alternate: turn t of session s on worker (s + t) %% 2; affinity: on s %% 2")
    ap.add_argument("--storage-bytes", type=int, default=0,
                    help="a storage process lends the store this much; the workers lend none (0: they lend)")
    ap.add_argument("--writers-gone", action="store_true",
                    help="the workers close their store clients before the fresh worker starts")
    args = ap.parse_args(argv)
    loaded = load_model("smollm2", device="cpu")
    runs = []
    for _ in range(args.repeats):
        for with_l3 in (False, True):
            r = one_run(loaded, args, with_l3)
            runs.append(r)
            print(f"l3={with_l3!s:5} hit {r['hit_rate']:.3f} ttft med {r['ttft_median_s'] * 1e3:.0f} ms | "
                  f"new worker: hit {r['warmup_hit_rate']:.3f} ttft med {r['warmup_ttft_median_s'] * 1e3:.0f} ms",
                  flush=True)
    summary = {}
    for mode in (False, True):
        rs = [r for r in runs if r["l3"] == mode]
        summary["with_l3" if mode else "without_l3"] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("hit_rate", "ttft_median_s", "warmup_hit_rate", "warmup_ttft_median_s")}
    print(summary)
    write_report(args.out, {"args": {k: v for k, v in vars(args).items() if k != "out"},
                            "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
