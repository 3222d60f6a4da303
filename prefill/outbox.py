"""The prefill role's side of the engine: finished prompts whose KV is held until it is sent.

:class:`PrefillOutbox` runs on the engine thread: it is the scheduler's ``on_finish`` hook, so a
request that finishes normally (its one sampled token) keeps its row and locked KV here instead
of releasing it. :class:`PrefillHandle` is how the prefill worker reaches it:

    held_pages(rid, start) -> HeldKV    page ids of positions [start, len(prompt)) and usage
    release_held(rid)                   the KV was sent (or the send failed): cache / free it
    page_digest(pages) -> str           digest of pages about to be sent (``--kv-digest``)
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.handle import EngineHandle
from tandem.engine.kv_digest import page_digest
from tandem.engine.sched_types import SchedReq


@dataclass(frozen=True)
class HeldKV:
    pages: tuple[int, ...]      # source page ids of positions [start, len(prompt))
    cached_tokens: int          # prompt tokens this worker's prefix cache served


class PrefillOutbox:
    """Engine thread only. ``held``: finished requests whose KV waits to be sent."""

    def __init__(self, scheduler):
        self.sched = scheduler
        self.held: dict[str, SchedReq] = {}
        scheduler.on_finish = self.hold

    def hold(self, sr: SchedReq) -> bool:
        self.held[sr.rid] = sr
        return True

    def held_pages(self, rid: str, start: int) -> HeldKV:
        sr = self.held[rid]
        return HeldKV(self.sched.kv.pages(sr, start, len(sr.req.prompt_ids)), sr.req.cached_len)

    def release(self, rid: str) -> None:
        sr = self.held.pop(rid, None)
        if sr is not None:
            self.sched.kv.release(sr)

    def digest(self, pages: tuple[int, ...]) -> str:
        return page_digest(self.sched.kv.kv_pool.kv_data, pages, self.sched.kv.page_size)


class PrefillHandle(EngineHandle):
    def __init__(self, engine):
        super().__init__(engine)
        self.outbox = PrefillOutbox(engine.scheduler)   # before any request is submitted

    async def held_pages(self, rid: str, start: int) -> HeldKV:
        return await self._run(self.outbox.held_pages, rid, start)

    async def release_held(self, rid: str) -> None:
        await self._run(self.outbox.release, rid)

    async def page_digest(self, pages: tuple[int, ...]) -> str:
        return await self._run(self.outbox.digest, pages)
