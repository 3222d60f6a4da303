"""``--kv-store``: the cluster's Mooncake master (issue 26).

``mooncake`` starts a master beside the router (a local child process on free ports, killed on
shutdown) and rewrites the config to ``mooncake://HOST:PORT/METAPORT`` so every worker joins the
same one; ``mooncake://...`` joins an existing master and starts nothing; ``off`` does nothing.
"""

from __future__ import annotations

from typing import Callable

from tandem.core.config import ServeConfig


def start_kv_store(cfg: ServeConfig) -> tuple[ServeConfig, Callable[[], None]]:
    """(the config workers should see, a stop function)."""
    if cfg.kv_store != "mooncake":
        return cfg, lambda: None
    from tandem.cache.l3.mooncake import MasterProcess

    master = MasterProcess()
    url = master.address.url()
    print(f"tandem: L3 KV store: Mooncake master at {url}", flush=True)
    return cfg.model_copy(update={"kv_store": url}), master.stop
