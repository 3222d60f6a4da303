"""Host tier for every component (HiCache's same-name transfer): SWA rows and recurrent-state
checkpoints go to their host pools with the node's FULL pages and come back on restore.

Real tensors on the CPU; every pool's row of a token holds the token id (a state row holds the
id of the node's last token), so a copy to the wrong place shows up as a wrong number. Every
operation runs the cache's invariant recount (debug_invariants), which now covers the components'
host pools (sizes, ownership) too.
"""

from __future__ import annotations

import pytest
import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import KVPool
from tandem.cache.radix.components import FULL, SWA, Mamba, StateCopy
from tandem.cache.tiers.host import HostStore, HostTier
from tandem.cache.state_pool import StatePool

from cache_support import make_cache

W = 4           # SWA window
PAGES = 32


class Rig:
    """A cache over a full KV pool (page 2), an SWA pool + index_map and a state pool, with a
    host tier holding ``host_tokens`` FULL tokens, ``swa_rows`` SWA rows, ``state_rows`` states."""

    def __init__(self, policy="write_through", host_tokens=32, swa_rows=32, state_rows=4, ps=2,
                 device="cpu"):
        self.ps, self.dev = ps, device
        self.full = KVPool(PAGES * ps, ps, num_layers=1, num_kv_heads=1, head_dim=1, device=device)
        self.swa_pool = KVPool(64, 1, num_layers=1, num_kv_heads=1, head_dim=1, device=device)
        self.state = StatePool(8, [0], (3,), device=device)
        self.swa_alloc, self.state_alloc = PagedAllocator(64, 1), PagedAllocator(8, 1)
        self.index_map = torch.zeros(PAGES * ps + ps, dtype=torch.int64, device=device)
        self.swa = SWA(W, self.swa_alloc, self.index_map)
        self.mamba = Mamba(self.state_alloc)
        stores = [HostStore("swa", self.swa_pool.kv_data, swa_rows),
                  HostStore("mamba", self.state.data.unsqueeze(1), state_rows)]
        self.host = HostTier(self.full, host_tokens, policy, stores)
        self.cache, self.alloc = make_cache(page_size=ps, pages=PAGES, host=self.host,
                                            components=(FULL, self.swa, self.mamba))

    def compute(self, ids, start=0):
        """A request computing ``ids[start:]``: full slots, SWA rows bound in index_map, a
        state row holding the last token id. Returns (full slots, swa rows, state row)."""
        n = len(ids) - start
        slots, rows = self.alloc.alloc(n), self.swa_alloc.alloc(n)
        d = self.dev
        self.index_map[slots.to(d)] = rows.to(d)
        t = torch.tensor(ids[start:], dtype=torch.float32, device=d)
        self.full.kv_data[:, :, slots.to(d)] = t[:, None, None]
        self.swa_pool.kv_data[:, :, rows.to(d)] = t[:, None, None]
        s = int(self.state_alloc.alloc(1)[0])
        self.state.data[:, s] = float(ids[-1])
        return slots, rows, s

    def cache_all(self, ids):
        slots, rows, s = self.compute(ids)
        _, node = self.cache.cache(ids, slots, None, extra={"swa": rows, "mamba": s})
        self.cache.unlock(node)
        return node

    def swa_tokens(self, slots):       # the SWA K values attention would read for these slots
        rows = self.index_map[slots.to(self.dev)]
        return self.swa_pool.kv_data[0, 0, rows, 0, 0].to(torch.int64).tolist()

    def check(self):
        none = torch.empty(0, dtype=torch.int64)
        self.cache.check(extra_owned={"full": none, "swa": none, "mamba": none})


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evict_to_host_match_and_load_back_every_component(policy):
    g = Rig(policy)
    ids = list(range(10, 22))                                         # 12 tokens
    node = g.cache_all(ids)
    assert (node.host is not None) == (policy == "write_through")
    assert g.cache.evict(12) == 12                                    # write_back copies here
    assert node.value is None and node.aux == [None, None]
    assert g.swa_alloc.available_size() == 64 and g.state_alloc.available_size() == 8
    assert g.host.usage() == {"full": (12, 32), "swa": (12, 32), "mamba": (1, 4)}
    # The vote accepts the host-only node: its component data is on the host.
    r = g.cache.match(ids)
    assert r.prefix_len == 0 and r.best_match_node is node and r.host_hit_length == 12
    slots = g.host.restore(r.best_match_node)
    r = g.cache.match(ids)
    assert r.prefix_len == 12 and r.host_hit_length == 0
    assert g.full.kv_data[0, 0, slots, 0, 0].to(torch.int64).tolist() == ids
    # SWA rows came back for the window before the boundary only (the node is one edge here,
    # so all of it), through a rewritten index_map; the checkpoint into a fresh state row.
    assert g.swa_tokens(slots) == ids
    assert isinstance(r.components["mamba"], StateCopy)
    assert float(g.state.data[0, r.components["mamba"].src, 0]) == ids[-1]
    g.check()


def test_restore_loads_component_data_only_within_its_lock_span():
    g = Rig()
    a = list(range(10, 18))
    na = g.cache_all(a)                                               # node [0, 8)
    b = a + list(range(30, 38))
    slots, rows, s = g.compute(b, start=8)
    r = g.cache.match(b)
    g.cache.lock(r.last_device_node)
    _, nb = g.cache.cache(b, torch.cat([r.device_indices, slots]), r.last_device_node,
                          extra={"swa": torch.cat([torch.full((8,), -1), rows]), "mamba": s})
    g.cache.unlock(nb)                                                # node [8, 16)
    assert g.cache.evict(16) == 16
    assert na.aux_host[0] is not None and na.aux_host[1] is not None
    r = g.cache.match(b)
    assert r.best_match_node is nb and r.host_hit_length == 16
    g.host.restore(nb)
    # FULL back for both nodes; SWA only for the window below 16 (node [8, 16)); MAMBA only
    # for the boundary node. a's host copies of its component data stay on the host.
    assert na.value is not None and nb.value is not None
    assert na.aux == [None, None] and nb.aux[0] is not None and nb.aux[1] is not None
    assert na.aux_host[0] is not None and na.aux_host[1] is not None
    assert g.cache.match(b).prefix_len == 16
    assert g.cache.match(a + [0, 0]).prefix_len == 0                 # a's boundary: no state, no window
    r = g.cache.match(a + [0, 0])
    assert r.best_match_node is na                                    # ... but on the host it has both
    g.host.restore(na)
    assert g.cache.match(a + [0, 0]).prefix_len == 8
    g.check()


def test_full_component_host_pool_leaves_host_only_nodes_failing_its_vote():
    g = Rig(state_rows=1)
    a, b = list(range(10, 14)), list(range(50, 54))
    na, nb = g.cache_all(a), g.cache_all(b)                           # write-through: b's state evicts a's
    assert na.aux_host[1] is None and nb.aux_host[1] is not None
    assert g.cache.evict(8) == 8
    r = g.cache.match(a)
    assert r.best_match_node.end == 0 and r.host_hit_length == 0      # no state anywhere: no reuse
    assert g.cache.match(b).best_match_node is nb
    # Host eviction of component data keeps each pool within its size, never past a lock.
    g.cache.lock(nb)
    assert g.cache._tree.hosted.evict_aux(1, 1) == 0
    g.cache.unlock(nb)
    assert g.cache._tree.hosted.evict_aux(1, 1) == 1
    g.cache._after()
    assert g.host.usage()["mamba"] == (0, 1)
    g.check()


def test_split_of_a_host_only_node_cuts_its_swa_host_rows():
    g = Rig()
    ids = list(range(10, 22))
    node = g.cache_all(ids)
    g.cache.evict(12)
    r = g.cache.match(ids[:6] + [99, 99])                             # splits [0, 12) at 6
    up = node.parent
    assert up.end == 6 and len(up.aux_host[0]) == 6 and len(node.aux_host[0]) == 6
    assert up.aux_host[1] is None and node.aux_host[1] is not None    # the checkpoint stays below
    assert r.best_match_node.end == 0                                 # no state at 6 on any tier
    g.check()


def test_retraction_backup_moves_component_data_and_restore_brings_it_back():
    g = Rig("write_back")
    ids = list(range(10, 22))
    slots, rows, s = g.compute(ids)
    rows[:4] = -1                                                     # released behind the window
    g.swa_alloc.free(g.index_map[slots[:4]])
    node, freed = g.host.backup(ids, slots, None, extra={"swa": rows, "mamba": s})
    # Both nodes (the tombstoned [0, 4) and [4, 12)) are only this request's: both move.
    assert freed == 12 and node.value is None and node.parent.value is None and node.lock_ref == 1 and node.aux_host[1] is not None
    assert g.swa_alloc.available_size() == 64 and g.state_alloc.available_size() == 8
    # locked: neither its FULL nor its component host copies can be evicted
    assert g.cache.evict(100, component="host") == 0
    assert g.cache._tree.hosted.evict_aux(0, 100) == 0 and g.cache._tree.hosted.evict_aux(1, 1) == 0
    r = g.cache.match(ids)
    assert r.best_match_node is node and r.host_hit_length == 12
    back = g.host.restore(node)
    r = g.cache.match(ids)
    assert r.prefix_len == 12 and back.tolist() == r.device_indices.tolist()
    assert g.swa_tokens(r.device_indices[4:]) == ids[4:]
    assert float(g.state.data[0, r.components["mamba"].src, 0]) == ids[-1]
    g.cache.unlock(node)
    g.check()


def test_swa_eviction_on_the_device_keeps_a_host_copy_and_restore_revives_it():
    g = Rig("write_back")
    ids = list(range(10, 18))
    node = g.cache_all(ids)
    g.cache.evict(1, component="full")                                # write-back: FULL + comps to host
    assert node.value is None
    g.host.restore(node)                                              # back on the device
    assert node.aux[0] is not None
    assert g.cache.evict(8, component="swa") == 8                     # tombstone on the device ...
    assert node.aux[0] is None and node.aux_host[0] is not None       # ... the host copy stays
    r = g.cache.match(ids)
    assert r.prefix_len == 0 and r.best_match_node is node and r.host_hit_length == 8
    g.host.restore(node)
    r = g.cache.match(ids)
    assert r.prefix_len == 8 and g.swa_tokens(r.device_indices) == ids
    g.check()


def test_host_store_must_name_a_component():
    full = KVPool(8, 2, num_layers=1, num_kv_heads=1, head_dim=1)
    host = HostTier(full, 8, stores=[HostStore("swa", torch.zeros(1, 2, 9, 1, 1), 4)])
    with pytest.raises(ValueError, match="name no component"):
        make_cache(page_size=2, pages=4, host=host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cuda_component_round_trip(policy):
    """The component stores' CUDA path (pinned host pools, side-stream D2H, H2D waited on by the
    compute stream), through a state pool viewed as [L, 1, rows, ...]."""
    g = Rig(policy, device="cuda")
    assert g.host.stores["swa"].data.is_pinned() and g.host.stores["mamba"].data.is_pinned()
    ids = list(range(10, 22))
    g.cache_all(ids)
    assert g.cache.evict(12) == 12
    g.swa_pool.kv_data.zero_()
    g.state.data.zero_()
    r = g.cache.match(ids)
    slots = g.host.restore(r.best_match_node)
    r = g.cache.match(ids)
    assert r.prefix_len == 12 and g.swa_tokens(slots) == ids
    assert float(g.state.data[0, r.components["mamba"].src, 0]) == ids[-1]
    g.check()
