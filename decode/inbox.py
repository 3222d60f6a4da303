"""The decode role's side of the engine: requests whose prompt KV arrives from a prefill worker.

:class:`DecodeInbox` runs on the engine thread, on the scheduler's decode entry points
(``admit_detached`` / ``resume`` / ``drop_detached``). :class:`DecodeHandle` is how the decode
worker (asyncio, another thread) reaches it, with typed methods:

    reserve(req) -> Reservation | None   a row + the cached prefix + pages for the rest of the
                                          prompt (the request waits in WAITING_FOR_KV); hybrid
                                          models also reserve SWA rows of the kept window and
                                          the working state row (engine/hybrid.py)
    activate(rid, first_token, on_chunk, first_logprob)
                                          the KV arrived: decode from here, chunks to on_chunk
                                          (the first one carries prefill's token and logprob)
    cancel(rid, why)                      the transfer failed or was aborted: free the pages
    reserved_tokens(rid) -> int           tokens a reservation holds (for quarantine accounting)
    page_digest(regions) -> str           digest of the received regions' pages (``--kv-digest``)

Decode-side prefix reuse goes through the cache's normal match (its component vote), so for a
hybrid model ``prefix_len`` is where every component accepts the decode tree's hit; the rest
comes from prefill: full pages of ``[prefix_len, n)``, SWA rows of the window decode keeps past
``prefix_len`` (the window before the hit, if needed, is the tree's own and locked), and the
recurrent state at ``n`` (never the checkpoint at the hit). The decode tree's checkpoint at the
prompt's end is a device-local copy made when the received prompt is cached at activation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Callable

from tandem.core.types import InvalidRequest, Req, StreamChunk, TokenLogprob
from tandem.engine.handle import EngineHandle
from tandem.engine.kv_digest import corrupt_page, regions_digest
from tandem.engine.kv_regions import KV, kv_regions
from tandem.engine.sched_types import SchedReq
from tandem.transfer.messages import RegionPages


@dataclass(frozen=True)
class Reservation:
    """Where a prompt's KV must land: positions ``[prefix_len, len(prompt))`` in ``pages``
    (``prefix_len`` is page-aligned: the decode cache already held that much). ``regions``: the
    destination ids of every region the transfer fills (``"kv"``: ``pages``; hybrid models:
    ``"swa"`` rows of the kept window, ``"state"``: the working state row), in transfer order."""

    prefix_len: int
    pages: tuple[int, ...]
    regions: tuple[RegionPages, ...] = ()


class DecodeInbox:
    """Engine thread only. ``reserved``: requests waiting for their KV."""

    def __init__(self, scheduler, regions: dict | None = None):
        self.sched = scheduler
        self.regions = regions if regions is not None else {}   # name -> RegionSpec
        self.reserved: dict[str, SchedReq] = {}

    def reserve(self, req: Req) -> Reservation | None:
        sr = self.sched.admit_detached(req)
        if sr is None:
            return None
        self.reserved[req.rid] = sr
        kv, p = self.sched.kv, sr.locked_len
        pages = kv.pages(sr, p, req.seq_len)
        named = {KV: pages, **kv.transfer_rows(sr, p)}
        regions = tuple(RegionPages(n, ids) for n, ids in named.items() if n in self.regions)
        return Reservation(p, pages, regions)

    def activate(self, rid: str, first_token: int, first_logprob: TokenLogprob | None = None) -> StreamChunk:
        return self.sched.resume(self.reserved.pop(rid), first_token, first_logprob)

    def cancel(self, rid: str, error: str | None = None) -> StreamChunk | None:
        sr = self.reserved.pop(rid, None)
        return None if sr is None else self.sched.drop_detached(sr, error)

    def reserved_tokens(self, rid: str) -> int:
        sr = self.reserved.get(rid)
        return 0 if sr is None else sr.req.seq_len - sr.locked_len

    def digest(self, regions: tuple[RegionPages, ...]) -> str:
        return regions_digest(self.regions, [(rp.region, rp.pages) for rp in regions])

    def corrupt(self, regions: tuple[RegionPages, ...]) -> None:
        """Perturb the first page of the first region (``debug_corrupt_kv``)."""
        for rp in regions:
            if rp.pages:
                spec = self.regions[rp.region]
                corrupt_page(spec.tensor, rp.pages, spec.page_size)
                return


class DecodeHandle(EngineHandle):
    def __init__(self, engine):
        super().__init__(engine)
        self.inbox = DecodeInbox(engine.scheduler, kv_regions(engine))

    async def reserve(self, req: Req) -> Reservation | None:
        """Raises InvalidRequest for a prompt this engine can never serve."""
        return await self._run(self.inbox.reserve, req)

    def activate(self, rid: str, first_token: int, on_chunk: Callable[[StreamChunk], None],
                 first_logprob: TokenLogprob | None = None) -> concurrent.futures.Future:
        """Start decoding ``rid``; its chunks (the first token's included, with
        ``first_logprob`` when the request asked for logprobs) go to ``on_chunk`` from the engine
        thread. A constrained request's grammar continues from the first token. The future
        fails if activation raised."""
        self.check_alive()
        return self.engine.call(self.inbox.activate, rid, first_token, first_logprob,
                                on_chunk=on_chunk, rid=rid)

    async def cancel(self, rid: str, why: str) -> None:
        await self._run(self.inbox.cancel, rid, why)

    def cancel_later(self, rid: str) -> None:
        """Fire-and-forget cancel (a reservation that landed after its caller left)."""
        self.engine.call(self.inbox.cancel, rid, None)

    async def reserved_tokens(self, rid: str) -> int:
        return await self._run(self.inbox.reserved_tokens, rid)

    async def page_digest(self, regions: tuple[RegionPages, ...]) -> str:
        """Digest of the received ``regions`` (a Reservation's), in their order. Hashed on a
        helper thread, not the engine thread (a 2k-token prompt takes ~0.1 s of hashing; the
        step loop keeps decoding meanwhile): the reserved pages are this request's alone and no
        write into them is in flight once its PrefillResult arrived, so nothing changes them."""
        self.check_alive()
        return await asyncio.to_thread(self.inbox.digest, regions)

    async def corrupt_page(self, regions: tuple[RegionPages, ...]) -> None:
        """Test lever (``debug_corrupt_kv``): flip bytes of the first received page."""
        await self._run(self.inbox.corrupt, regions)
