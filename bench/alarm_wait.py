"""The router's wait for a worker's next chunk, alone: the poll it had (``asyncio.wait`` on the chunk
with a 0.25 s timeout, then the workers' flags) vs cluster/alarms.py's pushed ``next_or_alarm``
(woken by the chunk or by the supervisor's ring). Every chunk is ready at once, so what is timed is
each wait's own cost per chunk (the serve benches' router overhead, without their noise). The two
alternate, ``--repeats`` rounds of ``--chunks`` each; medians.

    .venv/bin/python -m tandem.bench.alarm_wait [--chunks 20000] [--repeats 5]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, cast

from tandem.bench.common import bench_parser, write_report
from tandem.cluster.alarms import Alarms, next_or_alarm
from tandem.cluster.workers import DECODE, WorkerRef
from tandem.core.types import StreamChunk

POLL_S = 0.25   # the poll interval the backend had (STALL_POLL_S)


async def _chunk() -> StreamChunk | None:
    await asyncio.sleep(0)
    return None


async def _polled(d: WorkerRef) -> StreamChunk | None:
    """The backend's wait before the push (its _next_or_stall, decode worker only)."""
    nxt = asyncio.ensure_future(_chunk())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=POLL_S)
            if done:
                return nxt.result()
            if d.suspect_since is not None:
                raise RuntimeError("suspect")
    finally:
        if not nxt.done():
            nxt.cancel()


async def _rounds(n: int, repeats: int) -> dict[str, list[float]]:
    d, alarms = WorkerRef("decode-0", DECODE, 0, cast(Any, None)), Alarms()    # no actor: nothing calls it
    out: dict[str, list[float]] = {"poll": [], "alarm": []}
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            await _polled(d)
        out["poll"].append((time.perf_counter() - t) / n * 1e6)
        t = time.perf_counter()
        for _ in range(n):
            await next_or_alarm(_chunk(), alarms, "r", d, None, 5.0)
        out["alarm"].append((time.perf_counter() - t) / n * 1e6)
    return out


def main(argv=None) -> int:
    ap = bench_parser(__doc__, "alarm_wait", repeats=5)
    ap.add_argument("--chunks", type=int, default=20000)
    args = ap.parse_args(argv)
    res = asyncio.run(_rounds(args.chunks, args.repeats))
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{'wait':>8}{'us per chunk (median)':>24}   rounds")
    for k, v in res.items():
        print(f"{k:>8}{med[k]:>24.1f}   {[round(x, 1) for x in v]}")
    print(f"alarm / poll: {med['alarm'] / med['poll']:.2f}")
    write_report(args.out, {"chunks": args.chunks, "repeats": args.repeats, "us_per_chunk": res, "median": med,
                            "ratio": med["alarm"] / med["poll"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
