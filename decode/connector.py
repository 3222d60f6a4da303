"""The decode role's side of the engine: requests whose prompt KV a prefill worker writes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Callable

from tandem.core.messages import GenerateRequest
from tandem.core.types import StreamChunk, TokenLogprob
from tandem.engine.commands import Activate, Migrate, Release
from tandem.engine.connector import KVConnector
from tandem.engine.sched_types import SchedReq
from tandem.transfer.messages import RegionPages
from tandem.worker.handle import RoleHandle
from tandem.worker.held_kv import HeldKV, held_kv
from tandem.worker.kv_digest import corrupt_page, regions_digest
from tandem.worker.kv_regions import KV, kv_regions


@dataclass(frozen=True)
class Reservation:
    """Where a prompt's KV must land: positions ``[prefix_len, len(prompt))`` in ``pages``
    (``prefix_len`` is page-aligned: the decode cache already held that much)."""

    prefix_len: int
    pages: tuple[int, ...]
    regions: tuple[RegionPages, ...] = ()


class DecodeConnector(KVConnector):
    """Engine thread, except :meth:`expect` and :meth:`forget` (any thread)."""

    def __init__(self, engine):
        self.kv = engine.kv
        self.regions = kv_regions(engine)
        self._expected: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def expect(self, rid: str) -> concurrent.futures.Future:
        """Before ``rid`` is submitted: a peer writes its prompt. The future gets its Reservation."""
        with self._lock:
            fut = self._expected[rid] = concurrent.futures.Future()
        return fut

    def forget(self, rid: str) -> None:
        with self._lock:
            fut = self._expected.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def receives(self, sr: SchedReq) -> bool:
        with self._lock:
            return sr.rid in self._expected

    def reserved(self, sr: SchedReq) -> None:
        kv, p = self.kv, sr.locked_len
        pages = kv.pages(sr, p, sr.req.computed_len)   # the reserved end: seq_len, or seq_len - 1 resumed
        named = {KV: pages, **kv.transfer_rows(sr, p)}
        regions = tuple(RegionPages(n, ids) for n, ids in named.items() if n in self.regions)
        with self._lock:
            fut = self._expected.get(sr.rid)
        if fut is not None and not fut.done():
            fut.set_result(Reservation(p, pages, regions))

    def finished(self, sr: SchedReq, reason: str) -> bool:
        """Holds the KV of a request that migrated (until the new worker has copied it)."""
        self.forget(sr.rid)
        return reason == "migrated"

    def digest(self, regions: tuple[RegionPages, ...]) -> str:
        return regions_digest(self.regions, [(rp.region, rp.pages) for rp in regions])

    def corrupt(self, regions: tuple[RegionPages, ...]) -> None:
        """Perturb the first page of the first region (``debug_corrupt_kv``)."""
        for rp in regions:
            if rp.pages:
                spec = self.regions[rp.region]
                corrupt_page(spec.tensor, rp.pages, spec.page_size)
                return


class DecodeHandle(RoleHandle):
    ROLE, CONNECTOR = "decode", DecodeConnector
    connector: DecodeConnector

    def receive(self, greq: GenerateRequest,
                on_chunk: Callable[[StreamChunk], None]) -> concurrent.futures.Future:
        """Queue ``greq`` to be filled by a peer; raises InvalidRequest for a prompt this engine
        can never serve. Chunks (from the first token on) go to ``on_chunk``."""
        self.check_alive()
        fut = self.connector.expect(greq.rid)
        try:
            self.engine.submit(greq, on_chunk)
        except BaseException:
            self.connector.forget(greq.rid)
            raise
        return fut

    def activate(self, rid: str, first_token: int | None, first_logprob: TokenLogprob | None = None) -> None:
        """Start decoding ``rid`` from prefill's first token (and its logprob when asked). A
        constrained request's grammar continues from it."""
        self.check_alive()
        self.engine.send(Activate(rid, first_token, first_logprob))

    def cancel(self, rid: str, why: str | None) -> None:
        """End ``rid`` and free its reserved pages (queued or reserved alike). The caller guarantees
        that no write into them is in flight."""
        self.connector.forget(rid)
        self.engine.abort(rid, error=why)

    async def page_digest(self, regions: tuple[RegionPages, ...]) -> str:
        """Digest of the received ``regions`` (a Reservation's), in their order, hashed on a
        helper thread (the step loop keeps decoding): the reserved pages are this request's
        alone and no write into them is in flight once its PrefillResult arrived."""
        self.check_alive()
        return await asyncio.to_thread(self.connector.digest, regions)

    async def migrate(self, rid: str) -> None:
        """End decoding ``rid`` here with "migrated", its KV held; ValueError (nothing changed)
        when it is not decoding here."""
        self.check_alive()
        cmd = Migrate(rid)
        self.engine.send(cmd)
        await asyncio.wait_for(asyncio.wrap_future(cmd.future), self.timeout_s)

    async def held_pages(self, rid: str, start: int) -> HeldKV:
        """A migrated request's KV from ``start`` (KeyError when it holds none here)."""
        return await self._read(held_kv, self.engine, rid, start)

    def release_held(self, rid: str) -> None:
        """Queued: a migrated request's held KV goes to this worker's cache."""
        self.engine.send(Release(rid))

    async def corrupt_page(self, regions: tuple[RegionPages, ...]) -> None:
        self.check_alive()
        await asyncio.to_thread(self.connector.corrupt, regions)
