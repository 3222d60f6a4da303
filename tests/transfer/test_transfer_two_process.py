"""A real NIXL WRITE between two processes over the ZMQ bootstrap, and a write to a dead peer.

The test process is the prefill worker (bootstrap server + writer); ``transfer_peer.py`` is the
decode worker (receiver) in a child process. CPU only: UCX over tcp/cma.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from tandem.core.kv_messages import Handshake, KVTransferRequest  # noqa: E402
from tandem.core.transfer_state import TransferState  # noqa: E402
from tandem.transfer.agent import KVTransferAgent, Region  # noqa: E402
from tandem.transfer.bootstrap import BootstrapServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import transfer_peer as peer  # noqa: E402

PEER = str(Path(__file__).parent / "transfer_peer.py")


def _spawn(mode: str, endpoint: str, progress_thread: bool) -> subprocess.Popen:
    extra = ["progress-thread"] if progress_thread else []
    return subprocess.Popen([sys.executable, PEER, mode, endpoint, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def _bootstrap(server: BootstrapServer, agent: KVTransferAgent) -> KVTransferRequest:
    """Serve the child's Handshake (answering with ours) and return its KVTransferRequest."""
    got = server.recv(timeout_s=30)
    assert got is not None, "no handshake from the peer within 30 s"
    ident, hs = got
    assert isinstance(hs, Handshake) and hs.agent_name == "decode"
    assert hs.region("kv").layout.rows == peer.DST_ROWS
    agent.add_peer(hs.agent_name, hs.agent_metadata, hs.regions)
    server.send(ident, agent.handshake())
    got = server.recv(timeout_s=30)
    assert got is not None, "no transfer request from the peer"
    req = got[1]
    assert isinstance(req, KVTransferRequest) and req.transfer_id == peer.TRANSFER_ID
    return req


def _wait(agent: KVTransferAgent, h, limit_s: float) -> TransferState:
    end = time.monotonic() + limit_s
    while (st := agent.poll(h)) is TransferState.TRANSFERRING and time.monotonic() < end:
        time.sleep(0.001)
    return st


def _prefill(progress_thread: bool):
    pool = peer.source_pool()
    agent = KVTransferAgent("prefill", [Region.of("kv", pool, page_size=peer.PAGE)], timeout_s=10,
                            progress_thread=progress_thread)
    server = BootstrapServer()
    return agent, server


@pytest.fixture(params=[True, False], ids=["progress-thread", "no-progress-thread"])
def prefill(request):
    """The writer, with NIXL's progress thread on or off (the peer mirrors it)."""
    agent, server = _prefill(request.param)
    yield agent, server
    server.close()
    agent.close()


@pytest.fixture
def prefill_with_thread():
    agent, server = _prefill(True)
    yield agent, server
    server.close()
    agent.close()


def _hang_then(sig: int, agent: KVTransferAgent, server: BootstrapServer):
    """Start a peer that bootstraps and idles, signal it, then write to it: (status, seconds, handle)."""
    child = _spawn("hang", server.endpoint, agent.progress_thread)
    try:
        req = _bootstrap(server, agent)
        lines = iter(child.stdout.readline, "")  # NIXL logs to stdout too
        assert any(line.strip() == "READY" for line in lines), "peer exited before READY"
        child.send_signal(sig)
        if sig == signal.SIGKILL:
            child.wait(timeout=30)
        t0 = time.monotonic()
        h = agent.write_pages(req.agent_name, "kv", peer.SRC_PAGES, req.pages("kv"), notif=b"x", timeout_s=1.0)
        st = _wait(agent, h, 10)
        elapsed = time.monotonic() - t0
        agent.release(h)  # cancels an in-flight request
    finally:
        child.kill()
        child.communicate(timeout=30)
    return st, elapsed, h


def test_write_noncontiguous_pages_to_another_process(prefill):
    agent, server = prefill
    child = _spawn("receive", server.endpoint, agent.progress_thread)
    try:
        req = _bootstrap(server, agent)
        h = agent.write_pages(req.agent_name, "kv", peer.SRC_PAGES, req.pages("kv"), notif=peer.done_notif())
        assert h.num_descs == 5 * peer.L * 2  # 5 runs x (layer, k/v)
        assert _wait(agent, h, 10) is TransferState.DONE, h.error
        agent.release(h)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0, f"peer failed ({child.returncode}): {out}\n{err[-2000:]}"
    assert out.strip().endswith("OK")


def test_write_to_killed_peer_fails_fast(prefill):
    """UCX (error handling mode "peer") sees the reset: the post itself fails."""
    agent, server = prefill
    st, elapsed, h = _hang_then(signal.SIGKILL, agent, server)
    assert st is TransferState.FAILED and elapsed < 2.0, (st, elapsed)
    assert "'decode'" in h.error and "NIXL_ERR_REMOTE_DISCONNECT" in h.error, h.error
    agent.remove_peer("decode")
    assert agent.peers == []
    with pytest.raises(KeyError, match="unknown peer 'decode'"):
        agent.write_pages("decode", "kv", [1], [1])


def test_write_to_stopped_peer_never_hangs(prefill_with_thread):
    """A stopped (not dead) peer: the one-sided cma write may still land (DONE); if it waits on the
    peer (connection setup), the write's deadline fails it. Either way it ends within ~1 s."""
    agent, server = prefill_with_thread
    st, elapsed, h = _hang_then(signal.SIGSTOP, agent, server)
    assert elapsed < 2.0, f"write took {elapsed:.1f}s to end"
    assert st is TransferState.DONE or "deadline passed" in h.error, h.error
