"""Tiers built from config: one factory entry per tier, in admission order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tandem.cache.tiers.base import KVTier
from tandem.cache.tiers.host import HostTier


@dataclass(frozen=True)
class TierSite:

    kv_pool: Any
    full_pool: Any
    model: str = ""
    aux_data: Mapping[str, Any] = field(default_factory=dict)
    aux_components: tuple = ()
    host_stores: Callable[[int], list] = lambda tokens: []
    config: Any = None


def _host(site: TierSite, options: Mapping[str, Any] | None) -> HostTier | None:
    if options is None:
        return None
    n = options["tokens"]
    return HostTier(site.full_pool, n, options["write_policy"], site.host_stores(n))


def _l3(site: TierSite, options: Mapping[str, Any] | None) -> KVTier | None:
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
