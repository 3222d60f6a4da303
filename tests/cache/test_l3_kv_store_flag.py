"""``--kv-store``: the flag reaches ServeConfig, and ``mooncake`` starts a master and a storage
process (pages live in its segment, not in the workers') that stop kills."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from tandem.core.config import ServeConfig


def test_kv_store_values():
    assert ServeConfig().kv_store == "off" and not ServeConfig().debug_corrupt_l3
    assert ServeConfig(kv_store="mooncake://10.0.0.1:50051/50052").kv_store.endswith("/50052")
    with pytest.raises(ValidationError):
        ServeConfig(kv_store="redis://10.0.0.1:1")


def test_the_flag_sets_the_field():
    import argparse

    from tandem.cluster import flags as F

    p = argparse.ArgumentParser()
    F.add_flags(p, F.SERVE_FLAGS, ServeConfig)
    args = p.parse_args(["--kv-store", "mooncake://h:1", "--debug-corrupt-l3", "--l3-store-bytes", "67108864",
                         "--l3-worker-segment-bytes", "33554432"])
    got = F.given(args, F.SERVE_FLAGS)
    assert got["kv_store"] == "mooncake://h:1" and got["debug_corrupt_l3"] is True
    assert got["l3_store_bytes"] == 64 << 20 and got["l3_worker_segment_bytes"] == 32 << 20
    assert ServeConfig().l3_store_bytes == 1 << 30 and ServeConfig().l3_worker_segment_bytes == 0


def test_a_store_with_no_memory_is_refused():
    from tandem.cluster.kv_store import start_kv_store

    with pytest.raises(ValueError, match="l3-worker-segment-bytes"):
        start_kv_store(ServeConfig(kv_store="mooncake", l3_store_bytes=0))
    from tandem.cache.tiers.l3.mooncake import MasterAddress, StorageProcess

    with pytest.raises(ValueError, match="minimum"):      # before any process starts
        StorageProcess(MasterAddress("127.0.0.1", 1, 2), 1 << 20)


def test_mooncake_starts_a_master_and_a_storage_and_stop_kills_both():
    pytest.importorskip("mooncake.store")
    from tandem.cache.tiers.l3.mooncake import MasterAddress, connect
    from tandem.cache.tiers.l3.store import L3Store
    from tandem.cluster.kv_store import start_kv_store

    off, stop = start_kv_store(ServeConfig())
    assert off.kv_store == "off"
    stop()
    cfg, stop = start_kv_store(ServeConfig(kv_store="mooncake", l3_store_bytes=32 << 20))
    addr = MasterAddress.parse(cfg.kv_store[len("mooncake://"):])
    try:
        assert cfg.kv_store.startswith("mooncake://127.0.0.1:")
        # writer and reader lend nothing: the page lives in the storage process's segment
        w = L3Store(connect(addr, segment_bytes=0, buffer_bytes=16 << 20), "t")
        assert w.put(1, b"abc")
        w.close()
        r = L3Store(connect(addr, segment_bytes=0, buffer_bytes=16 << 20), "t")
        assert r.get(1) == b"abc", "the page went with the client that wrote it"
        r.close()
    finally:
        stop()
    with pytest.raises(OSError):                  # nothing listens on the master's port now
        socket.create_connection((addr.host, addr.port), timeout=0.5).close()
