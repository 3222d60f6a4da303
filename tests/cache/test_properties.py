"""Property-based tests: random operation sequences against a reference model, with
check() after every operation (debug_invariants) and exact slot ownership checked.

1. Simulated cache, FULL only, page sizes 1 and 4, every eviction policy: a set of cached page
   prefixes predicts every match and insert; evictions must free exactly what disappears, never
   a locked prefix, and leave a prefix-closed set.
2. Real pools with SWA and/or MAMBA on (page sizes 1 and 4): an engine-like driver starts and
   finishes requests, releases SWA rows that leave the window, hands over state rows, evicts each
   pool. Checked: the component vote (recomputed from the tree's data), slot stability, the SWA
   index map, and that every slot of every pool is owned exactly once.
3. Host tier (write-through / write-back): runs, evictions on both tiers, load-back and
   retraction backups; the KV bytes of every reused position must be that position's.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.radix.components import FULL, SWA, Mamba, StateCopy
from tandem.cache.radix.eviction import POLICIES
from tandem.cache.tiers.host import HostTier
from tandem.cache.unified import UnifiedRadixCache
from tandem.core.config import CacheConfig

from cache_support import FakeClock

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Component bugs (locks across splits, SWA floors) need longer searches to surface.
COMPONENT_SETTINGS = settings(SETTINGS, max_examples=120)


def seqs(page_size):
    """Token lists over a tiny alphabet, half of them cut from three long shared "documents" at
    any depth, with a short tail: lots of shared prefixes diverging mid-edge."""
    n = 4 * page_size + 3
    docs = [[(i * 7 + d) % 3 for i in range(n)] for d in range(3)]
    tail = st.lists(st.integers(0, 2), max_size=page_size + 1)
    derived = st.builds(lambda d, cut, t: (docs[d][:cut] + t)[:n], st.integers(0, 2),
                        st.integers(0, n), tail)
    return st.one_of(st.lists(st.integers(0, 2), max_size=n), derived)


def page_prefixes(ids, ps):
    return {tuple(ids[:k]) for k in range(ps, len(ids) // ps * ps + 1, ps)}


def longest(model, ids, ps):
    n = 0
    for k in range(ps, len(ids) // ps * ps + 1, ps):
        if tuple(ids[:k]) not in model:
            break
        n = k
    return n


def walk(cache):
    """(node, tokens of the path to the node's end) for every node below the root."""
    out, stack = [], [(cache._tree.root, ())]
    while stack:
        nd, toks = stack.pop()
        for c in nd.children.values():
            t = toks + tuple(c.key)
            out.append((c, t))
            stack.append((c, t))
    return out


# -- 1. simulated, FULL only -----------------------------------------------------------------------
def sim_ops(ps):
    return st.lists(st.one_of(
        st.tuples(st.just("insert"), seqs(ps), st.sampled_from([None, "s1", "s2"]), st.integers(0, 3)),
        st.tuples(st.just("match"), seqs(ps), st.sampled_from([None, "s1", "s2"])),
        st.tuples(st.just("lock"), seqs(ps)),
        st.tuples(st.just("unlock"), st.integers(0, 9)),
        st.tuples(st.just("evict"), st.integers(1, 4 * ps + 2)),
        st.tuples(st.just("tick"), st.integers(1, 20)),
    ), max_size=30)


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_simulated_cache_against_reference(ps, policy):
    @SETTINGS
    @given(ops=sim_ops(ps))
    def run(ops):
        clock = FakeClock()
        cache = UnifiedRadixCache.simulated(page_size=ps, eviction=policy, session_ttl_s=10,
                                            debug_invariants=True, clock=clock)
        model: set = set()
        locks: list = []                                # (node, page prefixes it protects)
        for op in ops:
            if op[0] == "insert":
                _, ids, sid, prio = op
                assert cache.insert(ids, session_id=sid, priority=prio) == longest(model, ids, ps)
                model |= page_prefixes(ids, ps)
            elif op[0] in ("match", "lock"):
                ids = op[1]
                r = cache.match(ids, session_id=op[2] if op[0] == "match" else None)
                n = longest(model, ids, ps)
                assert r.prefix_len == n and r.device_indices.tolist() == list(range(n))
                if op[0] == "lock":
                    cache.lock(r.last_device_node)
                    locks.append((r.last_device_node, page_prefixes(ids[:n], ps)))
            elif op[0] == "unlock":
                if locks:
                    cache.unlock(locks.pop(op[1] % len(locks))[0])
            elif op[0] == "evict":
                before = cache.stats().evictable
                freed = cache.evict(op[1])
                now = {toks[:k] for nd, toks in walk(cache)
                       for k in range(nd.start + ps, nd.end + 1, ps)}
                assert now <= model and len(model - now) * ps == freed
                assert min(op[1], before) <= freed <= before
                assert all(longest(now, p, ps) == len(p) for p in now)      # prefix-closed
                assert all(p <= now for _, p in locks)
                model = now
            else:
                clock.t += op[1]
            protected = set().union(*(p for _, p in locks))
            assert cache.stats().device == len(model) * ps
            assert cache.stats().protected == len(protected) * ps
    run()


# -- 2. real pools with SWA / MAMBA ----------------------------------------------------------------
class Driver:
    """An engine in miniature: requests match, lock, compute (allocating from every pool),
    release SWA rows that left the window, and hand everything to cache()."""

    def __init__(self, ps, comps, policy):
        self.ps = ps
        self.window = 3 if ps == 1 else 8
        self.alloc = PagedAllocator(48, ps)
        self.swa_alloc = PagedAllocator(48, ps) if "swa" in comps else None
        self.states = PagedAllocator(24, 1) if "mamba" in comps else None
        self.index_map = torch.zeros(49 * ps, dtype=torch.int64)
        components = [FULL]
        if self.swa_alloc:
            components.append(SWA(self.window, self.swa_alloc, self.index_map))
        if self.states:
            components.append(Mamba(self.states))
        self.cache = UnifiedRadixCache(CacheConfig(page_size=ps, eviction_policy=policy,
                                                   debug_invariants=True),
                                       self.alloc, components=components)
        self.swa_i = 0 if self.swa_alloc else None
        self.mamba_i = (1 if self.swa_alloc else 0) if self.states else None
        self.inflight: list[dict] = []
        self.snapshot()

    # The tree's content, per page prefix (and per node end for MAMBA). Between snapshots no
    # slot, SWA row or state moves to another prefix; states appear only where a request just
    # finished (``new_state_ok``).
    def snapshot(self, new_state_ok=()):
        ps = self.ps
        old = (self.full, self.swa, self.state) if hasattr(self, "full") else ({}, {}, {})
        self.full, self.swa, self.state, self.ends = {}, {}, {}, set()
        for nd, toks in walk(self.cache):
            self.ends.add(toks)
            for j in range(len(nd.key) // ps):
                p = toks[:nd.start + (j + 1) * ps]
                self.full[p] = nd.value[j * ps:(j + 1) * ps].tolist()
                if self.swa_i is not None and nd.aux[self.swa_i] is not None:
                    rows = nd.aux[self.swa_i][j * ps:(j + 1) * ps]
                    self.swa[p] = rows.tolist()
                    assert self.index_map[nd.value[j * ps:(j + 1) * ps]].tolist() == rows.tolist()
            if self.mamba_i is not None and nd.aux[self.mamba_i] is not None:
                self.state[toks] = nd.aux[self.mamba_i]
        for before, now in zip(old, (self.full, self.swa, self.state)):
            assert all(now[p] == v for p, v in before.items() if p in now)
        assert all(p in old[2] or p in new_state_ok for p in self.state)

    def expected_match(self, ids):
        ps, W = self.ps, self.window
        L = longest(self.full, ids, ps)
        for b in range(L, 0, -ps):
            if b != L and tuple(ids[:b]) not in self.ends:
                continue                                 # not a node boundary
            if self.swa_i is not None and not all(
                    tuple(ids[:k]) in self.swa for k in range(max(0, b - W) // ps * ps + ps, b + 1, ps)):
                continue
            if self.mamba_i is not None and tuple(ids[:b]) not in self.state:
                continue
            return b
        return 0

    def check_match(self, ids, r):
        ps = self.ps
        b = self.expected_match(ids)
        assert r.prefix_len == b, (ids, r.prefix_len, b)
        pages = [self.full[tuple(ids[:k])] for k in range(ps, b + 1, ps)]
        assert r.device_indices.tolist() == [s for p in pages for s in p]
        if self.swa_i is not None:
            rows = [self.swa.get(tuple(ids[:k]), [-1] * ps) for k in range(ps, b + 1, ps)]
            assert r.components["swa"].tolist() == [x for p in rows for x in p]
        if self.mamba_i is not None:
            assert r.components["mamba"] == (StateCopy(self.state[tuple(ids[:b])]) if b else None)

    def owned(self):
        cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64)
        return {"full": cat([q["own"] for q in self.inflight]),
                "swa": cat([q["swa_own"][q["swa_own"] >= 0] for q in self.inflight if self.swa_alloc]),
                "mamba": torch.tensor([q["state"] for q in self.inflight if self.states], dtype=torch.int64)}

    def _take(self, alloc, n, component):
        got = alloc.alloc(n) if n else torch.empty(0, dtype=torch.int64)
        if got is None:
            self.cache.evict(n, component)
            got = alloc.alloc(n)
        return got

    def start(self, ids, keep_pages=0):
        r = self.cache.match(ids)
        self.check_match(ids, r)
        self.cache.lock(r.last_device_node)
        P, n = r.prefix_len, len(ids)
        q = {"ids": ids, "r": r, "P": P, "own": self._take(self.alloc, n - P, "full"),
             "swa_own": None, "state": None}
        ok = q["own"] is not None
        if ok and self.swa_alloc:
            q["swa_own"] = self._take(self.swa_alloc, n - P, "swa")
            ok = q["swa_own"] is not None
            if ok:
                self.index_map[q["own"]] = q["swa_own"]
                # Rows before the window (whole pages) are released while decoding, lazily:
                # ``keep_pages`` more pages than the window needs are still held.
                rel = ((n - self.window) // self.ps - keep_pages) * self.ps - P
                if rel > 0:
                    self.swa_alloc.free(q["swa_own"][:rel])
                    q["swa_own"] = q["swa_own"].clone()
                    q["swa_own"][:rel] = -1
        if ok and self.states:
            got = self._take(self.states, 1, "mamba")
            ok = got is not None
            q["state"] = int(got) if ok else None
        if not ok:
            self.abort(q)
            return
        self.inflight.append(q)

    def abort(self, q):
        if q["own"] is not None:
            self.alloc.free(q["own"])
        if q["swa_own"] is not None and (q["swa_own"] >= 0).any():
            self.swa_alloc.free(q["swa_own"][q["swa_own"] >= 0])
        if q["state"] is not None:
            self.states.free(torch.tensor([q["state"]]))
        self.cache.unlock(q["r"].last_device_node)

    def finish(self, i):
        if not self.inflight:
            return
        q = self.inflight.pop(i % len(self.inflight))
        ids, r, P = q["ids"], q["r"], q["P"]
        before_full, before_swa, before_state = self.full, self.swa, self.state
        aligned = len(ids) // self.ps * self.ps
        slots = torch.cat([r.device_indices, q["own"]])
        extra = {}
        if self.swa_alloc:
            extra["swa"] = torch.cat([r.components["swa"], q["swa_own"]])
        if self.states:
            if aligned == len(ids):
                extra["mamba"] = q["state"]              # ownership moves to the cache
            else:
                self.states.free(torch.tensor([q["state"]]))
        indices, node = self.cache.cache(ids, slots, r.last_device_node, extra=extra)
        assert indices[:P].tolist() == r.device_indices.tolist()
        if len(ids) > aligned:                           # the partial page stays the request's
            self.alloc.free(slots[aligned:])
            if self.swa_alloc:
                tail = extra["swa"][aligned:]
                if (tail >= 0).any():
                    self.swa_alloc.free(tail[tail >= 0])
        self.cache.unlock(node)
        self.snapshot(new_state_ok={tuple(ids[:aligned])})
        ps = self.ps
        for k in range(ps, aligned + 1, ps):
            p = tuple(ids[:k])
            assert self.full[p] == indices[k - ps:k].tolist()
            if p in before_full:
                assert before_full[p] == self.full[p]     # canonical slots never move
            if p in before_swa:
                assert self.swa.get(p) == before_swa[p]   # an insert never drops SWA data
            elif p in self.swa:
                assert self.swa[p] == extra["swa"][k - ps:k].tolist()
        for p, s in before_state.items():
            assert self.state.get(p) == s
        if "mamba" in extra and aligned:
            assert self.state[tuple(ids[:aligned])] in (extra["mamba"], before_state.get(tuple(ids[:aligned])))

    def evict(self, component, n):
        before = (dict(self.full), dict(self.swa), dict(self.state))
        freed = self.cache.evict(n, component)
        self.snapshot()
        gone_full = set(before[0]) - set(self.full)
        gone_swa = set(before[1]) - set(self.swa)
        gone_state = set(before[2]) - set(self.state)
        if component == "full":
            assert len(gone_full) * self.ps == freed
        elif component == "swa":
            assert not gone_full and len(gone_swa) * self.ps == freed
        else:
            assert not gone_full and not gone_swa and len(gone_state) == freed
        for q in self.inflight:                          # locked prefixes survive
            assert page_prefixes(q["ids"][:q["P"]], self.ps) <= set(self.full)


def real_ops(ps):
    return st.lists(st.one_of(
        st.tuples(st.just("start"), seqs(ps), st.integers(0, 2)),
        st.tuples(st.just("finish"), st.integers(0, 9)),
        st.tuples(st.just("match"), seqs(ps)),
        st.tuples(st.just("fork"), st.integers(0, 9), st.integers(0, 4 * ps + 3)),
        st.tuples(st.just("evict"), st.sampled_from(["full", "swa", "mamba"]), st.integers(1, 3 * ps)),
    ), max_size=30)


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("comps, policy", [("swa", "lru"), ("mamba", "lfu"), ("swa+mamba", "slru")])
def test_components_against_reference(ps, comps, policy):
    @COMPONENT_SETTINGS
    @given(ops=real_ops(ps))
    def run(ops):
        d = Driver(ps, comps, policy)
        for op in ops:
            if op[0] == "start":
                d.start(op[1], op[2])
            elif op[0] == "finish":
                d.finish(op[1])
            elif op[0] in ("match", "fork"):
                ids = op[1]
                if op[0] == "fork":                      # diverge from an in-flight prompt:
                    if not d.inflight:                   # splits under a held lock
                        continue
                    own = d.inflight[op[1] % len(d.inflight)]["ids"]
                    cut = op[2] % (len(own) + 1)
                    ids = own[:cut] + [(own[cut] + 1) % 3 if cut < len(own) else 0]
                d.snapshot()
                d.check_match(ids, d.cache.match(ids))
            elif op[1] in comps or op[1] == "full":
                d.evict(op[1], op[2])
            d.snapshot()
            d.cache.check(extra_owned=d.owned())
        while d.inflight:
            d.finish(0)
        d.cache.evict(10 ** 6)
        d.cache.check(extra_owned=d.owned())
        assert d.alloc.available_size() == d.alloc.size
        for a in (d.swa_alloc, d.states):
            assert a is None or a.available_size() == a.size
    run()


# -- 3. host tier ----------------------------------------------------------------------------------
def kv_of(prefix) -> float:
    return float(hash(prefix) % 1_000_003)


@pytest.mark.parametrize("ps, policy", [(1, "write_through"), (2, "write_back"),
                                        (2, "write_through"), (1, "write_back")])
def test_host_tier_against_reference(ps, policy):
    def host_ops():
        return st.lists(st.one_of(
            st.tuples(st.just("run"), seqs(ps)),
            st.tuples(st.just("retract"), seqs(ps)),
            st.tuples(st.just("release"), st.integers(0, 9)),
            st.tuples(st.just("load"), seqs(ps)),
            st.tuples(st.just("evict"), st.sampled_from(["full", "host"]), st.integers(1, 4 * ps)),
        ), max_size=25)

    @SETTINGS
    @given(ops=host_ops())
    def run(ops):
        pool = KVPool(24 * ps, ps, num_layers=1, num_kv_heads=1, head_dim=1)
        host = HostTier(pool, 16 * ps, policy)
        alloc = PagedAllocator(24, ps)
        cache = UnifiedRadixCache(CacheConfig(page_size=ps, debug_invariants=True), alloc, host=host)
        backups: list = []

        def check_kv(ids, slots):
            got = pool.kv_data[0, 0, slots, 0, 0].tolist()
            assert got == [kv_of(tuple(ids[:p + 1])) for p in range(len(slots))]

        def compute(ids):
            r = cache.match(ids)
            check_kv(ids, r.device_indices)
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
                if op[0] == "run":
                    _, node = cache.cache(ids, slots, r.last_device_node)
                    cache.unlock(node)
                else:
                    node, _ = cache.host.backup(ids, slots, r.last_device_node)
                    backups.append(node)
            elif op[0] == "release":
                if backups:
                    cache.unlock(backups.pop(op[1] % len(backups)))
            elif op[0] == "load":
                ids = op[1]
                r = cache.match(ids)
                any_tier = {toks[:k] for nd, toks in walk(cache)
                            for k in range(nd.start + ps, nd.end + 1, ps)}
                assert r.best_match_node.end == longest(any_tier, ids, ps)
                assert r.host_hit_length == r.best_match_node.end - r.prefix_len
                indices = cache.host.restore(r.best_match_node)
                if indices is not None:
                    check_kv(ids, indices)
                    assert cache.match(ids).prefix_len == r.best_match_node.end
            else:
                cache.evict(op[2], op[1])
            for nd in backups:                           # backed-up KV stays (device or host)
                assert nd.parent is not None or nd is cache._tree.root
            cache.check(extra_owned=torch.empty(0, dtype=torch.int64))
        for nd in backups:
            cache.unlock(nd)
        cache.evict(10 ** 6)
        cache.evict(10 ** 6, "host")
        assert cache.stats().device == 0 and cache.stats().host == 0
        assert alloc.available_size() == alloc.size and host.allocator.available_size() == host.allocator.size
    run()
