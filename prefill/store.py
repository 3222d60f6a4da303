"""Reply push, the receiving side of a prefill worker: a decode worker's finished sequence (a
session's prompt and the reply it generated) is written into pages reserved here and cached, so
the session's next turn is computed here from its new tokens only (decode/README.md, "reply
push"). A policy over the worker's :class:`KVReceiver`: the prompt's handoff with the roles
swapped; the source's own bound ends its call (nothing here waits longer), and a push that
fails costs the next turn a recompute, never a wrong token."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter

from tandem.core.messages import GenerateRequest
from tandem.core.types import SamplingParams, StreamChunk
from tandem.prefill.connector import PrefillHandle
from tandem.worker.kv_flow import KVReceiver
from tandem.worker.kv_flow_types import Failed, KVSource, Landed


class ReplyStore:
    """Counts ``stored_tokens``, ``store_failed``, ``store_skipped`` in ``counts``."""

    def __init__(self, receiver: KVReceiver, handle: PrefillHandle, counts: dict, registry: CollectorRegistry):
        self.receiver, self.handle, self.counts = receiver, handle, counts
        self._stored = Counter("tandem_prefill_stored_tokens_total",
                               "Tokens of decode workers' finished sequences received and cached here "
                               "(reply push, prefill/store.py).", registry=registry)

    async def store(self, req_wire: dict, source: KVSource) -> int:
        """Receive ``req_wire``'s sequence (its ``prompt_ids``: the tokens whose KV ``source``
        holds under ``req_wire["rid"]``) past what this cache already holds, then cache it.
        Returns the tokens received (0: nothing moved, the next turn recomputes what it lacks)."""
        wire = GenerateRequest.from_wire(req_wire)
        greq = replace(wire, rid=f"{wire.rid}#stored", params=SamplingParams(max_tokens=1), group=None,
                       resume=None, trace="")
        final: asyncio.Future[StreamChunk] = asyncio.get_running_loop().create_future()
        got = await self.receiver.receive(greq, source, wire=req_wire, bounded=False,
                                          on_chunk=_on_final(final))
        if isinstance(got, Failed):
            self.counts["store_skipped" if got.reason in ("refused", "no_room") else "store_failed"] += 1
            return 0
        if not isinstance(got, Landed):   # PrefillConnector prefills nothing it expects
            raise TypeError(f"receive of {greq.rid} answered {got!r}, not Landed")
        self.handle.store(greq.rid)
        await final
        n = len(greq.prompt_ids) - got.reservation.prefix_len
        self.counts["stored_tokens"] += n
        self._stored.inc(n)
        return n


def _on_final(fut: asyncio.Future):
    """An engine-thread chunk callback that resolves ``fut`` with the final chunk."""
    loop = fut.get_loop()

    def on_chunk(c: StreamChunk) -> None:
        if c.finish_reason is not None:
            loop.call_soon_threadsafe(_resolve, fut, c)
    return on_chunk


def _resolve(fut: asyncio.Future[StreamChunk], c: StreamChunk) -> None:
    if not fut.done():
        fut.set_result(c)
