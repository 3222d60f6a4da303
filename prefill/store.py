"""Reply push, the receiving side of a prefill worker: a decode worker's finished sequence (a
session's prompt and the reply it generated) is written into pages reserved here and cached, so
the session's next turn is computed here from its new tokens only (decode/README.md, "reply push").

A mixin of :class:`~tandem.prefill.worker.PrefillWorker` (its ``handle``, ``agent``, ``name``,
``counts``, ``transfer_timeout_s``). :meth:`ReplyStore.store` is one push, the receiving side of
the handoff decode runs for a prompt, with the roles swapped::

    decode (source)                           prefill (this)
    holds the finished sequence's KV  <─store─ handle.receive: reserve [p, m) past its own match
                                       ─────── KVTransferRequest(pages) -> source.prefill
    write_held [p, m)  ══ NIXL WRITE ═══════>  pages
    PrefillResult (no write in flight) ─────>  DONE: handle.store (cached, "stored");
                                               FAILED: handle.cancel (freed); in_flight: quarantined

Rules: the reserved pages are freed only once the source's call ended (it returns only when no
write is in flight, or raised: its worker died) and never when it answers ``in_flight``; nothing
here waits longer than the source's own bound; a push that finds no room in time reserves
nothing. A push that fails costs the next turn a recompute, never a wrong token.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import replace
from typing import Protocol

from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams, StreamChunk
from tandem.transfer.handoff import Handoff
from tandem.transfer.messages import KVTransferRequest, PrefillResult

log = logging.getLogger(__name__)

_PUMP_S = 0.0005   # NIXL progress while a write into this worker is live (UCX tcp needs the target)


class KVWriter(Protocol):
    """The decode worker holding the sequence: ``prefill`` is its write of the held KV."""

    name: str

    async def prefill(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult: ...


class ReplyStore:
    async def store(self, req_wire: dict, source: KVWriter) -> int:
        """Receive ``req_wire``'s sequence (its ``prompt_ids``: the tokens whose KV ``source``
        holds under ``req_wire["rid"]``) past what this cache already holds, then cache it.
        Returns the tokens received (0: nothing moved, the next turn recomputes what it lacks)."""
        wire = GenerateRequest.from_wire(req_wire)
        greq = replace(wire, rid=f"{wire.rid}#stored", params=SamplingParams(max_tokens=1), group=None,
                       resume=None, trace="")
        loop = asyncio.get_running_loop()
        final: asyncio.Future[StreamChunk] = loop.create_future()

        def on_chunk(c: StreamChunk) -> None:
            if c.finish_reason is not None:
                loop.call_soon_threadsafe(lambda: final.done() or final.set_result(c))

        fut = asyncio.wrap_future(self.handle.receive(greq, on_chunk))
        done, _ = await asyncio.wait([fut, final], timeout=self.transfer_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        res = fut.result() if fut.done() else None
        if res is None:   # no room in time, or it ended first: nothing was posted
            self.handle.cancel(greq.rid, "reply push: not reserved")
            self.counts["store_skipped"] += 1
            return 0
        n = len(greq.prompt_ids) - res.prefix_len
        h = Handoff(greq.rid, deadline=time.monotonic() + self.transfer_timeout_s)
        h.bootstrap(secrets.randbits(63))
        xfer = KVTransferRequest(h.transfer_id, self.name, res.named(),
                                 deadline=time.time() + self.transfer_timeout_s)
        call = asyncio.ensure_future(source.prefill(req_wire, xfer.encode(), res.prefix_len))
        h.send()
        result = await self._pump_until(call)
        if result is not None and result.ok and result.transfer_id == h.transfer_id:
            h.land()
            self.handle.store(greq.rid)
            await final
            self.counts["stored_tokens"] += n
            self._stored.inc(n)
            return n
        why = result.error if result is not None else "the source's call raised"
        h.fail(f"reply push: {why}")
        if h.settle(in_flight=result is not None and result.in_flight):
            self.handle.cancel(greq.rid, f"reply push failed: {why}")
            self.counts["store_failed"] += 1
        else:
            self.counts["quarantined_tokens"] += n
            log.error("reply push %s into %s may still be writing: %d tokens quarantined", greq.rid, self.name, n)
        return 0

    async def _pump_until(self, call: asyncio.Future) -> PrefillResult | None:
        """``call``'s result (None when it raised), progressing the agent while it runs."""
        while not call.done():
            try:
                self.agent.progress()
            except Exception:  # keep pumping: the writer's own bound ends the call
                log.exception("NIXL progress failed on %s", self.name)
            await asyncio.wait([call], timeout=_PUMP_S)
        if call.exception() is not None:
            log.info("reply push source failed: %s", call.exception())
            return None
        return call.result()
