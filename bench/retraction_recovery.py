"""Does decode throughput come back after a retraction storm? (sglang#26248: it falls ~14x, forever.)

One engine (SmolLM2 on the CPU, page size 16, a device KV pool that holds the steady load with
room to spare) under a closed loop of ``--concurrency`` requests (each finished one is replaced at
once; 64-token prompts, 0.5-1.5x ``--out-tokens`` output tokens (random, so requests do not
finish in lockstep), EOS ignored). Three phases:

1. **before**: the steady load alone for ``--phase-s`` seconds;
2. **storm**: ``--storm`` extra requests arrive at once, far more KV than the pool holds, so the
   decode batch retracts request after request (backed up to the host pool, or recomputed with
   ``--host-pool-tokens 0``) until the storm's requests are done;
3. **after**: the steady load alone again for ``--phase-s`` seconds.

Throughput is output tokens per second of the steady requests and the storm's together, from the
engine's stream callbacks: a phase's figure is its tokens over its duration (the first seconds of
"before", while the batch fills, are left out); the timeline plot shows 1-second windows. On a
shared machine wall-clock rates drift with the neighbours' load, so each phase also reports
**tokens per model step** (generated tokens / forward steps, from the scheduler's counters): the
decode batch's occupancy, which is what collapses when a system never recovers (requests stuck
retracted or not admitted), and which does not depend on how fast the CPU is at that moment
(speculative decoding is off here: accepted drafts would count as occupancy). The figure that matters is ``after / before`` (the issue's bar: >= 0.9). Both host-pool
settings run in the same process, alternated (ABAB with ``--repeats 2``), and the run writes
``bench/out/retraction_recovery.json`` and a timeline plot ``bench/out/retraction_recovery.png``.

Usage: python bench/retraction_recovery.py [--threads 1] [--concurrency 8] [--storm 24]
           [--phase-s 15] [--out-tokens 64] [--repeats 1] [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def run_once(loaded, *, host_pool_tokens: int, concurrency: int, storm: int, phase_s: float,
             out_tokens: int, threads: int, seed: int = 0, log=print) -> dict:
    import torch

    from tandem.core.config import CacheConfig, EngineConfig
    from tandem.core.types import SamplingParams
    from tandem.engine.engine import Engine

    page = 16
    per_req = -(-(64 + out_tokens * 3 // 2) // page) * page
    pool = (concurrency + 2) * per_req + 4 * page           # the steady load fits with room left
    # speculation off: tokens per step must count the batch's occupancy, not accepted drafts
    e = Engine(EngineConfig(device="cpu", dtype="float32", num_threads=threads, speculative_algorithm="off",
                            cache=CacheConfig(page_size=page, max_total_tokens=pool,
                                              max_running_requests=concurrency + storm + 4,
                                              host_pool_tokens=host_pool_tokens)), loaded=loaded)
    g = torch.Generator().manual_seed(seed)
    vocab = loaded.arch.vocab_size
    lock = threading.Lock()
    stamps: list[float] = []           # one per output token
    live = {"steady": 0, "storm": 0}
    stop_steady = threading.Event()
    errors: list[str] = []
    n = [0]

    def submit(kind: str) -> None:
        ids = torch.randint(100, vocab - 100, (64,), generator=g).tolist()
        with lock:
            n[0] += 1
            rid = f"{kind}-{n[0]}"
            live[kind] += 1

        def on_chunk(c):
            now = time.perf_counter()
            again = False
            with lock:
                stamps.extend([now] * len(c.token_ids))
                if c.finish_reason is not None:
                    live[kind] -= 1
                    if c.error:
                        errors.append(c.error)
                    again = kind == "steady" and not stop_steady.is_set()
            if again:
                submit("steady")

        n_out = int(torch.randint(out_tokens // 2, out_tokens * 3 // 2 + 1, (1,), generator=g))
        e.submit(e.make_request(ids, SamplingParams(max_tokens=n_out, ignore_eos=True), rid=rid),
                 on_chunk)

    try:
        def counters() -> tuple[int, int]:
            st = e.stats()
            return st["generated_tokens"], st["steps"]

        t0 = time.perf_counter()
        for _ in range(concurrency):
            submit("steady")
        time.sleep(min(3.0, phase_s / 3))
        c_warm = counters()
        time.sleep(phase_s - min(3.0, phase_s / 3))
        c_storm = counters()
        t_storm = time.perf_counter()
        for _ in range(storm):
            submit("storm")
        while True:
            with lock:
                if live["storm"] == 0:
                    break
            time.sleep(0.05)
        t_after = time.perf_counter()
        c_after = counters()
        time.sleep(phase_s)
        t_end = time.perf_counter()
        c_end = counters()
        stop_steady.set()
        while True:
            with lock:
                if live["steady"] == 0:
                    break
            time.sleep(0.05)
        stats = e.stats()
        snap = e.snapshot()
    finally:
        e.shutdown()

    def windows(a: float, b: float) -> list[float]:
        """Tokens per second in whole 1-second windows of [a, b) (a partial tail is dropped)."""
        k = int(b - a)
        counts = [0] * k
        for s in stamps:
            i = int(s - a)
            if a <= s < b and i < k:
                counts[i] += 1
        return [float(c) for c in counts]

    def rate(a: float, b: float) -> float:
        return sum(1 for s in stamps if a <= s < b) / (b - a) if b > a else float("nan")

    warm = min(3.0, phase_s / 3)                  # the first seconds fill the batch: not steady
    med = {"before": rate(t0 + warm, t_storm), "storm": rate(t_storm, t_after),
           "after": rate(t_after, t_end)}
    def per_step(a, b) -> float:
        return (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else float("nan")

    occ = {"before": per_step(c_warm, c_storm), "storm": per_step(c_storm, c_after),
           "after": per_step(c_after, c_end)}
    res = {"host_pool_tokens": host_pool_tokens, "device_pool_tokens": pool,
           "tok_per_step_before": occ["before"], "tok_per_step_storm": occ["storm"],
           "tok_per_step_after": occ["after"], "step_recovery": occ["after"] / occ["before"],
           "concurrency": concurrency, "storm": storm, "out_tokens": out_tokens,
           "tok_s_before": med["before"], "tok_s_storm": med["storm"], "tok_s_after": med["after"],
           "recovery": med["after"] / med["before"] if med["before"] else float("nan"),
           "storm_s": t_after - t_storm, "retractions": stats["retractions"],
           "restores": stats["retraction_restores"], "recomputes": stats["retraction_recomputes"],
           "errors": len(errors), "idle_leak_tokens": snap.leaked_tokens,
           "idle_locked_tokens": snap.locked_tokens,
           "timeline": {"t0": 0.0, "storm": t_storm - t0, "after": t_after - t0, "end": t_end - t0,
                        "per_s": windows(t0, t_end)}}
    log(f"  host={host_pool_tokens}: before {med['before']:.1f} tok/s, storm {med['storm']:.1f} "
        f"({res['storm_s']:.1f} s, {stats['retractions']} retractions, {stats['retraction_restores']} "
        f"restores, {stats['retraction_recomputes']} recomputes), after {med['after']:.1f} -> "
        f"recovery {res['recovery']:.2f}; tokens/step {occ['before']:.2f} / {occ['storm']:.2f} / "
        f"{occ['after']:.2f} -> {res['step_recovery']:.2f}")
    return res


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    for r in runs:
        tl = r["timeline"]
        ax.plot(range(len(tl["per_s"])), tl["per_s"],
                label=f"host pool {r['host_pool_tokens']} tokens (recovery {r['recovery']:.2f})")
        ax.axvspan(tl["storm"], tl["after"], alpha=0.08, color="red")
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens / s")
    ax.set_title("decode throughput before, during (shaded) and after a retraction storm")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--storm", type=int, default=24)
    ap.add_argument("--phase-s", type=float, default=15.0)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--host-pool-tokens", type=int, default=None,
                    help="run only this host pool size (default: 0 and 8x the device pool, alternated)")
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args(argv)

    from tandem.engine.loader import load_model

    loaded = load_model("smollm2", device="cpu", dtype="float32")
    page = 16
    pool = (a.concurrency + 2) * (-(-(64 + a.out_tokens * 3 // 2) // page) * page) + 4 * page
    sizes = [a.host_pool_tokens] if a.host_pool_tokens is not None else [8 * pool, 0]
    runs = []
    for rep in range(a.repeats):   # ABBA: load drifts hit both settings alike
        for h in (sizes if rep % 2 == 0 else sizes[::-1]):
            runs.append(run_once(loaded, host_pool_tokens=h, concurrency=a.concurrency, storm=a.storm,
                                 phase_s=a.phase_s, out_tokens=a.out_tokens, threads=a.threads, seed=rep))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "retraction_recovery.json").write_text(json.dumps(runs, indent=1))
    plot(runs, out / "retraction_recovery.png")
    print(f"{'host pool':>10} {'tok/s before':>12} {'storm':>7} {'after':>7} {'ratio':>6} "
          f"{'tok/step before':>15} {'storm':>6} {'after':>6} {'ratio':>6} {'retract':>8} "
          f"{'restore':>8} {'recomp':>7} {'errors':>7} {'leak':>5}")
    for r in runs:
        print(f"{r['host_pool_tokens']:>10} {r['tok_s_before']:>12.1f} {r['tok_s_storm']:>7.1f} "
              f"{r['tok_s_after']:>7.1f} {r['recovery']:>6.2f} {r['tok_per_step_before']:>15.2f} "
              f"{r['tok_per_step_storm']:>6.2f} {r['tok_per_step_after']:>6.2f} {r['step_recovery']:>6.2f} "
              f"{r['retractions']:>8} {r['restores']:>8} {r['recomputes']:>7} {r['errors']:>7} "
              f"{r['idle_leak_tokens']:>5}")
    print(f"wrote {out / 'retraction_recovery.json'} and {out / 'retraction_recovery.png'}")
    bad = [r for r in runs if r["errors"] or r["idle_leak_tokens"] or r["idle_locked_tokens"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
