"""``--kv-store``: the cluster's Mooncake Store, a master and a storage process (issue 26).

``mooncake`` starts a master beside the router and a storage process that lends the store
``l3_store_bytes`` of memory (local child processes on free ports, killed on shutdown), and
rewrites the config to ``mooncake://HOST:PORT/METAPORT`` so every worker joins the same store;
workers lend ``l3_worker_segment_bytes`` (0 by default), so the pages live in the storage's
segment and outlive any worker. ``mooncake://...`` joins an existing master and its storage and
starts nothing; ``off`` does nothing.
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
