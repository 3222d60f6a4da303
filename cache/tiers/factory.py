"""Tiers built from config: one factory entry per tier, in admission order.

An entry ``make(site, options)`` returns its tier over ``site`` (the engine's pools and cache
config, described without the engine), or None when the tier is off (``options`` None and no
config field of its own set) or cannot start (an L3 store that cannot be reached: L3 is an
optimisation, never a reason for a worker not to start). The engine builds its cache's tiers
with :func:`build_tiers`; a worker adds one the cluster configures later with :func:`build_tier`
(worker/role_worker.py ``attach_tier``: the shared L3 store). A new tier (a disk tier, say) is
its module, one entry in :data:`FACTORIES`, and the config field its entry reads.
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
    of that many tokens; ``config``: the ``CacheConfig``."""

    kv_pool: Any
    full_pool: Any
    model: str = ""
    aux_data: Mapping[str, Any] = field(default_factory=dict)
    aux_components: tuple = ()
    host_stores: Callable[[int], list] = lambda tokens: []
    config: Any = None


def _host(site: TierSite, options: Mapping[str, Any] | None) -> HostTier | None:
    """``options``: ``tokens`` (host pool tokens, sized by the engine: engine/host_sizing.py),
    ``write_policy`` (``CacheConfig.host_write_policy``); None: no host tier."""
    if options is None:
        return None
    n = options["tokens"]
    return HostTier(site.full_pool, n, options["write_policy"], site.host_stores(n))


def _l3(site: TierSite, options: Mapping[str, Any] | None) -> KVTier | None:
    """``options``: cache/tiers/l3/connect.py ``l3_options`` (``ServeConfig.kv_store``, ...);
    None: no store."""
    if options is None:
        return None
    from tandem.cache.tiers.l3.connect import connect_tier

    return connect_tier(site.kv_pool, site.model, site.aux_components, site.aux_data, **options)


FACTORIES: dict[str, Callable[[TierSite, Mapping[str, Any] | None], KVTier | None]] = {
    "host": _host,
    "l3": _l3,
}


def build_tier(name: str, site: TierSite, options: Mapping[str, Any] | None) -> KVTier | None:
    """The tier ``name`` over ``site`` with ``options``; None when off or unavailable."""
    return FACTORIES[name](site, options)


def build_tiers(site: TierSite, options: Mapping[str, Mapping[str, Any] | None]) -> list[KVTier]:
    """Every tier an entry builds over ``site`` (``options`` by tier name; a name left out is
    None), in :data:`FACTORIES` order: the admission order."""
    tiers = (make(site, options.get(name)) for name, make in FACTORIES.items())
    return [t for t in tiers if t is not None]
