"""Session-aware vs LRU eviction on multi-turn sessions with a cache too small for everything.

Conversations are shaped like vLLM's multi-turn generator config
(workloads/vllm_generate_multi_turn.json): a 500-token prefix common to all, a
per-conversation prefix (lognormal, mean 1,000, max 5,000 tokens), 12-18 turns of 120-160 new
input tokens and 80-120 output tokens; between turns the user thinks for 20-90 s (an agent
waiting on a tool, a person reading). Simulated clock, simulated cache, page size 16.

Scenarios:
- ``background``: 24 conversations starting in the first minute, plus one-shot traffic with no
  session (2 requests/s of 500-1,500 unique tokens); 64k-token cache: room for the sessions'
  contexts, not for them plus the background.
- ``sessions_only``: 64 conversations starting over 15 minutes (so some end while others run),
  no background; 40k-token cache, below the live sessions' working set.

Each request matches its prompt (hit tokens counted), then inserts prompt + output (as the engine
caches a finished request), evicting to the capacity. ``session`` evicts entries of sessions not
seen within ``session_ttl_s`` (120 s) and session-less entries first, then LRU;
``session+end`` is the same policy told when a conversation ends (``policy.end_session``).
Writes bench/out/session_eviction.json.

    .venv/bin/python bench/session_eviction.py [--seeds 0 1 2]
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from typing import Any

from tandem.bench.common import bench_parser, write_report
from tandem.cache.radix.eviction import SessionPolicy
from tandem.cache.unified import UnifiedRadixCache

SCENARIOS: dict[str, dict[str, Any]] = {
    "background": {"conversations": 24, "start_window_s": 60, "background_rps": 2.0, "capacity": 64_000},
    "sessions_only": {"conversations": 64, "start_window_s": 900, "background_rps": 0.0, "capacity": 40_000},
}
PAGE = 16
TTL = 120.0


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def make_workload(seed: int, conversations: int, start_window_s: float, background_rps: float,
                  **_):
    """``(time, session_id or None, prompt, output, last turn?)`` tuples, in time order."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(1, 50_000) for _ in range(n)]
    common = tok(500)
    events: list[tuple[float, int, int | None]] = []   # (time, order, conversation or None)
    convs: list[dict[str, Any]] = []
    for c in range(conversations):
        mu = math.log(1000) - 0.5                  # lognormal with mean ~1,000 (sigma 1)
        prefix = tok(min(5000, int(rng.lognormvariate(mu, 1.0))))
        turns = [(tok(rng.randint(120, 160)), tok(rng.randint(80, 120)))
                 for _ in range(rng.randint(12, 18))]
        convs.append({"id": f"conv{c}", "context": common + prefix, "turns": turns})
        heapq.heappush(events, (rng.uniform(0, start_window_s), len(events), c))
    t = 0.0
    while background_rps and t < 2000:
        t += rng.expovariate(background_rps)
        heapq.heappush(events, (t, len(events), None))
    out: list[tuple[float, str | None, list[int], list[int], bool]] = []
    while events:
        t, _order, ci = heapq.heappop(events)
        if ci is None:
            if any(cv["turns"] for cv in convs):   # background only while sessions run
                out.append((t, None, tok(rng.randint(500, 1500)), [], True))
            continue
        cv = convs[ci]
        new_in, reply = cv["turns"].pop(0)
        prompt = cv["context"] + new_in
        cv["context"] = prompt + reply
        out.append((t, cv["id"], prompt, reply, not cv["turns"]))
        if cv["turns"]:
            heapq.heappush(events, (t + rng.uniform(20, 90), len(events) + 10_000_000, ci))
    return out


def replay(workload, policy: str, capacity: int) -> dict[str, float]:
    """``policy`` is an eviction policy name; ``session+end`` is ``session`` told explicitly
    (``policy.end_session``) when a conversation's last turn is done."""
    clock = Clock()
    explicit_end = policy == "session+end"
    policy = "session" if explicit_end else policy
    cache = UnifiedRadixCache.simulated(page_size=PAGE, capacity_tokens=capacity, eviction=policy,
                                        session_ttl_s=TTL, clock=clock)
    stats = {"session": [0, 0], "session_after_first": [0, 0], "background": [0, 0]}
    seen = set()
    for t, sid, prompt, reply, last in workload:
        clock.t = t
        hit = cache.match(prompt, session_id=sid).prefix_len
        cache.insert(prompt + reply, session_id=sid)
        if explicit_end and last and sid is not None and isinstance(cache.policy, SessionPolicy):
            cache.policy.end_session(sid)
        kinds = ["background"] if sid is None else ["session"] + (["session_after_first"] if sid in seen else [])
        for k in kinds:
            stats[k][0] += hit
            stats[k][1] += len(prompt)
        seen.add(sid)
    return {k: h / n if n else 0.0 for k, (h, n) in stats.items()}


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, "session_eviction")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policies", nargs="+", default=["lru", "session", "session+end", "lfu", "slru"])
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"page_size": PAGE, "session_ttl_s": TTL, "seeds": args.seeds, "scenarios": {}}
    for name, sc in SCENARIOS.items():
        rows: dict[str, list[dict[str, float]]] = {p: [] for p in args.policies}
        for seed in args.seeds:
            wl = make_workload(seed, **sc)
            for p in args.policies:
                rows[p].append(replay(wl, p, sc["capacity"]))
        print(f"\n{name}: {sc}, page {PAGE}, session TTL {TTL:.0f} s, seeds {args.seeds}")
        print(f"{'policy':>11} {'session hit':>12} {'turns 2+ hit':>13} {'background hit':>15}")
        summary: dict[str, dict[str, Any]] = {}
        for p, rs in rows.items():
            mean = {k: statistics.fmean(r[k] for r in rs) for k in rs[0]}
            summary[p] = {"mean": mean, "per_seed": rs}
            print(f"{p:>11} {mean['session']:>12.4f} {mean['session_after_first']:>13.4f} "
                  f"{mean['background']:>15.4f}")
        if "lru" in summary and "session" in summary:
            gain = (summary["session"]["mean"]["session_after_first"]
                    - summary["lru"]["mean"]["session_after_first"])
            print(f"session-aware vs LRU, hit rate on turns 2+: {100 * gain:+.1f} points")
        result["scenarios"][name] = {"config": sc, "policies": summary}
    write_report(args.out, result, indent=2)
    return result


if __name__ == "__main__":
    main()
