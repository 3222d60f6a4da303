"""The decode side of the two-process NIXL tests: ``python transfer_peer.py MODE ENDPOINT [progress-thread]``.

It owns a zeroed KV pool and a NIXL agent, connects to the test's bootstrap server, sends its
Handshake and one KVTransferRequest, then:

- MODE ``receive``: waits for the write's notification (``done_notif()``), checks every byte of the pool
  against :func:`expected_pool`, prints ``OK`` and exits 0 (nonzero with a reason otherwise);
- MODE ``hang``: prints ``READY`` and sleeps until killed (the dead-peer test kills it).
"""

from __future__ import annotations

import sys
import time

import torch

# pool geometry shared with the test: [L, 2, rows, H_kv, D] float32, page_size 4
L, H, D, PAGE = 3, 2, 8, 4
SRC_ROWS, DST_ROWS = 16 * PAGE, 12 * PAGE      # the two sides differ in rows on purpose
SRC_PAGES = [1, 2, 3, 7, 9, 10]                 # non-contiguous on the writer
DST_PAGES = [5, 6, 2, 3, 4, 11]                 # 5 runs: 1,2->5,6 | 3->2 | 7->3 | 9->4 | 10->11
TRANSFER_ID = 7
FIRST_TOKEN = 42


def source_pool() -> torch.Tensor:
    """The writer's pool: every element distinct, so a misplaced byte is caught."""
    n = L * 2 * SRC_ROWS * H * D
    return torch.arange(n, dtype=torch.float32).reshape(L, 2, SRC_ROWS, H, D).contiguous()


def expected_pool() -> torch.Tensor:
    src = source_pool()
    out = torch.zeros(L, 2, DST_ROWS, H, D)
    for s, d in zip(SRC_PAGES, DST_PAGES):
        out[:, :, d * PAGE:(d + 1) * PAGE] = src[:, :, s * PAGE:(s + 1) * PAGE]
    return out


def done_notif() -> bytes:
    """The notification the writer attaches to its write (an agent feature the test checks)."""
    return f"done:{TRANSFER_ID}:{FIRST_TOKEN}".encode()


def main(mode: str, endpoint: str, progress_thread: bool) -> int:
    from tandem.core.kv_messages import Handshake, KVTransferRequest, RegionPages
    from tandem.transfer.agent import KVTransferAgent, Region
    from tandem.transfer.bootstrap import BootstrapClient

    pool = torch.zeros(L, 2, DST_ROWS, H, D)
    agent = KVTransferAgent("decode", [Region.of("kv", pool, page_size=PAGE)], progress_thread=progress_thread)
    client = BootstrapClient(endpoint)
    theirs = client.request(agent.handshake(), timeout_s=20)
    if not isinstance(theirs, Handshake):
        print(f"expected a Handshake reply, got {theirs!r}")
        return 2
    agent.add_peer(theirs.agent_name, theirs.agent_metadata, theirs.regions)
    client.send(KVTransferRequest(TRANSFER_ID, agent.name, (RegionPages("kv", tuple(DST_PAGES)),),
                                  deadline=time.time() + 20))
    if mode == "hang":
        print("READY", flush=True)
        time.sleep(120)
        return 0
    end = time.monotonic() + 20
    got: list[bytes] = []
    while not got and time.monotonic() < end:
        got = agent.get_notifs().get(theirs.agent_name, [])
        time.sleep(0.002)
    if len(got) != 1:
        print(f"expected one notification, got {got!r}")
        return 3
    if got[0] != done_notif():
        print(f"unexpected notification {got[0]!r}")
        return 4
    if not torch.equal(pool, expected_pool()):
        bad = (pool != expected_pool()).nonzero()[:5].tolist()
        print(f"pool mismatch at (layer, kind, row, head, dim) {bad}")
        return 5
    print("OK", flush=True)
    client.close()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], progress_thread=sys.argv[3:] == ["progress-thread"]))
