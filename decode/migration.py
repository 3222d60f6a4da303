"""Live migration, the source side of a decode worker: freeze a running request, hold its KV, and
WRITE it to the worker that continues it. Invariant: a frozen request's KV is held until exactly
one of :meth:`MigrationSource.write`, :meth:`~MigrationSource.release` or the expiry (two transfer
timeouts). The reply push (decode/reply_push.py) holds and writes a finished sequence the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.core.kv_messages import KVTransferRequest, PrefillResult
from tandem.decode.connector import DecodeHandle
from tandem.worker.kv_flow import KVSender


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
    """The frozen requests of a decode worker and the one write of each (a policy over the
    worker's :class:`KVSender`); ``counts["migrated_out"]`` counts the writes done."""

    def __init__(self, handle: DecodeHandle, sender: KVSender, counts: dict, ttl_s: float):
        self.handle, self.sender, self.counts = handle, sender, counts
        self.frozen = FrozenRequests(self.release, ttl_s)

    async def freeze(self, rid: str) -> None:
        """End decoding ``rid`` here (its stream's last chunk says "migrated") and hold its KV for
        :meth:`write`; ValueError, changing nothing, when it is not decoding here. A frozen
        request nobody copies within ``frozen.ttl_s`` (its router died) goes to the cache."""
        await self.handle.migrate(rid)
        self.frozen.hold(rid)

    def hold(self, rid: str) -> None:
        """``rid`` finished held (decode/connector.py ``hold``): frozen from now on."""
        self.frozen.hold(rid)

    def release(self, rid: str) -> None:
        """A frozen request whose KV will not be copied from here (the new worker recomputes it,
        or the move was given up): its KV goes to this worker's cache. A no-op if none is held."""
        self.frozen.end(rid)
        self.handle.release_held(rid)

    async def write(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """The KVSource's ``prefill`` of a frozen request: WRITE its KV from ``dst_prefix_len`` into
        ``xfer``'s pages, then release it to this worker's cache. Returns only when no write is
        in flight (but ``in_flight=True``)."""
        rid = req_wire["rid"]
        self.frozen.end(rid)   # being copied: no expiry from here on
        result = await self.sender.send(rid, KVTransferRequest.decode(xfer), dst_prefix_len)
        self.counts["migrated_out"] += result.ok
        return result
