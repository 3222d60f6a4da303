"""core/ports.py: listening ports are picked below the ephemeral range, distinct, and free."""

from __future__ import annotations

import socket

from tandem.core import ports


def test_ports_are_distinct_free_and_outside_the_ephemeral_range():
    lo, _ = ports.ephemeral_range()
    picked = ports.free_ports(64)
    assert len(set(picked)) == 64
    if ports.listen_range() is not None:
        assert all(ports.LISTEN_LOW <= p < lo for p in picked), picked
    for p in picked[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))                 # still free once handed back


def test_a_taken_port_is_never_picked_and_a_full_range_falls_back_to_the_kernel(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "listen_range", lambda ephemeral=None: range(taken, taken + 1))
        got = ports.free_ports(2)
        assert taken not in got and len(set(got)) == 2 and all(0 < p < 65536 for p in got)


def test_the_ranges(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ports.ephemeral_range(str(f)) == (32768, 60999)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == ports.DEFAULT_EPHEMERAL
    assert ports.listen_range((32768, 60999)) == range(20000, 32768)
    assert ports.listen_range((20500, 60999)) is None          # no room below: the kernel's pick
