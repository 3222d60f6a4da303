"""The router's KV-event feed: every worker's publisher applied to the dispatcher's exact block
index by one thread (replay on add, gap repair, publisher restarts). The index may under-report,
never over-report: a worker whose replay does not answer has its entries dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.cache.radix.events import replay_frames
from tandem.router.kv_wire import APPLY, GAP, RESTART, SequenceCheck, decode_payload
from tandem.router.prefix_index import GlobalBlockIndex

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import zmq

    from tandem.router.kv_wire import KVEvent

log = logging.getLogger(__name__)

POLL_MS = 100
REPLAY_TIMEOUT_MS = 2000
RESYNC_INTERVAL_S = 1.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class _Source:
    endpoint: str
    replay: str | None
    sock: zmq.Socket[bytes]
    seq: SequenceCheck = field(default_factory=SequenceCheck)
    synced: bool = False
    last_try: float = float("-inf")


class KVEventFeed:
    def __init__(self, index: GlobalBlockIndex, lock: AbstractContextManager[Any],
                 replay_timeout_ms: int = REPLAY_TIMEOUT_MS) -> None:
        import zmq

        self._zmq = zmq
        self.index, self.lock = index, lock
        self.replay_timeout_ms = replay_timeout_ms
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        # ("add", worker id, (endpoint, replay endpoint)) or ("remove", worker id, None)
        self._cmds: queue.SimpleQueue[tuple[str, int, tuple[str, str | None] | None]] = queue.SimpleQueue()
        self._sources: dict[int, _Source] = {}
        self.counts = {"batches": 0, "events": 0, "malformed": 0, "gaps": 0, "replays": 0,
                       "restarts": 0, "dropped": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-kv-events", daemon=True)
        self._thread.start()

    def add(self, worker_id: int, endpoint: str, replay_endpoint: str | None = None) -> None:
        for e in (endpoint, replay_endpoint):
            if e is not None and (not isinstance(e, str) or not e.startswith("tcp://")):
                raise ValueError(f"bad KV event endpoint {e!r} for worker {worker_id}")
        self._cmds.put(("add", worker_id, (endpoint, replay_endpoint)))

    def remove(self, worker_id: int) -> None:
        self._cmds.put(("remove", worker_id, None))

    def synced(self, worker_id: int) -> bool:
        """Whether ``worker_id``'s history has been replayed into the index (tests, /health)."""
        s = self._sources.get(worker_id)
        return s is not None and s.synced

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _commands(self, poller: zmq.Poller) -> None:
        zmq = self._zmq
        while True:
            try:
                op, wid, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            old = self._sources.pop(wid, None)
            if old is not None:
                poller.unregister(old.sock)
                old.sock.close(0)
            with self.lock:
                self.index.remove_worker(wid)
            if op == "add" and arg is not None:
                endpoint, replay = arg
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(endpoint)
                src = _Source(endpoint, replay, sock)
                self._sources[wid] = src
                poller.register(src.sock, zmq.POLLIN)
                self._sync(wid, src, 0)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._commands(poller)
                if not self._sources:
                    self._stop.wait(POLL_MS / 1000)
                    continue
                ready = dict(poller.poll(POLL_MS))
                for wid, src in list(self._sources.items()):
                    if src.sock in ready:
                        self._drain(wid, src)
        except Exception:  # noqa: BLE001
            log.exception("KV event feed stopped")
        finally:
            for src in self._sources.values():
                src.sock.close(0)

    def _drain(self, wid: int, src: _Source) -> None:
        zmq = self._zmq
        while True:
            try:
                parts = src.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._parse(wid, parts)
            if msg is None:
                continue
            seq, events = msg
            if not src.synced and time.monotonic() - src.last_try >= RESYNC_INTERVAL_S:
                self._sync(wid, src, 0 if src.seq.expected is None else src.seq.expected)
            action = src.seq.check(seq, events)
            if action == RESTART:
                self.counts["restarts"] += 1
                log.warning("worker %d's KV event publisher restarted (seq %d, expected %s): resyncing",
                            wid, seq, src.seq.expected)
                src.seq.expected = None
                self._drop(wid)
                self._sync(wid, src, 0)
                action = src.seq.check(seq, events)
            elif action == GAP:
                self.counts["gaps"] += 1
                self._sync(wid, src, src.seq.expected or 0)
                action = src.seq.check(seq, events)
            if action == APPLY:
                self._apply(wid, src, seq, events)

    def _apply(self, wid: int, src: _Source, seq: int, events: list[KVEvent]) -> None:
        with self.lock:
            if self._sources.get(wid) is src:
                self.index.apply_all(events)
        src.seq.applied(seq)
        self.counts["batches"] += 1
        self.counts["events"] += len(events)

    def _drop(self, wid: int) -> None:
        with self.lock:
            self.index.remove_worker(wid)

    def _sync(self, wid: int, src: _Source, start: int) -> None:
        """Replay from ``start`` into the index; on no answer drop the worker's entries."""
        src.last_try = time.monotonic()
        if src.replay is None:
            src.synced = start == 0 and src.seq.expected is None
            return
        self.counts["replays"] += 1
        try:
            batches = self._replay(wid, src.replay, start)
        except (TimeoutError, ValueError) as e:
            self.counts["dropped"] += 1
            log.warning("KV event replay from worker %d failed (%s): its index entries are dropped", wid, e)
            self._drop(wid)
            src.seq.expected, src.synced = None, False
            return
        for seq, events in batches:
            snapshot = bool(events) and events[0].kind == "cleared"
            if src.seq.expected is None or seq >= src.seq.expected or snapshot:
                self._apply(wid, src, seq, events)
        src.synced = True

    def _replay(self, wid: int, endpoint: str, start: int) -> list[tuple[int, list[KVEvent]]]:
        frames = replay_frames(endpoint, start, self.replay_timeout_ms, ctx=self._ctx)
        return [(seq, decode_payload(wid, payload)) for seq, payload in frames]

    def _parse(self, wid: int, parts: list[bytes]) -> tuple[int, list[KVEvent]] | None:
        try:
            _topic, seq_b, payload = parts
            if len(seq_b) != 8:
                raise ValueError(f"sequence frame of {len(seq_b)} bytes")
            events = decode_payload(wid, payload)
        except Exception as ex:  # noqa: BLE001
            self.counts["malformed"] += 1
            log.warning("dropped a malformed KV event message from worker %d: %s", wid, ex)
            return None
        return int.from_bytes(seq_b, "big"), events
