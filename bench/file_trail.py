"""How many product files one disaggregated streamed chat request passes through.

A 1 prefill + 1 decode cluster (SmolLM2, CPU, Ray) behind the real FastAPI app (driven in process
over ASGI). Every process records the Python files whose functions run (``sys.setprofile``, and
``threading.setprofile`` for threads started later; in the Ray workers through Ray's
``worker_process_setup_hook``, so the product carries no hook). After one warm-up request the
records are cleared, one streamed chat request runs, and the files (with the functions that ran in each) of the product's packages
(the repository's top-level rooms) seen in any process are counted, per process and in all. The
background (heartbeats, stats, the monitor) runs meanwhile: an idle window as long as the request
is recorded too, and the files seen only while the request ran are reported beside.

    .venv/bin/python -m tandem.bench.file_trail [--max-tokens 8] [--out FILE]
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

from tandem.bench.common import bench_parser, write_report

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("core", "cache", "engine", "transfer", "worker", "prefill", "decode", "router", "cluster", "sim",
         "loadtest", "workloads", "tandem")
_DIR = os.environ.get("TANDEM_FILE_TRAIL_DIR", "/tmp/tandem-file-trail")
_seen: set[tuple[str, str]] = set()


def _profile(frame, event, arg):
    _seen.add((frame.f_code.co_filename, frame.f_code.co_name))


def _dump_loop(name: str) -> None:
    """Every 0.2 s: clear the record when the reset file changed, write what was seen."""
    reset, last = Path(_DIR) / "reset", None
    out = Path(_DIR) / f"{name}.txt"
    while True:
        time.sleep(0.2)
        stamp = reset.stat().st_mtime if reset.exists() else None
        if stamp != last:
            last = stamp
            _seen.clear()
        out.write_text("\n".join(sorted(f"{f}\t{fn}" for f, fn in _seen.copy())))


def _install(name: str | None = None) -> None:
    """Record this process's files from now on (Ray's worker setup hook calls it with no name)."""
    Path(_DIR).mkdir(parents=True, exist_ok=True)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_dump_loop, args=(name or f"worker-{os.getpid()}",), daemon=True).start()


def _product(lines: list[str]) -> dict[str, set[str]]:
    """``file\tfunction`` lines -> {product file relative to the repository: its functions that ran}."""
    out: dict[str, set[str]] = {}
    for line in lines:
        f, _, fn = line.partition("\t")
        try:
            rel = Path(f).resolve().relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in ROOMS and rel.suffix == ".py":
            out.setdefault(str(rel), set()).add(fn)
    return out


async def _chat(app, max_tokens: int, tag: str) -> str:
    import httpx

    body = {"model": "smollm2", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Name three rivers ({tag})."}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        async with c.stream("POST", "/v1/chat/completions", json=body, timeout=300) as r:
            r.raise_for_status()
            return "".join([line async for line in r.aiter_lines()])


def _read(wait_s: float = 1.0) -> dict[str, dict[str, set[str]]]:
    time.sleep(wait_s)   # every dump loop wrote after the request
    return {p.stem: _product([ln for ln in p.read_text().split("\n") if ln]) for p in Path(_DIR).glob("*.txt")}


def main(argv=None) -> int:
    import ray

    ap = bench_parser(__doc__, "file_trail")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    os.environ["TANDEM_FILE_TRAIL_DIR"] = _DIR
    for p in Path(_DIR).glob("*"):
        p.unlink()
    from tandem.cluster.launch import launch_disaggregated
    from tandem.core.config import CacheConfig, EngineConfig, ServeConfig
    from tandem.engine.loader import load_model
    from tandem.router.http import create_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "tandem.bench.file_trail._install",
                          "env_vars": {"TANDEM_FILE_TRAIL_DIR": _DIR}})
    engine = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=16, max_total_tokens=4096))
    cfg = ServeConfig(prefill=1, decode=1, engine_config=engine, kv_events=False)
    backend = launch_disaggregated(cfg, loaded=load_model("smollm2", device="cpu"))
    try:
        app = create_app(backend, cfg)
        _install("router")
        asyncio.run(_chat(app, args.max_tokens, "warm-up"))
        (Path(_DIR) / "reset").write_text("request")
        time.sleep(1.0)   # every process cleared its record
        t0 = time.monotonic()
        asyncio.run(_chat(app, args.max_tokens, "measured"))
        took = time.monotonic() - t0
        per_fns = _read()
        (Path(_DIR) / "reset").write_text("idle")
        time.sleep(1.0 + took)
        idle = set().union(*_read().values())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        backend.close()
        ray.shutdown()
    procs = {name: set(files) for name, files in per_fns.items()}
    every = set().union(*procs.values())
    functions: dict[str, set[str]] = {}
    for files in per_fns.values():
        for f, fns in files.items():
            functions.setdefault(f, set()).update(fns)
    print(f"{'process':<24} {'product files':>13}")
    for name, fset in sorted(procs.items()):
        print(f"{name:<24} {len(fset):>13}")
    print(f"{'all processes':<24} {len(every):>13}")
    print(f"{'idle window':<24} {len(idle):>13}")
    print(f"{'only with the request':<24} {len(every - idle):>13}")
    write_report(args.out, {"per_process": {k: sorted(v) for k, v in procs.items()}, "files": sorted(every),
                            "count": len(every), "idle": sorted(idle), "request_only": sorted(every - idle),
                            "functions": {f: sorted(fns) for f, fns in sorted(functions.items())},
                            "max_tokens": args.max_tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
