"""The driver's KV-event feed: ZMQ SUB sockets to every prefill worker's KVEventPublisher, one
background thread, events applied to the router's exact :class:`GlobalBlockIndex`.

Each worker's publisher binds ``tcp://127.0.0.1:<ephemeral>`` and reports the endpoint in its
``info()``; the backend calls :meth:`KVEventFeed.add` with the worker's policy id. Messages are
multipart ``[topic, seq (8 bytes big-endian), msgpack payload]`` (cache/radix/events.py); each
payload is unpacked with msgpack (never pickle) and every event validated by
``KVEvent.from_wire``; anything malformed is dropped and counted. A sequence gap (PUB drops for
slow subscribers) is counted too. The sockets belong to the thread; add/remove go through a queue.
"""

from __future__ import annotations

import logging
import queue
import threading

import msgpack

from tandem.router.prefix_index import GlobalBlockIndex, KVEvent

log = logging.getLogger(__name__)

POLL_MS = 100


class KVEventFeed:
    def __init__(self, index: GlobalBlockIndex, lock, topic: bytes = b"kv"):
        import zmq

        self._zmq = zmq
        self.index, self.lock, self.topic = index, lock, topic
        self._ctx = zmq.Context.instance()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._socks: dict[int, object] = {}        # worker id -> SUB socket
        self._next_seq: dict[int, int] = {}
        self.counts = {"batches": 0, "events": 0, "malformed": 0, "gaps": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-kv-events", daemon=True)
        self._thread.start()

    def add(self, worker_id: int, endpoint: str) -> None:
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise ValueError(f"bad KV event endpoint {endpoint!r} for worker {worker_id}")
        self._cmds.put(("add", worker_id, endpoint))

    def remove(self, worker_id: int) -> None:
        self._cmds.put(("remove", worker_id, None))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the thread
    def _commands(self, poller) -> None:
        zmq = self._zmq
        while True:
            try:
                op, wid, endpoint = self._cmds.get_nowait()
            except queue.Empty:
                return
            old = self._socks.pop(wid, None)
            if old is not None:
                poller.unregister(old)
                old.close(0)
            self._next_seq.pop(wid, None)
            if op == "add":
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                sock.connect(endpoint)
                self._socks[wid] = sock
                poller.register(sock, zmq.POLLIN)
            else:
                with self.lock:   # events that arrived after the worker left
                    self.index.remove_worker(wid)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._commands(poller)
                if not self._socks:
                    self._stop.wait(POLL_MS / 1000)
                    continue
                ready = dict(poller.poll(POLL_MS))
                for wid, sock in list(self._socks.items()):
                    if sock in ready:
                        self._drain(wid, sock)
        except Exception:  # noqa: BLE001 - the feed is advisory; routing goes on without it
            log.exception("KV event feed stopped")
        finally:
            for sock in self._socks.values():
                sock.close(0)

    def _drain(self, wid: int, sock) -> None:
        zmq = self._zmq
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            events = self._parse(wid, parts)
            if events:
                with self.lock:
                    if wid in self._socks:
                        self.index.apply_all(events)
                self.counts["events"] += len(events)

    def _parse(self, wid: int, parts: list[bytes]) -> list[KVEvent]:
        try:
            topic, seq_b, payload = parts
            seq = int.from_bytes(seq_b, "big")
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
            if not isinstance(obj, dict) or not isinstance(obj.get("events"), list):
                raise ValueError("payload is not {'events': [...]}")
            events = []
            for e in obj["events"]:
                if not isinstance(e, dict):
                    raise ValueError(f"event is a {type(e).__name__}")
                ev = KVEvent.from_wire(wid, e)
                if not all(isinstance(h, int) for h in ev.block_hashes):
                    raise ValueError("block hashes must be ints")
                events.append(ev)
        except Exception as ex:  # noqa: BLE001 - anything a peer sends that we cannot read
            self.counts["malformed"] += 1
            log.warning("dropped a malformed KV event message from worker %d: %s", wid, ex)
            return []
        expect = self._next_seq.get(wid)
        if expect is not None and seq != expect:
            self.counts["gaps"] += 1
        self._next_seq[wid] = seq + 1
        self.counts["batches"] += 1
        return events
