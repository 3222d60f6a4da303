"""Running generations for a route: metering, client disconnects, SSE, and n streams at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, Overloaded, StreamChunk
from tandem.router import metrics as m
from tandem.router.backend import ServingBackend

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0


class ClientGone(Exception):
    pass


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(aw: Awaitable[Any], receive) -> Any:
    """Await ``aw`` unless the client disconnects first (then cancel it and raise ClientGone)."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def metered(backend: ServingBackend, greq: GenerateRequest, arrival: float) -> AsyncGenerator[StreamChunk, None]:
    """``backend.generate(greq)`` with the front door's metrics; aborts ``greq.rid`` when closed (or
    cancelled) before the final chunk."""
    chunks = backend.generate(greq)
    status, finished, last, out = "aborted", False, None, 0
    count_prompt = greq.group is None or greq.group.leader
    try:
        async for c in chunks:
            now = time.perf_counter()
            out += len(c.token_ids)
            if c.token_ids:
                if last is None:
                    m.TTFT.observe(now - arrival)
                else:
                    gap = (now - last) / len(c.token_ids)
                    for _ in c.token_ids:
                        m.ITL.observe(gap)
                last = now
            if c.finish_reason is not None:
                finished = True
                status = "error" if c.error else "aborted" if c.finish_reason == "abort" else "ok"
                tenant = greq.tenant or "default"
                if count_prompt:
                    m.count_prompt(c.prompt_tokens, c.cached_tokens)
                    m.count_tenant(tenant, "prompt", c.prompt_tokens)
                    m.count_tenant(tenant, "cached", c.cached_tokens)
                m.count_tenant(tenant, "output", out)
            yield c
            if finished:
                return
        status = "error"
        raise RuntimeError(f"backend stream for {greq.rid} ended without a finish_reason")
    except InvalidRequest:
        status = "rejected"
        m.REJECTED.labels("invalid_request").inc()
        raise
    except Overloaded:
        status = "rejected"
        m.REJECTED.labels("overloaded").inc()
        raise
    except Exception:
        status = "error"
        raise
    finally:
        if not finished:
            try:
                await asyncio.wait_for(backend.abort(greq.rid), ABORT_TIMEOUT_S)
            except Exception:
                log.exception("abort(%s) failed", greq.rid)
        await chunks.aclose()
        m.REQUESTS.labels(status).inc()


@dataclass
class Running:
    """One started generation: its first chunk and the rest of its stream."""

    greq: GenerateRequest
    first: StreamChunk
    chunks: AsyncGenerator[StreamChunk, None]


class StartFailed(Exception):
    """A generation could not start: ``kind`` is "gone" (client hung up), "invalid", "overloaded"
    or "error"; the route turns it into its API's error response."""

    def __init__(self, kind: str, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.kind, self.message, self.retry_after_s = kind, message, retry_after_s


async def start(backend: ServingBackend, greqs: list[GenerateRequest], arrival: float, receive) -> list[Running]:
    """Start every generation and await each first chunk (raises StartFailed after closing them all)."""
    streams = [metered(backend, g, arrival) for g in greqs]
    try:
        firsts = await unless_disconnected(asyncio.gather(*(anext(s) for s in streams)), receive)
    except BaseException as e:
        await close_all(streams)
        if isinstance(e, ClientGone):
            raise StartFailed("gone", "client disconnected") from None
        if isinstance(e, InvalidRequest):
            raise StartFailed("invalid", str(e)) from None
        if isinstance(e, Overloaded):
            raise StartFailed("overloaded", str(e), e.retry_after_s) from None
        if isinstance(e, Exception):
            log.exception("backend failed on %s", greqs[0].rid)
            raise StartFailed("error", f"backend error: {e!r}"[:500]) from None
        raise
    return [Running(g, f, s) for g, f, s in zip(greqs, firsts, streams)]


async def close_all(streams) -> None:
    for s in streams:
        try:
            await s.aclose()
        except Exception:   # pragma: no cover - closing is best effort
            log.exception("closing a stream failed")


async def merge(runs: list[Running]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Every chunk of every run as (index in ``runs``, chunk), first chunks first; ends when each
    run has given its final chunk. An exception in one stream is raised here (the caller closes)."""
    for i, r in enumerate(runs):
        yield i, r.first
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, r: Running) -> None:
        try:
            if r.first.finish_reason is None:
                async for c in r.chunks:
                    await q.put((i, c, None))
                    if c.finish_reason is not None:
                        break
                else:
                    raise RuntimeError(f"stream of {r.greq.rid} ended without a finish_reason")
        except Exception as e:
            await q.put((i, None, e))
        finally:
            await q.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        done = 0
        while done < len(runs):
            i, c, err = await q.get()
            if err is not None:
                raise err
            if c is None:
                done += 1
                continue
            yield i, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Collected:
    """One whole generation: its text, final chunk, token count, logprobs and prompt logprobs."""

    text: str
    last: StreamChunk
    n_tokens: int
    logprobs: list
    prompt_logprobs: tuple = ()


async def collect(runs: list[Running]) -> list[Collected]:
    parts: list[list[str]] = [[] for _ in runs]
    lps: list[list] = [[] for _ in runs]
    counts = [0] * len(runs)
    lasts: list[StreamChunk | None] = [None] * len(runs)
    plps: list[tuple] = [()] * len(runs)
    async for i, c in merge(runs):
        parts[i].append(c.text)
        lps[i].extend(c.logprobs)
        plps[i] = c.prompt_logprobs or plps[i]
        counts[i] += len(c.token_ids)
        if c.finish_reason is not None:
            lasts[i] = c
    out = []
    for p, last, n, lp, pl in zip(parts, lasts, counts, lps, plps):
        if last is None:    # metered() raises first: its streams end with a finish_reason
            raise RuntimeError("a generation ended without its final chunk")
        out.append(Collected("".join(p), last, n, lp, pl))
    return out


class SSEResponse(Response):
    """Server-sent events from ``events``; stops (and closes ``events``) when the client disconnects,
    whatever ASGI spec version the server speaks."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await unless_disconnected(pump(), receive)
        except (ClientGone, OSError):
            pass
        finally:
            await self.events.aclose()   # runs metered()'s abort when the stream was cut short


def sse(data: str, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data.encode() + b"\n\n"
