"""Test support for tests/worker, tests/decode and tests/cluster: the front door over a backend,
served by uvicorn in a thread, and the helpers the in-process worker tests share."""

from __future__ import annotations

import asyncio
import threading
import time

from tandem.core.ports import free_port


class LocalClient:
    """The real prefill worker as decode's PrefillClient, with optional fault injection."""

    def __init__(self, worker, delay_s: float = 0.0):
        self.w, self.name, self.delay_s = worker, worker.name, delay_s
        self.aborts: list[str] = []

    async def prefill(self, req_wire, xfer, dst_prefix_len):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await self.w.prefill(req_wire, xfer, dst_prefix_len)

    async def abort(self, rid, reason):
        self.aborts.append(rid)
        await self.w.abort(rid, reason)


class PushClient(LocalClient):
    """LocalClient with the reply push's ``store`` (decode/reply_push.py): the prefill worker
    reserves pages and calls back the decode worker's ``push_out``, as the Ray actors do."""

    def __init__(self, worker, decode):
        super().__init__(worker)
        self.source = _PushSource(decode)

    async def store(self, req_wire):
        return await self.w.store(req_wire, self.source)


class _PushSource:
    def __init__(self, decode):
        self.decode, self.name = decode, decode.name

    async def prefill(self, req_wire, xfer, dst_prefix_len):
        return await self.decode.push_out(req_wire, xfer, dst_prefix_len)


def peered_workers(loop, name: str, cfg, loaded, **decode_kw):
    """A PrefillWorker and a DecodeWorker (``decode_kw``: its options) of ``cfg``, peered, made
    on ``loop`` (their agents and tasks live there)."""
    from tandem.decode.worker import DecodeWorker
    from tandem.prefill.worker import PrefillWorker

    async def make():
        p = PrefillWorker(f"{name}-prefill", cfg, loaded=loaded, transfer_timeout_s=20)
        d = DecodeWorker(f"{name}-decode", cfg, loaded=loaded, transfer_timeout_s=20, **decode_kw)
        p.add_peer(d.handshake())
        d.add_peer(p.handshake())
        return p, d

    return loop.run_until_complete(make())




class Server:
    """uvicorn serving ``create_app(backend, cfg)`` in a thread; ``client`` is an openai client."""

    def __init__(self, backend, cfg, name: str = ""):
        import openai
        import uvicorn

        from tandem.router.http import create_app

        self.name = name
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(backend, cfg), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < end, "uvicorn did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def collect(gen, stop_after: int | None = None) -> list:
    """Every chunk of an async generator (or the first ``stop_after``), closing it."""
    out = []
    try:
        async for c in gen:
            out.append(c)
            if stop_after is not None and len(out) >= stop_after:
                break
    finally:
        await gen.aclose()
    return out


async def at_baseline(*ws, timeout: float = 15.0) -> list[dict]:
    """Wait until no page on any worker is owned by a request; return the last stats."""
    end = time.monotonic() + timeout
    while True:
        for w in ws:
            if hasattr(w, "drain"):
                await w.drain(timeout)
        stats = [await w.stats() for w in ws]
        if all(s["available_tokens"] + s["evictable_tokens"] == s["total_tokens"]
               and s["live_transfers"] == 0 for s in stats):
            return stats
        if time.monotonic() > end:
            raise AssertionError(f"pages still owned by requests: {stats}")
        await asyncio.sleep(0.05)
