"""How big an engine's host (L2) KV pool is, by role, when the config does not say."""

from __future__ import annotations

import os

DECODE_FACTOR = 4
HOST_MEMORY_SHARE = 0.25


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_pool_tokens(configured: int | None, role: str, device_tokens: int, bytes_per_token: int,
                     page_size: int, available_bytes: int | None = None) -> tuple[int, str]:
    """``(tokens, why)``: the host pool size for an engine of ``role`` and the reason, for the
    startup line."""
    if configured is not None:
        return configured // page_size * page_size, "as configured"
    if role != "decode":
        return 0, f"off by default for {role} engines (--host-pool-tokens N turns it on)"
    want = DECODE_FACTOR * device_tokens
    avail = available_host_bytes() if available_bytes is None else available_bytes
    cap = int(avail * HOST_MEMORY_SHARE) // max(bytes_per_token, 1)
    n = min(want, cap) // page_size * page_size
    why = (f"decode default: {DECODE_FACTOR}x the device pool ({want} tokens)"
           + (f", capped at {HOST_MEMORY_SHARE:.0%} of free host memory ({cap} tokens)" if cap < want else ""))
    return n, why


def capped_rows(want: int, bytes_per_row: int, available_bytes: int | None = None) -> int:
    """``want`` host rows of ``bytes_per_row`` each, at most ``HOST_MEMORY_SHARE`` of the host
    memory available now (at least 1: a host tier with a component has a row for it)."""
    avail = available_host_bytes() if available_bytes is None else available_bytes
    return max(1, min(want, int(avail * HOST_MEMORY_SHARE) // max(bytes_per_row, 1)))
