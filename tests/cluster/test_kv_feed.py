"""The router's KV-event feed (cluster/kv_feed.py) against real publishers over ZMQ, and an
llm-d-style consumer decoding Tandem's events with vLLM's schema and repairing a dropped range by
replay."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.cache.radix.events import KVEventPublisher, page_hashes
from tandem.cache.unified import UnifiedRadixCache
from tandem.cluster.kv_feed import KVEventFeed
from tandem.router.kv_wire import GAP, RESTART, SKIP, APPLY, SequenceCheck
from tandem.router.prefix_index import KVEvent, GlobalBlockIndex

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _held(index: GlobalBlockIndex, wid: int, keys, page=2) -> list[int]:
    return [index.overlap(page_hashes(k, page)).get(wid, (0, 0))[0] for k in keys]


KEYS = ([1, 2, 3, 4], [1, 2, 5, 6, 7, 8], [9, 9])


def test_sequence_check():
    s = SequenceCheck()
    assert s.check(5, []) == APPLY
    s.applied(5)
    assert (s.check(6, []), s.check(9, []), s.check(4, []), s.check(0, [])) == (APPLY, GAP, SKIP, RESTART)
    assert s.check(3, [KVEvent(0, "cleared")]) == RESTART


def test_feed_rebuilds_a_running_workers_index_and_repairs_a_gap(monkeypatch):
    pub = KVEventPublisher(buffer_steps=3)
    cache = UnifiedRadixCache.simulated(page_size=2, events=pub)
    for k in KEYS:                                   # history published before anyone listens
        cache.insert(k)
    cache.insert([7, 7, 7, 7])
    index, lock = GlobalBlockIndex(), threading.RLock()
    feed = KVEventFeed(index, lock)
    try:
        feed.add(3, pub.endpoint, pub.replay_endpoint)   # older than the buffer: a snapshot
        assert _wait(lambda: feed.synced(3))
        assert _held(index, 3, KEYS) == [2, 3, 1]
        # drop everything the SUB socket delivers for a while: a gap the next message reveals
        real = KVEventFeed._parse
        dropping, dropped = {"on": True}, []

        def lossy(self, wid, parts):
            if dropping["on"]:
                dropped.append(parts)
                return None
            return real(self, wid, parts)

        monkeypatch.setattr(KVEventFeed, "_parse", lossy)
        time.sleep(0.3)                                   # the slow joiner has joined
        cache.insert([5, 5, 5, 5])
        cache.evict(100)                                  # everything goes
        cache.insert([1, 2, 3, 4])
        assert pub.seq == 8
        assert _wait(lambda: len(dropped) >= 3), len(dropped)   # seq 6-8 arrived and were dropped
        dropping["on"] = False
        cache.insert([6, 6])                              # this one arrives: the gap shows
        assert _wait(lambda: feed.counts["gaps"] == 1)
        assert _wait(lambda: _held(index, 3, KEYS + ([5, 5, 5, 5], [6, 6])) == [2, 1, 0, 0, 1])
    finally:
        feed.close()
        pub.close()


def test_feed_resyncs_a_publisher_that_restarted_in_place():
    pub = KVEventPublisher()
    port_pub, port_replay = pub.endpoint, pub.replay_endpoint
    cache = UnifiedRadixCache.simulated(page_size=2, events=pub)
    cache.insert([1, 2, 3, 4])
    index, lock = GlobalBlockIndex(), threading.RLock()
    feed = KVEventFeed(index, lock)
    try:
        feed.add(0, port_pub, port_replay)
        assert _wait(lambda: _held(index, 0, KEYS[:1]) == [2])
        for _ in range(3):
            cache.insert([8, 8])
            cache.evict(2)
        assert _wait(lambda: feed.counts["batches"] >= 7)
        pub.close()                                       # the engine restarts on the same ports
        for _ in range(50):                               # ZMQ releases the ports asynchronously
            try:
                pub2 = KVEventPublisher(port_pub, replay_endpoint=port_replay)
                break
            except zmq.ZMQError:
                time.sleep(0.1)
        time.sleep(0.3)                                   # the SUB socket reconnects
        cache2 = UnifiedRadixCache.simulated(page_size=2, events=pub2)   # seq 0: AllBlocksCleared
        cache2.insert([9, 9])
        assert _wait(lambda: _held(index, 0, KEYS) == [0, 0, 1])     # old entries gone, new ones in
        assert feed.counts["restarts"] + feed.counts["gaps"] >= 1
        pub2.close()
    finally:
        feed.close()


# -- an llm-d-style consumer, from vLLM's published schema -----------------------------------------
from vllm_kv_schema import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402


class LlmdStyleConsumer:
    """What llm-d's kv-cache indexer does with a vLLM pod: SUB to ``kv@<pod>@<model>``, decode each
    batch, keep {block hash} per pod; on a sequence gap ask the replay socket (vLLM's protocol)."""

    def __init__(self, endpoint: str, replay_endpoint: str):
        self.dec = msgspec.msgpack.Decoder(KVEventBatch)
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.blocks: set[int] = set()
        self.next_seq: int | None = None
        self.gaps: list[tuple[int, int]] = []
        self.pods: set[str] = set()

    def apply(self, payload: bytes) -> None:
        for e in self.dec.decode(payload).events:
            if isinstance(e, BlockStored):
                self.blocks |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.blocks -= set(e.block_hashes)
            else:
                self.blocks.clear()

    def replay(self, start: int) -> None:
        """vLLM's replay protocol from a DEALER: ``[b"", start]`` -> ``[b"", seq, payload]``* then -1."""
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            self.apply(payload)
            self.next_seq = int.from_bytes(seq, "big") + 1
        dealer.close(0)

    def poll(self, drop: set[int] = frozenset(), timeout_ms: int = 500) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_b, payload = self.sub.recv_multipart()
        self.pods.add(topic.decode().split("@")[1])
        seq = int.from_bytes(seq_b, "big")
        if seq in drop:
            return True                                   # lost on the way
        if self.next_seq is not None and seq > self.next_seq:
            self.gaps.append((self.next_seq, seq))
            self.replay(self.next_seq)
        if self.next_seq is None or seq >= self.next_seq:
            self.apply(payload)
            self.next_seq = seq + 1
        return True


def test_an_llm_d_style_consumer_reads_tandem_events_and_repairs_a_dropped_range():
    pub = KVEventPublisher(topic="kv@prefill-0@smollm2")
    consumer = LlmdStyleConsumer(pub.endpoint, pub.replay_endpoint)
    try:
        cache = UnifiedRadixCache.simulated(page_size=2, capacity_tokens=12, events=pub)   # seq 0
        joins: list[list[int]] = []

        def join() -> bool:                               # PUB/SUB drops what precedes the join:
            joins.append([0, len(joins)])                 # publish until one event arrives
            cache.insert(joins[-1])
            return consumer.poll(timeout_ms=50)

        assert _wait(join)
        while consumer.poll(timeout_ms=100):
            pass
        consumer.blocks.clear()                           # a late joiner replays the history
        consumer.replay(0)
        start = pub.seq
        inputs = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10], [11, 12], [1, 2, 3, 4, 13, 14]]
        for k in inputs:                                  # capacity forces removals too
            cache.insert(k)
        drop = {start + 1, start + 2}                     # a range lost on the way
        while consumer.poll(drop, timeout_ms=300):
            pass
        assert consumer.gaps == [(start + 1, start + 3)]
        held = set()
        for k in inputs + joins:
            m = cache.match(k)
            held |= set(page_hashes(k[:len(m.device_indices)], 2))
        assert consumer.blocks == held and consumer.pods == {"prefill-0"}
    finally:
        consumer.sub.close(0)
        pub.close()
