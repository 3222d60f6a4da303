"""NIXL KV transfer between two processes vs a single-threaded memcpy of the same bytes.

A 2,048-token SmolLM2-135M KV (30 layers x K/V = 60 buffers, 3 kv heads, head_dim 64, fp32:
2048 * 768 B * 60 = 94.4 MB) is WRITTEN from a writer process's pool into a reader process's
pool through :class:`~tandem.transfer.agent.KVTransferAgent` (UCX over the host: cma), for:

- page_size 16 and 1; pages ``contiguous`` (one run: 60 descriptors) or ``scattered`` (a random
  permutation on both sides: every page its own run, 60 descriptors per page);
- ``dynamic`` (coalesced byte ranges per write) vs ``prepped`` (one descriptor per page, picked by
  index, as vLLM does), split into 1, 2 or 4 NIXL requests;
- sessions: UCX_TLS settings, NIXL's progress thread off / on (1 ms idle wake) / on (NIXL's busy
  loop), 1 or 2 UCX workers; each session is a fresh pair of processes.

Each cell: ``--repeats`` timed writes (post -> DONE on the writer) after one warm-up, each right
after a ``torch`` ``copy_`` of one 94.4 MB buffer with ``torch.set_num_threads(1)`` in the same
process (interleaved, because this shared 2-core machine's load moves memcpy from 3 to 12 GB/s);
``ratio`` = median memcpy time / median NIXL time. The reader checks every byte of every cell.

What it showed (2 vCPU, loaded): contiguous pages reach ~50-60% of memcpy (cma's
process_vm_writev itself reaches 60-75%: it pins the remote pages 4 KB at a time); the cost is
per descriptor (~2.6 us of writer CPU each, ~5 us wall), so scattered pages fall to ~20%
(page 16) and ~2-4% (page 1). Splits, a second UCX worker and prepped lists do not help; a
progress thread costs throughput; UCX_TLS with or without sm is the same. See transfer/README.md.

    python bench/transfer.py [--repeats 7] [--quick] [--sessions 0,4]   # table; JSON in bench/out/transfer.json
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import time

from tandem.bench.common import bench_parser, default_out, write_report

LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 30, 3, 64, 2048
NUM_SLOTS = 2 * TOKENS                                  # pool twice the transfer, so pages can scatter
ROWS = NUM_SLOTS + 16                                   # kv_pool.py: num_slots + page_size (16 | 4112)
ROW_BYTES = KV_HEADS * HEAD_DIM * 4
NBYTES = TOKENS * ROW_BYTES * LAYERS * 2
OUT = default_out("transfer")                           # no --out flag: always bench/out/transfer.json

# (name, UCX_TLS, UCX backend workers, progress thread, its idle delay in us); "all" = UCX's default
TLS = "tcp,sm,cma,self"
SESSIONS = [
    ("default (no progress thread)", TLS, 0, False, 100),
    ("progress thread, 1 ms wake", TLS, 0, True, 100),
    ("progress thread, busy (NIXL)", TLS, 0, True, 0),
    ("UCX_TLS=all (UCX default)", "all", 0, False, 100),
    ("UCX_TLS=tcp,cma,self", "tcp,cma,self", 0, False, 100),
    ("UCX_TLS=tcp,self", "tcp,self", 0, False, 100),
    ("2 UCX workers", TLS, 2, False, 100),
    ("2 UCX workers + prog. thread", TLS, 2, True, 100),
]
ALL_PLANS = [("dynamic", 1), ("dynamic", 2), ("dynamic", 4), ("prepped", 1), ("prepped", 4)]
FEW_PLANS = [("dynamic", 1), ("prepped", 1)]
SPLIT_PLANS = [("dynamic", 1), ("dynamic", 2), ("dynamic", 4)]


def _pages(page_size: int, layout: str, seed: int = 0):
    """(src_pages, dst_pages) for one 2,048-token transfer; page 0 is the pool's padding page."""
    import numpy as np

    n = TOKENS // page_size
    if layout == "contiguous":
        return np.arange(1, n + 1), np.arange(1, n + 1)
    rng = np.random.default_rng(seed + page_size)
    total = ROWS // page_size
    return rng.permutation(np.arange(1, total))[:n], rng.permutation(np.arange(1, total))[:n]


def _source_pool():
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randn((LAYERS, 2, ROWS, KV_HEADS, HEAD_DIM), generator=g)


def _regions(pool):
    from tandem.transfer.agent import Region

    return [Region.of("p16", pool, 16), Region.of("p1", pool, 1)]


def _agent(name: str, pool, sess: tuple):
    from tandem.transfer.agent import KVTransferAgent

    _, tls, threads, pt, delay = sess
    return KVTransferAgent(name, _regions(pool), ucx_tls=tls, num_threads=threads, progress_thread=pt,
                           progress_delay_us=delay, timeout_s=60)


def reader(endpoint: str, conn, sess: tuple) -> None:
    """Receives the writes; after each cell, checks the notifications and every written byte."""
    import faulthandler

    import torch

    faulthandler.enable()
    from tandem.core.kv_messages import Handshake
    from tandem.transfer.bootstrap import BootstrapClient

    torch.set_num_threads(1)
    pool = torch.zeros((LAYERS, 2, ROWS, KV_HEADS, HEAD_DIM))
    agent = _agent("reader", pool, sess)
    client = BootstrapClient(endpoint)
    theirs = client.request(agent.handshake(), timeout_s=60)
    if not isinstance(theirs, Handshake):
        raise RuntimeError(f"the writer answered a {type(theirs).__name__}, not a Handshake")
    agent.add_peer(theirs.agent_name, theirs.agent_metadata, theirs.regions)
    src = _source_pool()
    seen = 0
    while True:
        while not conn.poll(0.001):  # like a decode loop: progress NIXL between steps
            seen += sum(len(v) for v in agent.get_notifs().values())
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, page_size, layout, expect = cmd
        end = time.monotonic() + 60
        while seen < expect and time.monotonic() < end:
            seen += sum(len(v) for v in agent.get_notifs().values())
            time.sleep(0.001)
        sp, dp = _pages(page_size, layout)
        rows_s = (torch.as_tensor(sp)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        rows_d = (torch.as_tensor(dp)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        ok = seen >= expect and torch.equal(pool[:, :, rows_d], src[:, :, rows_s])
        pool.zero_()
        conn.send(bool(ok))
    client.close()
    agent.close()


def _plans(sess_name: str, page_size: int, layout: str, quick: bool):
    if quick or (page_size == 1 and layout == "scattered"):   # 122,880 descriptors: slow everywhere
        return FEW_PLANS
    if sess_name == SESSIONS[0][0]:
        return ALL_PLANS
    return SPLIT_PLANS if "workers" in sess_name else FEW_PLANS  # splits only pay with >1 worker


def writer(conn, rconn, sess: tuple, repeats: int, quick: bool) -> None:
    """Times each write post -> DONE, interleaved with one baseline memcpy of the same byte count."""
    import faulthandler

    import torch

    faulthandler.enable()
    from tandem.core.kv_messages import Handshake
    from tandem.core.transfer_state import TransferState
    from tandem.transfer.bootstrap import BootstrapServer

    torch.set_num_threads(1)
    pool = _source_pool()
    agent = _agent("writer", pool, sess)
    server = BootstrapServer()
    conn.send(server.endpoint)
    got = server.recv(timeout_s=60)
    if got is None:
        raise RuntimeError("no reader handshake within 60 s")
    ident, hs = got
    if not isinstance(hs, Handshake):
        raise RuntimeError(f"the reader sent a {type(hs).__name__}, not a Handshake")
    agent.add_peer(hs.agent_name, hs.agent_metadata, hs.regions)
    server.send(ident, agent.handshake())
    a, b = torch.randn(NBYTES // 4), torch.empty(NBYTES // 4)
    b.copy_(a)
    rows, sent, tid = [], 0, 0
    for page_size in (16, 1):
        for layout in ("contiguous", "scattered"):
            sp, dp = _pages(page_size, layout)
            for mode, parts in _plans(sess[0], page_size, layout, quick):
                agent.mode, agent.parts = mode, parts
                nx_wall, nx_cpu, post, mc_wall, mc_cpu, descs = [], [], [], [], [], 0
                for i in range(repeats + 1):
                    c0, t0 = time.process_time(), time.perf_counter()
                    b.copy_(a)
                    c1, t1 = time.process_time(), time.perf_counter()
                    tid += 1
                    notif = f"done:{tid}".encode()
                    h = agent.write_pages("reader", f"p{page_size}", sp, dp, notif=notif)
                    t2 = time.perf_counter()
                    while (st := agent.poll(h)) is TransferState.TRANSFERRING:
                        pass
                    c3, t3 = time.process_time(), time.perf_counter()
                    if st is not TransferState.DONE:
                        raise RuntimeError(h.error)
                    descs = h.num_descs
                    agent.release(h)
                    sent += 1
                    if i:  # the first write warms connections and prepared lists
                        mc_wall.append(t1 - t0)
                        mc_cpu.append(c1 - c0)
                        nx_wall.append(t3 - t1)
                        nx_cpu.append(c3 - c1)
                        post.append(t2 - t1)
                rconn.send(("verify", page_size, layout, sent))
                if not rconn.poll(120):
                    raise TimeoutError(f"reader did not verify {page_size}/{layout}/{mode}/{parts}")
                ok = rconn.recv()
                med, mmed = statistics.median(nx_wall), statistics.median(mc_wall)
                cpu, mcpu = statistics.median(nx_cpu), statistics.median(mc_cpu)
                rows.append(dict(
                    session=sess[0], ucx_tls=sess[1], ucx_workers=sess[2], progress_thread=sess[3],
                    progress_delay_us=sess[4], page_size=page_size, layout=layout, mode=mode, parts=parts,
                    descs=descs, median_ms=med * 1e3, post_ms=statistics.median(post) * 1e3,
                    gbps=NBYTES / med / 1e9, memcpy_gbps=NBYTES / mmed / 1e9, ratio=mmed / med,
                    cpu_ratio=mcpu / cpu if cpu > 0 else None, verified=ok))
    rconn.send(("stop",))
    conn.send(rows)
    server.close()
    agent.close()


def run_session(sess: tuple, repeats: int, quick: bool) -> list[dict]:
    """A fresh writer and reader process pair (UCX reads UCX_TLS once per process)."""
    ctx = mp.get_context("spawn")
    wmain, wchild = ctx.Pipe()
    rmain, rchild = ctx.Pipe()
    w = ctx.Process(target=writer, args=(wchild, rmain, sess, repeats, quick))
    w.start()
    r = None
    try:
        if not wmain.poll(120):
            raise TimeoutError("writer did not start")
        r = ctx.Process(target=reader, args=(wmain.recv(), rchild, sess))
        r.start()
        end = time.monotonic() + 900
        while not wmain.poll(1.0):
            if not (w.is_alive() and r.is_alive()) or time.monotonic() > end:
                raise RuntimeError(f"session ended early: writer exit {w.exitcode}, reader exit {r.exitcode}")
        return wmain.recv()
    finally:
        for p in (w, r):
            if p is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()


def main() -> None:
    ap = bench_parser(__doc__, repeats=7)
    ap.add_argument("--quick", action="store_true", help="first session, two plans")
    ap.add_argument("--sessions", default="", help="comma-separated session indices (default all)")
    args = ap.parse_args()
    sessions = SESSIONS[:1] if args.quick else SESSIONS
    if args.sessions:
        sessions = [SESSIONS[int(i)] for i in args.sessions.split(",")]
    rows = []
    for sess in sessions:
        try:
            rows += run_session(sess, args.repeats, args.quick)
        except Exception as e:  # one failing transport setting must not lose the others
            rows.append(dict(session=sess[0], ucx_tls=sess[1], error=repr(e)))
        print(f"  session {sess[0]!r} done", flush=True)
    _report(rows, args)


def _report(rows: list[dict], args) -> None:
    hdr = (f"{'session':30} {'page':>4} {'pages':10} {'mode':7} {'parts':>5} {'descs':>6} {'ms':>7} "
           f"{'GB/s':>5} {'memcpy':>6} {'ratio':>5} {'cpu-r':>5} ok")
    print(f"\n{NBYTES / 1e6:.1f} MB per transfer ({TOKENS} tokens, {LAYERS * 2} K/V buffers, fp32); "
          f"median of {args.repeats}, each interleaved with a 1-thread memcpy of the same bytes")
    print("ratio = memcpy time / NIXL time (wall); cpu-r = the same in writer CPU seconds")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['session']:30} ERROR {r['error']}")
            continue
        cr = f"{r['cpu_ratio']:5.2f}" if r["cpu_ratio"] else "    -"
        print(f"{r['session']:30} {r['page_size']:>4} {r['layout']:10} {r['mode']:7} {r['parts']:>5} "
              f"{r['descs']:>6} {r['median_ms']:7.1f} {r['gbps']:5.2f} {r['memcpy_gbps']:6.2f} "
              f"{r['ratio']:5.2f} {cr} {'y' if r['verified'] else 'NO'}")
    good = [r for r in rows if "error" not in r and r["verified"]]
    cells = [(ps, lay) for ps in (16, 1) for lay in ("contiguous", "scattered")]
    print("\nratio to memcpy per session (dynamic, 1 part):")
    print(f"{'session':30}" + "".join(f"{f'p{ps} {lay}':>16}" for ps, lay in cells))
    summary = {}
    for sess in dict.fromkeys(r["session"] for r in good):
        got = {(r["page_size"], r["layout"]): r for r in good
               if r["session"] == sess and r["mode"] == "dynamic" and r["parts"] == 1}
        summary[sess] = {f"p{ps}-{lay}": got[(ps, lay)]["ratio"] for ps, lay in cells if (ps, lay) in got}
        print(f"{sess:30}" + "".join(f"{got[c]['ratio']:16.2f}" if c in got else f"{'-':>16}" for c in cells))
    best = {}
    for ps, lay in cells:
        cell = [r for r in good if r["page_size"] == ps and r["layout"] == lay]
        if cell:
            b = max(cell, key=lambda r: r["gbps"])
            best[f"p{ps}-{lay}"] = {k: b[k] for k in ("session", "mode", "parts", "descs", "gbps",
                                                      "memcpy_gbps", "ratio", "cpu_ratio")}
    print("\nfastest per page layout (by NIXL GB/s; memcpy measured interleaved):")
    for k, b in best.items():
        print(f"  {k:16} {b['session']:30} {b['mode']:7} parts={b['parts']}  {b['gbps']:.2f} GB/s "
              f"vs memcpy {b['memcpy_gbps']:.2f}: {b['ratio']:.0%}")
    print()
    write_report(OUT, dict(
        bytes_per_transfer=NBYTES, tokens=TOKENS, layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        dtype="float32", pool_rows=ROWS, repeats=args.repeats, cpus=os.cpu_count(),
        load_avg=os.getloadavg(), machine=platform.platform(), gb="1e9 bytes", results=rows,
        ratio_by_session=summary, fastest=best))


if __name__ == "__main__":
    main()
