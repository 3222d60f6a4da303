"""The host KV pool's role defaults (engine/host_sizing.py)."""

from __future__ import annotations

from tandem.engine.host_sizing import DECODE_FACTOR, host_pool_tokens


def test_decode_default_is_four_times_the_device_pool_within_the_memory_cap():
    n, why = host_pool_tokens(None, "decode", 1000, 1024, 16, available_bytes=1 << 40)
    assert n == DECODE_FACTOR * 1000 // 16 * 16 and "4x the device pool" in why
    n, why = host_pool_tokens(None, "decode", 1000, 1024, 16, available_bytes=1 << 20)
    assert n == (1 << 20) // 4 // 1024 // 16 * 16 and "capped at 25% of free host memory" in why


def test_other_roles_get_none_and_a_configured_size_wins():
    for role in ("prefill", "colocated"):
        n, why = host_pool_tokens(None, role, 1000, 1024, 16)
        assert n == 0 and "--host-pool-tokens" in why
    assert host_pool_tokens(0, "decode", 1000, 1024, 16)[0] == 0          # --host-pool-tokens 0: off
    assert host_pool_tokens(100, "prefill", 1000, 1024, 16) == (96, "as configured")


def test_host_state_checkpoints_are_capped_by_free_host_memory():
    from tandem.engine.host_sizing import HOST_MEMORY_SHARE, capped_rows

    assert capped_rows(64, 1 << 20, available_bytes=1 << 40) == 64                 # room: as many as the device
    assert capped_rows(64, 1 << 20, available_bytes=40 << 20) == int(40 * HOST_MEMORY_SHARE)   # 10 of 1 MiB
    assert capped_rows(64, 1 << 30, available_bytes=1 << 20) == 1                  # never zero
