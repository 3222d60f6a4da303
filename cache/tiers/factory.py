"""Tiers built from config: one factory entry per tier, in admission order.

``build_tier(name, site, options)`` returns the tier ``name`` over ``site`` (the engine's pools,
described without the engine), or None when ``options`` is None (the tier is off) or the tier
cannot start (an L3 store that cannot be reached: L3 is an optimisation, never a reason for a
worker not to start). A new tier (a disk tier, say) is its module, one entry in
:data:`FACTORIES`, and the config field its options come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tandem.cache.tiers.base import KVTier
from tandem.cache.tiers.host import HostTier


@dataclass(frozen=True)
class TierSite:
    """What a tier is built over. ``kv_pool``: the engine's device KV pool (the L3 tier's pages);
    ``full_pool``: the full layers' pool the host tier mirrors (``kv_pool`` for FULL-only models);
    ``aux_data``: each auxiliary component's device data by name; ``aux_components``: the cache's
    auxiliary components; ``host_stores(tokens)``: one host store per component for a host tier
    of that many tokens."""

    kv_pool: Any
    full_pool: Any
    model: str = ""
    aux_data: Mapping[str, Any] = field(default_factory=dict)
    aux_components: tuple = ()
    host_stores: Callable[[int], list] = lambda tokens: []


def _host(site: TierSite, options: Mapping[str, Any]) -> HostTier:
    """``options``: ``tokens`` (host pool tokens, > 0), ``write_policy`` (CacheConfig's)."""
    n = options["tokens"]
    return HostTier(site.full_pool, n, options["write_policy"], site.host_stores(n))


def _l3(site: TierSite, options: Mapping[str, Any]) -> KVTier | None:
    """``options``: cache/tiers/l3/connect.py ``l3_options`` (ServeConfig ``kv_store``, ...)."""
    from tandem.cache.tiers.l3.connect import connect_tier

    return connect_tier(site.kv_pool, site.model, site.aux_components, site.aux_data, **options)


FACTORIES: dict[str, Callable[[TierSite, Mapping[str, Any]], KVTier | None]] = {
    "host": _host,
    "l3": _l3,
}


def build_tier(name: str, site: TierSite, options: Mapping[str, Any] | None) -> KVTier | None:
    """The tier ``name`` over ``site`` with ``options``; None when off or unavailable."""
    if options is None:
        return None
    return FACTORIES[name](site, options)
