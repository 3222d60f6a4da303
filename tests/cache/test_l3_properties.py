"""Property-based: random runs, retraction backups, evictions of both tiers and loads (host
load-back, then the L3 fetch) on a cache with an L3 tier over an in-memory store, with and
without a host tier, both L3 write policies. After every operation: check() (sizes, ownership,
no spill left unwritten); the KV bytes of every reused position are that position's, L3-fetched
ones included; and, with nothing locked, a load finds every page prefix ever computed (a page's
last copy leaving the tree is always written to L3 first)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.tiers.l3.store import L3Store
from tandem.cache.tiers.l3.tier import L3Tier
from tandem.cache.tiers.host import HostTier
from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import CacheConfig

from test_l3_tier import DictBackend
from test_properties import SETTINGS, kv_of, longest, page_prefixes, seqs

NONE = torch.empty(0, dtype=torch.int64)


@pytest.mark.parametrize("ps, l3_policy, host_tokens", [(1, "write_back", 0), (2, "write_back", 8),
                                                        (2, "write_through", 0), (1, "write_through", 8)])
def test_l3_tier_against_reference(ps, l3_policy, host_tokens):
    def ops():
        return st.lists(st.one_of(
            st.tuples(st.just("run"), seqs(ps)),
            st.tuples(st.just("retract"), seqs(ps)),
            st.tuples(st.just("release"), st.integers(0, 9)),
            st.tuples(st.just("load"), seqs(ps)),
            st.tuples(st.just("evict"), st.sampled_from(["full", "host"]), st.integers(1, 4 * ps)),
        ), max_size=25)

    @SETTINGS
    @given(ops=ops())
    def run(ops):
        pool = KVPool(24 * ps, ps, num_layers=1, num_kv_heads=1, head_dim=1)
        host = HostTier(pool, host_tokens * ps, "write_back") if host_tokens else None
        alloc = PagedAllocator(24, ps)
        cache = UnifiedRadixCache(CacheConfig(page_size=ps, debug_invariants=True), alloc, host=host)
        tier = L3Tier(L3Store(DictBackend(), "p", timeout_s=5), pool.kv_data, ps, write_policy=l3_policy)
        cache.add_tier(tier)
        backups: list = []
        ever: set = set()

        def check_kv(ids, slots):
            got = pool.kv_data[0, 0, slots, 0, 0].tolist()
            assert got == [kv_of(tuple(ids[:p + 1])) for p in range(len(slots))]

        def load(ids):
            r = cache.match(ids)
            if r.host_hit_length and cache.host is not None:
                if cache.host.restore(r.best_match_node) is not None:
                    r = cache.match(ids)
            if tier.fetch(ids, r):
                r = cache.match(ids)
            check_kv(ids, r.device_indices)
            return r

        def compute(ids):
            r = load(ids)
            cache.lock(r.last_device_node)
            n = len(ids) - r.prefix_len
            own = alloc.alloc(n)
            if own is None:
                cache.evict(n)
                own = alloc.alloc(n)
            if own is None:
                cache.unlock(r.last_device_node)
                return None
            for j, s in enumerate(own.tolist()):
                pool.kv_data[:, :, s] = kv_of(tuple(ids[:r.prefix_len + j + 1]))
            return r, torch.cat([r.device_indices, own])

        for op in ops:
            if op[0] in ("run", "retract"):
                ids = op[1]
                got = compute(ids)
                if got is None:
                    continue
                r, slots = got
                aligned = len(ids) // ps * ps
                if len(ids) > aligned:
                    alloc.free(slots[aligned:])
                if op[0] == "run" or host is None:
                    _, node = cache.cache(ids, slots, r.last_device_node)
                    cache.unlock(node)
                else:
                    node, _ = cache.host.backup(ids, slots, r.last_device_node)
                    backups.append(node)
                ever |= page_prefixes(ids, ps)
            elif op[0] == "release":
                if backups:
                    cache.unlock(backups.pop(op[1] % len(backups)))
            elif op[0] == "load":
                ids = op[1]
                r = load(ids)
                if not backups:             # nothing locked: room for every fetch
                    assert r.prefix_len == longest(ever, ids, ps), (r.prefix_len, tier.stats)
            else:
                cache.evict(op[2], op[1])
            assert tier.store.flush(5.0)
            cache.check(extra_owned=NONE)
        for nd in backups:
            cache.unlock(nd)
        cache.evict(10 ** 6)
        if host is not None:
            cache.evict(10 ** 6, "host")
        assert cache.stats().device == 0 and cache.stats().host == 0
        assert alloc.available_size() == alloc.size
        assert tier.store.stats.write_dropped == 0 and tier.store.stats.corrupt == 0
    run()
