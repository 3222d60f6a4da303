"""KV events: page hash chains, encodings, and a real ZMQ PUB/SUB round trip."""

from __future__ import annotations

import time

import pytest

from tandem.cache.radix.events import (AllCleared, BlockRemoved, BlockStored, EventBatch,
                                       KVEventPublisher, KVEventSubscriber, decode, encode,
                                       page_hashes)
from tandem.cache.unified import UnifiedRadixCache


def test_page_hash_chain_names_the_whole_prefix():
    h = page_hashes([1, 2, 3, 4, 5], 2)                     # the partial page is not hashed
    assert len(h) == 2 and h == page_hashes([1, 2, 3, 4], 2)
    assert page_hashes([3, 4], 2, parent=h[0]) == [h[1]]
    assert page_hashes([9, 9, 3, 4], 2)[1] != h[1]          # same page, different prefix


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_encoding_round_trip(fmt):
    batch = EventBatch(7, 1.5, [BlockStored([1, 2], None, [5, 6, 7, 8], 2), BlockRemoved([2], 2, "host"),
                                AllCleared()])
    assert decode(encode(batch, fmt), fmt) == batch


def _connect(pub: KVEventPublisher) -> KVEventSubscriber:
    """Subscribe and wait until the PUB socket delivers (ZMQ's slow-joiner window)."""
    sub = KVEventSubscriber(pub.endpoint)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pub.publish([AllCleared()])
        if sub.recv(50) is not None:
            while sub.recv(50) is not None:                 # drain the probes
                pass
            return sub
    raise AssertionError("subscriber never connected")


def test_events_over_zmq():
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
    sub = _connect(pub)
    try:
        cache = UnifiedRadixCache.simulated(page_size=2, events=pub, debug_invariants=True)
        assert sub.recv(1000).events == [AllCleared()]
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
