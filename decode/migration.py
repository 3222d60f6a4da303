"""Live migration, the source side of a decode worker: freeze a running request, hold its KV, and
WRITE it to the worker that continues it. Invariant: a frozen request's KV is held until exactly
one of ``migrate_out``, ``release_frozen`` or the expiry (two transfer timeouts)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.transfer.handoff import Handoff
from tandem.transfer.messages import KVTransferRequest, PrefillResult, RegionPages
from tandem.transfer.state import TransferState


class FrozenRequests:
    """The requests frozen on this worker and not yet being copied (the router's FROZEN,
    cluster/moves.py), each with its expiry: ``expire(rid)`` runs ``ttl_s`` after :meth:`hold`
    unless :meth:`end` came first. Event-loop only."""

    def __init__(self, expire: Callable[[str], None], ttl_s: float):
        self._expire, self.ttl_s = expire, ttl_s
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def hold(self, rid: str) -> None:
        self.end(rid)
        self._timers[rid] = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, rid)

    def end(self, rid: str) -> bool:
        """``rid``'s expiry is off (copied, or released); whether it was held."""
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        return timer is not None

    def __contains__(self, rid: str) -> bool:
        return rid in self._timers

    def __len__(self) -> int:
        return len(self._timers)


class MigrationSource:
    frozen: FrozenRequests   # the worker's: ``FrozenRequests(self.release_frozen, 2 * transfer_timeout_s)``

    async def freeze(self, rid: str) -> None:
        """End decoding ``rid`` here (its stream's last chunk says "migrated") and hold its KV for
        :meth:`migrate_out`; ValueError, changing nothing, when it is not decoding here. A frozen
        request nobody copies within ``frozen.ttl_s`` (its router died) goes to the cache."""
        await self.handle.migrate(rid)
        self.frozen.hold(rid)

    def release_frozen(self, rid: str) -> None:
        """A frozen request whose KV will not be copied from here (the new worker recomputes it,
        or the move was given up): its KV goes to this worker's cache. A no-op if none is held."""
        self.frozen.end(rid)
        self.handle.release_held(rid)

    async def migrate_out(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """The new worker's side of a migration calls this as its ``prefill``: WRITE the frozen
        request's KV from ``dst_prefix_len`` into ``xfer``'s pages, then release it to this worker's
        cache. Returns, like a prefill, only when no write is in flight (but ``in_flight=True``)."""
        rid, req = req_wire["rid"], KVTransferRequest.decode(xfer)
        self.frozen.end(rid)   # being copied: no expiry from here on
        h = self.handoffs[rid] = Handoff(rid, req.transfer_id, TransferState.BOOTSTRAPPED)

        def answer(status: TransferState, error: str = "", **f) -> PrefillResult:
            return PrefillResult(req.transfer_id, status, self.name, error=error, **f)

        try:
            try:
                held = await self.handle.held_pages(rid, dst_prefix_len)
            except KeyError:
                h.fail("not frozen")
                return answer(TransferState.FAILED, f"{rid} is not frozen on {self.name}")
            bad = [n for n in req.regions if len(held.source(n)) != len(req.pages(n))]
            if bad:
                h.fail("region sizes differ")
                return answer(TransferState.FAILED, f"transfer {req.transfer_id}: sizes differ in {bad}")
            digest = ""
            if req.digest:
                digest = await self.handle.page_digest(tuple(RegionPages(n, held.source(n)) for n in req.regions))
            w = await self.write_held(h, req, held)
            self.counts["migrated_out"] += w.state is TransferState.DONE
            return answer(w.state if w.state is TransferState.DONE else TransferState.FAILED,
                          "" if w.state is TransferState.DONE else f"migration write {w.error}",
                          in_flight=w.state is TransferState.QUARANTINED, bytes=w.nbytes,
                          pages=len(held.pages), cached_tokens=held.cached_tokens, transfer_s=w.seconds,
                          digest=digest)
        finally:
            self.handoffs.pop(rid, None)
            self.handle.release_held(rid)
