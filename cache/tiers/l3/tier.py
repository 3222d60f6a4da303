"""L3Tier: the shared store as the radix cache's third tier (a ``KVTier``, like HostTier).

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

Prefetch (SGLang HiCache's idea: the hit travels store -> host -> device before the prefill,
overlapped with other work): :meth:`prefetch`, called when a request is queued (engine/request_kv.py
``prefetch``), computes on the engine thread what a fetch would ask for, and the tier's prefetch
thread asks and reads it into a bounded host staging area (``staging.py``: raw payloads by
``(kind, hash)``, at most ``staging_bytes``, oldest dropped; at most ``PREFETCH_JOBS`` jobs wait,
more are not prefetched). A later fetch takes the staged values (each once), counts them as
stored without asking, and reads only the rest from the store, within the same deadline. The
store calls of both threads go through the client's bounded calls (timeouts, backoff), so a slow
or dead store holds the prefetch thread, and a fetch no longer than without a prefetch. Covers
every component's values (SWA pages, states) as well as FULL pages. A request admitted while its
job still runs stops it (the handle :meth:`prefetch` returns) and reads what is not staged yet
itself; a value the job's last call brings after that ages out unused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from tandem.cache.tiers.l3.payload import Payload
from tandem.cache.tiers.l3.reach import FULL, Reach, Rule
from tandem.cache.tiers.l3.staging import Jobs, Staging
from tandem.cache.tiers.l3.store import L3Store
from tandem.core.page_hash import page_hashes

WRITE_POLICIES = ("write_back", "write_through")
FULL_LAYOUT = "l2phd"       # a FULL page: [L, 2, page_size, H_kv, D]
STAGING_REQUESTS = 4        # the default staging bound: this many full budgets of FULL pages
PREFETCH_JOBS = 16          # prefetch jobs that may wait; more requests are not prefetched


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
    prefetches: int = 0         # prefetch jobs queued (one per queued request with pages to ask)
    prefetch_skipped: int = 0   # prefetches not queued: PREFETCH_JOBS jobs waiting
    prefetched_pages: int = 0   # values (FULL pages, component values) a prefetch staged
    prefetch_used_pages: int = 0    # staged values a fetch took instead of reading the store
    prefetch_dropped_pages: int = 0  # staged values dropped unused (the staging bound)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Ask:
    """What a fetch or a prefetch asks the store about, computed from the tree on the engine
    thread; it holds no tree reference, so a prefetch job carries it to its thread. A prefetch
    returns its job's Ask as the job's handle: :meth:`stop` ends its store reads."""

    hashes: list[int]               # [P]: page p's hash (FULL-only caches: 0 below s0, never asked)
    s0: int                         # the device match's end, in pages
    refs: list[tuple[str, int]]     # (kind, hash): FULL pages [s0, P), then each component's pages
    rules: list[Rule]               # each component's rule (which pages below s0 it holds)
    asked: list[list[int]]          # each component's pages among ``refs``, in order
    stopped: bool = False           # set by the engine thread, read by the prefetch thread

    def stop(self) -> None:
        """A prefetch job: start no store call after the one running (its request is being
        admitted: the fetch reads what is not staged yet itself)."""
        self.stopped = True


class L3Tier:
    """The L3 :class:`~tandem.cache.tiers.base.KVTier`. ``store``: the client; ``kv_data``: the device pool's ``[L, 2, rows, H_kv, D]``;
    ``aux_data``: each auxiliary component's device pool by name, as the host tier takes it
    (``{"swa": swa_pool.kv_data, "mamba": state_pool.data.unsqueeze(1)}``); ``staging_bytes``:
    the prefetch's staging bound (None: ``STAGING_REQUESTS`` x ``budget_pages`` FULL pages'
    bytes; 0: no prefetch)."""

    def __init__(self, store: L3Store, kv_data: torch.Tensor, page_size: int, *,
                 aux_data: Mapping[str, torch.Tensor] | None = None,
                 write_policy: str = "write_back", budget_pages: int = 256,
                 deadline_s: float | None = None, remember_pages: int = 1 << 18,
                 staging_bytes: int | None = None):
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
        self._port = None
        if staging_bytes is None:
            staging_bytes = STAGING_REQUESTS * budget_pages * self._full.nbytes
        self._staging = Staging(staging_bytes)
        self._jobs = Jobs(self._prefetch_job, max_pending=PREFETCH_JOBS, name="l3-prefetch")

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    name = "l3"

    def bind(self, port) -> None:
        """Attach to one cache through its port. Every auxiliary component needs its device
        data in ``aux_data`` (ValueError otherwise)."""
        if self._port is not None and self._port is not port:
            raise ValueError("an L3Tier serves one cache")
        if port.allocator is None or port.page_size != self.page_size:
            raise ValueError("the L3 tier needs a device allocator with its page_size")
        names = [c.name for c in port.components]
        missing = [n for n in names if n not in self._aux_data]
        unknown = sorted(set(self._aux_data) - set(names))
        if missing or unknown:
            raise ValueError(f"the L3 tier needs the device data of every component of the cache "
                             f"({names}); missing {missing}, not components {unknown}")
        ps = self.page_size
        self._aux = [(i, c, Payload(c.name, self._aux_data[c.name], ps if c.per_token else 1))
                     for i, c in enumerate(port.components)]
        self._port = port
        port.record_spills()

    # -- the KVTier port -------------------------------------------------------------------------
    def lookup(self, token_ids, m) -> int:
        """Tokens past ``m``'s device prefix a :meth:`fetch` would ask the store about (0 when
        it would not ask: a host part not restored, the store down, no whole page past it)."""
        last = m.last_device_node
        if last is None or m.best_match_node is not last or not self.store.up:
            return 0
        n_pages = min((len(token_ids) - m.prefix_len) // self.page_size, self.budget_pages)
        return max(n_pages, 0) * self.page_size

    def load(self, token_ids, m, *, session_id=None) -> bool:
        return self.fetch(token_ids, m, session_id=session_id) > 0

    def on_insert(self, node, created: bool, adopted: bool) -> None:
        if self.write_through and (created or adopted):
            self.write_node(node)

    def on_evict(self, node) -> None:
        pass            # what leaves the tree for good comes as spills

    def on_spill(self, spills) -> None:
        self.spill(spills)

    def as_dict(self) -> dict:
        """The tier's and the store client's counters (``/debug/kv``, ``/metrics``)."""
        return {**self.stats.as_dict(), **{f"store_{k}": v for k, v in self.store.stats.as_dict().items()},
                "up": self.store.up, "write_policy": self.write_policy,
                "staged_bytes": self._staging.nbytes, "staging_bytes": self._staging.cap_bytes}

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
        t = self._port.tree
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
        host = self._port.host
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
        not restored, the store down, no room, no end the components accept). Values a
        :meth:`prefetch` staged are taken from the staging area (each once) and count as stored
        without asking; the rest are asked and read as without a prefetch, so the pages placed
        are the same. Waits on the store at most ``deadline_s`` in all (each get is bounded by
        what is left, plus the batch ``exists``, bounded by the store's timeout); the caller
        matches again."""
        t0 = time.perf_counter()
        found = self._lookup(token_ids, m)
        if found is None:
            return 0
        key, last, path, ask = found
        c, t = self._port, self._port.tree
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
        """``(key, last device node, matched device path, what to ask)`` for the pages after
        ``m``'s device prefix (at most ``budget_pages``), or None when there is nothing to ask
        (a host part not restored, the store down, no whole page past the match). Reads the
        tree: engine thread only."""
        c = self._port
        t, ps = c.tree, self.page_size
        last = m.last_device_node
        if last is None or m.best_match_node is not last or not self.store.up:
            return None
        key = c.key(token_ids)
        start = m.prefix_len
        n_pages = min((len(key) - start) // ps, self.budget_pages)
        if n_pages <= 0:
            return None
        path = t.path(last) if self._aux else []
        parent = t.hashes(last)[-1] if last is not t.root else None
        # [P]: page p's hash (FULL-only caches never ask below start: no chain built there)
        before = [h for nd in path for h in t.hashes(nd)] if self._aux else [0] * (start // ps)
        hashes = before + page_hashes(key[start:start + n_pages * ps], ps, parent)
        return key, last, path, self._ask(hashes, start // ps, path)

    def _ask(self, hashes: list[int], s0: int, path: list) -> Ask:
        """The FULL pages ``[s0, P)`` and what the components could use there (``path``: the
        matched device nodes, which may hold a window's first pages), as refs for one batch
        ``exists``."""
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
        return Ask(hashes, s0, refs, rules, asked)

    def _exists(self, refs: list[tuple[str, int]]) -> list[bool]:
        """Which of ``refs`` are available: staged ones without asking, the rest in one batch
        ``exists`` (no store call when every one is staged)."""
        staged = self._staging.holds(refs)
        answers = iter(self.store.exists_keys([r for r, s in zip(refs, staged) if not s]))
        return [True if s else next(answers) for s in staged]

    def _reach(self, ask: Ask, found: list[bool]) -> Reach:
        """The availability ``found`` (one per ref of ``ask``) as a :class:`Reach`."""
        n_full = len(ask.hashes) - ask.s0
        off = n_full
        for rule, pages in zip(ask.rules, ask.asked):
            rule.stored = dict(zip(pages, found[off:off + len(pages)]))
            off += len(pages)
        return Reach(self.page_size, ask.s0, found[:n_full], ask.rules)

    def _payload(self, j: int) -> Payload:
        """The codec of a ref's component index (``FULL``: the FULL pages)."""
        return self._full if j == FULL else self._aux[j][2]

    def _read(self, key: list, ask: Ask, reach: Reach, path: list, m, t0: float,
              session_id) -> int:
        """Read the deepest accepted end's values (shrinking it on each miss), place them in new
        device slots and rows, insert. Returns the FULL pages added."""
        c, ps, s0 = self._port, self.page_size, reach.s0
        if c.allocator.available_size() + c.tree.evictable < (reach.deepest() - s0) * ps:
            return 0                        # no room even after evicting everything unlocked
        read = self._collect(reach, ask.hashes, t0, self._take)
        e = reach.deepest()
        if e <= s0:
            return 0
        return self._place(key, ask.hashes, reach, e, read, path, m, session_id)

    def _collect(self, reach: Reach, hashes: list[int], t0: float, load) -> dict:
        """``{ref: load(ref, page hash, seconds left)}`` for every value the deepest accepted end
        needs; a ``None`` loaded is lost (the end moves up and the loop asks again), and past
        ``deadline_s`` from ``t0`` only what was loaded counts. Leaves ``reach.deepest()`` at
        the end whose values are all loaded (or at ``s0``)."""
        read: dict[tuple[int, int], object] = {}
        e = reach.deepest()
        while e > reach.s0:
            missed = False
            for ref in reach.needs(e):
                if ref in read:
                    continue
                left = self.deadline_s - (time.perf_counter() - t0)
                if left <= 0:
                    reach.keep_only(set(read))
                    missed = True
                    break
                value = load(ref, hashes[ref[1]], left)
                if value is None:
                    reach.lose(ref)
                    missed = True
                    break
                read[ref] = value
            if not missed:
                break
            e = reach.deepest()
        return read

    def _take(self, ref: tuple[int, int], h: int, left: float) -> torch.Tensor | None:
        """A fetch's read of one value: staged (taken), else from the store within ``left``
        seconds; decoded, or None (a component's counted in ``aux_misses``)."""
        pl = self._payload(ref[0])
        payload = self._staging.take((pl.kind, h))
        if payload is not None:
            self.stats.prefetch_used_pages += 1
        else:
            payload = self.store.get(h, budget_s=left, kind=pl.kind)
        value = pl.decode(payload) if payload is not None else None
        if value is None and ref[0] != FULL:
            self.stats.aux_misses += 1
        return value

    def _place(self, key, hashes, reach: Reach, e: int, read: dict, path: list, m,
               session_id) -> int:
        """Device slots for FULL pages ``[s0, e)`` and rows for the components' values, filled
        from ``read`` and inserted with the component data (``extra``). 0 when there is no room
        (everything taken is given back)."""
        c, ps, s0 = self._port, self.page_size, reach.s0
        alloc = c.allocator
        need = (e - s0) * ps
        if alloc.available_size() < need:
            c.make_room(need - alloc.available_size())
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
        cached = c.insert_loaded(key[:e * ps], value, extra or None, session_id)
        if cached > m.prefix_len:           # device nodes the vote had not accepted: ours are duplicates
            alloc.free(value[m.prefix_len:cached])
        return e - s0

    def _rows(self, i: int, comp, n: int) -> torch.Tensor | None:
        """``n`` rows of component ``i``'s device pool (evicting its unlocked data when short;
        an empty tensor for ``n == 0``), or None."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        alloc = comp.allocator
        if alloc.available_size() < n:
            self._port.make_room_aux(i, n - alloc.available_size())
        return alloc.alloc(n)

    # -- prefetch --------------------------------------------------------------------------------
    def prefetch(self, token_ids, m, *, session_id=None) -> Ask | None:
        """Start reading, off the calling thread, what :meth:`fetch` would read for match ``m``
        of ``token_ids`` now: the page hashes and the refs are computed here (the tree is read on
        this thread only), then a job on the tier's prefetch thread asks the store (one batch
        ``exists``), picks the deepest end FULL and every component accept, and gets its values
        (component values first, then FULL pages from ``s0``, the leading run up to the first
        miss: what a fetch would read, at most ``budget_pages`` FULL pages) into the staging
        area, within ``deadline_s`` of the job's start, each call bounded by the store's
        timeout. Values already staged are not read again. Never waits on the store, never
        touches the tree or device memory off this thread. Returns the job's handle (its
        :class:`Ask`: call ``stop()`` when the request is admitted, so that the job and the fetch
        do not both read the rest), or None when no job was queued (prefetch off, the store
        down, nothing past the device match, a host part not restored, or ``PREFETCH_JOBS``
        jobs waiting). ``session_id`` is accepted as :meth:`fetch` takes it; staged values are
        shared, keyed by ``(kind, hash)``."""
        if not self.prefetching:
            return None
        found = self._lookup(token_ids, m)
        if found is None:
            return None
        ask = found[3]
        if not self._jobs.submit((ask,)):
            self.stats.prefetch_skipped += 1
            return None
        self.stats.prefetches += 1
        return ask

    @property
    def prefetching(self) -> bool:
        """Prefetch is on (``staging_bytes > 0``) and the store is up."""
        return self._staging.cap_bytes > 0 and self.store.up

    def prefetch_idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until every queued prefetch job has run (tests)."""
        return self._jobs.idle(timeout_s)

    def _prefetch_job(self, ask: Ask) -> None:
        """The prefetch thread: one job (``ask`` holds no tree reference)."""
        if ask.stopped:
            return
        t0 = time.perf_counter()
        reach = self._reach(ask, self._exists(ask.refs))
        self._collect(reach, ask.hashes, t0, lambda ref, h, left: self._stage(ask, ref, h, left))

    def _stage(self, ask: Ask, ref: tuple[int, int], h: int, left: float) -> bytes | None:
        """The prefetch thread's read of one value: already staged, or got from the store within
        ``left`` seconds and staged (raw payload, decoded by the fetch that takes it); None once
        the job is stopped (the loop then ends)."""
        kind = self._payload(ref[0]).kind
        if ask.stopped:
            return None
        if self._staging.holds([(kind, h)])[0]:
            return b""
        payload = self.store.get(h, budget_s=left, kind=kind)
        if payload is not None:
            self.stats.prefetched_pages += 1
            self.stats.prefetch_dropped_pages += self._staging.put((kind, h), payload)
        return payload

    def close(self) -> None:
        """Stop the prefetch thread (waiting jobs dropped; the running one ends within its
        bounds), drop the staged values, close the store client. Idempotent."""
        self._jobs.close()
        self._staging.clear()
        self.store.close()
