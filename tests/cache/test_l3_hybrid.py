"""The L3 tier for hybrid caches: SWA rows and recurrent-state checkpoints travel with the FULL
pages, and a match continued into the store ends only where the components' vote accepts it.

Real tensors on the CPU, an in-memory store (the real Mooncake master and real hybrid engines:
tests/worker/test_l3_hybrid_engines.py). Every pool's row of a token holds a number naming the
token's whole prefix (``val``), a state row the number of the prefix before its checkpoint, so a
value read into the wrong place, or for another prefix, shows up as a wrong number. Every operation runs the cache's invariant recount (debug_invariants) and the
tests end with the exact ownership check of every pool (full, SWA, state, host ones).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.tiers.l3.store import L3Store, page_key
from tandem.cache.tiers.l3.tier import L3Tier, layout
from tandem.cache.radix.components import FULL, SWA, Mamba, StateCopy
from tandem.cache.tiers.host import HostStore, HostTier
from tandem.cache.state_pool import StatePool
from tandem.core.page_hash import page_hashes

from cache_support import make_cache
from test_l3_tier import DictBackend
from test_properties import COMPONENT_SETTINGS, seqs

PS = 2
W = 4           # SWA window
PAGES = 32
NONE = torch.empty(0, dtype=torch.int64)


def val(ids, i) -> float:
    """The value every pool holds for token ``i`` of ``ids``: a number naming ``ids[:i + 1]``."""
    return float(hash(tuple(ids[:i + 1])) % 1_000_003)


def vals(ids, a, b) -> list[float]:
    return [val(ids, i) for i in range(a, b)]


class Rig:
    """A cache with the components ``comps`` (``"swa"``, ``"mamba"``) over real pools, an L3
    tier over ``backend`` and, with ``host_tokens``, a host tier with a pool per component.
    ``compute`` behaves like the engine: SWA rows behind the window are released before the
    hand-over (-1), the state row holds the id of the last token."""

    def __init__(self, backend, comps=("swa", "mamba"), policy="write_through", host_tokens=0,
                 swa_rows=64, state_rows=8):
        self.full = KVPool(PAGES * PS, PS, num_layers=2, num_kv_heads=1, head_dim=1)
        self.swa_pool = KVPool(swa_rows, 1, num_layers=1, num_kv_heads=1, head_dim=1)
        self.state = StatePool(state_rows, [0], (3,))
        self.swa_alloc, self.state_alloc = PagedAllocator(swa_rows, 1), PagedAllocator(state_rows, 1)
        self.index_map = torch.zeros(PAGES * PS + PS, dtype=torch.int64)
        self.comps = comps
        components, data, stores = [FULL], {}, []
        if "swa" in comps:
            components.append(SWA(W, self.swa_alloc, self.index_map))
            data["swa"] = self.swa_pool.kv_data
            stores.append(HostStore("swa", self.swa_pool.kv_data, 32))
        if "mamba" in comps:
            components.append(Mamba(self.state_alloc))
            data["mamba"] = self.state.data.unsqueeze(1)
            stores.append(HostStore("mamba", self.state.data.unsqueeze(1), 4))
        self.host = HostTier(self.full, host_tokens, "write_back", stores) if host_tokens else None
        self.cache, self.alloc = make_cache(page_size=PS, pages=PAGES, components=tuple(components),
                                            host=self.host)
        self.store = L3Store(backend, "t/" + layout(self.cache._aux), timeout_s=5, backoff_s=60)
        self.tier = L3Tier(self.store, self.full.kv_data, PS, aux_data=data, write_policy=policy)
        self.cache.add_tier(self.tier)

    # -- an engine-like request --------------------------------------------------------------------
    def load(self, ids):
        """Admission: match, host load-back, L3 fetch, match again."""
        m = self.cache.match(ids)
        if m.host_hit_length and self.host is not None:
            if self.host.restore(m.best_match_node) is not None:
                m = self.cache.match(ids)
        if m.prefix_len < len(ids) // PS * PS and self.tier.fetch(ids, m):
            m = self.cache.match(ids)
        return m

    def run(self, ids):
        """A request over ``ids``: reuse, compute the rest, hand it over, finish. Returns the
        match it was admitted with (after checking every reused value)."""
        m = self.load(ids)
        self.check_reused(ids, m)
        c = self.cache
        c.lock(m.last_device_node)
        n, p = len(ids) // PS * PS, m.prefix_len
        slots = self._alloc(self.alloc, "full", n - p)
        self.full.kv_data[:, :, slots] = torch.tensor(vals(ids, p, n))[:, None, None]
        extra = {}
        if "swa" in self.comps:
            keep = max(0, (n - W) // PS * PS)           # engine: rows behind the window released
            rows = torch.full((n,), -1, dtype=torch.int64)
            own = self._alloc(self.swa_alloc, "swa", n - max(keep, p))
            rows[max(keep, p):] = own
            self.index_map[slots[max(keep, p) - p:]] = own
            self.swa_pool.kv_data[:, :, own] = torch.tensor(vals(ids, max(keep, p), n))[:, None, None]
            extra["swa"] = rows
        if "mamba" in self.comps and n:
            s = int(self._alloc(self.state_alloc, "mamba", 1)[0])
            self.state.data[:, s] = val(ids, n - 1)
            extra["mamba"] = s
        _, node = c.cache(ids[:n], torch.cat([m.device_indices, slots]), m.last_device_node, extra=extra)
        c.unlock(node)
        self.store.flush()
        return m

    def _alloc(self, alloc, pool: str, n: int) -> torch.Tensor:
        """``n`` rows of a pool, evicting unlocked cache of that pool when short (the engine's way)."""
        if alloc.available_size() < n:
            self.cache.evict(n - alloc.available_size(), pool)
        got = alloc.alloc(n)
        assert got is not None, f"test pools too small for {n} {pool} rows"
        return got

    def check_reused(self, ids, m):
        n = m.prefix_len
        idx = m.device_indices
        assert self.full.kv_data[1, 1, idx, 0, 0].tolist() == vals(ids, 0, n)
        if "swa" in self.comps and n:
            lo = max(0, n - W)                          # the window attention reads
            rows = self.index_map[idx[lo:]]
            assert self.swa_pool.kv_data[0, 0, rows, 0, 0].tolist() == vals(ids, lo, n)
            assert m.components["swa"][lo:].tolist() == rows.tolist()
        if "mamba" in self.comps and n:
            src = m.components["mamba"]
            assert isinstance(src, StateCopy) and float(self.state.data[0, src.src, 0]) == val(ids, n - 1)

    def check(self):
        owned = {"full": NONE}
        owned.update({c: NONE for c in self.comps})
        self.cache.check(extra_owned=owned)


def keys(backend, kind):
    """The stored keys of one kind (``""``: FULL pages)."""
    kinds = {"swa", "mamba"}
    return sorted(k for k in backend.data
                  if (k.split("/")[-2] == kind if kind else k.split("/")[-2] not in kinds))


@pytest.mark.parametrize("comps", [("swa",), ("mamba",), ("swa", "mamba")])
def test_a_fresh_cache_reads_every_component_back_from_l3(comps):
    b = DictBackend()
    a = Rig(b, comps)
    ids = list(range(100, 112))                                        # 12 tokens, 6 pages
    a.run(ids)
    assert len(keys(b, "")) == 6
    if "swa" in comps:
        assert len(keys(b, "swa")) == W // PS                          # the window's pages only
    if "mamba" in comps:
        h = page_hashes(ids, PS)[-1]
        assert keys(b, "mamba") == [page_key(a.store.prefix, h, "mamba")]
    fresh = Rig(b, comps)
    m = fresh.run(ids + [7, 7])                                        # checks what it reused
    assert m.prefix_len == 12
    st = fresh.tier.stats
    assert (st.hit_pages, st.miss_pages, st.aux_misses) == (6, 1, 0)      # page 7: never stored
    assert st.aux_hits == (W // PS if "swa" in comps else 0) + ("mamba" in comps)
    a.check()
    fresh.check()


def test_hybrid_and_full_only_entries_never_share_a_key():
    assert layout() == "l2phd"
    b = DictBackend()
    Rig(b, ("swa",)).run(list(range(100, 108)))
    Rig(b, ("mamba",)).run(list(range(100, 108)))
    prefixes = {k.rsplit("/", 1)[0].removesuffix("/swa").removesuffix("/mamba") for k in b.data}
    assert prefixes == {"t/l2phd+swa", "t/l2phd+mamba"}


def test_the_l3_match_ends_only_where_the_writer_s_own_vote_would():
    """SWA: the writer released the rows behind the window, so an end in the middle of its
    prompt has no window anywhere: the store serves no deeper than the writer's own cache.
    MAMBA: checkpoints sit at the two turns' ends only."""
    b = DictBackend()
    a = Rig(b)
    first = list(range(100, 108))
    second = first + list(range(200, 208))
    a.run(first)
    a.run(second)
    fresh = Rig(b)
    for probe, want in [(second[:6] + [1, 1], 0), (second[:12] + [1, 1], 8), (second + [1], 16)]:
        assert a.cache.match(probe).prefix_len == want                  # the writer's device vote
        m = fresh.run(probe)
        assert m.prefix_len == want, probe
    fresh.check()


def test_a_missing_checkpoint_stops_the_match_at_the_previous_one():
    b = DictBackend()
    a = Rig(b)
    first, second = list(range(100, 108)), list(range(100, 108)) + list(range(200, 208))
    a.run(first)
    a.run(second)
    del b.data[page_key(a.store.prefix, page_hashes(second, PS)[-1], "mamba")]
    fresh = Rig(b)
    assert fresh.run(second + [1]).prefix_len == 8
    st = fresh.tier.stats
    assert st.hit_pages == 4 and st.miss_pages == 4                    # FULL pages past the end: misses
    fresh.check()


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_corrupt_component_value_is_a_counted_miss_and_the_match_backs_off(kind):
    b = DictBackend()
    a = Rig(b)
    first, second = list(range(100, 108)), list(range(100, 108)) + list(range(200, 208))
    a.run(first)
    a.run(second)
    k = page_key(a.store.prefix, page_hashes(second, PS)[-1], kind)     # the last page's value
    v = bytearray(b.data[k])
    v[-1] ^= 0xFF
    b.data[k] = bytes(v)
    fresh = Rig(b)
    m = fresh.run(second + [1])                                        # checks every reused value
    assert m.prefix_len == 8                                           # the first turn's end
    assert fresh.tier.stats.aux_misses == 1 and fresh.store.stats.corrupt == 1
    fresh.check()


def test_a_wrong_sized_component_value_is_a_miss():
    b = DictBackend()
    a = Rig(b, ("mamba",))
    ids = list(range(100, 108))
    a.run(ids)
    fresh = Rig(b, ("mamba",))
    fresh.store.put(page_hashes(ids, PS)[-1], b"short", kind="mamba")  # sealed, but not a state
    assert fresh.run(ids + [1]).prefix_len == 0
    assert fresh.tier.stats.aux_misses == 1
    fresh.check()


def test_write_back_spills_every_component_and_reads_it_back():
    b = DictBackend()
    g = Rig(b, policy="write_back")
    ids = list(range(100, 112))
    g.run(ids)
    assert not b.data
    assert g.cache.evict(12) == 12                                      # no host: the last copies
    g.store.flush()
    assert (len(keys(b, "")), len(keys(b, "swa")), len(keys(b, "mamba"))) == (6, W // PS, 1)
    assert g.swa_alloc.available_size() == g.swa_alloc.size
    assert g.run(ids + [1]).prefix_len == 12
    g.check()


def test_component_evictions_write_back_their_last_copy():
    """``evict(n, "swa" | "mamba")`` tombstones a node's component data while its FULL pages stay:
    with write-back that data goes to L3 first (and the FULL pages when they leave later), so a
    later match gets all of it back from there."""
    b = DictBackend()
    g = Rig(b, policy="write_back")
    ids = list(range(100, 112))
    g.run(ids)
    assert g.cache.evict(100, "swa") == W and g.cache.evict(1, "mamba") == 1
    g.store.flush()
    assert not keys(b, "") and len(keys(b, "swa")) == W // PS and len(keys(b, "mamba")) == 1
    assert g.cache.match(ids).prefix_len == 0                          # the vote fails on the device
    assert g.cache.evict(12) == 12                                      # now the FULL pages' last copy
    g.store.flush()
    assert len(keys(b, "")) == 6
    m = g.run(ids + [1])
    assert m.prefix_len == 12 and g.tier.stats.hit_pages == 6
    g.check()


def test_full_pages_on_the_device_past_the_vote_are_kept_and_fetched_ones_freed():
    """The device holds FULL pages the vote did not accept (component data tombstoned); a fetch
    reads FULL and component values from the store, the tree keeps its own FULL slots and adopts
    the component data; the fetched FULL duplicates are freed (exact ownership)."""
    b = DictBackend()
    g = Rig(b)                                                         # write-through: all in L3
    ids = list(range(100, 112))
    g.run(ids)
    g.cache.evict(100, "swa")
    g.cache.evict(1, "mamba")
    path = g.cache._tree.path(g.cache._tree.match(g.cache._key(ids))[-1])
    before = torch.cat([nd.value for nd in path])                      # the tree's own FULL slots
    assert g.cache.match(ids).prefix_len == 0
    m = g.run(ids + [1])
    assert m.prefix_len == 12 and m.device_indices.tolist() == before.tolist()
    assert g.alloc.available_size() + g.cache.stats().evictable == g.alloc.size
    g.check()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_evictions_write_back_component_host_copies(policy):
    b = DictBackend()
    g = Rig(b, policy=policy, host_tokens=8)
    g.run(list(range(100, 108)))
    g.run(list(range(200, 208)))
    assert g.cache.evict(16) == 16                                      # to the host; it holds 8
    g.store.flush()
    for ids in (list(range(100, 108)), list(range(200, 208))):
        assert g.run(ids + [1]).prefix_len == 8                         # host or L3
    g.check()


def test_no_room_for_component_rows_is_no_fetch():
    b = DictBackend()
    a = Rig(b, ("swa",))
    ids = list(range(100, 112))
    a.run(ids)
    fresh = Rig(b, ("swa",))
    held = fresh.swa_alloc.alloc(fresh.swa_alloc.available_size())     # every SWA row taken
    m = fresh.cache.match(ids + [1])
    assert fresh.tier.fetch(ids + [1], m) == 0
    assert fresh.alloc.available_size() == fresh.alloc.size            # FULL slots given back
    fresh.swa_alloc.free(held)
    fresh.check()


@pytest.mark.parametrize("comps, policy, host_tokens", [
    (("swa", "mamba"), "write_through", 0), (("swa", "mamba"), "write_back", 0),
    (("swa",), "write_back", 8), (("mamba",), "write_through", 8)])
def test_two_hybrid_caches_sharing_a_store_against_their_values(comps, policy, host_tokens):
    """Random runs on two caches over one store, evictions of every pool (FULL, each component,
    the host): every value a request reuses (device, host load-back, L3) is its prefix's, and
    every pool's ownership stays exact (check after every operation, and all free at the end)."""
    def ops():
        return st.lists(st.one_of(
            st.tuples(st.just("run"), st.integers(0, 1), seqs(PS)),
            st.tuples(st.just("again"), st.integers(0, 1), st.integers(0, 9), st.integers(0, 2)),
            st.tuples(st.just("evict"), st.integers(0, 1), st.sampled_from(("full", "host") + comps),
                      st.integers(1, 4 * PS)),
            st.tuples(st.just("evict"), st.integers(0, 1), st.sampled_from(("full", "host")),
                      st.just(10 ** 6)),          # everything unlocked leaves that tier
        ), max_size=30)

    @COMPONENT_SETTINGS
    @given(ops=ops())
    def run(ops):
        b = DictBackend()
        rigs = [Rig(b, comps, policy, host_tokens, swa_rows=24, state_rows=4) for _ in range(2)]
        done: list[list[int]] = []
        for op in ops:
            g = rigs[op[1]]
            if op[0] == "run":
                g.run(op[2])                        # checks every reused value
                done.append(op[2])
            elif op[0] == "again":                  # an earlier prompt and a new token (a next turn)
                if done:
                    g.run(done[op[2] % len(done)] + [op[3]])
            elif op[2] != "host" or g.host is not None:
                g.cache.evict(op[3], op[2])
            g.store.flush()
            g.check()
        for g in rigs:
            g.cache.evict(10 ** 6)
            if g.host is not None:
                g.cache.evict(10 ** 6, "host")
            g.store.flush()
            g.check()
            assert g.alloc.available_size() == g.alloc.size
            assert g.swa_alloc.available_size() == g.swa_alloc.size or "swa" not in comps
            assert g.state_alloc.available_size() == g.state_alloc.size or "mamba" not in comps
            assert g.store.stats.corrupt == 0 and g.tier.stats.aux_misses == 0
    run()
