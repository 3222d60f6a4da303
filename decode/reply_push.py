"""Reply push, the sending side of a decode worker: once a request finished normally, the KV of
its whole sequence (the prompt and the reply but its last token) goes to the prefill worker that
served it, past what that worker holds, off the critical path (prefill/store.py receives it;
decode/README.md, "reply push"). The sequence is held like a frozen migration: the prefill
worker's ``store`` reserves pages and calls back this worker's KVSource, whose write is
:meth:`ReplyPush.write`; the hold ends with that write, with the push ending without it, or at
the expiry. ``debug_push_fault="fail"`` (test lever) answers every write FAILED, unwritten."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

from tandem.core.config import WorkerOptions
from tandem.core.kv_messages import KVTransferRequest, PrefillResult
from tandem.core.messages import GenerateRequest
from tandem.core.transfer_state import TransferState
from tandem.decode.connector import DecodeHandle
from tandem.decode.local_prefill import SentPrefixes
from tandem.decode.migration import MigrationSource

log = logging.getLogger(__name__)


class StoreClient(Protocol):
    """A prefill worker that can take a pushed sequence: ``store(req_wire) -> tokens received``
    (it calls back this worker's KVSource)."""

    name: str

    async def store(self, req_wire: dict) -> int: ...


class ReplyPush:
    """The pushes of one decode worker. ``can_push(name)``: a NIXL peer it may write to;
    ``whole_pages_only``: a hybrid model (a cache keeps a state checkpoint only at a page boundary)."""

    def __init__(self, name: str, handle: DecodeHandle, source: MigrationSource, sent: SentPrefixes,
                 counts: dict, options: WorkerOptions, *, can_push: Callable[[str], bool],
                 whole_pages_only: bool, page_size: int):
        self.name, self.handle, self.source, self.sent, self.counts = name, handle, source, sent, counts
        self.on, self.fault, self.timeout_s = options.reply_push, options.debug_push_fault, options.transfer_timeout_s
        self.can_push, self.whole_pages_only, self.page_size = can_push, whole_pages_only, page_size
        self.tasks: set[asyncio.Task] = set()
        self.pushing: set[str] = set()   # rids whose held sequence is being pushed
        self._by_session: dict[str, asyncio.Task] = {}

    def wanted(self, greq: GenerateRequest, prefill) -> bool:
        """Whether ``greq``'s sequence goes to ``prefill`` once it finished normally (then hold it)."""
        return (self.on and prefill is not None and greq.resume is None
                and (greq.group is None or greq.group.size <= 1)
                and self.can_push(prefill.name) and hasattr(prefill, "store"))

    def ended(self, greq: GenerateRequest, prefill: StoreClient, out_ids: list[int]) -> None:
        """The stream of ``greq`` ended: push its held sequence (if it finished held)."""
        if not self.handle.connector.unhold(greq.rid):
            return
        seq = tuple(greq.prompt_ids) + tuple(out_ids[:-1])    # the last token has no KV
        if len(seq) % self.page_size and self.whole_pages_only:
            self.source.release(greq.rid)   # the next turn is prefilled here instead
            self.counts["push_skipped"] += 1
            return
        self.source.hold(greq.rid)
        self.pushing.add(greq.rid)
        task = asyncio.ensure_future(self._push(greq, seq, prefill))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if greq.session_id is not None:
            self._by_session[greq.session_id] = task
            task.add_done_callback(lambda t: self._by_session.get(greq.session_id) is t
                                   and self._by_session.pop(greq.session_id))

    async def settled(self, greq: GenerateRequest) -> None:
        """Before routing ``greq``: its session's push still in flight ends first (bounded by
        the transfer timeout), so the turn sees what the push moved."""
        task = self._by_session.get(greq.session_id) if greq.session_id is not None else None
        if task is not None and not task.done():
            await asyncio.wait([task], timeout=self.timeout_s)

    async def _push(self, greq: GenerateRequest, seq: tuple[int, ...], prefill: StoreClient) -> None:
        wire = GenerateRequest(greq.rid, seq, session_id=greq.session_id, tenant=greq.tenant,
                               cache_salt=greq.cache_salt, pins=greq.pins, pin_cap=greq.pin_cap).to_wire()
        try:
            n = await prefill.store(wire)
        except Exception as e:   # the prefill worker died or refused: the next turn recomputes
            log.info("reply push of %s to %s failed: %s", greq.rid, prefill.name, e)
            n = 0
        finally:
            self.pushing.discard(greq.rid)
            self.source.release(greq.rid)   # a no-op once the write released it
        self.counts["pushed" if n else "push_failed"] += 1
        self.counts["pushed_tokens"] += n
        if n:
            self.sent.add(prefill.name, GenerateRequest(greq.rid, seq, cache_salt=greq.cache_salt).cache_key)

    async def write(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """The prefill worker's ``store`` calls this: WRITE the held sequence from
        ``dst_prefix_len`` into ``xfer``'s pages (:meth:`MigrationSource.write`'s contract)."""
        if self.fault == "fail":
            self.source.release(req_wire["rid"])
            return PrefillResult(KVTransferRequest.decode(xfer).transfer_id, TransferState.FAILED, self.name,
                                 error="debug_push_fault=fail: nothing written")
        return await self.source.write(req_wire, xfer, dst_prefix_len)
