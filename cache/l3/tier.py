"""L3Tier: the shared store as the radix cache's third tier (the cache's collaborator, like HostTier).

One more place a node's data can be, beside the device and the host, for every component of the
cache. Values are named by the page hash chain (``core/page_hash.py``) under the store's key
prefix (model, page size, dtype, layout; :func:`layout` names the components, so a hybrid
model's entries never meet a FULL-only model's), one key per kind (``store.page_key``):

- FULL: a page's K/V for every layer of the device pool, ``[L, 2, page_size, H_kv, D]``;
- SWA: the SWA rows of that page's tokens, ``[L_swa, 2, page_size, H_kv, D]``, where the SWA
  component holds them (a tombstoned node has none);
- MAMBA: the recurrent state after the page's last token, ``[L_m, 1, 1, *state]``, where the
  MAMBA component holds a checkpoint (at a node's end);

each in its pool's dtype, as raw bytes (``payload.py``; the store adds and checks a digest). The
layouts are the host tier's (``HostStore``): the same tensors, the same row axis.

Writes (never block the step: the bytes are gathered here, the store write is queued for the
store client's writer thread, and a full queue or a down store drops the write, counted):

- ``write_back``: data whose last copy leaves the tree (a device eviction without a host copy, a
  host eviction of a host-only node, a component's data dropped with no copy on the other tier)
  is written before its slots or rows are freed (the tree records it in ``spills``; the cache
  drains them before it frees anything);
- ``write_through``: also every node the tree creates, at insert, and (hybrid) the component
  data a node adopts: the nodes within the components' spans before the inserted key's end.
Values this tier wrote or read recently are not written again.

Reads: :meth:`fetch` continues a match that ends on the device (after any host load-back) into
the store: one batch ``exists`` over the next pages (at most ``budget_pages``) and, for each
component, the data an end there needs (``reach.py``: SWA the pages of the window before it,
MAMBA the state at it); the deepest end every component accepts is read into fresh device slots
and rows and inserted into the tree with its component data. A value that is absent, corrupt,
wrong-sized or past ``deadline_s`` is a miss: the end moves up to where the components accept
what was read, or the request recomputes. A fetch never leaves the match wrong, only shorter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from tandem.cache.l3.payload import Payload
from tandem.cache.l3.reach import FULL, Reach, Rule
from tandem.cache.l3.store import L3Store
from tandem.core.page_hash import page_hashes

WRITE_POLICIES = ("write_back", "write_through")
FULL_LAYOUT = "l2phd"       # a FULL page: [L, 2, page_size, H_kv, D]


def layout(components=()) -> str:
    """The layout part of the key prefix: FULL's, then each auxiliary component's name
    (``l2phd``, ``l2phd+swa``, ``l2phd+mamba``, ``l2phd+swa+mamba``)."""
    return FULL_LAYOUT + "".join(f"+{c.name}" for c in components)


@dataclass
class L3TierStats:
    lookups: int = 0            # fetches that asked the store (a match shorter than the prompt)
    hit_pages: int = 0          # pages read from the store into the cache
    miss_pages: int = 0         # pages asked for and not fetched (absent, corrupt, late, no room,
    #                             or past where the components accept the match)
    aux_hits: int = 0           # component values read into the cache (SWA pages, states)
    aux_misses: int = 0         # component values a match end needed that could not be read
    #                             (corrupt, wrong size, late, gone since exists)
    prefetch_s: float = 0.0     # seconds spent in fetch (exists + get + copies)
    written_pages: int = 0      # values queued for writing (write-back spills and write-through)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class L3Tier:
    """``store``: the client; ``kv_data``: the device pool's ``[L, 2, rows, H_kv, D]``;
    ``aux_data``: each auxiliary component's device pool by name, as the host tier takes it
    (``{"swa": swa_pool.kv_data, "mamba": state_pool.data.unsqueeze(1)}``)."""

    def __init__(self, store: L3Store, kv_data: torch.Tensor, page_size: int, *,
                 aux_data: Mapping[str, torch.Tensor] | None = None,
                 write_policy: str = "write_back", budget_pages: int = 256,
                 deadline_s: float | None = None, remember_pages: int = 1 << 18):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown L3 write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        self.store = store
        self.kv_data = kv_data
        self.page_size = page_size
        self.write_policy = write_policy
        self.budget_pages = budget_pages
        self.deadline_s = store.timeout_s if deadline_s is None else deadline_s
        self.stats = L3TierStats()
        self._remember = remember_pages
        self._known: dict[tuple[str, int], None] = {}   # (kind, hash) recently written or read
        self._full = Payload("", kv_data, page_size)
        self._aux_data = dict(aux_data or {})
        self._aux: list[tuple[int, object, Payload]] = []  # (component index, component, payload)
        self._cache = None

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    def bind(self, cache) -> None:
        """Attach to one cache (a friend: it reaches the cache's tree and allocators). Every
        auxiliary component needs its device data in ``aux_data`` (ValueError otherwise)."""
        if self._cache is not None and self._cache is not cache:
            raise ValueError("an L3Tier serves one cache")
        if cache.allocator is None or cache.page_size != self.page_size:
            raise ValueError("the L3 tier needs a device allocator with its page_size")
        names = [c.name for c in cache._aux]
        missing = [n for n in names if n not in self._aux_data]
        unknown = sorted(set(self._aux_data) - set(names))
        if missing or unknown:
            raise ValueError(f"the L3 tier needs the device data of every component of the cache "
                             f"({names}); missing {missing}, not components {unknown}")
        ps = self.page_size
        self._aux = [(i, c, Payload(c.name, self._aux_data[c.name], ps if c.per_token else 1))
                     for i, c in enumerate(cache._aux)]
        self._cache = cache
        cache._tree.spills = []

    def as_dict(self) -> dict:
        """The tier's and the store client's counters (``/debug/kv``, ``/metrics``)."""
        return {**self.stats.as_dict(), **{f"store_{k}": v for k, v in self.store.stats.as_dict().items()},
                "up": self.store.up, "write_policy": self.write_policy}

    # -- writes ----------------------------------------------------------------------------------
    def _remember_refs(self, refs) -> None:
        known = self._known
        for r in refs:
            known[r] = None
        while len(known) > self._remember:
            del known[next(iter(known))]

    def write_node(self, nd) -> None:
        """Write-through: queue ``nd``'s values that the store was not given recently: its FULL
        pages and, with components, each node's component data within the components' spans
        before ``nd``'s end (and the FULL pages of the new nodes above ``nd``)."""
        t = self._cache._tree
        if not self._aux:
            self._write(self._full, t.hashes(nd), nd.value)
            return
        floor = nd.end - max(c.lock_span for _, c, _ in self._aux)
        x = nd
        while x is not t.root:
            hs = t.hashes(x)
            if x.end <= floor and ("", hs[-1]) in self._known:
                break                       # above the spans, and written before
            if x.value is not None:
                self._write(self._full, hs, x.value)
            for i, c, pl in self._aux:
                if x.aux[i] is not None and (x.end > floor or not c.per_token):
                    self._write_aux(pl, c, hs, x.aux[i])
            x = x.parent

    def spill(self, spills: list) -> None:
        """Write-back: queue the values of the tree's ``spills`` records ``(hashes, FULL slots
        or None, on_host, ((component index, value, on_host), ...))`` before the cache frees
        those slots and rows."""
        host = self._cache.host
        if host is not None and any(on_host or any(a[2] for a in aux) for _, _, on_host, aux in spills):
            host.synchronize()              # host rows may still be landing (CUDA)
        by_index = {i: (c, pl) for i, c, pl in self._aux}
        for hashes, slots, on_host, aux in spills:
            if slots is not None:
                self._write(self._full, hashes, slots, host.pool.kv_data if on_host else None)
            for i, value, aux_on_host in aux:
                c, pl = by_index[i]
                self._write_aux(pl, c, hashes, value, host.stores[c.name].data if aux_on_host else None)

    def _write_aux(self, pl: Payload, comp, hashes: list[int], value, src=None) -> None:
        """A component's data on a node with page hashes ``hashes``: per-token rows ``[len]``
        (one value per page), or one row (the value at the node's end, keyed by its last page)."""
        if comp.per_token:
            self._write(pl, hashes, value, src)
        else:
            self._write(pl, hashes[-1:], torch.tensor([int(value)], dtype=torch.int64), src)

    def _write(self, pl: Payload, hashes: list[int], rows: torch.Tensor, src=None) -> None:
        """Queue the values of ``hashes`` whose ``(kind, hash)`` is not known: value ``i`` is
        ``rows[i * units:(i + 1) * units]`` of ``src`` (default: the device pool)."""
        u, kind = pl.units, pl.kind
        todo = [i for i, h in enumerate(hashes) if (kind, h) not in self._known]
        if not todo or not self.store.up:
            return
        idx = torch.cat([rows[i * u:(i + 1) * u] for i in todo])
        values = pl.gather(idx, src)
        pages = [(hashes[i], v) for i, v in zip(todo, values)]
        queued = self.store.put_async(pages, kind)
        self.stats.written_pages += queued
        self._remember_refs((kind, h) for h, _ in pages[:queued])

    # -- reads -----------------------------------------------------------------------------------
    def fetch(self, token_ids, m, *, session_id=None) -> int:
        """Continue match ``m`` of ``token_ids`` into the store: read the values of the deepest
        end past ``m``'s device prefix that FULL and every component accept into new device
        slots and rows, and insert them. Returns the tokens added (0: nothing, e.g. a host part
        not restored, the store down, no room, no end the components accept). Waits on the
        store at most ``deadline_s`` in all (each get is bounded by what is left, plus the batch
        ``exists``, bounded by the store's timeout); the caller matches again."""
        c = self._cache
        t, ps = c._tree, self.page_size
        last = m.last_device_node
        if last is None or m.best_match_node is not last or not self.store.up:
            return 0
        key = c._key(token_ids)
        start = m.prefix_len
        n_pages = min((len(key) - start) // ps, self.budget_pages)
        if n_pages <= 0:
            return 0
        t0 = time.perf_counter()
        self.stats.lookups += 1
        path = t.path(last) if self._aux else []
        parent = t.hashes(last)[-1] if last is not t.root else None
        # [P]: page p's hash (FULL-only caches never ask below start: no chain built there)
        before = [h for nd in path for h in t.hashes(nd)] if self._aux else [0] * (start // ps)
        hashes = before + page_hashes(key[start:start + n_pages * ps], ps, parent)
        reach = self._ask(hashes, start // ps, path)
        got = 0
        if reach.deepest() > reach.s0:
            t.lock(last, +1)                # the matched prefix stays while we make room
            try:
                got = self._read(key, hashes, reach, path, m, t0, session_id)
            finally:
                t.lock(last, -1)
                c._after()
        self.stats.hit_pages += got
        self.stats.miss_pages += n_pages - got
        self.stats.prefetch_s += time.perf_counter() - t0
        return got * ps

    def _ask(self, hashes: list[int], s0: int, path: list) -> Reach:
        """One batch ``exists`` over the FULL pages ``[s0, P)`` and what the components could
        use there (``path``: the matched device nodes, which may hold a window's first pages)."""
        ps, P = self.page_size, len(hashes)
        refs = [("", h) for h in hashes[s0:]]
        rules, asked = [], []
        for i, c, pl in self._aux:
            if c.per_token:
                on_device = [False] * s0    # pages of matched nodes holding the data on the device
                for nd in path:
                    if nd.aux[i] is not None:
                        on_device[nd.start // ps:nd.end // ps] = [True] * (len(nd.key) // ps)
                lo = max(0, (s0 * ps + ps - c.lock_span) // ps)    # no window reaches below
                pages = [p for p in range(lo, P) if not (p < s0 and on_device[p])]
                rule = Rule(True, c.lock_span, on_device)
            else:
                pages, rule = list(range(s0, P)), Rule(False)
            rules.append(rule)
            asked.append(pages)
            refs += [(pl.kind, hashes[p]) for p in pages]
        found = self.store.exists_keys(refs)
        n_full = P - s0
        off = n_full
        for rule, pages in zip(rules, asked):
            rule.stored = dict(zip(pages, found[off:off + len(pages)]))
            off += len(pages)
        return Reach(ps, s0, found[:n_full], rules)

    def _read(self, key: list, hashes: list[int], reach: Reach, path: list, m, t0: float,
              session_id) -> int:
        """Read the deepest accepted end's values (shrinking it on each miss), place them in new
        device slots and rows, insert. Returns the FULL pages added."""
        c, ps, s0 = self._cache, self.page_size, reach.s0
        read: dict[tuple[int, int], torch.Tensor] = {}
        e = reach.deepest()
        if c.allocator.available_size() + c._tree.evictable < (e - s0) * ps:
            return 0                        # no room even after evicting everything unlocked
        while e > s0:
            missed = False
            for ref in reach.needs(e):
                if ref in read:
                    continue
                left = self.deadline_s - (time.perf_counter() - t0)
                if left <= 0:
                    reach.keep_only(set(read))
                    missed = True
                    break
                j, p = ref
                pl = self._full if j == FULL else self._aux[j][2]
                payload = self.store.get(hashes[p], budget_s=left, kind=pl.kind)
                value = pl.decode(payload) if payload is not None else None
                if value is None:
                    if j != FULL:
                        self.stats.aux_misses += 1
                    reach.lose(ref)
                    missed = True
                    break
                read[ref] = value
            if not missed:
                break
            e = reach.deepest()
        if e <= s0:
            return 0
        return self._place(key, hashes, reach, e, read, path, m, session_id)

    def _place(self, key, hashes, reach: Reach, e: int, read: dict, path: list, m,
               session_id) -> int:
        """Device slots for FULL pages ``[s0, e)`` and rows for the components' values, filled
        from ``read`` and inserted with the component data (``extra``). 0 when there is no room
        (everything taken is given back)."""
        c, t, ps, s0 = self._cache, self._cache._tree, self.page_size, reach.s0
        alloc = c.allocator
        need = (e - s0) * ps
        if alloc.available_size() < need:
            c._evict_device(need - alloc.available_size())
            c._free_device()
        slots = alloc.alloc(need)
        if slots is None:
            return 0
        extra, taken, refs = {}, [], []
        for j, (i, comp, pl) in enumerate(self._aux):
            pages = [p for p in (reach.window(reach.rules[j], e) if comp.per_token else [e - 1])
                     if (j, p) in read]
            rows = self._rows(i, comp, len(pages) * pl.units)
            if rows is None:                  # no room for the component: nothing is placed
                alloc.free(slots)
                for comp2, r in taken:
                    comp2.allocator.free(r)
                return 0
            if len(rows):
                taken.append((comp, rows))
            pl.scatter(rows, [read[(j, p)] for p in pages])
            refs += [(pl.kind, hashes[p]) for p in pages]
            if comp.per_token:
                # [e * ps]: the matched nodes' own rows where they hold them now (kept as they
                # are; read after making room, which may have tombstoned unlocked ones), the
                # window's fetched rows, -1 elsewhere (new pages below the window: tombstones)
                v = torch.full((e * ps,), -1, dtype=torch.int64)
                for nd in path:
                    if nd.aux[i] is not None:
                        v[nd.start:nd.end] = nd.aux[i]
                for p, r in zip(pages, rows.view(-1, ps)):
                    v[p * ps:(p + 1) * ps] = r
                extra[comp.name] = v
            else:
                extra[comp.name] = int(rows[0])
        self._full.scatter(slots, [read[(FULL, p)] for p in range(s0, e)])
        self.stats.aux_hits += len(refs)
        self._remember_refs([("", h) for h in hashes[s0:e]] + refs)  # write-through skips them
        value = torch.cat([m.device_indices, slots])
        cached, _, _ = c._insert(key[:e * ps], value, extra or None, session_id, 0)
        if cached > m.prefix_len:           # device nodes the vote had not accepted: ours are duplicates
            alloc.free(value[m.prefix_len:cached])
        return e - s0

    def _rows(self, i: int, comp, n: int) -> torch.Tensor | None:
        """``n`` rows of component ``i``'s device pool (evicting its unlocked data when short;
        an empty tensor for ``n == 0``), or None."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        c, alloc = self._cache, comp.allocator
        if alloc.available_size() < n:
            backup = c.host.copy_aux if c.host is not None else None
            c._tree.evict_aux(i, n - alloc.available_size(), backup=backup)
            c._free_aux()
        return alloc.alloc(n)
