"""The prefill role's side of the engine: finished prompts whose KV is held until it is sent."""

from __future__ import annotations

import asyncio

from tandem.engine.commands import Release
from tandem.engine.connector import KVConnector
from tandem.engine.sched_types import SchedReq
from tandem.worker.handle import RoleHandle
from tandem.worker.held_kv import HeldKV, held_kv
from tandem.worker.kv_digest import regions_digest
from tandem.worker.kv_regions import kv_regions


class PrefillConnector(KVConnector):
    """Engine thread only: every normal finish is held for sending."""

    def __init__(self, engine):
        self.engine = engine

    def finished(self, sr: SchedReq, reason: str) -> bool:
        return reason != "abort"

    def held_kv(self, rid: str, start: int) -> HeldKV:
        """Source ids of held ``rid``'s positions ``[start, len(prompt))``; KeyError if not held."""
        return held_kv(self.engine, rid, start)


class PrefillHandle(RoleHandle):
    ROLE, CONNECTOR = "prefill", PrefillConnector
    connector: PrefillConnector

    def __init__(self, engine):
        super().__init__(engine)
        self.regions = kv_regions(engine)

    async def held_pages(self, rid: str, start: int) -> HeldKV:
        """Raises KeyError when ``rid`` is not held here."""
        return await self._read(self.connector.held_kv, rid, start)

    def release_held(self, rid: str) -> None:
        """Queued: the next step caches / frees ``rid``'s held KV (a no-op if it holds none)."""
        self.engine.send(Release(rid))

    async def page_digest(self, named_pages: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
        """Digest of ``[(region, source ids)]`` in the transfer's region order, hashed on a
        helper thread (the step loop keeps running): held pages are locked, and locked cache
        pages and a finished request's own pages are never written."""
        self.check_alive()
        return await asyncio.to_thread(regions_digest, self.regions, named_pages)
