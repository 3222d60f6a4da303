"""``--kv-store``: the flag reaches ServeConfig, and ``mooncake`` starts a master that stop kills."""

from __future__ import annotations

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
    args = p.parse_args(["--kv-store", "mooncake://h:1", "--debug-corrupt-l3"])
    got = F.given(args, F.SERVE_FLAGS)
    assert got["kv_store"] == "mooncake://h:1" and got["debug_corrupt_l3"] is True


def test_mooncake_starts_a_master_and_stop_kills_it():
    pytest.importorskip("mooncake.store")
    from tandem.cache.l3.mooncake import MasterAddress, connect
    from tandem.cache.l3.store import L3Store
    from tandem.cluster.kv_store import start_kv_store

    off, stop = start_kv_store(ServeConfig())
    assert off.kv_store == "off"
    stop()
    cfg, stop = start_kv_store(ServeConfig(kv_store="mooncake"))
    try:
        assert cfg.kv_store.startswith("mooncake://127.0.0.1:")
        addr = MasterAddress.parse(cfg.kv_store[len("mooncake://"):])
        s = L3Store(connect(addr, segment_bytes=16 << 20, buffer_bytes=16 << 20), "t")
        assert s.put(1, b"abc") and s.get(1) == b"abc"
        s.close()
    finally:
        stop()
