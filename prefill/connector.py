"""The prefill role's side of the engine: finished prompts whose KV is held until it is sent.

:class:`PrefillConnector` is the scheduler's KVConnector on a prefill worker (engine/connector.py):
a request that finishes normally (its one sampled token) keeps its row and locked KV, in the
scheduler's ``detached``, until a ``Release``. :class:`PrefillHandle` is how the prefill worker
reaches it:

    held_pages(rid, start) -> HeldKV    page ids of positions [start, len(prompt)) and usage;
                                        hybrid models: the SWA rows of the window decode keeps
                                        past ``start`` and the working state row (the state at
                                        the prompt's end), engine/hybrid.py ``transfer_rows``
    release_held(rid)                   the write ended (or never started): cache / free the KV
    page_digest(regions) -> str         digest of the regions' pages about to be sent
    receive(greq, on_chunk), cancel(rid, why), store(rid)
                                        a decode worker's finished sequence written into
                                        reserved pages (worker/receiving.py), then cached
                                        (prefill/store.py)
"""

from __future__ import annotations

import asyncio

from tandem.engine.commands import Activate, Release
from tandem.engine.sched_types import SchedReq
from tandem.worker.held_kv import HeldKV, held_kv
from tandem.worker.kv_digest import regions_digest
from tandem.worker.kv_regions import kv_regions
from tandem.worker.receiving import ReceivingConnector, ReceivingHandle


class PrefillConnector(ReceivingConnector):
    """Engine thread, except :meth:`expect` and :meth:`forget`: every computed prompt that
    finishes normally is held for sending; a received one ("stored") goes to the cache."""

    def __init__(self, engine):
        super().__init__(engine)
        self.engine = engine

    def finished(self, sr: SchedReq, reason: str) -> bool:
        self.forget(sr.rid)
        return reason not in ("abort", "stored")

    def held_kv(self, rid: str, start: int) -> HeldKV:
        """Source ids of held ``rid``'s positions ``[start, len(prompt))``; KeyError if not held."""
        return held_kv(self.engine, rid, start)


class PrefillHandle(ReceivingHandle):
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

    def store(self, rid: str) -> None:
        """Queued: received ``rid``'s KV landed (no write into it is in flight): cache it; it
        finishes "stored"."""
        self.check_alive()
        self.engine.send(Activate(rid, None))

    async def page_digest(self, named_pages: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
        """Digest of ``[(region, source ids)]`` in the transfer's region order, hashed on a
        helper thread (the step loop keeps running): held pages are locked, and locked cache
        pages and a finished request's own pages are never written."""
        self.check_alive()
        return await asyncio.to_thread(regions_digest, self.regions, named_pages)
