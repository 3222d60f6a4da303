"""A worker's L3 tier from its ``--kv-store`` options: join the Mooncake master, attach to the
cache."""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from tandem.cache.tiers.l3.budget import PRIOR_PREFILL_TOK_S
from tandem.cache.tiers.l3.store import L3Store, key_prefix
from tandem.cache.tiers.l3.tier import L3Tier, layout

log = logging.getLogger(__name__)

WORKER_WRITE_POLICY = "write_through"


def l3_options(kv_store: str, timeout_s: float, corrupt: bool = False, segment_bytes: int = 0,
               prefill_tok_s: float | None = PRIOR_PREFILL_TOK_S) -> dict | None:
    """The workers' L3 options for ``ServeConfig.kv_store`` once a master is known
    (``mooncake://HOST:PORT[/METAPORT]``); None for ``off``."""
    if not kv_store.startswith("mooncake://"):
        return None
    return {"url": kv_store, "timeout_s": timeout_s, "corrupt": corrupt, "segment_bytes": segment_bytes,
            "prefill_tok_s": prefill_tok_s}


def attach_store(cache, kv_pool, model: str, *, aux_data: Mapping[str, Any] | None = None,
                 **options) -> L3Tier | None:
    """Connect to the store (``options``: :func:`connect_tier`'s) and add the L3 tier to ``cache``'s
    tiers (None: not attached)."""
    if not hasattr(cache, "add_tier"):
        log.info("L3 store off: the prefix cache is disabled")
        return None
    tier = connect_tier(kv_pool, model, cache.aux_components, aux_data, **options)
    if tier is not None:
        cache.add_tier(tier)
    return tier


def connect_tier(kv_pool, model: str, comps, aux_data: Mapping[str, Any] | None, *, url: str,
                 timeout_s: float, corrupt: bool = False, write_policy: str = WORKER_WRITE_POLICY,
                 segment_bytes: int = 0, prefill_tok_s: float | None = PRIOR_PREFILL_TOK_S,
                 max_tokens: int | None = None) -> L3Tier | None:
    """An :class:`L3Tier` over the store at ``url`` for a cache with auxiliary components ``comps``
    (None: no store joined, or a component without its device data), its read rate measured
    once here (``ReadBudget.probe``)."""
    missing = [c.name for c in comps if c.name not in (aux_data or {})]
    if missing:
        log.warning("L3 store off: no device data given for the components %s", missing)
        return None
    from tandem.cache.tiers.l3 import mooncake as mc

    address = mc.MasterAddress.parse(url[len("mooncake://"):])
    try:
        backend = mc.connect(address, segment_bytes=segment_bytes, buffer_bytes=64 << 20)
    except Exception as e:     # noqa: BLE001 - a missing wheel or master: no L3, still serve
        log.warning("L3 store at %s not joined (%s); serving without it", url, e)
        return None
    dtype = str(kv_pool.dtype).removeprefix("torch.")
    store = L3Store(backend, key_prefix(os.path.basename(model.rstrip("/")), kv_pool.page_size,
                                        dtype, layout(comps)), timeout_s=timeout_s, pin_config=mc.soft_pin)
    store.corrupt_all = corrupt
    tier = L3Tier(store, kv_pool.kv_data, kv_pool.page_size, write_policy=write_policy,
                  aux_data={c.name: (aux_data or {})[c.name] for c in comps}, prefill_tok_s=prefill_tok_s,
                  max_tokens=max_tokens)
    rate = tier.budget.probe(store, tier.budget.token_bytes * kv_pool.page_size)
    log.info("L3 store joined at %s (%s, prefix %s, read %s MB/s)", url, write_policy, store.prefix,
             "?" if rate is None else f"{rate / 1e6:.0f}")
    return tier
