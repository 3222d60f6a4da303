"""Where stored responses live: :class:`ResponseStore` (the interface the routes use),
:class:`ResponseTable` (the bounded table itself) and :class:`MemoryResponseStore`."""

from __future__ import annotations

import copy
import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

IN_PROGRESS = ("queued", "in_progress")


@dataclass(frozen=True)
class StoredResponse:
    """One response: ``response`` is its Response object (JSON-able dict, ``status`` in it),
    ``history`` its conversation's input items up to and including its output, ``session``
    the session key its turns are routed by (the KV of the chain is on that session's
    workers), ``tenant`` the tenant that created it: only that tenant may read, delete,
    cancel or continue it (anyone else gets 404)."""

    id: str
    response: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    session: str | None = None
    tenant: str = ""

    @property
    def status(self) -> str:
        return str(self.response.get("status", ""))

    def with_status(self, status: str) -> "StoredResponse":
        return replace(self, response={**self.response, "status": status})

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "StoredResponse":
        if not isinstance(d, dict) or not {"id", "response", "history", "session"} <= set(d) <= {
                "id", "response", "history", "session", "tenant"}:
            raise ValueError(f"not a stored response: {sorted(d) if isinstance(d, dict) else type(d).__name__}")
        return cls(d["id"], d["response"], d["history"], d["session"], d.get("tenant", ""))

    def size(self) -> int:
        return len(json.dumps(self.to_wire(), ensure_ascii=False, separators=(",", ":")))


@runtime_checkable
class ResponseStore(Protocol):
    """The routes' view of the store (async: a Ray-backed one answers over the network)."""

    async def put(self, rec: StoredResponse, unless_cancelled: bool = False) -> StoredResponse:
        """Store ``rec`` (replacing a record of its id); returns what is stored afterwards (the
        cancelled record, with ``unless_cancelled``, when the id was cancelled meanwhile)."""

    async def get(self, rid: str) -> StoredResponse | None:
        """The record, or None (never stored, deleted, evicted or expired)."""

    async def delete(self, rid: str) -> bool:
        """Drop the record; whether there was one."""

    async def cancel(self, rid: str) -> StoredResponse | None:
        """Mark a queued / in-progress record "cancelled" and return it (records in any other
        state are returned unchanged); None when there is no record."""


class ResponseTable:
    """The bounded table (synchronous; one caller at a time: the actor's or the event loop's)."""

    def __init__(self, max_stored: int, max_bytes: int, ttl_s: float, clock=time.monotonic):
        self.max_stored, self.max_bytes, self.ttl_s, self.clock = max_stored, max_bytes, ttl_s, clock
        self._recs: OrderedDict[str, tuple[dict, int, float]] = OrderedDict()   # id -> (wire, size, touched)
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._recs)

    def put(self, wire: dict, unless_cancelled: bool = False) -> dict:
        rec = StoredResponse.from_wire(wire)
        self._expire()
        old = self._recs.get(rec.id)
        if unless_cancelled and old is not None and old[0]["response"].get("status") == "cancelled":
            self._touch(rec.id)
            return old[0]
        self._drop(rec.id)
        size = rec.size()
        if size > self.max_bytes:
            return wire          # larger than the whole store: not kept
        self._recs[rec.id] = (wire, size, self.clock())
        self.bytes += size
        while len(self._recs) > self.max_stored or self.bytes > self.max_bytes:
            self._drop(next(iter(self._recs)))
            self.evicted += 1
        return wire

    def get(self, rid: str) -> dict | None:
        self._expire()
        if rid not in self._recs:
            return None
        self._touch(rid)
        return self._recs[rid][0]

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._drop(rid)

    def cancel(self, rid: str) -> dict | None:
        wire = self.get(rid)
        if wire is None or wire["response"].get("status") not in IN_PROGRESS:
            return wire
        return self.put(StoredResponse.from_wire(wire).with_status("cancelled").to_wire())

    def stats(self) -> dict:
        return {"stored": len(self._recs), "bytes": self.bytes, "evicted": self.evicted}

    def _touch(self, rid: str) -> None:
        wire, size, _ = self._recs[rid]
        self._recs[rid] = (wire, size, self.clock())
        self._recs.move_to_end(rid)

    def _drop(self, rid: str) -> bool:
        old = self._recs.pop(rid, None)
        if old is not None:
            self.bytes -= old[1]
        return old is not None

    def _expire(self) -> None:
        now = self.clock()
        while self._recs:
            rid, (_, _, touched) = next(iter(self._recs.items()))
            if now - touched <= self.ttl_s:
                return
            self._drop(rid)


class MemoryResponseStore:
    """:class:`ResponseStore` over a :class:`ResponseTable` in this process. Records are copied
    in and out, as they would be over the wire, so no caller shares a dict with the table."""

    def __init__(self, max_stored: int = 10_000, max_bytes: int = 256 << 20, ttl_s: float = 86400.0):
        self.table = ResponseTable(max_stored, max_bytes, ttl_s)

    async def put(self, rec: StoredResponse, unless_cancelled: bool = False) -> StoredResponse:
        return StoredResponse.from_wire(copy.deepcopy(self.table.put(copy.deepcopy(rec.to_wire()), unless_cancelled)))

    async def get(self, rid: str) -> StoredResponse | None:
        return _copy(self.table.get(rid))

    async def delete(self, rid: str) -> bool:
        return self.table.delete(rid)

    async def cancel(self, rid: str) -> StoredResponse | None:
        return _copy(self.table.cancel(rid))


def _copy(wire: dict | None) -> StoredResponse | None:
    return None if wire is None else StoredResponse.from_wire(copy.deepcopy(wire))
