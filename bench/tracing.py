"""What tracing costs: the front door's request latency with tracing off vs on, in one run.

Two apps over one echo backend (it answers 16 tokens at once, so the front door's own work is
what is timed): one made while tracing is off (no middleware), one while it is on (a server span
per request, its traceparent stamped on the GenerateRequest), exported over OTLP/HTTP to a sink
in this process that reads and drops every batch. Requests go through httpx's in-process ASGI
transport (no sockets: the app's own cost, not the loopback's). Rounds alternate off, on, on, off
(tracing is turned off and on again between them); each round sends ``--requests`` sequential
POST /v1/completions; a pair of rounds (one off, one on) gives one on/off ratio of their medians,
so load that drifts over the run cancels. Reports the median latency of each mode, the median
of the pairs' ratios, the same for this process's CPU time per request (the exporter's thread
included; steadier than latency on a loaded machine), the cost of one
worker-side span (``tracing.record``: prefill, KV transfer and decode each record one per
request) and of ``tracing.current()`` with tracing off (the one call the front door makes then;
worker call sites test ``if greq.trace`` first).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.common import bench_parser, write_report


class _Echo:
    """A serving backend whose generation is free: 16 tokens in one chunk."""

    model_name, max_context = "echo", 4096

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, req):
        from tandem.core.types import StreamChunk

        ids = tuple(range(100, 116))
        yield StreamChunk(req.rid, ids, "x" * 16, "length", len(req.prompt_ids), 0, 16)

    async def abort(self, rid):
        pass

    async def health(self):
        return {"status": "ok"}

    def metrics_text(self):
        return b""


class _Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


async def _round(client, n: int) -> list[float]:
    body = {"model": "echo", "prompt": list(range(1000, 1200)), "max_tokens": 16}
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json=body)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return out


def _per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    p = bench_parser(__doc__, "tracing", repeats=40)
    p.add_argument("--requests", type=int, default=25, help="requests per round")
    args = p.parse_args(argv)

    import httpx

    from tandem.cluster.launch import load_tokenizer
    from tandem.core import tracing
    from tandem.core.config import ServeConfig
    from tandem.router.http import create_app

    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
    backend = _Echo(load_tokenizer("smollm2"))
    tracing.shutdown()
    off_app = create_app(backend, ServeConfig())
    tracing.setup("router", endpoint)
    on_app = create_app(backend, ServeConfig())
    lat: dict[str, list[float]] = {"off": [], "on": []}
    ratios: list[float] = []      # per adjacent off/on pair: the machine's load drifts less within one
    cpu: dict[str, list[float]] = {"off": [], "on": []}    # CPU seconds of this process per request
    cpu_ratios: list[float] = []

    async def run() -> None:
        def client(app):
            return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench", timeout=30)

        async with client(off_app) as off, client(on_app) as on:
            await _round(off, 50)         # warm both paths
            await _round(on, 50)
            for i in range(args.repeats):      # off, on, then on, off: drift hits both alike
                pair = {}
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    if mode == "off":
                        tracing.shutdown()
                    else:
                        tracing.setup("router", endpoint)
                    c0 = time.process_time()
                    got = await _round(off if mode == "off" else on, args.requests)
                    if mode == "on":
                        tracing.flush()     # the export's CPU belongs to the round that made the spans
                    cpu[mode].append((time.process_time() - c0) / args.requests)
                    lat[mode] += got
                    pair[mode] = statistics.median(got)
                ratios.append(pair["on"] / pair["off"])
                cpu_ratios.append(cpu["on"][-1] / cpu["off"][-1])

    asyncio.run(run())
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    tracing.setup("router", endpoint)
    record_on = _per_call(lambda: tracing.record("decode", parent, time.time(), **{"tandem.tokens": 16}), 1000)
    tracing.shutdown()
    current_off = _per_call(tracing.current, 100000)
    sink.shutdown()

    med = {k: statistics.median(v) for k, v in lat.items()}
    rows = [("request latency, tracing off (median)", f"{med['off'] * 1e3:.3f} ms"),
            ("request latency, tracing on (median)", f"{med['on'] * 1e3:.3f} ms"),
            ("on / off, median of the pairs' ratios", f"{statistics.median(ratios):.3f}"),
            ("CPU per request, off / on (medians)",
             f"{statistics.median(cpu['off']) * 1e6:.0f} us / {statistics.median(cpu['on']) * 1e6:.0f} us"),
            ("CPU on / off, median of the pairs' ratios", f"{statistics.median(cpu_ratios):.3f}"),
            ("one worker span (tracing.record), on", f"{record_on * 1e6:.1f} us"),
            ("tracing.current(), tracing off", f"{current_off * 1e9:.0f} ns")]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    write_report(args.out, {"requests_per_round": args.requests, "rounds": args.repeats,
                            "median_off_s": med["off"], "median_on_s": med["on"],
                            "ratio_on_off": statistics.median(ratios), "pair_ratios": ratios,
                            "cpu_per_request_s": {k: statistics.median(v) for k, v in cpu.items()},
                            "cpu_ratio_on_off": statistics.median(cpu_ratios),
                            "record_on_s": record_on,
                            "current_off_s": current_off})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
