"""ZMQ side channel in one process: ephemeral bind, handshake round trip, malformed frames dropped."""

from __future__ import annotations

import time

import pytest
import zmq

from tandem.core.kv_messages import Handshake, KVTransferRequest, RegionInfo, RegionPages
from tandem.core.pool_layout import PoolLayout
from tandem.transfer.bootstrap import BootstrapClient, BootstrapServer

HS = Handshake("d0", b"md", (RegionInfo("kv", 4096, 0, "DRAM", PoolLayout(2, 32, 16, 64)),))


@pytest.fixture
def server():
    s = BootstrapServer()
    yield s
    s.close()


def test_binds_ephemeral_port_and_reports_it(server):
    assert server.endpoint.startswith("tcp://127.0.0.1:") and server.port > 0
    assert server.endpoint == f"tcp://127.0.0.1:{server.port}"


def test_handshake_then_request(server):
    with BootstrapClient(server.endpoint) as client:
        client.send(HS)
        ident, got = server.recv(timeout_s=5)
        assert got == HS
        server.send(ident, Handshake("p0", b"pmd", ()))
        assert client.recv(timeout_s=5) == Handshake("p0", b"pmd", ())
        req = KVTransferRequest(5, "d0", (RegionPages("kv", (1, 2)),), deadline=time.time() + 5)
        client.send(req)
        assert server.recv(timeout_s=5) == (ident, req)


def test_request_times_out_naming_endpoint(server):
    with BootstrapClient(server.endpoint) as client:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=server.endpoint):
            client.request(HS, timeout_s=0.2)
        assert time.monotonic() - t0 < 1.0


def test_malformed_frames_are_dropped_and_counted(server):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    raw.send(b"\x80\x04pickle?")
    raw.send_multipart([b"a", b"b"])
    raw.send(HS.encode())
    _, got = server.recv(timeout_s=5)
    assert got == HS and server.dropped == 2
    raw.close()
    ctx.term()


def test_recv_timeout_and_unknown_peer(server):
    t0 = time.monotonic()
    assert server.recv(timeout_s=0.1) is None
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ConnectionError, match="cannot send Handshake"):
        server.send(b"nobody", HS)
