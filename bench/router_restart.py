"""Router restart on a real multi-node Ray cluster: how long until requests are served again, and
does the next turn of a session still hit the cache?

The cluster (cluster/raynodes.py, all on this machine, Ray token auth on): a head, a ``prefill``
node (1 CPU) and a ``decode`` node (2 CPUs); ``tandem serve`` with ``worker_lifetime: cluster``
(detached workers: real SmolLM2, fp32, KV over UCX/TCP). Per round:

- **no restart**: a session's first turn, then its second turn through the same router: the
  second turn's cached/prompt tokens (the prefix cache's ceiling);
- **restart**: another session's first turn; 4 requests in flight; the router is SIGKILLed; a
  new ``tandem serve`` joins and adopts the running workers. Reported: seconds from the kill to
  the new router's first served request (process start, Ray connect, adopt, the turn itself),
  and the second turn's cached/prompt tokens and decode worker (same as its first turn's?).

Medians over ``--rounds``; the JSON keeps every round. tests/cluster/test_multinode.py asserts the
same scenario (tests/support/multinode.py holds the test's copy of the config and helpers).

    .venv/bin/python -m tandem.bench.router_restart --rounds 3 --out bench/out/router_restart.json
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import tempfile
import time

from tandem.bench.common import bench_parser, medians, write_report
from tandem.cluster.raynodes import RayNodes, Router, start_router

TRANSFER_TIMEOUT_S = 8.0
CONFIG = {
    "mode": "disaggregated", "prefill": 1, "decode": 2, "worker_lifetime": "cluster",
    "ray_namespace": "tandem-mn", "policy": "session", "transfer_timeout_s": TRANSFER_TIMEOUT_S,
    "debug_endpoints": True,
    "engine_config": {"device": "cpu", "dtype": "float32", "num_threads": 1,
                      "cache": {"page_size": 16, "max_total_tokens": 4096, "max_running_requests": 8,
                                "host_pool_tokens": 0},
                      "scheduler": {"chunked_prefill_size": 256, "max_batch_tokens": 1024},
                      "transfer": {"ucx_tls": "tcp"}},
}
SYSTEM = "You are a terse assistant. " * 12          # a long shared opening: many cached pages
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def chat(url: str, session: str, turns: list[str], max_tokens: int = 4, timeout: float = 120.0):
    """One chat request of ``session`` whose user turns are ``turns`` (earlier answers "ok")."""
    import httpx

    msgs = [{"role": "system", "content": SYSTEM}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": "ok"})
    return httpx.post(f"{url}/v1/chat/completions", timeout=timeout, headers={"X-Session-Id": session},
                      json={"model": "smollm2", "messages": msgs, "max_tokens": max_tokens, "temperature": 0})


def kill_under_load(router, session_prefix: str, requests: int = 4) -> float:
    """SIGKILL ``router`` while ``requests`` longer chats run through it (they may fail: they ran
    through the dead router); returns the kill's ``time.monotonic()``."""
    import httpx

    with cf.ThreadPoolExecutor(requests) as pool:
        inflight = [pool.submit(chat, router.url, f"{session_prefix}-{k}", [f"Count to {k}."], 24, 30)
                    for k in range(requests)]
        time.sleep(1.0)
        t_kill = time.monotonic()
        router.kill()
        for f in inflight:
            try:
                f.result()
            except httpx.HTTPError:
                pass
    return t_kill


def cached(r) -> int:
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _ratio(r) -> float:
    return cached(r) / r.json()["usage"]["prompt_tokens"]


def _round(c: RayNodes, cfg: dict, work: str, router: Router, i: int) -> tuple[dict, Router]:
    import httpx

    base1 = chat(router.url, f"base-{i}", ["Name a colour."])
    base2 = chat(router.url, f"base-{i}", ["Name a colour.", "Another one."])
    first = chat(router.url, f"restart-{i}", ["Name a colour."])
    t_kill = kill_under_load(router, f"load-{i}")
    new = start_router(cfg, c.client_env(), work)
    nxt = chat(new.url, f"restart-{i}", ["Name a colour.", "Another one."])
    restart_s = time.monotonic() - t_kill
    assert base1.status_code == base2.status_code == first.status_code == nxt.status_code == 200
    return {"restart_s": round(restart_s, 2), "cached_ratio_no_restart": round(_ratio(base2), 3),
            "cached_ratio_after_restart": round(_ratio(nxt), 3),
            "cached_after_restart": cached(nxt), "prompt_tokens": nxt.json()["usage"]["prompt_tokens"],
            "same_worker": nxt.headers["X-Tandem-Worker"] == first.headers["X-Tandem-Worker"],
            "worker_restarts": httpx.get(f"{new.url}/health", timeout=30).json()["restarts"]}, new


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "router_restart")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), **UCX_ENV}
    rows, routers = [], []
    with tempfile.TemporaryDirectory(prefix="tandem-restart-") as work, RayNodes(token_auth=True, env=env) as c:
        c.add_node({"prefill": 1}, num_cpus=1)
        c.add_node({"decode": 2}, num_cpus=2)
        cfg = {**CONFIG, "ray_address": c.address}
        print("starting the cluster and the first router (model loads) ...", file=sys.stderr)
        router = start_router(cfg, c.client_env(), work)
        routers.append(router)
        try:
            for i in range(args.rounds):
                row, router = _round(c, cfg, work, router, i)
                routers.append(router)
                rows.append(row)
                print(f"round {i + 1}/{args.rounds}: {row}", file=sys.stderr)
        finally:
            for r in routers:
                r.kill()
    med = medians(rows, ("restart_s", "cached_ratio_no_restart", "cached_ratio_after_restart"))
    print(f"\nrounds {len(rows)}, medians:\n")
    print("| | value |\n|---|---|")
    each = ", ".join(f"{r['restart_s']:.1f}" for r in rows)
    print(f"| kill -> the new router's first request served | {med['restart_s']:.1f} s ({each}) |")
    print(f"| next turn's cached / prompt tokens, after the restart | {med['cached_ratio_after_restart']:.2f} |")
    print(f"| the same, no restart | {med['cached_ratio_no_restart']:.2f} |")
    print(f"| next turn on the same decode worker | {sum(r['same_worker'] for r in rows)}/{len(rows)} |")
    print(f"| workers relaunched | {max(r['worker_restarts'] for r in rows)} |")
    print()
    write_report(args.out, {"rounds": rows, "medians": med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
