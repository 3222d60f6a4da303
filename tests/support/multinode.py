"""The router-restart scenario tests/cluster/test_multinode.py asserts (bench/router_restart.py
measures the same one with its own copy): the cluster's serving config, a session's chat turn,
and a router killed while requests run through it."""

from __future__ import annotations

import concurrent.futures as cf
import time

TRANSFER_TIMEOUT_S = 8.0
CONFIG = {
    "mode": "disaggregated", "prefill": 1, "decode": 2, "worker_lifetime": "cluster",
    "ray_namespace": "tandem-mn", "policy": "session", "transfer_timeout_s": TRANSFER_TIMEOUT_S,
    "debug_endpoints": True,
    # the default numerics (bf16 + the GGUF's Q4_1 weights where the CPU has native bf16): each
    # node's workers load and run it faster than the bench's float32
    "engine_config": {"device": "cpu", "dtype": "auto", "num_threads": 1,
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


def cached(r) -> int:
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def requests_in_flight(url: str) -> int:
    """Requests the workers behind router ``url`` hold now (running or waiting; GET /debug/kv)."""
    import httpx

    kv = httpx.get(f"{url}/debug/kv", timeout=30).json()
    rows = kv["workers"] if isinstance(kv, dict) else kv
    return sum(int(w.get("running") or 0) + int(w.get("waiting") or 0) for w in rows)


def wait_in_flight(url: str, futures: list, wait_s: float = 60.0) -> None:
    """Return once the workers behind router ``url`` hold a request (GET /debug/kv), or every
    future is done, or ``wait_s`` passed: a fault injected next meets the requests in flight
    instead of racing their arrival."""
    end = time.monotonic() + wait_s
    while requests_in_flight(url) == 0 and not all(f.done() for f in futures) and time.monotonic() < end:
        time.sleep(0.05)


def kill_under_load(router, session_prefix: str, requests: int = 4) -> float:
    """SIGKILL ``router`` once the workers hold one of the ``requests`` longer chats sent through
    it (:func:`wait_in_flight`); they may fail, having run through the dead router. Returns the
    kill's ``time.monotonic()``."""
    import httpx

    with cf.ThreadPoolExecutor(requests) as pool:
        inflight = [pool.submit(chat, router.url, f"{session_prefix}-{k}", [f"Count to {k}."], 24, 30)
                    for k in range(requests)]
        wait_in_flight(router.url, inflight)
        t_kill = time.monotonic()
        router.kill()
        for f in inflight:
            try:
                f.result()
            except httpx.HTTPError:
                pass
    return t_kill
