"""Ports for a child process to listen on (a router, a Ray head, a Mooncake master, a test server),
picked where nothing else will take them before the child binds.

A port from ``bind(0)`` is an ephemeral one: the kernel hands the same range out as the local
port of every outgoing connection, so between the pick and the child's bind a connection of any
process (Ray's gRPC clients open dozens while a router starts) may take it, and the child fails
with EADDRINUSE (a fresh-clone CI run saw a router die so, test_autoscale). Ports are therefore
picked at random below the ephemeral range and above Ray's worker ports (10002-19999), each checked
free by a bind, all held together while they are picked so they are distinct; where the machine's
ephemeral range leaves no room below it, the kernel's pick is the fallback."""

from __future__ import annotations

import contextlib
import random
import socket

LISTEN_LOW = 20000                  # above Ray's default worker ports (10002-19999)
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range
_ATTEMPTS = 200
_rng = random.SystemRandom()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def listen_range(ephemeral: tuple[int, int] | None = None) -> range | None:
    """Where listening ports are picked: ``[LISTEN_LOW, start of the ephemeral range)``, or None
    when that leaves fewer than 1,024 ports."""
    lo, _ = ephemeral or ephemeral_range()
    return range(LISTEN_LOW, lo) if lo - LISTEN_LOW >= 1024 else None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, outside the ephemeral range (module docstring).
    Another process may still bind one before the caller's child does, but no outgoing
    connection takes it."""
    where = listen_range()
    with contextlib.ExitStack() as stack:
        out: list[int] = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            out.append(_bind_one(s, host, where, out))
        return out


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def _bind_one(s: socket.socket, host: str, where: range | None, taken: list[int]) -> int:
    if where is not None:
        for _ in range(_ATTEMPTS):
            port = _rng.choice(where)
            if port in taken:
                continue
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    s.bind((host, 0))                       # no room below the ephemeral range: the kernel's pick
    return int(s.getsockname()[1])
