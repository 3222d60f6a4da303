"""EngineHandle: the only way a worker reaches its engine: its commands (engine/commands.py) and
queries (engine/queries.py) as typed methods, async where an answer comes back."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncGenerator
from typing import Any, Callable

from tandem.core.messages import GenerateRequest
from tandem.core.types import StreamChunk, TokenLogprob
from tandem.engine.commands import Land, LandResumed, Migrate, Release, Store
from tandem.engine.queries import (CachedPrefix, CheckInvariants, EngineSnapshot, HeldKV, HeldPages, PinReport, Query,
                                   Snapshot)

ENGINE_CALL_TIMEOUT_S = 120.0


class EngineHandle:
    def __init__(self, engine, timeout_s: float = ENGINE_CALL_TIMEOUT_S):
        self.engine = engine
        self.timeout_s = timeout_s

    async def _ask(self, q: Query) -> Any:
        self.check_alive()
        return await self._wait(self.engine.query(q))

    async def _wait(self, fut: concurrent.futures.Future) -> Any:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)

    # requests
    def stream(self, greq: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        return self.engine.stream(greq)

    def submit(self, greq: GenerateRequest, on_chunk: Callable[[StreamChunk], None]) -> None:
        """Queue ``greq`` (InvalidRequest, before anything is queued, for ids outside the
        vocabulary or a prompt this engine can never serve); its chunks go to ``on_chunk``."""
        self.engine.submit(greq, on_chunk)

    def abort(self, rid: str, error: str | None = None) -> None:
        self.engine.abort(rid, error=error)

    async def check_constraint(self, params) -> None:
        """Compile ``params.constraint`` on the engine's grammar pool (not the engine thread);
        raises InvalidRequest when it does not compile, before anything is reserved."""
        await self.engine.check_constraint(params)

    # a request whose KV crosses workers (engine/sched/scheduler.py ``handoff``); queued, in order
    def land(self, rid: str, first_token: int, logprob: TokenLogprob | None = None) -> None:
        """Received ``rid``'s KV landed (no write into it in flight): decode on from prefill's first
        token (and its logprob when asked); a constrained request's grammar continues from it."""
        self.check_alive()
        self.engine.send(Land(rid, first_token, logprob))

    def land_resumed(self, rid: str) -> None:
        """Migrated ``rid``'s KV landed: decode on from the tokens it came with."""
        self.check_alive()
        self.engine.send(LandResumed(rid))

    def store(self, rid: str) -> None:
        """Received ``rid``'s KV landed: cache it; it finishes "stored"."""
        self.check_alive()
        self.engine.send(Store(rid))

    def release_held(self, rid: str) -> None:
        """``rid``'s held KV goes to the cache (a no-op if it holds none): its write ended."""
        self.engine.send(Release(rid))

    async def migrate(self, rid: str) -> None:
        """End decoding ``rid`` here with "migrated", its KV held; ValueError (nothing changed)
        when it is not decoding here."""
        self.check_alive()
        cmd = Migrate(rid)
        self.engine.send(cmd)
        await asyncio.wait_for(asyncio.wrap_future(cmd.future), self.timeout_s)

    # the cache
    async def unpin(self, prefix_hash: str, tenant: str | None = None) -> int:
        """Tokens unpinned by ending the pins of prefix ``prefix_hash`` (0: none such)."""
        self.check_alive()
        n: int = await self._wait(self.engine.unpin(prefix_hash, tenant))
        return n

    # queries (engine/queries.py), each read on the engine thread
    async def held_pages(self, rid: str, start: int) -> HeldKV:
        """Held ``rid``'s source ids from ``start`` (KeyError when it holds none here)."""
        held: HeldKV = await self._ask(HeldPages(rid, start))
        return held

    async def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of ``ids`` (page-aligned, at most ``len(ids) - 1``) the prefix cache holds on the
        device."""
        n: int = await self._ask(CachedPrefix(tuple(ids)))
        return n

    async def pins(self) -> dict:
        """The cache's pins (engine/queries.py ``PinReport``)."""
        report: dict = await self._ask(PinReport())
        return report

    async def snapshot(self) -> EngineSnapshot:
        snap: EngineSnapshot = await self._ask(Snapshot())
        return snap

    async def check_invariants(self) -> None:
        await self._ask(CheckInvariants())

    def check_alive(self) -> None:
        """Raise if the engine thread died."""
        err = self.engine.error
        if err is not None:
            raise RuntimeError(f"engine thread died: {err!r}")
