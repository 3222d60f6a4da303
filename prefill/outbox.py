"""The prefill role's side of the engine: finished prompts whose KV is held until it is sent.

:class:`PrefillOutbox` runs on the engine thread: it is the scheduler's ``on_finish`` hook, so a
request that finishes normally (its one sampled token) keeps its row and locked KV here instead
of releasing it. :class:`PrefillHandle` is how the prefill worker reaches it:

    held_pages(rid, start) -> HeldKV    page ids of positions [start, len(prompt)) and usage;
                                        hybrid models: the SWA rows of the window decode keeps
                                        past ``start`` and the working state row (the state at
                                        the prompt's end), engine/hybrid.py ``transfer_rows``
    release_held(rid)                   the KV was sent (or the send failed): cache / free it
    page_digest(regions) -> str         digest of the regions' pages about to be sent
"""

from __future__ import annotations

import asyncio

from dataclasses import dataclass, field

from tandem.engine.handle import EngineHandle
from tandem.engine.kv_digest import regions_digest
from tandem.engine.kv_regions import KV, kv_regions
from tandem.engine.sched_types import SchedReq


@dataclass(frozen=True)
class HeldKV:
    pages: tuple[int, ...]      # source page ids of positions [start, len(prompt))
    cached_tokens: int          # prompt tokens this worker's prefix cache served
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)   # hybrid: "swa", "state"

    def source(self, region: str) -> tuple[int, ...]:
        """Source ids of ``region`` ("kv": the pages)."""
        return self.pages if region == KV else self.rows[region]


class PrefillOutbox:
    """Engine thread only. ``held``: finished requests whose KV waits to be sent."""

    def __init__(self, scheduler, regions: dict | None = None):
        self.sched = scheduler
        self.regions = regions if regions is not None else {}   # name -> RegionSpec
        self.held: dict[str, SchedReq] = {}
        scheduler.on_finish = self.hold

    def hold(self, sr: SchedReq) -> bool:
        self.held[sr.rid] = sr
        return True

    def held_pages(self, rid: str, start: int) -> HeldKV:
        sr, kv = self.held[rid], self.sched.kv
        return HeldKV(kv.pages(sr, start, len(sr.req.prompt_ids)), sr.req.cached_len,
                      kv.transfer_rows(sr, start))

    def release(self, rid: str) -> None:
        sr = self.held.pop(rid, None)
        if sr is not None:
            self.sched.kv.release(sr)

    def digest(self, named_pages: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
        return regions_digest(self.regions, named_pages)


class PrefillHandle(EngineHandle):
    def __init__(self, engine):
        super().__init__(engine)
        self.outbox = PrefillOutbox(engine.scheduler, kv_regions(engine))   # before any request

    async def held_pages(self, rid: str, start: int) -> HeldKV:
        return await self._run(self.outbox.held_pages, rid, start)

    async def release_held(self, rid: str) -> None:
        await self._run(self.outbox.release, rid)

    async def page_digest(self, named_pages: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
        """Digest of ``[(region, source ids)]`` in the transfer's region order, hashed on a
        helper thread (the step loop keeps running): held pages are locked, and locked cache
        pages and a finished request's own pages are never written."""
        self.check_alive()
        return await asyncio.to_thread(self.outbox.digest, named_pages)
