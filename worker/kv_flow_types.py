"""The words of a KV handoff (worker/kv_flow.py): who writes the KV (:class:`KVSource`), how a
write ended (:class:`WriteOutcome`), how a receive ended (:class:`Landed` or :class:`Failed`), how
a policy stops one (:class:`Stop`), and one handoff's state (:class:`Handoff`, transfer/handoff.py's)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.core.kv_messages import PrefillResult
from tandem.core.transfer_state import TransferState
from tandem.core.types import StreamChunk
# re-exported: the roles name KVSender.open's handoffs and import only worker/ and core/
from tandem.transfer.handoff import Handoff as Handoff
from tandem.worker.receiving import Reservation


class KVSource(Protocol):
    """Whoever writes a request's KV into pages a worker reserved (a prefill worker computing it,
    a decode worker holding it), in process; over Ray it is core/actors.py's ``KVSource``
    (``write_kv`` / ``drop_kv``) through worker/actor.py's one adapter, ``RayKVSource``."""

    name: str

    async def prefill(self, req_wire: dict[str, Any], xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """WRITE ``req_wire``'s KV from ``dst_prefix_len`` into ``xfer``'s pages; returns (or raises)
        only when no write can still be in flight, except a result with ``in_flight=True``."""

    async def abort(self, rid: str, reason: str) -> None:
        """No write will be wanted for ``rid`` (stop computing it, or release its held KV)."""


class SourceUnavailable(Exception):
    """What a KVSource's ``prefill`` raises when its worker is dead (no write of it can land)."""


@dataclass(frozen=True)
class WriteOutcome:
    """How a WRITE ended: DONE, FAILED, or QUARANTINED (its destination pages are never reused)."""

    state: TransferState
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Landed:
    """The KV is in ``reservation``'s pages (no write in flight); ``source`` wrote it."""

    reservation: Reservation
    result: PrefillResult
    source: KVSource
    reserve_s: float
    receive_s: float


@dataclass(frozen=True)
class Failed:
    """Not received: ``reason`` one of refused, no_room, aborted, timeout, prefill_failed,
    digest; ``final``: the engine's own last chunk when the request ended before it was
    reserved; ``redispatch``: the source died before writing. The pages follow the handoff's
    rule (freed now, after the source's call ended, or quarantined)."""

    error: str
    reason: str
    final: StreamChunk | None = None
    redispatch: bool = False


@dataclass(eq=False)
class Stop:
    """The policy's way to stop a receive in progress (``set``); also what group gates wait on."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.event.set()
