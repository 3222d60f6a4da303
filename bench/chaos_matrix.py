"""The long chaos benchmark: ``tandem chaos`` against four server configurations, one table.

Each configuration is a real ``tandem serve`` (a child process on 127.0.0.1: Ray, NIXL, SmolLM2
fp32, page size 16, a 1024-token decode pool, forced retraction every 11 decode steps,
``--debug-endpoints``), driven by the same seeded plan (``--sessions`` x ``--turns`` requests):

- ``recompute``: ``--host-pool-tokens 0`` (every retraction re-prefills);
- ``mixed``: a 256-token host pool (backups that fit are restored, the rest recomputed);
- ``backup``: the decode worker's default host pool (4x its device pool: restores only);
- ``kill``: two decode workers, the default host pool, one decode worker killed mid-run
  (its in-flight requests fail with a stated reason, later ones are served by the other and by
  its replacement).

One :class:`~tandem.loadtest.chaos.oracle.Oracle` (a fresh engine, requests alone) checks every
completed text of every configuration. Writes ``bench/out/chaos_matrix.json``; exit status 1 if
any configuration fails its verdict (mismatch, leak, invariant, unexplained failure).

Usage: python -m tandem.bench.chaos_matrix [--sessions 25] [--turns 4] [--seed 0] [--out bench/out]
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

from tandem.bench.common import bench_parser, write_report

CONFIGS = {
    "recompute": ["--host-pool-tokens", "0"],
    "mixed": ["--host-pool-tokens", "256"],
    "backup": [],
    "kill": ["--decode", "2"],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--mode", "disaggregated", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--page-size", "16", "--decode-max-total-tokens", "1024",
           "--debug-retract-every", "11", "--debug-endpoints", *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"tandem serve did not come up in 300 s; see {log_path}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main(argv=None) -> int:
    from tandem.loadtest.chaos.cli import format_table, options, run_chaos, verdict
    from tandem.loadtest.chaos.oracle import Oracle

    ap = bench_parser(__doc__, seed=0)
    ap.add_argument("--sessions", type=int, default=25)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    ap.add_argument("--out", default="bench/out", help="folder of chaos_matrix.json and the servers' logs")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    oracle = Oracle("smollm2", "float32")
    reps, bad = {}, []
    try:
        for name in a.configs.split(","):
            proc, url = start(CONFIGS[name], out / f"chaos_{name}_serve.log")
            try:
                t0 = time.perf_counter()
                kill = ["decode@8"] if name == "kill" else []
                rep = asyncio.run(run_chaos(options(url, seed=a.seed, sessions=a.sessions, turns=a.turns,
                                                    kill=kill, settle_s=30.0), oracle=oracle))
                rep["config"], rep["total_s"] = name, time.perf_counter() - t0
            finally:
                stop(proc)
            why = verdict(rep)
            reps[name] = rep | {"verdict": why}
            print(format_table(rep).replace("tandem chaos", f"tandem chaos [{name}]"))
            print("  verdict:", "; ".join(why) if why else "passed", flush=True)
            bad += [f"{name}: {w}" for w in why]
    finally:
        oracle.close()
    kept = {k: {kk: vv for kk, vv in v.items() if kk not in ("outcomes", "workers")} for k, v in reps.items()}
    report = write_report(out / "chaos_matrix.json", kept)
    print(f"\n{'config':<10} {'req':>4} {'done':>5} {'abrt':>5} {'fail':>5} {'retr':>5} {'rest':>5} "
          f"{'recomp':>6} {'mism':>5} {'leak':>5} {'run s':>6}")
    for k, r in reps.items():
        print(f"{k:<10} {r['requests']:>4} {r['completed']:>5} {r['aborted_early'] + r['aborted_mid']:>5} "
              f"{r['failed']:>5} {int(r['retractions']):>5} {int(r['restores']):>5} {int(r['recomputes']):>6} "
              f"{len(r['mismatches']):>5} {r['leaked_tokens']:>5} {r['wall_s']:>6.1f}")
    print(f"{report}: " + (f"FAILED: {'; '.join(bad)}" if bad else "all passed"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
