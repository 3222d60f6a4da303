"""EngineHandle: the only way a worker reaches its engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass
from typing import Callable

from tandem.core.messages import GenerateRequest
from tandem.core.types import StreamChunk

ENGINE_CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine's accounting at one moment (read on the engine thread)."""

    available_tokens: int
    evictable_tokens: int
    locked_tokens: int
    total_tokens: int
    request_tokens: int
    host_used_tokens: int
    running: int
    waiting: int
    retracted: int
    detached: int
    rows_free: int
    waiting_prompt_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def leaked_tokens(self) -> int:
        """Allocated slots neither cached nor owned by a request (0 unless there is a leak)."""
        return (self.total_tokens - self.available_tokens - self.evictable_tokens
                - self.locked_tokens - self.request_tokens)


def _whole_pages(slots, page_size: int) -> int:
    return int(len(set((slots // page_size).tolist()))) * page_size


def take_snapshot(engine) -> EngineSnapshot:
    """Engine thread only."""
    s, kv = engine.scheduler, engine.kv
    st = kv.cache.stats()
    host = kv.cache.host.used() if kv.cache.host is not None else 0
    return EngineSnapshot(
        available_tokens=kv.alloc.available_size(), evictable_tokens=st.evictable,
        locked_tokens=st.protected, total_tokens=kv.alloc.size,
        request_tokens=_whole_pages(kv.owned_slots(), kv.page_size), host_used_tokens=host,
        running=len(s.running), waiting=len(s.waiting), retracted=len(s.retraction.retracted),
        detached=len(kv.holders) - len(s.running), rows_free=kv.r2t.available_size(),
        waiting_prompt_tokens=sum(len(sr.req.prompt_ids) for sr in s.waiting))


def pin_report(engine) -> dict:
    """Engine thread only: the live pinned prefixes (``cache.pins()``), pinned tokens per tenant,
    matches that ended on a pinned node and pins refused past a tenant's cap."""
    c = engine.kv.cache
    return {"prefixes": c.pins(), "tokens": c.pinned_tokens, "hits": c.pin_hits, "refused": c.pin_refused}


class EngineHandle:
    def __init__(self, engine, timeout_s: float = ENGINE_CALL_TIMEOUT_S):
        self.engine = engine
        self.timeout_s = timeout_s

    async def _read(self, fn: Callable, *args):
        self.check_alive()
        fut = self.engine.inspect(fn, *args)
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)

    def stream(self, greq: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        return self.engine.stream(greq)

    def submit(self, greq: GenerateRequest, on_chunk: Callable[[StreamChunk], None]) -> None:
        self.engine.submit(greq, on_chunk)

    def abort(self, rid: str, error: str | None = None) -> None:
        self.engine.abort(rid, error=error)

    async def check_constraint(self, params) -> None:
        """Compile ``params.constraint`` on the engine's grammar pool (not the engine thread);
        raises InvalidRequest when it does not compile, before anything is reserved."""
        await self.engine.check_constraint(params)

    async def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of ``ids`` (page-aligned, at most ``len(ids) - 1``) the prefix cache holds on the
        device."""
        return await self._read(self._cached_prefix, list(ids))

    def _cached_prefix(self, ids: list[int]) -> int:
        ps = self.engine.kv.page_size
        usable = (len(ids) - 1) // ps * ps
        return min(self.engine.kv.cache.peek(ids[:usable]), usable)

    async def pins(self) -> dict:
        """The cache's pins (:func:`pin_report`), read on the engine thread."""
        return await self._read(pin_report, self.engine)

    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """Tokens unpinned by ending the pins of prefix ``prefix_hash`` (0: none such)."""
        self.check_alive()
        fut = self.engine.unpin(prefix_hash, tenant)
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)

    async def snapshot(self) -> EngineSnapshot:
        return await self._read(take_snapshot, self.engine)

    async def check_invariants(self) -> None:
        await self._read(self.engine.scheduler.check_invariants)

    def check_alive(self) -> None:
        """Raise if the engine thread died."""
        err = self.engine.error
        if err is not None:
            raise RuntimeError(f"engine thread died: {err!r}")
