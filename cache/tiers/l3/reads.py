"""The L3 tier's reads: continue a device match into the store (engine thread only)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.cache.tiers.l3.payload import Payload
from tandem.cache.tiers.l3.reach import FULL, Reach, Rule
from tandem.core.page_hash import page_hashes

if TYPE_CHECKING:
    from tandem.cache.radix.components import TreeComponent
    from tandem.cache.tiers.base import CachePort
    from tandem.cache.tiers.l3.budget import ReadBudget
    from tandem.cache.tiers.l3.staging import Staging
    from tandem.cache.tiers.l3.store import L3Store

READ_BATCH = 256


@dataclass
class Ask:
    """What a fetch or a prefetch asks the store about; holds no tree reference. A prefetch
    returns its job's Ask as the job's handle: :meth:`stop` ends its store reads."""

    hashes: list[int]               # [P]: page p's hash (FULL-only caches: 0 below s0, never asked)
    s0: int                         # the device match's end, in pages
    refs: list[tuple[str, int]]     # (kind, hash): FULL pages [s0, P), then each component's pages
    rules: list[Rule]               # each component's rule (which pages below s0 it holds)
    asked: list[list[int]]          # each component's pages among ``refs``, in order
    wait_s: float = 0.0             # the longest wait on the store for these pages
    stopped: bool = False           # set by the engine thread, read by the prefetch thread

    def stop(self) -> None:
        """Start no store call after the one running (its request is being admitted)."""
        self.stopped = True


@dataclass
class L3TierStats:
    lookups: int = 0
    hit_pages: int = 0
    miss_pages: int = 0
    aux_hits: int = 0
    aux_misses: int = 0         # component values a match end needed that could not be read
    prefetch_s: float = 0.0     # seconds spent in fetch
    written_pages: int = 0
    prefetches: int = 0
    prefetch_skipped: int = 0
    prefetched_pages: int = 0
    prefetch_used_pages: int = 0
    prefetch_dropped_pages: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class L3Reads:
    # L3Tier's (its __init__ and bind() set them; this mixin reads the store into the tree)
    store: L3Store
    page_size: int
    stats: L3TierStats
    budget: ReadBudget
    _full: Payload
    _aux: list[tuple[int, TreeComponent, Payload]]
    _port: CachePort | None
    _staging: Staging

    if TYPE_CHECKING:       # L3Tier's
        def _remember_refs(self, refs: Iterable[tuple[str, int]]) -> None: ...

    @property
    def port(self) -> CachePort:
        """The bound cache's port (RuntimeError before ``bind()``)."""
        if self._port is None:
            raise RuntimeError("the L3 tier is not bound to a cache yet")
        return self._port


    def _pages_to_ask(self, n_tokens: int) -> int:
        return max(self.budget.tokens(max(n_tokens, 0)) // self.page_size, 0)

    def fetch(self, token_ids, m, *, session_id=None) -> int:
        """Continue match ``m`` of ``token_ids`` into the store: read the values of the deepest end
        past ``m``'s device prefix that FULL and every component accept into new device
        slots and rows, and insert them. Returns the tokens added; waits on the store at most
        ``Ask.wait_s`` (plus one batch ``exists``)."""
        t0 = time.perf_counter()
        found = self._lookup(token_ids, m)
        if found is None:
            return 0
        key, last, path, ask = found
        c = self.port
        t = c.tree
        self.stats.lookups += 1
        reach = self._reach(ask, self._exists(ask.refs))
        got = 0
        if reach.deepest() > reach.s0:
            t.lock(last, +1)                # the matched prefix stays while we make room
            try:
                got = self._read(key, ask, reach, path, m, t0, session_id)
            finally:
                t.lock(last, -1)
                c.settle()
        self.stats.hit_pages += got
        self.stats.miss_pages += len(ask.hashes) - ask.s0 - got
        self.stats.prefetch_s += time.perf_counter() - t0
        return got * self.page_size

    def _lookup(self, token_ids, m) -> tuple[list, object, list, Ask] | None:
        c = self.port
        t, ps = c.tree, self.page_size
        last = m.last_device_node
        if last is None or m.best_match_node is not last or not self.store.up:
            return None
        key = c.key(token_ids)
        start = m.prefix_len
        n_pages = self._pages_to_ask(len(key) - start)
        if n_pages <= 0:
            return None
        path = t.path(last) if self._aux else []
        parent = t.hashes(last)[-1] if last is not t.root else None
        before = [h for nd in path for h in t.hashes(nd)] if self._aux else [0] * (start // ps)
        hashes = before + page_hashes(key[start:start + n_pages * ps], ps, parent)
        ask = self._ask(hashes, start // ps, path)
        ask.wait_s = self.budget.wait_s(n_pages * ps)
        return key, last, path, ask

    def _ask(self, hashes: list[int], s0: int, path: list) -> Ask:
        ps, P = self.page_size, len(hashes)
        refs = [("", h) for h in hashes[s0:]]
        rules, asked = [], []
        for i, c, pl in self._aux:
            if c.per_token:
                on_device = [False] * s0
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
        return Ask(hashes, s0, refs, rules, asked)

    def _exists(self, refs: list[tuple[str, int]]) -> list[bool]:
        staged = self._staging.holds(refs)
        answers = iter(self.store.exists_keys([r for r, s in zip(refs, staged) if not s]))
        return [True if s else next(answers) for s in staged]

    def _reach(self, ask: Ask, found: list[bool]) -> Reach:
        n_full = len(ask.hashes) - ask.s0
        off = n_full
        for rule, pages in zip(ask.rules, ask.asked):
            rule.stored = dict(zip(pages, found[off:off + len(pages)]))
            off += len(pages)
        return Reach(self.page_size, ask.s0, found[:n_full], ask.rules)

    def _payload(self, j: int) -> Payload:
        return self._full if j == FULL else self._aux[j][2]

    def _read(self, key: list, ask: Ask, reach: Reach, path: list, m, t0: float,
              session_id) -> int:
        c, ps, s0 = self.port, self.page_size, reach.s0
        if c.allocator.available_size() + c.tree.evictable < (reach.deepest() - s0) * ps:
            return 0                        # no room even after evicting everything unlocked
        read = self._collect(reach, ask, t0, self._take)
        e = reach.deepest()
        if e <= s0:
            return 0
        return self._place(key, ask.hashes, reach, e, read, path, m, session_id)

    def _collect(self, reach: Reach, ask: Ask, t0: float, load) -> dict:
        """``{ref: value}`` for the deepest accepted end, by ``load(refs, page hashes, seconds left)``
        (None where lost: the end moves up); past ``ask.wait_s`` only what was loaded counts."""
        read: dict[tuple[int, int], object] = {}
        e = reach.deepest()
        while e > reach.s0:
            need = [ref for ref in reach.needs(e) if ref not in read][:READ_BATCH]
            if not need:
                break
            left = ask.wait_s - (time.perf_counter() - t0)
            if left <= 0:
                reach.keep_only(set(read))
            else:
                values = load(need, [ask.hashes[r[1]] for r in need], left)
                for ref, value in zip(need, values):
                    if value is None:
                        reach.lose(ref)
                    else:
                        read[ref] = value
            e = reach.deepest()
        return read

    def _get_many(self, refs: list, hashes: list[int], left: float) -> list:
        t0 = time.perf_counter()
        payloads = self.store.get_many([(self._payload(r[0]).kind, h) for r, h in zip(refs, hashes)],
                                       budget_s=left)
        got = sum(len(p) for p in payloads if p is not None)
        if got:
            self.budget.observe(got, time.perf_counter() - t0)
        return payloads

    def _take(self, refs: list, hashes: list[int], left: float) -> list:
        payloads = [self._staging.take((self._payload(r[0]).kind, h)) for r, h in zip(refs, hashes)]
        self.stats.prefetch_used_pages += sum(p is not None for p in payloads)
        ask = [i for i, p in enumerate(payloads) if p is None]
        if ask:
            for i, p in zip(ask, self._get_many([refs[i] for i in ask], [hashes[i] for i in ask], left)):
                payloads[i] = p
        values = []
        for ref, p in zip(refs, payloads):
            value = self._payload(ref[0]).decode(p) if p is not None else None
            if value is None and ref[0] != FULL:
                self.stats.aux_misses += 1
            values.append(value)
        return values

    def _place(self, key, hashes, reach: Reach, e: int, read: dict, path: list, m,
               session_id) -> int:
        c, ps, s0 = self.port, self.page_size, reach.s0
        alloc = c.allocator
        need = (e - s0) * ps
        if alloc.available_size() < need:
            c.make_room(need - alloc.available_size())
        slots = alloc.alloc(need)
        if slots is None:
            return 0
        extra: dict[str, Any] = {}
        taken: list[tuple[TreeComponent, torch.Tensor]] = []
        refs: list[tuple[str, int]] = []
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
                # [e * ps]: the matched nodes' own rows where they hold them now, the window's
                # fetched rows, -1 elsewhere (new pages below the window: tombstones)
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
        cached = c.insert_loaded(key[:e * ps], value, extra or None, session_id)
        if cached > m.prefix_len:           # device nodes the vote had not accepted: ours are duplicates
            alloc.free(value[m.prefix_len:cached])
        return e - s0

    def _rows(self, i: int, comp, n: int) -> torch.Tensor | None:
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        alloc = comp.allocator
        if alloc.available_size() < n:
            self.port.make_room_aux(i, n - alloc.available_size())
        return alloc.alloc(n)
