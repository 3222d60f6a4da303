"""An engine's Gateway API Inference Extension metrics (core/gie.py names them), read at scrape
time."""

from __future__ import annotations

from prometheus_client.registry import REGISTRY

from tandem.core.gie import GIECollector, GIESample


def register_gie_metrics(engine, worker: str, role: str = "colocated", registry=REGISTRY) -> GIECollector:
    """Register ``engine``'s GIE families on ``registry`` (the worker's own, or the default)."""
    def read() -> GIESample:
        s, a = engine.scheduler, engine.allocator
        host = engine.kv.cache.host
        page = engine.kv_pool.page_size
        return GIESample(waiting=len(s.waiting), running=len(s.running),
                         kv_used_tokens=a.size - a.available_size(), kv_total_tokens=a.size,
                         block_size=page,
                         host_blocks=(host.pool.num_slots // page) if host is not None else 0,
                         prefix_caching=not engine.config.cache.disable_prefix_cache)

    c = GIECollector(read, engine.model_name, worker, role)
    registry.register(c)
    return c
