"""Starting Mooncake's children robustly (issue 50): a master whose port another process took
between the probe and its bind exits at start; it is started again on fresh ports, and where its
ports are fixed the error quotes the master's own last lines."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("mooncake.store")

from tandem.cache.tiers.l3 import mooncake as mc  # noqa: E402


@pytest.fixture
def taken():
    """A port some other process listens on (every address)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def test_ports_are_distinct():
    for _ in range(20):
        ports = mc.free_ports(3)
        assert len(set(ports)) == 3


def test_a_master_whose_port_was_taken_starts_again_on_fresh_ports(monkeypatch, taken):
    real, calls = mc.free_ports, []

    def first_one_taken(n, host="127.0.0.1"):
        calls.append(n)
        ports = real(n, host)
        return ports[:-1] + [taken] if len(calls) == 1 else ports   # the metrics port, the last to bind

    monkeypatch.setattr(mc, "free_ports", first_one_taken)
    m = mc.MasterProcess()
    try:
        assert len(calls) == 2 and m.alive and taken not in (m.address.port, m.address.metadata_port)
    finally:
        m.stop()


def test_a_master_on_fixed_ports_that_cannot_bind_says_why(taken):
    with pytest.raises(mc.ChildStartError) as e:
        mc.MasterProcess(address=mc.MasterAddress("127.0.0.1", taken, mc.free_port()))
    msg = str(e.value)
    assert "mooncake_master exited with" in msg and str(taken) in msg
    assert "master" in msg.split("its last lines:", 1)[1]       # the master's own log lines follow
