"""KV events as the router reads them: vLLM's wire format, and the per-publisher sequence check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .prefix_index import DEVICE, HOST, KVEvent

TIERS = {None: DEVICE, "GPU": DEVICE, "CPU": HOST, "gpu": DEVICE, "cpu": HOST}


def _hash(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("a block hash is not a bool")
    if isinstance(v, int):
        return v & 0xFFFF_FFFF_FFFF_FFFF
    if isinstance(v, (bytes, bytearray)) and v:
        return int.from_bytes(bytes(v[-8:]).rjust(8, b"\0"), "big")
    raise ValueError(f"block hash {v!r} is neither an int nor bytes"[:120])


def _tier(v: Any) -> str:
    if v not in TIERS:
        raise ValueError(f"unknown medium {v!r}"[:80])
    return TIERS[v]


def parse_event(worker_id: int, w: Any) -> KVEvent:
    """One wire event as a router :class:`KVEvent`; ValueError when it is not one."""
    if not isinstance(w, list) or not w or not isinstance(w[0], str):
        raise ValueError(f"event is not a tagged array: {w!r}"[:160])
    tag = w[0]
    if tag == "BlockStored":
        if len(w) < 5 or not isinstance(w[1], list) or not isinstance(w[3], list):
            raise ValueError(f"malformed BlockStored: {w!r}"[:160])
        hashes = tuple(_hash(h) for h in w[1])
        parent = None if w[2] is None else _hash(w[2])
        return KVEvent(worker_id, "stored", hashes, len(w[3]), _tier(w[6] if len(w) > 6 else None), parent)
    if tag == "BlockRemoved":
        if len(w) < 2 or not isinstance(w[1], list):
            raise ValueError(f"malformed BlockRemoved: {w!r}"[:160])
        return KVEvent(worker_id, "removed", tuple(_hash(h) for h in w[1]), 0,
                       _tier(w[2] if len(w) > 2 else None))
    if tag == "AllBlocksCleared":
        return KVEvent(worker_id, "cleared")
    if tag == "BlockPinned":          # Tandem's extension (cache/radix/events.py)
        if len(w) < 3 or not isinstance(w[1], list) or not isinstance(w[2], (int, float)) or w[2] < 0:
            raise ValueError(f"malformed BlockPinned: {w!r}"[:160])
        return KVEvent(worker_id, "pinned", tuple(_hash(h) for h in w[1]), ttl_s=float(w[2]))
    if tag == "BlockUnpinned":
        if len(w) < 2 or not isinstance(w[1], list):
            raise ValueError(f"malformed BlockUnpinned: {w!r}"[:160])
        return KVEvent(worker_id, "unpinned", tuple(_hash(h) for h in w[1]))
    raise ValueError(f"unknown KV event tag {tag!r}"[:80])


def decode_payload(worker_id: int, payload: bytes) -> list[KVEvent]:
    """A batch's events, validated (msgpack only, never pickle). ValueError on anything else."""
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError("payload is not [ts, [events]]")
    return [parse_event(worker_id, w) for w in obj[1]]


APPLY, SKIP, GAP, RESTART = "apply", "skip", "gap", "restart"


@dataclass
class SequenceCheck:
    """The next sequence number expected from one publisher (None: not synchronised yet)."""

    expected: int | None = None

    def check(self, seq: int, events: list[KVEvent]) -> str:
        """What to do with batch ``seq``:

        - APPLY: the next one (or the first seen with nothing expected yet);
        - SKIP: already applied (a replay and the live stream overlap);
        - GAP: later than expected: fetch ``[expected, seq)`` first (a replay), then this one;
        - RESTART: earlier than expected and it opens a new history (sequence 0, or an
          ``AllBlocksCleared`` first): the publisher restarted; forget its blocks and resync.
        """
        if self.expected is None or seq == self.expected:
            return APPLY
        if seq > self.expected:
            return GAP
        if seq == 0 or (events and events[0].kind == "cleared"):
            return RESTART
        return SKIP

    def applied(self, seq: int) -> None:
        self.expected = seq + 1
