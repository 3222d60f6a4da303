"""KVTransferAgent with two NIXL agents in one process (loopback over UCX): exact bytes land."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("nixl")

from tandem.core.transfer_state import TransferState  # noqa: E402
from tandem.transfer.agent import KVTransferAgent, Region, TransferHandle  # noqa: E402
from tandem.transfer.ucx_env import DEFAULT_UCX_TLS, configure_ucx_tls  # noqa: E402

PAGE = 4


def _wait(agent, h, limit_s=5.0):
    end = time.monotonic() + limit_s
    while (st := agent.poll(h)) is TransferState.TRANSFERRING and time.monotonic() < end:
        time.sleep(0.0005)
    return st


def _notifs(agent, n=1, limit_s=5.0):
    got, end = [], time.monotonic() + limit_s
    while len(got) < n and time.monotonic() < end:
        for msgs in agent.get_notifs().values():
            got += msgs
    return got


@pytest.fixture(scope="module")
def pair():
    # writer: kv [L=2, 2, rows=32, H=2, D=4]; state [L=3, 8 slots, 6]; reader has fewer rows
    src_kv = torch.arange(2 * 2 * 32 * 8, dtype=torch.float32).reshape(2, 2, 32, 2, 4)
    src_st = torch.arange(3 * 8 * 6, dtype=torch.float32).reshape(3, 8, 6)
    dst_kv, dst_st = torch.zeros(2, 2, 16, 2, 4), torch.zeros(3, 4, 6)
    a = KVTransferAgent("A", [Region.of("kv", src_kv, PAGE), Region.of("state", src_st, 1, slab_dims=1)])
    # B progresses in the background: the test thread only polls A while a write is in flight, and
    # without B's progress thread the connection setup would wait for B's next call (the contract)
    b = KVTransferAgent("B", [Region.of("kv", dst_kv, PAGE), Region.of("state", dst_st, 1, slab_dims=1)],
                        progress_thread=True)
    hs = b.handshake()
    a.add_peer(hs.agent_name, hs.agent_metadata, hs.regions)
    yield a, b, (src_kv, src_st, dst_kv, dst_st)
    a.close()
    b.close()


def _expect_kv(src, dst_shape, sp, dp):
    want = torch.zeros(dst_shape)
    for s, d in zip(sp, dp):
        want[:, :, d * PAGE:(d + 1) * PAGE] = src[:, :, s * PAGE:(s + 1) * PAGE]
    return want


def test_ucx_tls_default_only_when_unset(pair):
    assert configure_ucx_tls(None, env := {}) == DEFAULT_UCX_TLS == "tcp,sm,cma,self"
    assert env == {"UCX_TLS": "tcp,sm,cma,self"}
    assert configure_ucx_tls(None, env := {"UCX_TLS": "tcp"}) == "tcp" and env == {"UCX_TLS": "tcp"}
    assert configure_ucx_tls("tcp,cma,self", env) == "tcp,cma,self" and env == {"UCX_TLS": "tcp,cma,self"}
    assert "UCX_TLS" in os.environ  # the agents in ``pair`` applied the default (or kept the user's)


@pytest.mark.parametrize("mode, parts", [("dynamic", 1), ("dynamic", 3), ("prepped", 1), ("prepped", 2)])
def test_write_pages_exact_bytes(pair, mode, parts):
    a, b, (src_kv, _, dst_kv, _) = pair
    dst_kv.zero_()
    a.mode, a.parts = mode, parts
    sp, dp = [1, 2, 6, 7], [3, 0, 1, 2]          # runs: 1->3 | 2->0 | 6,7->1,2
    h = a.write_pages("B", "kv", sp, dp, notif=b"t1")
    assert h.num_descs == (3 * 4 if mode == "dynamic" else 4 * 4)
    assert _wait(a, h) is TransferState.DONE, h.error
    assert h.nbytes == 4 * 4 * PAGE * 32
    a.release(h)
    assert _notifs(b) == [b"t1"]
    assert torch.equal(dst_kv, _expect_kv(src_kv, dst_kv.shape, sp, dp))
    a.mode, a.parts = "dynamic", 1


def test_multi_region_write_one_notification(pair):
    a, b, (src_kv, src_st, dst_kv, dst_st) = pair
    dst_kv.zero_()
    dst_st.zero_()
    a.parts = 2
    h = a.write("B", {"kv": ([5], [3]), "state": ([6, 7], [0, 1])}, notif=b"both")
    assert _wait(a, h) is TransferState.DONE, h.error
    a.release(h)
    a.parts = 1
    assert _notifs(b) == [b"both"]
    assert torch.equal(dst_kv, _expect_kv(src_kv, dst_kv.shape, [5], [3]))
    assert torch.equal(dst_st[:, :2], src_st[:, 6:8]) and not dst_st[:, 2:].any()


def test_empty_write_still_notifies_and_plain_notif(pair):
    a, b, _ = pair
    h = a.write_pages("B", "kv", [], [], notif=b"nothing")
    assert _wait(a, h) is TransferState.DONE and h.num_descs == 0
    a.release(h)
    assert a.send_notif("B", b"ping") is True
    assert _notifs(b, 2) == [b"nothing", b"ping"]


def test_misuse_raises(pair):
    a, b, (src_kv, *_) = pair
    with pytest.raises(KeyError, match="unknown peer 'C'"):
        a.write_pages("C", "kv", [0], [0])
    with pytest.raises(KeyError, match="no local region 'swa'"):
        a.write_pages("B", "swa", [0], [0])
    with pytest.raises(ValueError, match="dst_pages holds page 4 outside"):
        a.write_pages("B", "kv", [0], [4])
    with pytest.raises(ValueError, match="peer metadata is for agent 'B', not 'X'"):
        a.add_peer("X", b.metadata())
    assert a.peers == ["B"]
    with pytest.raises(ValueError, match="must be contiguous"):
        Region.of("t", src_kv.transpose(0, 1), PAGE)


def test_peer_without_region(pair):
    a, b, _ = pair
    c_kv = torch.zeros(2, 2, 16, 2, 4)
    c = KVTransferAgent("C", [Region.of("kv", c_kv, 8)])       # page_size differs from ours
    try:
        hs = c.handshake()
        a.add_peer(hs.agent_name, hs.agent_metadata, hs.regions)
        with pytest.raises(KeyError, match="peer 'C' has no region 'state'"):
            a.write_pages("C", "state", [0], [0])
        with pytest.raises(ValueError, match="page_size: source 4 vs destination 8"):
            a.write_pages("C", "kv", [0], [0])
        a.remove_peer("C")
        assert a.peers == ["B"]
    finally:
        c.close()


def test_poll_fails_a_stuck_write_at_its_deadline(pair, monkeypatch):
    """A write whose NIXL request never leaves PROC (a stopped peer) turns ERR at the deadline,
    and a release NIXL refuses is retried on the next release."""
    a, _, _ = pair
    stuck = object()
    monkeypatch.setattr(a._nixl, "check_xfer_state", lambda x: "PROC")
    h = TransferHandle("B", nbytes=96, num_descs=1, deadline=time.monotonic() + 0.05,
                       parts=[stuck], part_done=[False])
    assert a.poll(h) is TransferState.TRANSFERRING
    time.sleep(0.06)
    assert a.poll(h) is TransferState.FAILED and a.poll(h) is TransferState.FAILED
    assert h.error == "write to 'B' (96 bytes, 1 descriptors) failed: deadline passed"

    class Busy:
        calls = 0

        def release(self):
            Busy.calls += 1
            if Busy.calls == 1:
                raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")

    h.parts = [Busy()]
    a.release(h)
    assert Busy.calls == 2  # deferred on the first try, retried at the end of the same release


def test_a_peer_restarted_under_its_name_replaces_its_stale_metadata(pair):
    """Issue 48, item 6 (vLLM #49238): peer "R" dies and comes back under the same name with a new
    agent (new metadata; it may reuse the address and port). What RoleWorker.add_peer does: a peer
    known with the same handshake is kept, one with new metadata is loaded again, replacing the old;
    the next write lands in the new incarnation's memory, never the dead endpoint."""
    a, _, (src_kv, _, _, _) = pair

    def learn(hs) -> None:   # worker/role_worker.py RoleWorker.add_peer
        if not a.knows(hs.agent_name, hs.agent_metadata):
            a.connect(hs.encode())

    def incarnation(fill: float):
        kv = torch.full((2, 2, 16, 2, 4), fill)
        return kv, KVTransferAgent("R", [Region.of("kv", kv, PAGE)], progress_thread=True)

    old_kv, old = incarnation(-1.0)
    old_hs = old.handshake()
    learn(old_hs)
    assert a.knows("R", old_hs.agent_metadata)
    learn(old_hs)                                   # the same handshake again: kept as it is
    assert _wait(a, a.write_pages("R", "kv", [1], [0])) is TransferState.DONE
    old.close()
    new_kv, new = incarnation(-2.0)
    try:
        new_hs = new.handshake()
        assert new_hs.agent_metadata != old_hs.agent_metadata and not a.knows("R", new_hs.agent_metadata)
        learn(new_hs)
        assert a.knows("R", new_hs.agent_metadata) and not a.knows("R", old_hs.agent_metadata)
        assert _wait(a, a.write_pages("R", "kv", [2], [3])) is TransferState.DONE
        assert torch.equal(new_kv[:, :, 3 * PAGE:4 * PAGE], src_kv[:, :, 2 * PAGE:3 * PAGE])
    finally:
        a.remove_peer("R")
        new.close()
    assert a.peers == ["B"]
