"""KV events: page hash chains, vLLM's wire format (checked with vLLM's own msgspec schema, as
llm-d's indexer reads it), a real ZMQ PUB/SUB round trip, and replay (buffered and snapshot)."""

from __future__ import annotations

import time

import pytest

from tandem.cache.radix.events import (AllBlocksCleared, BlockPinned, BlockRemoved, BlockStored, BlockUnpinned,
                                       KVEventPublisher,
                                       KVEventSubscriber, decode, encode, page_hashes, replay, topic_for)
from tandem.cache.unified import UnifiedRadixCache

msgspec = pytest.importorskip("msgspec")


# vLLM's event schema, as llm-d's indexer decodes it (tests/vllm_kv_schema.py)
from vllm_kv_schema import DECODER as VLLM_DECODER  # noqa: E402
from vllm_kv_schema import AllBlocksCleared as VAllBlocksCleared  # noqa: E402
from vllm_kv_schema import BlockRemoved as VBlockRemoved  # noqa: E402
from vllm_kv_schema import BlockStored as VBlockStored  # noqa: E402


def test_page_hash_chain_names_the_whole_prefix():
    h = page_hashes([1, 2, 3, 4, 5], 2)                     # the partial page is not hashed
    assert len(h) == 2 and h == page_hashes([1, 2, 3, 4], 2)
    assert page_hashes([3, 4], 2, parent=h[0]) == [h[1]]
    assert page_hashes([9, 9, 3, 4], 2)[1] != h[1]          # same page, different prefix


def test_payload_is_vllms_event_batch():
    events = [BlockStored([1, 2], None, [5, 6, 7, 8], 2), BlockRemoved([2], "host"), AllBlocksCleared(),
              BlockStored([2**64 - 1], 1, [9, 9], 2, "host")]
    payload = encode(1.5, events)
    assert decode(payload) == (1.5, events)
    v = VLLM_DECODER.decode(payload)
    assert v.ts == 1.5 and v.data_parallel_rank is None
    s, r, c, s2 = v.events
    assert isinstance(s, VBlockStored) and (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size,
                                            s.lora_id, s.medium) == ([1, 2], None, [5, 6, 7, 8], 2, None, "GPU")
    assert isinstance(r, VBlockRemoved) and (r.block_hashes, r.medium) == ([2], "CPU")
    assert isinstance(c, VAllBlocksCleared)
    assert s2.block_hashes == [2**64 - 1] and s2.medium == "CPU"      # uint64 hashes survive
    # and Tandem's router reads vLLM's own encoding of the same batch
    from tandem.router.kv_wire import decode_payload

    vllm_bytes = msgspec.msgpack.encode(v)
    assert [(e.kind, e.block_hashes, e.tier) for e in decode_payload(3, vllm_bytes)] == [
        ("stored", (1, 2), "device"), ("removed", (2,), "host"), ("cleared", (), "device"),
        ("stored", (2**64 - 1,), "host")]


def _connect(pub: KVEventPublisher) -> KVEventSubscriber:
    """Subscribe and wait until the PUB socket delivers (ZMQ's slow-joiner window)."""
    sub = KVEventSubscriber(pub.endpoint)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        if sub.recv(50) is not None:
            while sub.recv(50) is not None:                 # drain the probes
                pass
            return sub
    raise AssertionError("subscriber never connected")


def test_events_over_zmq_in_llm_d_topic_form():
    pub = KVEventPublisher("tcp://127.0.0.1:0", topic=topic_for("prefill-0", "smollm2"))
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
    assert pub.replay_endpoint.startswith("tcp://127.0.0.1:")
    sub = _connect(pub)
    try:
        cache = UnifiedRadixCache.simulated(page_size=2, events=pub, debug_invariants=True)
        assert sub.recv(1000).events == [AllBlocksCleared()]
        cache.insert([1, 2, 3, 4])
        (stored,) = sub.recv(1000).events
        assert stored == BlockStored(page_hashes([1, 2, 3, 4], 2), None, [1, 2, 3, 4], 2, "device")
        cache.insert([1, 2, 5, 6])                          # splits [1, 2 | 3, 4]: no event for that
        (stored,) = sub.recv(1000).events
        h = page_hashes([1, 2, 5, 6], 2)
        assert stored.block_hashes == [h[1]] and stored.parent_block_hash == h[0]
        assert stored.token_ids == [5, 6] and stored.num_tokens == 2
        assert cache.evict(100) == 6
        batch = sub.recv(1000)
        removed = [x for e in batch.events for x in e.block_hashes]
        assert all(isinstance(e, BlockRemoved) and e.medium == "device" for e in batch.events)
        assert sorted(removed) == sorted(set(page_hashes([1, 2, 3, 4], 2) + h))
        assert sub.recv(100) is None
    finally:
        sub.close()
        pub.close()


def _held(batches) -> set[int]:
    held: set[int] = set()
    for b in batches:
        for e in b.events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif isinstance(e, BlockStored):
                held |= set(e.block_hashes)
            else:
                held -= set(e.block_hashes)
    return held


def test_replay_from_the_buffer_and_a_snapshot_past_it():
    pub = KVEventPublisher(buffer_steps=4)
    try:
        cache = UnifiedRadixCache.simulated(page_size=2, events=pub)      # seq 0: AllBlocksCleared
        cache.insert([1, 2, 3, 4])                                        # 1
        cache.insert([1, 2, 5, 6])                                        # 2
        cache.insert([7, 8])                                              # 3
        got = replay(pub.replay_endpoint, 2)
        assert [b.seq for b in got] == [2, 3]                             # buffered batches
        assert replay(pub.replay_endpoint, 4) == []                       # nothing newer
        cache.evict(2)                                                    # 4 (0 leaves the buffer)
        cache.insert([9, 10, 11, 12])                                     # 5
        snap = replay(pub.replay_endpoint, 0)                             # older than the buffer
        assert len(snap) == 1 and snap[0].seq == 5
        assert isinstance(snap[0].events[0], AllBlocksCleared)
        held = set(page_hashes([1, 2, 3, 4], 2) + page_hashes([1, 2, 5, 6], 2) + page_hashes([7, 8], 2)
                   + page_hashes([9, 10, 11, 12], 2))
        held -= set(page_hashes([1, 2, 3, 4], 2)[1:])                     # lru: the oldest leaf went
        assert _held(snap) == held
        VLLM_DECODER.decode(encode(0.0, snap[0].events))                  # an ordinary vLLM batch
    finally:
        pub.close()


def test_a_pin_is_published_in_a_batch_of_its_own_and_replayed():
    """Pins (Tandem's extension, issue 52) go in their own batch after the stores: a consumer that
    knows only vLLM's schema drops that batch whole and loses nothing else; a snapshot replay
    carries the live pins."""
    pub = KVEventPublisher(buffer_steps=2)
    sub = _connect(pub)
    try:
        cache = UnifiedRadixCache.simulated(page_size=2, events=pub)
        assert sub.recv(1000).events == [AllBlocksCleared()]
        cache.insert([1, 2, 3, 4, 5, 6])
        stores = sub.recv(1000)
        node = cache.match([1, 2, 3, 4, 5, 6]).last_device_node
        assert cache.pin(node, 4, 300.0, tenant="a") == 4
        pins = sub.recv(1000)
        h = page_hashes([1, 2, 3, 4, 5, 6], 2)
        (p,) = pins.events
        assert isinstance(p, BlockPinned) and p.block_hashes == h[:2] and 299 < p.ttl_s <= 300
        assert pins.seq == stores.seq + 1
        VLLM_DECODER.decode(encode(0.0, stores.events))             # vLLM's consumers read the stores
        with pytest.raises(msgspec.ValidationError):
            VLLM_DECODER.decode(encode(0.0, pins.events))           # and drop a pin batch whole
        assert cache.unpin(cache.pins()[0]["hash"]) == 4
        (u,) = sub.recv(1000).events
        assert isinstance(u, BlockUnpinned) and sorted(u.block_hashes) == sorted(h[:2])
        cache.pin(node, 6, 60.0, tenant="a")
        cache.insert([7, 8])
        cache.insert([9, 10])                                         # the buffer no longer holds 0
        snap = replay(pub.replay_endpoint, 0)
        assert isinstance(snap[0].events[0], AllBlocksCleared) and _held(snap[:1]) >= set(h)
        assert all(isinstance(e, BlockPinned) and 59 < e.ttl_s <= 60 for e in snap[1].events)
        assert {x for e in snap[1].events for x in e.block_hashes} == set(h)   # the live pins
        assert [b.seq for b in snap] == [pub.seq - 2, pub.seq - 1]
    finally:
        sub.close()
        pub.close()
