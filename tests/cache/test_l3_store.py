"""The L3 store client against a real Mooncake master on 127.0.0.1 (issue 26)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("mooncake.store")

from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402
from tandem.cache.tiers.l3.store import L3Store, key_prefix, page_key, seal, unseal  # noqa: E402
from tandem.core.page_hash import page_hashes  # noqa: E402

from support.l3 import join_store_threads, master_back  # noqa: E402

PREFIX = key_prefix("smollm2-135m", 16, "bfloat16", "nhd")


@pytest.fixture(scope="module")
def master():
    m = mc.MasterProcess()
    yield m
    m.stop()


def _client(master, prefix=PREFIX, **kw) -> L3Store:
    return L3Store(mc.connect(master.address, segment_bytes=16 << 20, buffer_bytes=16 << 20), prefix, **kw)


@pytest.fixture(scope="module")
def two(master):
    a, b = _client(master), _client(master)
    yield a, b
    a.close()
    b.close()


def test_keys_name_model_page_size_dtype_and_layout():
    assert key_prefix("m", 16, "bf16", "nhd") != key_prefix("m", 32, "bf16", "nhd")
    assert page_key(PREFIX, -1).endswith("/ffffffffffffffff")
    assert unseal(seal(b"abc")) == b"abc"
    assert unseal(b"\0" * 16 + b"abc") is None


def test_parse_kv_store():
    assert mc.parse_kv_store("off") == ("off", None)
    assert mc.parse_kv_store("mooncake") == ("mooncake", None)
    assert mc.parse_kv_store("mooncake://10.0.0.1:50051") == ("mooncake", "10.0.0.1:50051")
    a = mc.MasterAddress.parse("10.0.0.1:50051")
    assert (a.host, a.port, a.metadata_port) == ("10.0.0.1", 50051, 50052)
    assert mc.MasterAddress.parse(a.url()[len("mooncake://"):]) == a
    with pytest.raises(ValueError):
        mc.parse_kv_store("redis://x")


def test_a_page_put_by_one_worker_is_read_by_another(two):
    a, b = two
    hashes = page_hashes(list(range(64)), 16)  # 4 pages, the router's chain
    for i, h in enumerate(hashes[:3]):
        assert a.put(h, bytes([i]) * 4096)
    assert b.exists(hashes) == [True, True, True, False]
    assert b.leading_hits(hashes) == 3
    assert b.get(hashes[1]) == bytes([1]) * 4096
    assert b.get(hashes[3]) is None
    assert (b.stats.hits, b.stats.misses, b.stats.bytes_read) == (1, 1, 4096)


def test_a_pinned_page_is_written_again_soft_pinned(master):
    """A pinned prefix's page (issue 52) goes to the real master with Mooncake's soft pin and its
    TTL, replacing an unpinned copy written through earlier; both workers read it back."""
    a = _client(master, prefix=PREFIX + "/pins", pin_config=mc.soft_pin)
    b = _client(master, prefix=PREFIX + "/pins")
    try:
        h = page_hashes(list(range(16)), 16)[0]
        assert a.put_async([(h, b"u" * 2048)]) == 1                    # written through, unpinned
        assert a.flush()
        assert (a.stats.puts, a.stats.pinned_puts) == (1, 0)
        assert a.put_async([(h, b"p" * 2048)], pin_ttl_s=60.0) == 1     # then spilled, pinned
        assert a.flush()
        assert (a.stats.puts, a.stats.pinned_puts, a.stats.write_skipped) == (2, 1, 0)
        assert b.get(h) == b"p" * 2048
        assert a.put_async([(h, b"u" * 2048)]) == 1                    # an unpinned write: held, skipped
        assert a.flush() and a.stats.write_skipped == 1
    finally:
        a.close()
        b.close()


def test_another_prefix_does_not_see_the_pages(two):
    """A client of the same store under another prefix (here over b's connection: what it sees
    is a matter of keys, not of which connection asks)."""
    a, b = two
    h = page_hashes(list(range(100, 116)), 16)[0]
    assert a.put(h, b"x" * 100)
    other = L3Store(b.backend, key_prefix("smollm2-135m", 16, "float32", "nhd"))
    assert other.exists([h]) == [False] and b.exists([h]) == [True]


def test_a_corrupted_page_is_a_miss_counted(two):
    a, b = two
    h = page_hashes(list(range(200, 216)), 16)[0]
    a.corrupt_next = True
    assert a.put(h, b"y" * 1000)
    assert b.exists([h]) == [True]
    assert b.get(h) is None
    assert b.stats.corrupt == 1


def test_a_killed_store_is_a_miss_within_the_timeout():
    import threading

    m = mc.MasterProcess()
    others = set(threading.enumerate())
    s = _client(m, timeout_s=0.5, backoff_s=60)
    h = page_hashes(list(range(16)), 16)[0]
    assert s.put(h, b"z" * 100)
    m.stop()
    t0 = time.monotonic()
    got = [s.exists([h]), s.get(h), s.put(h, b"w"), s.exists([h])]
    assert time.monotonic() - t0 < 3.0, "a dead store blocked the caller"
    assert got[0] in ([True], [False]) and got[3] == [False] and got[2] is False
    assert not s.up  # down for backoff_s after the first failure: later calls cost nothing
    with master_back(m):    # the calls abandoned to the dead store end at once
        s.close()
        join_store_threads(others)

