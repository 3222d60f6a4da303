"""Reply push, the sending side of a decode worker: once a request finished normally, the KV of
its whole sequence (the prompt and the reply but its last token) goes to the prefill worker that
served it, past what that worker holds, off the critical path. The session's next turn then finds
the previous reply in that prefill worker's cache and computes only its new tokens there
(prefill/store.py is the receiving side; decode/README.md, "reply push").

A mixin of :class:`~tandem.decode.worker.DecodeWorker` (its ``handle``, ``frozen``,
``release_frozen``, ``migrate_out``, ``_sent``, ``_background``, ``counts``). The sequence is
held like a frozen migration (decode/migration.py): the prefill worker's ``store`` reserves pages
and calls back this worker's ``push_out`` (its KVSource), which is ``migrate_out``; the hold ends
with that write, or with :meth:`ReplyPush.release_frozen` when the push ends without it, or at the
expiry (two transfer timeouts).

``debug_push_fault`` (test lever, ServeConfig; off by default): ``"fail"`` answers every push
FAILED without writing, so the prefill worker frees its reservation and the next turn recomputes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from tandem.core.messages import GenerateRequest
from tandem.transfer.messages import KVTransferRequest, PrefillResult
from tandem.transfer.state import TransferState
from tandem.worker.kv_regions import KV

log = logging.getLogger(__name__)

PUSH_FAULTS = ("", "fail")


class StoreClient(Protocol):
    """A prefill worker that can take a pushed sequence: ``store(req_wire) -> tokens received``
    (it calls back this worker's ``push_out``)."""

    name: str

    async def store(self, req_wire: dict) -> int: ...


class ReplyPush:
    reply_push: bool
    debug_push_fault: str
    _pushes: dict   # session id -> its push in flight (asyncio.Task)

    def _push_wanted(self, greq: GenerateRequest, prefill) -> bool:
        """Whether ``greq``'s sequence goes to ``prefill`` once it finished normally."""
        return (self.reply_push and prefill is not None and greq.resume is None
                and (greq.group is None or greq.group.size <= 1)
                and prefill.name in self.agent.peers and hasattr(prefill, "store"))

    def _push_ended(self, greq: GenerateRequest, prefill: StoreClient, out_ids: list[int]) -> None:
        """The stream of ``greq`` ended: push its held sequence (if it finished held), else
        nothing is held."""
        if not self.handle.connector.unhold(greq.rid):
            return
        seq = tuple(greq.prompt_ids) + tuple(out_ids[:-1])    # the last token has no KV
        if len(seq) % self.page_size and set(self.regions) != {KV}:
            # hybrid: only the state at the sequence's end moves, and a cache keeps a state
            # checkpoint only at a page boundary; the next turn is prefilled here instead
            self.release_frozen(greq.rid)
            self.counts["push_skipped"] += 1
            return
        self.frozen.hold(greq.rid)
        task = asyncio.ensure_future(self._push(greq, seq, prefill))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if greq.session_id is not None:
            self._pushes[greq.session_id] = task
            task.add_done_callback(lambda t: self._pushes.get(greq.session_id) is t
                                   and self._pushes.pop(greq.session_id))

    async def _push_settled(self, greq: GenerateRequest) -> None:
        """Before routing ``greq``: its session's push still in flight ends first (bounded by
        the transfer timeout), so the turn sees what the push moved."""
        task = self._pushes.get(greq.session_id) if greq.session_id is not None else None
        if task is not None and not task.done():
            await asyncio.wait([task], timeout=self.transfer_timeout_s)

    async def _push(self, greq: GenerateRequest, seq: tuple[int, ...], prefill: StoreClient) -> None:
        wire = GenerateRequest(greq.rid, seq, session_id=greq.session_id, tenant=greq.tenant,
                               cache_salt=greq.cache_salt, pins=greq.pins, pin_cap=greq.pin_cap).to_wire()
        try:
            n = await prefill.store(wire)
        except Exception as e:   # the prefill worker died or refused: the next turn recomputes
            log.info("reply push of %s to %s failed: %s", greq.rid, prefill.name, e)
            n = 0
        finally:
            self.release_frozen(greq.rid)   # a no-op once push_out released it
        self.counts["pushed" if n else "push_failed"] += 1
        self.counts["pushed_tokens"] += n
        if n:
            self._sent.add(prefill.name, GenerateRequest(greq.rid, seq, cache_salt=greq.cache_salt).cache_key)

    async def push_out(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """A prefill worker's ``store`` calls this: WRITE the held sequence from
        ``dst_prefix_len`` into ``xfer``'s pages (:meth:`migrate_out`'s contract)."""
        if self.debug_push_fault == "fail":
            req = KVTransferRequest.decode(xfer)
            self.release_frozen(req_wire["rid"])
            return PrefillResult(req.transfer_id, TransferState.FAILED, self.name,
                                 error="debug_push_fault=fail: nothing written")
        return await self.migrate_out(req_wire, xfer, dst_prefix_len)
