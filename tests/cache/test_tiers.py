"""The KVTier port (cache/tiers/base.py) and the port the cache hands a tier: a tier built by a
factory entry is bound in order, hears the cache's hooks, loads pages through the port only,
and no tier module reaches another object's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from tandem.cache.kv_pool import KVPool
from tandem.cache.tiers import factory
from tandem.cache.tiers.base import KVTier
from tandem.cache.tiers.host import HostTier
from tandem.cache.tiers.l3.store import L3Store
from tandem.cache.tiers.l3.tier import L3Tier

from cache_support import make_cache
from test_l3_tier import DictBackend

TIERS = Path(__file__).resolve().parents[2] / "cache" / "tiers"


class Replay:
    """A tier that holds whole prompts it was given and loads them back past a match."""

    name = "replay"
    prefetching = False

    def __init__(self, held: list[list[int]]):
        self.held, self.calls, self.port = held, [], None

    def bind(self, port) -> None:
        self.port = port

    def lookup(self, token_ids, m) -> int:
        ids = self.port.key(token_ids)
        return max((len(h) - m.prefix_len for h in self.held if ids[:len(h)] == h), default=0)

    def load(self, token_ids, m, *, session_id=None) -> bool:
        n = self.lookup(token_ids, m)
        alloc = self.port.allocator
        if alloc.available_size() < n:
            self.port.make_room(n - alloc.available_size())
        slots = alloc.alloc(n)
        key = self.port.key(token_ids)[:m.prefix_len + n]
        cached = self.port.insert_loaded(key, torch.cat([m.device_indices, slots]), None)
        if cached > m.prefix_len:
            alloc.free(slots[:cached - m.prefix_len])
        self.port.settle()
        return True

    def prefetch(self, token_ids, m, *, session_id=None):
        return None

    def on_insert(self, node, created, adopted):
        self.calls.append(("insert", node.end, created))

    def on_evict(self, node):
        self.calls.append(("evict", node.end, node.value is not None))

    def on_spill(self, spills):
        self.calls.append(("spill", len(spills)))

    def as_dict(self) -> dict:
        return {"held": len(self.held)}

    def close(self) -> None:
        self.held = []


def test_no_tier_reaches_another_objects_private_names():
    bad = []
    for f in sorted(TIERS.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                bad.append(f"{f.relative_to(TIERS)}:{node.lineno} .{node.attr}")
    assert not bad, "\n".join(bad)


def test_host_and_l3_tiers_implement_the_port():
    pool = KVPool(32, 2, num_layers=1, num_kv_heads=1, head_dim=2)
    l3 = L3Tier(L3Store(DictBackend(), "t"), pool.kv_data, 2, staging_bytes=0)
    try:
        assert isinstance(HostTier(pool, 8), KVTier) and isinstance(l3, KVTier)
        assert isinstance(Replay([]), KVTier)
    finally:
        l3.close()


def test_a_factory_entry_builds_a_tier_the_cache_binds_in_order(monkeypatch):
    monkeypatch.setitem(factory.FACTORIES, "replay", lambda site, opts: Replay(opts) if opts else None)
    pool = KVPool(32, 2, num_layers=1, num_kv_heads=1, head_dim=2)
    site = factory.TierSite(pool, pool)
    tiers = factory.build_tiers(site, {"host": {"tokens": 8, "write_policy": "write_back"},
                                       "replay": [[1, 2, 3, 4]]})
    assert [t.name for t in tiers] == ["host", "replay"]
    assert factory.build_tiers(site, {}) == []
    cache, _ = make_cache(page_size=2, pages=16)
    for t in tiers:
        cache.add_tier(t)
    assert cache.host is tiers[0] and cache.tier("replay") is tiers[1] and cache.tier("l3") is None


def test_the_cache_calls_each_tier_and_a_load_lengthens_the_match():
    tier = Replay([[5, 6, 7, 8, 9, 10]])
    cache, alloc = make_cache(page_size=2, pages=8)
    cache.add_tier(tier)
    ids = [5, 6, 7, 8, 9, 10, 11]
    m = cache.match(ids)
    assert m.prefix_len == 0 and tier.lookup(ids, m) == 6
    assert tier.load(ids, m)
    m = cache.match(ids)
    assert m.prefix_len == 6 and tier.lookup(ids, m) == 0
    assert tier.calls == [("insert", 6, True)]
    assert cache.evict(6) == 6
    assert [c[0] for c in tier.calls[1:]] == ["evict"] and tier.calls[1][2]   # before the drop
    cache.check(extra_owned=torch.empty(0, dtype=torch.int64))
