"""The autoscaling scenario's serving config and open-loop load (tests/cluster/test_autoscale.py, bench/autoscale.py)."""

from __future__ import annotations

import asyncio
import time

PROMPT_TOKENS = 10_000


def serve_config(address: str, namespace: str, planner: dict | None) -> dict:
    """``tandem serve`` on the Ray cluster at ``address``: sim workers 1P+1D, a deep deferred queue
    (the step waits rather than meets a 429), the planner if given."""
    cfg = {"engine": "sim", "prefill": 1, "decode": 1, "ray_address": address,
           "worker_lifetime": "cluster", "ray_namespace": namespace, "sim_speedup": 1.0,
           "dispatch_queue_size": 512, "dispatch_queue_ttl_s": 60.0, "admission_max_queue": 1000,
           "admission_max_pending_s": 600.0,
           "engine_config": {"cache": {"page_size": 16}, "context_length": 32768}}
    if planner is not None:
        cfg["planner"] = {"enabled": True, **planner}
    return cfg


async def open_loop(url: str, rate: float, seconds: float, results: list, tag: str) -> None:
    """Arrivals at ``rate``/s for ``seconds``, each streamed; appends ``(tag, status, ttft_s)``
    (ttft None when no token came) to ``results``."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int):
            t0 = time.monotonic()
            try:
                r = await client.post(f"{url}/v1/completions", json={
                    "model": "smollm2", "prompt": [1000 + (i * 7919 + j) % 40000 for j in range(PROMPT_TOKENS)],
                    "max_tokens": 8, "stream": True}, headers={"X-Session-Id": f"{tag}-{i}"})
                ttft = None
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data: {"):
                        ttft = time.monotonic() - t0
                results.append((tag, r.status_code, ttft))
            except httpx.HTTPError:
                results.append((tag, 0, None))

        tasks, n, t0 = [], 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            tasks.append(asyncio.create_task(one(sum(map(ord, tag)) % 1000 * 10000 + n)))
            n += 1
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*tasks)
