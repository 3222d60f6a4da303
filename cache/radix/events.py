"""KV events: which pages a worker stored or removed, for a router's prefix index.

A page (block) is named by a hash chain: ``h_i = H(h_{i-1}, tokens of page i)`` with
``h_{-1}`` empty, ``H`` = the first 8 bytes of BLAKE2b as an unsigned int. The chain makes a
page's hash name its whole prefix, so a router can rebuild it from token ids alone
(:func:`page_hashes`) and never needs the worker's slot ids.

Events travel over ZMQ PUB as multipart ``[topic, seq (8 bytes big-endian), payload]``; the
payload is msgpack (or JSON) of ``{"ts", "seq", "events": [...]}``. Never pickle.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import msgpack

DEVICE = "device"
HOST = "host"


def page_hashes(tokens: Sequence[int], page_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of the whole pages of ``tokens`` (a trailing partial page is ignored)."""
    out = []
    h = parent
    for i in range(0, len(tokens) - page_size + 1, page_size):
        d = hashlib.blake2b(digest_size=8)
        if h is not None:
            d.update(h.to_bytes(8, "little"))
        d.update(array("q", tokens[i:i + page_size]).tobytes())
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


@dataclass(frozen=True)
class BlockStored:
    """Pages now held on ``medium``. ``token_ids`` covers exactly these pages."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = DEVICE
    type: str = "stored"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    num_tokens: int
    medium: str = DEVICE
    type: str = "removed"


@dataclass(frozen=True)
class AllCleared:
    type: str = "cleared"


KVEvent = BlockStored | BlockRemoved | AllCleared
_TYPES = {"stored": BlockStored, "removed": BlockRemoved, "cleared": AllCleared}


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: list[KVEvent]


def encode(batch: EventBatch, fmt: str = "msgpack") -> bytes:
    obj = {"seq": batch.seq, "ts": batch.ts, "events": [asdict(e) for e in batch.events]}
    if fmt == "msgpack":
        return msgpack.packb(obj, use_bin_type=True)
    if fmt == "json":
        return json.dumps(obj, separators=(",", ":")).encode()
    raise ValueError(f"unknown event encoding {fmt!r} (msgpack or json)")


def decode(payload: bytes, fmt: str = "msgpack") -> EventBatch:
    obj = msgpack.unpackb(payload, raw=False) if fmt == "msgpack" else json.loads(payload)
    events = [_TYPES[e["type"]](**{k: v for k, v in e.items() if k != "type"}) for e in obj["events"]]
    return EventBatch(obj["seq"], obj["ts"], events)


class KVEventPublisher:
    """ZMQ PUB socket bound to ``endpoint`` (``tcp://127.0.0.1:0`` picks a free port;
    :attr:`endpoint` then names the real one). ``publish`` never blocks: PUB drops messages for
    slow subscribers, and the sequence number lets a subscriber notice the gap."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", topic: bytes = b"kv",
                 fmt: str = "msgpack"):
        import zmq

        if fmt not in ("msgpack", "json"):
            raise ValueError(f"unknown event encoding {fmt!r} (msgpack or json)")
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        base, _, port = endpoint.rpartition(":")
        if port == "0":
            port = str(self._sock.bind_to_random_port(base))
        else:
            self._sock.bind(endpoint)
        self.endpoint = f"{base}:{port}"
        self.topic = topic
        self.fmt = fmt
        self.seq = 0

    def publish(self, events: Iterable[KVEvent]) -> None:
        events = list(events)
        if not events:
            return
        batch = EventBatch(self.seq, time.time(), events)
        self._sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), encode(batch, self.fmt)])
        self.seq += 1

    def close(self) -> None:
        self._sock.close(0)


class KVEventSubscriber:
    """Connects a ZMQ SUB socket to a publisher's endpoint. ``recv`` returns one batch or None."""

    def __init__(self, endpoint: str, topic: bytes = b"kv", fmt: str = "msgpack"):
        import zmq

        self._zmq = zmq
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self.fmt = fmt

    def recv(self, timeout_ms: int = 1000) -> EventBatch | None:
        if not self._sock.poll(timeout_ms, self._zmq.POLLIN):
            return None
        _topic, _seq, payload = self._sock.recv_multipart()
        return decode(payload, self.fmt)

    def close(self) -> None:
        self._sock.close(0)
