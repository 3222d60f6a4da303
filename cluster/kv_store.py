"""``--kv-store``: the cluster's Mooncake Store (``mooncake``: start a master and a storage process
here; ``mooncake://...``: join one; ``off``).
"""

from __future__ import annotations

from typing import Callable

from tandem.core.config import ServeConfig


def start_kv_store(cfg: ServeConfig) -> tuple[ServeConfig, Callable[[], None]]:
    """(the config workers should see, a stop function). ValueError when the store would have no
    memory at all (no storage and workers that lend none)."""
    if cfg.kv_store != "mooncake":
        return cfg, lambda: None
    if cfg.l3_store_bytes == 0 and cfg.l3_worker_segment_bytes == 0:
        raise ValueError("--kv-store mooncake with --l3-store-bytes 0 needs --l3-worker-segment-bytes > 0: "
                         "else no client lends the store memory and every L3 write fails")
    from tandem.cache.tiers.l3.mooncake import LocalStore

    store = LocalStore(cfg.l3_store_bytes)
    url = store.address.url()
    where = f", storage lending {cfg.l3_store_bytes >> 20} MiB" if store.storage else ", no storage (workers lend)"
    print(f"tandem: L3 KV store: Mooncake master at {url}{where}", flush=True)
    return cfg.model_copy(update={"kv_store": url}), store.stop
