"""Live migration, the source side of a decode worker: freeze a running request, hold its KV, and
WRITE it to the worker that continues it. Invariant: a frozen request's KV is held until exactly
one of ``migrate_out``, ``release_frozen`` or the expiry (two transfer timeouts)."""

from __future__ import annotations

import asyncio

from tandem.transfer.handoff import Handoff
from tandem.transfer.messages import KVTransferRequest, PrefillResult, RegionPages
from tandem.transfer.state import TransferState


class MigrationSource:
    _frozen: dict[str, asyncio.TimerHandle]

    async def freeze(self, rid: str) -> None:
        """End decoding ``rid`` here (its stream's last chunk says "migrated") and hold its KV for
        :meth:`migrate_out`; ValueError, changing nothing, when it is not decoding here."""
        await self.handle.migrate(rid)
        self._frozen[rid] = asyncio.get_running_loop().call_later(
            2 * self.transfer_timeout_s, self.release_frozen, rid)

    def release_frozen(self, rid: str) -> None:
        """A frozen request whose KV will not be copied from here (the new worker recomputes it,
        or the move was given up): its KV goes to this worker's cache. A no-op if none is held."""
        timer = self._frozen.pop(rid, None)
        if timer is not None:
            timer.cancel()
        self.handle.release_held(rid)

    async def migrate_out(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """The new worker's side of a migration calls this as its ``prefill``: WRITE the frozen
        request's KV from ``dst_prefix_len`` into ``xfer``'s pages, then release it to this worker's
        cache. Returns, like a prefill, only when no write is in flight (but ``in_flight=True``)."""
        rid, req = req_wire["rid"], KVTransferRequest.decode(xfer)
        timer = self._frozen.pop(rid, None)
        if timer is not None:
            timer.cancel()
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
