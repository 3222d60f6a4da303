"""The bounded soak (bench/soak.py, issue 25 item 4): two routers over a detached 1P+2D SmolLM2
cluster, 2 minutes of ``tandem chaos`` rounds with client aborts, forced retraction and live
migration, a decode worker killed and router 1 SIGKILLed with requests in flight (its clients
resend to router 0), sampled every 10 s. Pass: the chaos verdict (no mismatch against a fresh
engine, no leak, no hung request, no failure without a reason) and every process flat after a
60 s warm-up (bench/soak.py's default bounds: RSS +96 MiB, fds +16, threads +8).

``STOP_WORKER``: also SIGSTOP a decode worker for 10 s: its requests must be re-dispatched or
resumed on the other decode worker within the progress deadline (cluster/supervisor.py), or the
run reports them hung and fails.

The harness's own hang detection is tested without a cluster: a server that sends one chunk and
then nothing is reported as hung within the stall timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tandem.loadtest.chaos.client import Outcome, RunConfig, _one
from tandem.loadtest.chaos.plan import Turn

STOP_WORKER = True


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


@pytest.mark.timeout(900)
def test_the_bounded_soak_is_clean_and_flat(tmp_path):
    pytest.importorskip("ray")
    from tandem.bench.soak import soak

    rep = soak(duration="2m", sample_every="10s", warmup="60s", sessions=4, max_tokens=16, kill_at=20.0,
               kill_router_at=40.0, stop_at=70.0 if STOP_WORKER else None, stop_s=10.0, out=tmp_path)
    print("\n" + rep["sample_table"] + "\nevents: " + "; ".join(rep["events"]))
    assert rep["verdict"] == [], rep["verdict"]
    assert rep["completed"] >= 12 and rep["rounds"] >= 1
    assert rep["aborted_mid"] + rep["aborted_early"] >= 1                 # the clients did hang up
    assert rep["killed"] and rep["killed"][0].startswith("decode-")       # a worker was killed
    assert any("SIGKILL router 1" in e for e in rep["events"])            # and a router
    assert "in flight" in next(e for e in rep["events"] if "SIGKILL router 1" in e)
    assert rep["retried"] >= 1 and rep["retried_failed"] == 0             # every resend completed (or was
                                                                          # one of the plan's client aborts)
    assert rep["leaked_tokens"] == 0 and not rep["kv_problems"]
    procs = rep["samples"]["procs"]
    assert "router-0" in procs and any(k.startswith("decode@") for k in procs)
    assert len(procs["router-0"]) >= 8                                    # sampled all along
