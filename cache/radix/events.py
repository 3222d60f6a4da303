"""KV events: which pages a worker stored or removed, published in vLLM's wire format."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import msgpack

from tandem.core.page_hash import page_hashes  # noqa: F401  (the chain these events carry)

if TYPE_CHECKING:
    import zmq

DEVICE = "device"
HOST = "host"
MEDIUM = {DEVICE: "GPU", HOST: "CPU"}          # Tandem's tier -> vLLM's medium
TIER = {v: k for k, v in MEDIUM.items()}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_BUFFER = 10_000                          # batches kept for replay (vLLM's buffer_steps)


@dataclass(frozen=True)
class BlockStored:
    """Pages now held on ``medium`` (DEVICE or HOST). ``token_ids`` covers exactly these pages."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = DEVICE

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True)
class BlockPinned:
    """Tandem's extension: these pages (a prefix's chain, root first) are pinned on this worker for
    ``ttl_s`` more seconds (a pin made or lengthened; its end needs no event). Published in batches
    of their own, never beside vLLM's events, so that a consumer that knows only vLLM's schema drops
    a pin batch whole and loses no store or remove (tests/cache/test_events.py decodes both ways)."""

    block_hashes: list[int]
    ttl_s: float


@dataclass(frozen=True)
class BlockUnpinned:
    """Tandem's extension: these pages' pins ended early (``DELETE /admin/cache/pins``)."""

    block_hashes: list[int]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
PinEvent = BlockPinned | BlockUnpinned
WireEvent = KVEvent | PinEvent          # what a publisher sends (pins: Tandem's extension)


class EventPublisher(Protocol):
    """Where a cache sends its events: :class:`KVEventPublisher`, or a simulation's sink."""

    def publish(self, events: Iterable[WireEvent]) -> None: ...


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: list[WireEvent]


def _event_to_wire(e: WireEvent) -> list[Any]:
    if isinstance(e, BlockStored):
        return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids),
                e.block_size, None, MEDIUM[e.medium], None]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes), MEDIUM[e.medium]]
    if isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared"]
    if isinstance(e, BlockPinned):
        return ["BlockPinned", list(e.block_hashes), float(e.ttl_s)]
    if isinstance(e, BlockUnpinned):
        return ["BlockUnpinned", list(e.block_hashes)]
    raise TypeError(f"not a KV event: {e!r}")


def encode(ts: float, events: Sequence[WireEvent]) -> bytes:
    return msgpack.packb([ts, [_event_to_wire(e) for e in events]], use_bin_type=True)


def decode(payload: bytes) -> tuple[float, list[WireEvent]]:
    """The inverse of :func:`encode`. Raises ValueError on anything else."""
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError("payload is not [ts, [events]]")
    out: list[WireEvent] = []
    for w in obj[1]:
        tag = w[0] if isinstance(w, list) and w else None
        if tag == "BlockStored":
            out.append(BlockStored(list(w[1]), w[2], list(w[3]), int(w[4]), TIER.get(w[6] or "GPU", DEVICE)))
        elif tag == "BlockRemoved":
            out.append(BlockRemoved(list(w[1]), TIER.get((w[2] if len(w) > 2 else None) or "GPU", DEVICE)))
        elif tag == "AllBlocksCleared":
            out.append(AllBlocksCleared())
        elif tag == "BlockPinned":
            out.append(BlockPinned(list(w[1]), float(w[2])))
        elif tag == "BlockUnpinned":
            out.append(BlockUnpinned(list(w[1])))
        else:
            raise ValueError(f"unknown KV event {w!r}"[:200])
    return float(obj[0]), out


def topic_for(worker: str, model: str) -> str:
    return f"kv@{worker}@{model}"


class _Held:

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, str], tuple[int | None, list[int], int]] = {}
        self.pins: dict[int, float] = {}        # page hash -> monotonic time its pin ends

    def apply(self, e: WireEvent) -> None:
        if isinstance(e, BlockPinned):
            until = time.monotonic() + e.ttl_s
            for h in e.block_hashes:
                self.pins[h] = max(self.pins.get(h, 0.0), until)
        elif isinstance(e, BlockUnpinned):
            for h in e.block_hashes:
                self.pins.pop(h, None)
        elif isinstance(e, BlockStored):
            bs = e.block_size
            for i, h in enumerate(e.block_hashes):
                parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                self.blocks[(h, e.medium)] = (parent, list(e.token_ids[i * bs:(i + 1) * bs]), bs)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                self.blocks.pop((h, e.medium), None)
        else:
            self.blocks.clear()
            self.pins.clear()

    def snapshot(self) -> list[list[WireEvent]]:
        """What a late subscriber needs, as batches: the held blocks, then the live pins."""
        now = time.monotonic()
        out: list[list] = [[AllBlocksCleared()] + [BlockStored([h], parent, tokens, bs, medium)
                                                   for (h, medium), (parent, tokens, bs) in self.blocks.items()]]
        for h, until in list(self.pins.items()):
            if until <= now:
                del self.pins[h]
        if self.pins:
            out.append([BlockPinned([h], until - now) for h, until in self.pins.items()])
        return out


class KVEventPublisher:
    """ZMQ PUB socket bound to ``endpoint`` plus the replay ROUTER at ``replay_endpoint`` (None: no
    replay). ``publish`` is thread-safe and never blocks (PUB drops for slow subscribers; the
    sequence number shows the gap); :meth:`close` stops the replay thread."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", topic: str = "kv",
                 replay_endpoint: str | None = "tcp://127.0.0.1:0", buffer_steps: int = REPLAY_BUFFER):
        import zmq

        self._zmq = zmq
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = self._bind(self._sock, endpoint)
        self.topic = topic
        self.seq = 0
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._held = _Held()
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._router, replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, name="tandem-kv-replay", daemon=True)
            self._thread.start()

    @staticmethod
    def _bind(sock, endpoint: str) -> str:
        base, _, port = endpoint.rpartition(":")
        if port == "0":
            return f"{base}:{sock.bind_to_random_port(base)}"
        sock.bind(endpoint)
        return endpoint

    def publish(self, events: Iterable[WireEvent]) -> None:
        """Send ``events`` as one batch; pin events (Tandem's extension) go in a batch of their own,
        after the others."""
        events = list(events)
        pins = [e for e in events if isinstance(e, (BlockPinned, BlockUnpinned))]
        if pins and len(pins) < len(events):
            self.publish([e for e in events if not isinstance(e, (BlockPinned, BlockUnpinned))])
            events = pins
        if not events:
            return
        with self._lock:
            payload = encode(time.time(), events)
            seq = self.seq
            self.seq += 1
            for e in events:
                self._held.apply(e)
            self._buffer.append((seq, payload))
            self._sock.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])

    def _replies(self, start: int) -> list[tuple[int, bytes]]:
        with self._lock:
            if self.seq == 0:
                return []
            if start >= self.seq:
                return []
            if self._buffer and self._buffer[0][0] <= start:
                return [(s, p) for s, p in self._buffer if s >= start]
            batches = self._held.snapshot()         # numbered to end at the last sequence sent
            first = self.seq - len(batches)
            return [(first + i, encode(time.time(), b)) for i, b in enumerate(batches)]

    def _serve_replay(self) -> None:
        zmq = self._zmq
        try:
            while not self._stop.is_set():
                if not self._router.poll(100, zmq.POLLIN):
                    continue
                frames = self._router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                for s, p in self._replies(start):
                    self._router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
                self._router.send_multipart([ident, b"", END_SEQ, b""])
        except zmq.ZMQError:
            pass
        finally:
            self._router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._sock.close(0)


class KVEventSubscriber:
    """A ZMQ SUB socket connected to a publisher. ``recv`` returns one batch or None (timeout)."""

    def __init__(self, endpoint: str, topic: str = ""):
        import zmq

        self._zmq = zmq
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)

    def recv(self, timeout_ms: int = 1000) -> EventBatch | None:
        if not self._sock.poll(timeout_ms, self._zmq.POLLIN):
            return None
        _topic, seq, payload = self._sock.recv_multipart()
        ts, events = decode(payload)
        return EventBatch(int.from_bytes(seq, "big"), ts, events)

    def close(self) -> None:
        self._sock.close(0)


def replay_frames(endpoint: str, start_seq: int, timeout_ms: int = 2000,
                  ctx=None) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol as a client: ``(seq, payload)`` for every batch from ``start_seq``, in
    order; raises TimeoutError (no end marker within ``timeout_ms``) or ValueError (malformed)."""
    import zmq

    sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            if not sock.poll(timeout_ms, zmq.POLLIN):
                raise TimeoutError(f"no replay answer from {endpoint} within {timeout_ms} ms")
            frames = sock.recv_multipart()
            if len(frames) != 3:
                raise ValueError(f"a replay answer of {len(frames)} frames")
            _empty, seq, payload = frames
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(0)


def replay(endpoint: str, start_seq: int, timeout_ms: int = 2000) -> list[EventBatch]:
    return [EventBatch(seq, *decode(payload)) for seq, payload in replay_frames(endpoint, start_seq, timeout_ms)]
