"""The decode role's side of the engine: requests whose prompt KV arrives from a prefill worker.

:class:`DecodeInbox` runs on the engine thread, on the scheduler's decode entry points
(``admit_detached`` / ``resume`` / ``drop_detached``). :class:`DecodeHandle` is how the decode
worker (asyncio, another thread) reaches it, with typed methods:

    reserve(req) -> Reservation | None   a row + the cached prefix + pages for the rest of the
                                          prompt (the request waits in WAITING_FOR_KV)
    activate(rid, first_token, on_chunk)  the KV arrived: decode from here, chunks to on_chunk
    cancel(rid, why)                      the transfer failed or was aborted: free the pages
    reserved_tokens(rid) -> int           tokens a reservation holds (for quarantine accounting)
    page_digest(pages) -> str             digest of the received pages (``--kv-digest``)
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Callable

from tandem.core.types import InvalidRequest, Req, StreamChunk
from tandem.engine.handle import EngineHandle
from tandem.engine.kv_digest import corrupt_page, page_digest
from tandem.engine.sched_types import SchedReq


@dataclass(frozen=True)
class Reservation:
    """Where a prompt's KV must land: positions ``[prefix_len, len(prompt))`` in ``pages``
    (``prefix_len`` is page-aligned: the decode cache already held that much)."""

    prefix_len: int
    pages: tuple[int, ...]


class DecodeInbox:
    """Engine thread only. ``reserved``: requests waiting for their KV."""

    def __init__(self, scheduler):
        self.sched = scheduler
        self.reserved: dict[str, SchedReq] = {}

    def reserve(self, req: Req) -> Reservation | None:
        if self.sched.kv.hybrid.active:   # hybrid: SWA rows / recurrent state are not transferred
            raise InvalidRequest("KV transfer does not support hybrid (SWA / recurrent) models")
        sr = self.sched.admit_detached(req)
        if sr is None:
            return None
        self.reserved[req.rid] = sr
        return Reservation(sr.locked_len, self.sched.kv.pages(sr, sr.locked_len, req.seq_len))

    def activate(self, rid: str, first_token: int) -> StreamChunk:
        return self.sched.resume(self.reserved.pop(rid), first_token)

    def cancel(self, rid: str, error: str | None = None) -> StreamChunk | None:
        sr = self.reserved.pop(rid, None)
        return None if sr is None else self.sched.drop_detached(sr, error)

    def reserved_tokens(self, rid: str) -> int:
        sr = self.reserved.get(rid)
        return 0 if sr is None else sr.req.seq_len - sr.locked_len

    def digest(self, pages: tuple[int, ...]) -> str:
        return page_digest(self.sched.kv.kv_pool.kv_data, pages, self.sched.kv.page_size)

    def corrupt(self, pages: tuple[int, ...]) -> None:
        corrupt_page(self.sched.kv.kv_pool.kv_data, pages, self.sched.kv.page_size)


class DecodeHandle(EngineHandle):
    def __init__(self, engine):
        super().__init__(engine)
        self.inbox = DecodeInbox(engine.scheduler)

    async def reserve(self, req: Req) -> Reservation | None:
        """Raises InvalidRequest for a prompt this engine can never serve."""
        return await self._run(self.inbox.reserve, req)

    def activate(self, rid: str, first_token: int,
                 on_chunk: Callable[[StreamChunk], None]) -> concurrent.futures.Future:
        """Start decoding ``rid``; its chunks (the first token's included) go to ``on_chunk``
        from the engine thread. The future fails if activation raised."""
        self.check_alive()
        return self.engine.call(self.inbox.activate, rid, first_token, on_chunk=on_chunk, rid=rid)

    async def cancel(self, rid: str, why: str) -> None:
        await self._run(self.inbox.cancel, rid, why)

    def cancel_later(self, rid: str) -> None:
        """Fire-and-forget cancel (a reservation that landed after its caller left)."""
        self.engine.call(self.inbox.cancel, rid, None)

    async def reserved_tokens(self, rid: str) -> int:
        return await self._run(self.inbox.reserved_tokens, rid)

    async def page_digest(self, pages: tuple[int, ...]) -> str:
        return await self._run(self.inbox.digest, pages)

    async def corrupt_page(self, pages: tuple[int, ...]) -> None:
        """Test lever (``debug_corrupt_kv``): flip bytes of the first received page."""
        await self._run(self.inbox.corrupt, pages)
