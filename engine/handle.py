"""EngineHandle: the only way a worker reaches its engine.

A worker (prefill/, decode/) runs on an asyncio loop; its engine runs on its own thread and is
not thread-safe. Every cross-thread call goes through a handle method that names what it does
and returns a typed value: changes are typed engine commands (engine/commands.py), reads run a
named read-only method on the engine thread (``Engine.inspect``); none waits forever on a dead
engine thread. Role verbs live in the roles' subclasses: ``DecodeHandle`` (decode/connector.py:
receive, activate, cancel) and ``PrefillHandle`` (prefill/connector.py: held_pages, release_held).

    handle.stream(greq)              async iterator of StreamChunk (a locally run request)
    handle.abort(rid, error)         finish a request (fire and forget)
    await handle.cached_prefix(ids)  tokens of ``ids`` the prefix cache holds (no side effect)
    await handle.check_constraint(p) compile p.constraint (cached); InvalidRequest if it cannot
    await handle.snapshot()          EngineSnapshot: pool accounting and queue lengths
    await handle.check_invariants()  the ownership recount (raises AssertionError)
    handle.check_alive()             raises if the engine thread died
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Callable

from tandem.core.messages import GenerateRequest
from tandem.core.types import StreamChunk

ENGINE_CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine's accounting at one moment (read on the engine thread). Tokens are device KV
    slots; ``detached``: requests holding KV outside the step loop (reserved for a transfer on a
    decode worker, held for sending on a prefill worker)."""

    available_tokens: int        # free device slots
    evictable_tokens: int        # cached, unlocked
    locked_tokens: int           # cached, locked by requests
    total_tokens: int            # the device pool
    request_tokens: int          # slots of the pages requests own beyond their locked prefix
                                 # (a partly used last page counts whole)
    host_used_tokens: int        # host tier copies (0 without one)
    running: int
    waiting: int
    retracted: int
    detached: int
    rows_free: int
    waiting_prompt_tokens: int   # prompt tokens queued (not yet admitted)

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


class EngineHandle:
    def __init__(self, engine, timeout_s: float = ENGINE_CALL_TIMEOUT_S):
        self.engine = engine
        self.timeout_s = timeout_s

    async def _read(self, fn: Callable, *args):
        """Read-only ``fn(*args)`` on the engine thread. The engine's future is shielded:
        cancelling the caller must not cancel it (the engine thread would then fail to set it)."""
        self.check_alive()
        fut = self.engine.inspect(fn, *args)
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)

    # -- requests the engine runs by itself -------------------------------------------------------
    def stream(self, greq: GenerateRequest) -> AsyncIterator[StreamChunk]:
        return self.engine.stream(greq)

    def submit(self, greq: GenerateRequest, on_chunk: Callable[[StreamChunk], None]) -> None:
        self.engine.submit(greq, on_chunk)

    def abort(self, rid: str, error: str | None = None) -> None:
        self.engine.abort(rid, error=error)

    async def check_constraint(self, params) -> None:
        """Compile ``params.constraint`` on the engine's grammar pool (not the engine thread);
        raises InvalidRequest when it does not compile, before anything is reserved."""
        await self.engine.check_constraint(params)

    # -- reading ---------------------------------------------------------------------------------
    async def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of ``ids`` (page-aligned, at most ``len(ids) - 1``) the prefix cache holds on
        the device. Side-effect free: no split, no LRU touch, no load-back, nothing locked."""
        return await self._read(self._cached_prefix, list(ids))

    def _cached_prefix(self, ids: list[int]) -> int:
        ps = self.engine.kv.page_size
        usable = (len(ids) - 1) // ps * ps
        return min(self.engine.kv.cache.peek(ids[:usable]), usable)

    async def snapshot(self) -> EngineSnapshot:
        return await self._read(take_snapshot, self.engine)

    async def check_invariants(self) -> None:
        await self._read(self.engine.scheduler.check_invariants)

    def check_alive(self) -> None:
        """Raise if the engine thread died."""
        err = self.engine.error
        if err is not None:
            raise RuntimeError(f"engine thread died: {err!r}")
