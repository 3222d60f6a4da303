"""Per-engine resources of hybrid models: sliding-window (SWA) layers and recurrent ("mamba")
layers."""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from tandem.cache.allocator import PagedAllocator
from tandem.cache.kv_pool import HybridKVPool, KVPool
from tandem.cache.tiers.host import HostStore
from tandem.cache.state_pool import StatePool
from tandem.cache.radix.components import FULL, SWA, Mamba, StateCopy
from tandem.core.config import HybridConfig
from tandem.engine.host_sizing import capped_rows

_EMPTY = torch.empty(0, dtype=torch.int64)


class HybridHooks(Protocol):
    """The per-variant hooks of a model's hybrid resources. engine/request_kv.py calls them, and
    only it, at fixed points of a request's life; ``host_stores`` and ``describe`` are called
    outside the request path."""

    active: bool
    components: tuple
    stats: dict

    def attach(self, cache) -> None:
        """Once, before any request: the prefix cache (``evict(n, name)`` makes room in these
        pools)."""

    def claim(self, r, components: Mapping[str, Any], prefix_len: int) -> bool:
        """After the match is locked: take the working state row (the matched checkpoint copied in);
        False when none is free (the caller undoes the admission)."""

    def alloc(self, r, n: int, alloc_full, received: bool = False):
        """SWA rows for ``n`` new positions, then the full slots from ``alloc_full()``, bound in
        ``index_map``; None (nothing taken) when either is short."""

    def state_batch(self, reqs) -> tuple[Any, Any]:
        """``(state_indices [B], state_pool)`` of each sequence's state row for the forward."""

    def advanced(self, r, locked_len: int) -> None:
        """After the forward: release SWA rows behind the window, snapshot the state at page
        boundaries."""

    def handover(self, r, locked_len: int, aligned: int, final: bool) -> dict | None:
        """The component data ``cache(ids[:aligned])`` takes over: ``{"swa": rows, "mamba":
        row}``."""

    def drop_range(self, r, start: int, end: int) -> None:
        """Free the rows of positions ``[start, end)`` (never computed, or a backup's partial
        page)."""

    def release(self, r, locked_len: int) -> None:
        """Free everything the request still owns."""

    def transfer_rows(self, r, start: int) -> dict:
        """``{region: row ids}`` a KV transfer of positions ``[start, computed_len)`` moves."""

    def owned(self, held) -> dict:
        """``{component: rows}`` the requests in ``held`` own (the ownership check)."""

    def host_stores(self, host_tokens: int) -> list:
        """One host pool per component for a host tier of ``host_tokens`` FULL tokens."""

    def component_data(self) -> dict:
        """Each component's device pool by name, ``[L, K, rows, ...]``: what the host tier's pools
        mirror and the L3 tier reads and writes (cache/tiers/l3/connect.py ``attach_store``)."""

    def describe(self) -> dict:
        """Component -> its pool, for the startup line."""


class NoHybrid(HybridHooks):
    """FULL-only models: every hook is a no-op (the FULL path is unchanged)."""

    active = False
    components = (FULL,)
    stats: dict = {}

    def attach(self, cache) -> None: pass
    def claim(self, r, components: Mapping[str, Any], prefix_len: int) -> bool: return True
    def alloc(self, r, n: int, alloc_full, received: bool = False): return alloc_full()
    def state_batch(self, reqs) -> tuple[None, None]: return None, None
    def advanced(self, r, locked_len: int) -> None: pass
    def handover(self, r, locked_len: int, aligned: int, final: bool) -> None: return None
    def drop_range(self, r, start: int, end: int) -> None: pass
    def release(self, r, locked_len: int) -> None: pass
    def transfer_rows(self, r, start: int) -> dict: return {}
    def owned(self, held) -> dict: return {}
    def host_stores(self, host_tokens: int) -> list: return []
    def component_data(self) -> dict: return {}
    def describe(self) -> dict: return {}


NO_HYBRID = NoHybrid()


def make_hybrid(loaded, cache_cfg, chunked_prefill_size: int, allocator: PagedAllocator,
                req_to_token_pool, device, dtype, config: HybridConfig | None = None):
    """:data:`NO_HYBRID` for a model whose layers are all "full", else :class:`HybridResources`."""
    if all(t == "full" for t in loaded.arch.layer_types):
        return NO_HYBRID
    return HybridResources(loaded, cache_cfg, chunked_prefill_size, allocator, req_to_token_pool,
                           device, dtype, config or HybridConfig())


class HybridResources(HybridHooks):
    """The SWA pool + allocator + ``index_map``, the state pool + allocator, and each running
    request's SWA release point and state rows (indexed by its ``req_to_token`` row)."""

    active = True

    def __init__(self, loaded, cache_cfg, chunked_prefill_size: int, allocator: PagedAllocator,
                 req_to_token_pool, device, dtype, config: HybridConfig):
        arch = loaded.arch
        types = arch.layer_types
        self.page_size = ps = cache_cfg.page_size
        self.r2t = req_to_token_pool
        self.device = torch.device(device)
        self.cache = None
        self.config = config
        full_layers = [i for i, t in enumerate(types) if t == "full"]
        swa_layers = [i for i, t in enumerate(types) if t == "swa"]
        mamba_layers = [i for i, t in enumerate(types) if t == "mamba"]
        n_slots = allocator.num_pages * ps
        self.full_pool = KVPool(n_slots, ps, arch.num_layers, arch.num_kv_heads, arch.head_dim,
                                dtype, device, layer_ids=full_layers)
        self.window = arch.sliding_window if swa_layers else None
        self.swa_alloc = self.swa_pool = self.index_map = None
        if swa_layers:
            need = chunked_prefill_size + self.window + 2 * ps
            rows = config.swa_pool_tokens or max(n_slots, need)
            if rows < need:
                raise ValueError(f"swa_pool_tokens={rows} cannot hold one prefill chunk and a window "
                                 f"(chunked_prefill_size={chunked_prefill_size} + window={self.window}"
                                 f" + 2 pages of {ps} = {need})")
            self.swa_alloc = PagedAllocator(rows, 1)
            self.swa_pool = KVPool(rows, 1, arch.num_layers, arch.num_kv_heads, arch.head_dim,
                                   dtype, device, layer_ids=swa_layers)
            self.index_map = torch.zeros(n_slots + ps, dtype=torch.int64, device=device)
        self.kv_pool = HybridKVPool(self.full_pool, self.swa_pool, self.index_map)
        self.state_alloc = self.state_pool = None
        if mamba_layers:
            shape = getattr(loaded.model, "state_shape", None)
            if shape is None:
                raise ValueError(f"model {loaded.name!r} has mamba layers but no state_shape")
            slots = config.state_slots or 2 * cache_cfg.max_running_requests + 2
            self.state_alloc = PagedAllocator(slots, 1)
            self.state_pool = StatePool(slots, mamba_layers, tuple(shape), device)
        n_rows = req_to_token_pool.size + 1
        self._swa_from = [0] * n_rows
        self._work = [0] * n_rows
        self._track = [0] * n_rows
        self._track_len = [-1] * n_rows
        self.stats = {"swa_released": 0, "swa_evicted": 0, "state_evicted": 0, "checkpoints": 0}

    @property
    def components(self) -> tuple:
        """The radix cache's components over these pools."""
        comps: list = [FULL]
        if self.swa_alloc is not None:
            comps.append(SWA(self.window, self.swa_alloc, self.index_map))
        if self.state_alloc is not None:
            comps.append(Mamba(self.state_alloc))
        return tuple(comps)

    def attach(self, cache) -> None:
        """The engine's prefix cache (its ``evict(n, component)`` makes room in these pools)."""
        self.cache = cache

    def claim(self, r, components: Mapping[str, Any], prefix_len: int) -> bool:
        """After the match is locked: the request's working state row, holding the matched
        checkpoint's state (copy-on-claim) or zeros. False when no state row is free."""
        row = r.req_pool_idx
        self._swa_from[row] = prefix_len
        if self.state_alloc is None:
            return True
        slot = self._alloc_state()
        if slot is None:
            return False
        if prefix_len:
            src = components.get("mamba")
            if not isinstance(src, StateCopy):
                raise ValueError(f"request {r.rid}: a {prefix_len}-token prefix matched without a "
                                 f"recurrent-state checkpoint ({src!r})")
            self.state_pool.copy(src.src, slot)
        else:
            self.state_pool.zero(slot)
        self._work[row] = slot
        return True

    def alloc(self, r, n: int, alloc_full, received: bool = False):
        """SWA rows for ``n`` new positions (evicting the cache's unlocked SWA data when short; rows
        first: they free exactly, a half-used full page could not be given back), then the full
        slots from ``alloc_full()``, bound as ``index_map[slots] = rows``. None (nothing taken) when
        either is short."""
        if self.swa_alloc is None:
            return alloc_full()
        row, c = r.req_pool_idx, r.computed_len
        skip = max(0, min(n, self.keep_from(c + n) - c)) if received else 0
        need = n - skip
        short = need - self.swa_alloc.available_size()
        if short > 0 and self.cache is not None:
            self.stats["swa_evicted"] += self.cache.evict(short, "swa")
        rows = self.swa_alloc.alloc(need)
        if rows is None:
            return None
        slots = alloc_full()
        if slots is None:
            self.swa_alloc.free(rows)
            return slots
        dev = slots.to(self.device)
        self.index_map[dev[skip:]] = rows.to(self.device)
        if skip:
            self.index_map[dev[:skip]] = 0
            self._swa_from[row] = max(self._swa_from[row], c + skip)
        return slots

    def keep_from(self, n: int) -> int:
        """First position whose SWA row a request at length ``n`` keeps (the release rule)."""
        ps = self.page_size
        keep = n // ps * ps - self.window
        return keep // ps * ps if keep > 0 else 0

    def state_batch(self, reqs) -> tuple[torch.Tensor | None, StatePool | None]:
        """``(state_indices [B], state_pool)`` for the batch (None, None without recurrent
        layers)."""
        if self.state_pool is None:
            return None, None
        idx = [self._work[r.req_pool_idx] for r in reqs]
        return torch.tensor(idx, dtype=torch.int64, device=self.device), self.state_pool

    def advanced(self, r, locked_len: int) -> None:
        """After the forward moved ``r.computed_len``: release SWA rows that left the window;
        snapshot the state at a page-aligned length (track row, ``page_size > 1``)."""
        row, n, ps = r.req_pool_idx, r.computed_len, self.page_size
        if self.window is not None:
            new_from = self.keep_from(n)
            lo = max(self._swa_from[row], locked_len)
            if new_from > lo:
                rows = self.index_map[self.r2t.read(row, lo, new_from).to(self.device)]
                self.swa_alloc.free(rows)
                self.stats["swa_released"] += len(rows)
            self._swa_from[row] = max(self._swa_from[row], new_from)
        if self.state_pool is not None and ps > 1 and n % ps == 0:
            if not self._track[row]:
                self._track[row] = self._alloc_state() or 0
            if self._track[row]:
                self.state_pool.copy(self._work[row], self._track[row])
                self._track_len[row] = n

    def handover(self, r, locked_len: int, aligned: int, final: bool) -> dict | None:
        """What ``cache(ids[:aligned], ...)`` takes over besides the full slots: the SWA rows of
        ``[0, aligned)`` (-1 where the request owns none) and a checkpoint at ``aligned`` if the
        request has the state there."""
        row = r.req_pool_idx
        out: dict = {}
        if self.window is not None:
            rows = torch.full((aligned,), -1, dtype=torch.int64)
            lo = max(self._swa_from[row], locked_len)
            if aligned > lo:
                rows[lo:aligned] = self.index_map[self.r2t.read(row, lo, aligned).to(self.device)].cpu()
            out["swa"] = rows
        if self.state_pool is not None:
            slot = None
            if self._track[row] and self._track_len[row] == aligned:
                slot, self._track[row], self._track_len[row] = self._track[row], 0, -1
            elif aligned == r.computed_len:
                if final:
                    slot, self._work[row] = self._work[row], 0
                else:
                    slot = self._alloc_state()
                    if slot is not None:
                        self.state_pool.copy(self._work[row], slot)
            if slot:
                out["mamba"] = slot
                self.stats["checkpoints"] += 1
        return out or None

    def drop_range(self, r, start: int, end: int) -> None:
        """Free the SWA rows the request owns among positions ``[start, end)`` (the caller then sets
        ``computed_len = start``): a transfer's range that never became valid KV, or the partial
        last page of a backed-up request."""
        row = r.req_pool_idx
        if self.window is None:
            return
        lo = max(self._swa_from[row], start)
        if end > lo:
            self.swa_alloc.free(self.index_map[self.r2t.read(row, lo, end).to(self.device)])
            self._swa_from[row] = min(self._swa_from[row], start)

    def transfer_rows(self, r, start: int) -> dict[str, tuple[int, ...]]:
        """What a KV transfer of positions ``[start, computed_len)`` moves besides the full pages:
        ``"swa"``: the SWA rows decode keeps, in position order; ``"state"``: the working state
        row."""
        row, n = r.req_pool_idx, r.computed_len
        out: dict[str, tuple[int, ...]] = {}
        if self.window is not None:
            lo = max(start, self.keep_from(n))
            rows = self.index_map[self.r2t.read(row, lo, n).to(self.device)] if n > lo else _EMPTY
            out["swa"] = tuple(rows.tolist())
        if self.state_alloc is not None:
            out["state"] = (self._work[row],)
        return out

    def host_stores(self, host_tokens: int) -> list[HostStore]:
        """One host pool per component for a host tier of ``host_tokens`` FULL tokens."""
        data = self.component_data()
        stores = []
        if "swa" in data:
            rows = self.config.host_swa_rows or host_tokens
            stores.append(HostStore("swa", data["swa"], rows))
        if "mamba" in data:
            slots = self.config.host_state_slots or capped_rows(self.state_alloc.size,
                                                                self.state_pool.bytes_per_slot)
            stores.append(HostStore("mamba", data["mamba"], slots))
        return stores

    def component_data(self) -> dict[str, torch.Tensor]:
        """``{"swa": SWA pool [L_swa, 2, rows, H_kv, D], "mamba": state pool [L_m, 1, slots + 1,
        *state]}`` (those the model has): the layout of the host tier's pools and of the L3
        tier's component values."""
        data = {}
        if self.swa_pool is not None:
            data["swa"] = self.swa_pool.kv_data
        if self.state_pool is not None:
            data["mamba"] = self.state_pool.data.unsqueeze(1)
        return data

    def describe(self) -> dict[str, str]:
        """Component -> its pool, for the startup line (engine/describe.py)."""
        out = {}
        if self.swa_pool is not None:
            mib = self.swa_pool.kv_data.numel() * self.swa_pool.kv_data.element_size() / 2**20
            out["swa"] = (f"window {self.window}, {self.swa_alloc.size} rows x "
                          f"{len(self.swa_pool.layer_ids)} layers ({mib:.1f} MiB)")
        if self.state_pool is not None:
            mib = self.state_pool.data.numel() * self.state_pool.data.element_size() / 2**20
            out["mamba"] = (f"{self.state_alloc.size} state slots x {len(self.state_pool.layer_ids)} "
                            f"layers ({self.state_pool.bytes_per_slot / 2**10:.1f} KiB/slot, {mib:.1f} MiB)")
        return out

    def release(self, r, locked_len: int) -> None:
        """Free what the request still owns: SWA rows of ``[max(swa_from, locked_len),
        computed_len)`` and its working/track state rows."""
        row, n = r.req_pool_idx, r.computed_len
        if self.window is not None:
            lo = max(self._swa_from[row], locked_len)
            if n > lo:
                self.swa_alloc.free(self.index_map[self.r2t.read(row, lo, n).to(self.device)])
        if self.state_alloc is not None:
            held = [s for s in (self._work[row], self._track[row]) if s]
            if held:
                self.state_alloc.free(torch.tensor(held, dtype=torch.int64))
        self._swa_from[row] = self._work[row] = self._track[row] = 0
        self._track_len[row] = -1

    def owned(self, held) -> dict[str, torch.Tensor]:
        """Rows each pool's requests own; ``held``: ``(req, locked_len)`` of every request holding a
        row."""
        swa, states = [], []
        for r, locked_len in held:
            row = r.req_pool_idx
            if self.window is not None:
                lo = max(self._swa_from[row], locked_len)
                if r.computed_len > lo:
                    swa.append(self.index_map[self.r2t.read(row, lo, r.computed_len).to(self.device)].cpu())
            states += [s for s in (self._work[row], self._track[row]) if s]
        out = {}
        if self.swa_alloc is not None:
            out["swa"] = torch.cat(swa) if swa else _EMPTY
        if self.state_alloc is not None:
            out["mamba"] = torch.tensor(states, dtype=torch.int64)
        return out

    def _alloc_state(self) -> int | None:
        """A free state row, evicting one unlocked cached checkpoint if none is free."""
        if self.state_alloc.available_size() == 0 and self.cache is not None:
            self.stats["state_evicted"] += self.cache.evict(1, "mamba")
        s = self.state_alloc.alloc(1)
        return None if s is None else int(s[0])
