"""A decode worker (or, with ``--kill prefill``, the prefill worker) SIGKILLed under live streams: do
they complete identical, and how long is the longest gap a client sees (issue 48's goal: p99 <= 3 s on
the 2-core box)?

On a 1 prefill + 2 decode cluster (SmolLM2 float32, CPU, Ray, in-process router): ``--streams``
greedy chats of ``--tokens`` tokens, one session so they all decode on one worker, are run once
with no fault (the reference) and then ``--repeats`` times with that decode worker SIGKILLed once
every stream has ``--after`` tokens. Each stream resumes on the live decode worker after the tokens
it had (cluster/stream.py's failover). Reported: streams completed identical to the reference, error
events, the longest gap between two tokens per stream (p50/p99/max), the median inter-token gap
of the fault-free run, and the failovers the router counted. Between repeats the supervisor's
replacement of the killed worker is waited for.

``--kill prefill``: the one prefill worker is SIGKILLed while it prefills, i.e. as soon as every
stream is open on a decode worker and none has a token (``tokens_at_kill`` says how many had one);
each is prefilled again (re-dispatched, or prefilled on its decode worker) and must still complete
identical with no error event. ``first_token_s`` is then the figure to read (the fault-free one beside it).

    .venv/bin/python -m tandem.bench.failover [--kill decode|prefill] [--streams 4] [--tokens 96] [--after 4] [--repeats 2]
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

from tandem.bench.common import bench_parser, write_report

TOPICS = ("rivers", "bridges", "volcanoes", "glaciers", "deserts", "forests", "islands", "canyons")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _stream(backend, greq, stamps: list[float]) -> tuple[list[int], str | None, int]:
    """(ids, error, prompt tokens of the final chunk) of one request; a stamp per token."""
    ids, err, prompt = [], None, 0
    async for c in backend.generate(greq):
        ids += c.token_ids
        stamps += [time.perf_counter()] * len(c.token_ids)
        err = c.error or err
        if c.finish_reason is not None:
            prompt = c.prompt_tokens
    return ids, err, prompt


async def _run(backend, reqs, kill_after: int | None, pids: dict[str, int], role: str = "decode") -> dict:
    """Every request at once; with ``kill_after``, SIGKILL the decode worker holding them once each
    has that many tokens (``role`` prefill: the prefill worker, once every stream is open on a decode
    worker, before the first token). Returns per stream (ids, error, prompt tokens, stamps), the
    victim, each stream's tokens at the kill and when the requests were sent."""
    stamps: list[list[float]] = [[] for _ in reqs]
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(_stream(backend, r, s)) for r, s in zip(reqs, stamps)]
    victim, at_kill = None, []
    if kill_after is not None and role == "prefill":
        while not all(r.rid in backend.inflight for r in reqs):
            if any(stamps) or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.001)
        at_kill = [len(s) for s in stamps]
        victim = next(w.name for w in backend.prefills if w.alive)
        os.kill(pids[victim], signal.SIGKILL)
    elif kill_after is not None:
        while not all(len(s) >= kill_after for s in stamps):
            if all(t.done() for t in tasks):
                raise RuntimeError("the streams ended before the kill")
            await asyncio.sleep(0.005)
        on = [backend.inflight.get(r.rid) for r in reqs]
        victim = max({w.name for w in on if w is not None}, key=lambda n: sum(w.name == n for w in on if w))
        os.kill(pids[victim], signal.SIGKILL)
        at_kill = [len(s) for s in stamps]
    res = await asyncio.gather(*tasks)
    return {"streams": [(ids, err, prompt, s) for (ids, err, prompt), s in zip(res, stamps)], "victim": victim,
            "at_kill": at_kill, "t0": t0}


def _failovers() -> dict[str, float]:
    """tandem_failovers_total by ``role/outcome``."""
    from prometheus_client import REGISTRY

    return {f"{r}/{o}": REGISTRY.get_sample_value("tandem_failovers_total", {"role": r, "outcome": o}) or 0.0
            for r in ("decode", "prefill") for o in ("resumed", "redispatched", "failed")}


def main(argv=None) -> int:
    import ray

    from tandem.cluster.launch import launch_disaggregated
    from tandem.core.config import CacheConfig, EngineConfig, MigrationConfig, ServeConfig
    from tandem.core.messages import GenerateRequest
    from tandem.core.types import SamplingParams
    from tandem.engine.loader import load_model

    ap = bench_parser(__doc__, "failover", repeats=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--after", type=int, default=4, help="tokens every stream has when the worker is killed")
    ap.add_argument("--kill", choices=("decode", "prefill"), default="decode",
                    help="the worker SIGKILLed: the decode worker mid-stream, or the prefill worker while it prefills")
    args = ap.parse_args(argv)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    loaded = load_model("smollm2", device="cpu", dtype="float32")
    engine = EngineConfig(device="cpu", dtype="float32", num_threads=1,
                          cache=CacheConfig(page_size=16, max_total_tokens=4096, max_running_requests=16))
    cfg = ServeConfig(prefill=1, decode=2, transfer_timeout_s=30.0, engine_config=engine,
                      migration=MigrationConfig(policy="off"))
    backend = launch_disaggregated(cfg, loaded=loaded)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    tok = backend.tokenizer

    def reqs(tag: str) -> list:
        return [GenerateRequest(f"{tag}-{i}", tuple(tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": f"Write a long paragraph about {TOPICS[i % len(TOPICS)]}."}]))), params,
            session_id=f"failover-{tag}") for i in range(args.streams)]

    def pids() -> dict[str, int]:
        return {w.name: ray.get(w.api.info(), timeout=60)["pid"] for w in backend.pool.everyone()
                if w.alive}

    def whole() -> None:   # the supervisor replaced the killed worker: 1P+2D live again
        end = time.monotonic() + 300
        while sum(w.alive for w in backend.decodes) < 2 or not any(w.alive for w in backend.prefills):
            if time.monotonic() > end:
                raise RuntimeError("the killed decode worker was not replaced within 300 s")
            time.sleep(0.5)

    rows, bad, errors = [], [], []
    try:
        ref = asyncio.run(_run(backend, reqs("ref"), None, pids()))
        want = [ids for ids, *_ in ref["streams"]]
        prompts = [p for _, _, p, _ in ref["streams"]]
        itl = statistics.median(b - a for *_, s in ref["streams"] for a, b in zip(s, s[1:]))
        ref_gap = max(max(b - a for a, b in zip(s, s[1:])) for *_, s in ref["streams"])
        ref_ttft = statistics.median(s[0] - ref["t0"] for *_, s in ref["streams"])
        for r in range(args.repeats):
            whole()
            f0 = _failovers()
            got = asyncio.run(_run(backend, reqs(f"kill{r}"), args.after, pids(), args.kill))
            f1 = _failovers()
            moved = {k: f1[k] - f0[k] for k in f1 if f1[k] > f0[k]}
            for i, (ids, err, prompt, s) in enumerate(got["streams"]):
                gaps = [b - a for a, b in zip(s, s[1:])]
                same = ids == want[i] and prompt == prompts[i]
                if not same:
                    bad.append(f"kill{r}-{i}")
                if err:
                    errors.append(f"kill{r}-{i}: {err}")
                rows.append({"repeat": r, "stream": i, "victim": got["victim"], "identical": same,
                             "error": err, "tokens": len(ids), "max_gap_s": max(gaps) if gaps else 0.0,
                             "tokens_at_kill": got["at_kill"][i] if got["at_kill"] else None,
                             "first_token_s": s[0] - got["t0"] if s else None})
            last = rows[-args.streams:]
            print(f"  repeat {r}: killed {got['victim']} (tokens at the kill {got['at_kill']}); identical "
                  f"{sum(x['identical'] for x in last)}/{args.streams}; longest gap "
                  f"{max(x['max_gap_s'] for x in last):.2f} s; first token max "
                  f"{max(x['first_token_s'] or 0.0 for x in last):.2f} s; tandem_failovers_total {moved}", flush=True)
    finally:
        backend.close()
        ray.shutdown()
    gaps = [x["max_gap_s"] for x in rows]
    ttfts = [x["first_token_s"] for x in rows if x["first_token_s"] is not None]
    summary = {"kill": args.kill, "streams": args.streams, "tokens": args.tokens, "after": args.after,
               "repeats": args.repeats, "first_token_p50_s": statistics.median(ttfts) if ttfts else None,
               "first_token_max_s": max(ttfts) if ttfts else None, "no_fault_first_token_p50_s": ref_ttft,
               "identical": sum(x["identical"] for x in rows), "runs": len(rows), "errors": len(errors),
               "longest_gap_p50_s": _pct(gaps, 0.5), "longest_gap_p99_s": _pct(gaps, 0.99),
               "longest_gap_max_s": max(gaps), "no_fault_longest_gap_s": ref_gap, "no_fault_itl_p50_s": itl}
    print(f"{'streams':>8}{'tokens':>8}{'identical':>11}{'errors':>8}{'gap p50 s':>11}{'gap p99 s':>11}"
          f"{'gap max s':>11}{'no-fault max gap s':>20}{'ITL p50 s':>11}")
    print(f"{args.streams:>8}{args.tokens:>8}{summary['identical']:>5}/{summary['runs']:<5}{len(errors):>8}"
          f"{summary['longest_gap_p50_s']:>11.2f}{summary['longest_gap_p99_s']:>11.2f}{summary['longest_gap_max_s']:>11.2f}"
          f"{ref_gap:>20.2f}{itl:>11.3f}")
    if ttfts:
        print(f"first token: p50 {summary['first_token_p50_s']:.2f} s, max {summary['first_token_max_s']:.2f} s "
              f"(no fault: p50 {ref_ttft:.2f} s)")
    write_report(args.out, {"summary": summary, "runs": rows, "mismatches": bad, "errors": errors})
    if bad or errors:
        print(f"FAILED: mismatches {bad}, errors {errors}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
