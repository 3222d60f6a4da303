"""The soak's machinery in a short run (the soak itself is a benchmark: bench/soak.py, ``make soak``
and ``make soak-short``): ``tandem chaos --duration`` against a real ``tandem serve --mode
colocated`` process (SmolLM2, forced retraction, ``--debug-endpoints``), rounds of seeded sessions
with client aborts, sampled every second (the router process's RSS, fds and threads, GET /debug/kv's
KV totals). Pass: the chaos verdict (every completed text equal to the same request on a fresh
engine, no leak, no hung request, no failure without a reason, the process flat from its first sample to its last)
over several rounds and samples.

The harness's own hang detection is tested without a server of ours: a server that sends one chunk
and then nothing is reported as hung within the stall timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from support.serve import ServeProcess
from tandem.loadtest.chaos.client import Outcome, RunConfig, _one
from tandem.loadtest.chaos.plan import Turn


def test_a_silent_stream_is_reported_hung_within_the_stall_timeout(tmp_path):
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        async def body():
            yield b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
            await asyncio.sleep(3600)                    # a worker that stopped answering
        return StreamingResponse(body(), media_type="text/event-stream")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]),
                                           log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.01)

    async def main():
        import httpx

        cfg = RunConfig(f"http://127.0.0.1:{port}", "m", stall_s=1.0)
        o = Outcome("s", 0, [{"role": "user", "content": "x"}], 8, "none")
        async with httpx.AsyncClient(base_url=cfg.url) as http:
            t0 = time.perf_counter()
            await _one(http, cfg, o, Turn("x", 8))
            return o, time.perf_counter() - t0

    try:
        o, took = asyncio.run(main())
    finally:
        server.should_exit = True
    assert o.kind == "failed" and o.reason == "hung: no byte for 1 s after 1 chunk(s)", o
    assert 0.9 < took < 5.0


@pytest.fixture
def serve(smollm2_gguf, tmp_path):
    """``tandem serve --mode colocated`` in a process of its own (the sampler reads it as a soak
    reads its routers), started at once: it loads its model while the test's fixtures load theirs."""
    proc = ServeProcess(["--mode", "colocated", "--device", "cpu", "--threads", "1", "--page-size", "16",
                         "--max-total-tokens", "2048", "--max-running-requests", "8",
                         "--debug-retract-every", "5", "--debug-endpoints"], tmp_path / "serve.log")
    try:
        yield proc
    finally:
        proc.stop()


def test_a_short_soak_samples_the_server_and_passes_the_oracle(serve, smollm2_default, tmp_path):
    from tandem.loadtest.chaos.cli import options, run_chaos, verdict
    from tandem.loadtest.chaos.oracle import Oracle

    oracle = Oracle("smollm2", "auto", threads=1, loaded=smollm2_default)
    try:
        rep = asyncio.run(run_chaos(options(serve.url(), seed=11, sessions=3, turns=2, max_tokens=6, duration="3s",
                                            sample_every="1s", warmup="0s", stall_timeout=60.0,
                                            out=str(tmp_path)), oracle=oracle))
    finally:
        oracle.close()
    print("\n" + rep["sample_table"])
    assert verdict(rep) == [], verdict(rep)
    # rounds until the duration (the first round's plan, seed 11, already holds 2 early aborts, a
    # mid one and 3 turns that complete)
    assert rep["requests"] == rep["rounds"] * 3 * 2 and rep["wall_s"] >= 3.0
    assert rep["completed"] >= 3 and rep["failed"] == 0, rep["failure_reasons"]
    assert rep["aborted_mid"] + rep["aborted_early"] >= 1                 # the clients did hang up
    assert rep["retractions"] > 0                                          # the forced retraction ran
    assert rep["leaked_tokens"] == 0 and not rep["kv_problems"]
    samples = rep["samples"]
    assert list(samples["procs"]) == ["router-0"]                          # the server process, found by its port
    # sampled during the run and once idle after it (a sample scans every process of the machine:
    # on a loaded box one takes seconds, so the count is not pinned)
    assert len(samples["procs"]["router-0"]) >= 2 and len(samples["kv"]) >= 2
    assert samples["kv"][-1][0] >= rep["wall_s"] and samples["kv"][-1][1]["used_tokens"] == 0
    assert all(kv["leaked_tokens"] == 0 and kv["workers"] == 1 for _, kv in samples["kv"])
    assert set(rep["growth"]["router-0"]) == {"rss_mb", "fds", "threads"}  # judged
