"""L3Tier: the shared store as the radix cache's third tier."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import torch

from tandem.cache.tiers.l3.budget import ReadBudget
from tandem.cache.tiers.l3.payload import Payload
from tandem.cache.tiers.l3.prefetch import PREFETCH_JOBS, L3Prefetch
from tandem.cache.tiers.l3.reads import L3Reads, L3TierStats
from tandem.cache.tiers.l3.staging import Jobs, Staging
from tandem.cache.tiers.l3.store import L3Store

if TYPE_CHECKING:
    from tandem.cache.radix.components import TreeComponent
    from tandem.cache.tiers.base import CachePort

WRITE_POLICIES = ("write_back", "write_through")
FULL_LAYOUT = "l2phd"       # a FULL page: [L, 2, page_size, H_kv, D]
STAGING_PAGES = 1024


def layout(components=()) -> str:
    return FULL_LAYOUT + "".join(f"+{c.name}" for c in components)


class L3Tier(L3Reads, L3Prefetch):
    """The L3 :class:`~tandem.cache.tiers.base.KVTier`. ``deadline_s``: a fetch's wait on the store
    (default the store's timeout), longer only while reading beats recomputing at ``prefill_tok_s``
    (:class:`ReadBudget`); ``max_tokens``: a fixed cap per fetch; ``staging_bytes``: 0, no prefetch."""

    name = "l3"

    def __init__(self, store: L3Store, kv_data: torch.Tensor, page_size: int, *,
                 aux_data: Mapping[str, torch.Tensor] | None = None,
                 write_policy: str = "write_back", max_tokens: int | None = None,
                 deadline_s: float | None = None, prefill_tok_s: float | None = None,
                 remember_pages: int = 1 << 18, staging_bytes: int | None = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown L3 write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        self.store = store
        self.kv_data = kv_data
        self.page_size = page_size
        self.write_policy = write_policy
        self.stats = L3TierStats()
        self._remember = remember_pages
        self._known: dict[tuple[str, int], None] = {}   # (kind, hash) recently written or read
        self._full = Payload("", kv_data, page_size)
        self.budget = ReadBudget(store.timeout_s if deadline_s is None else deadline_s,
                                 max(self._full.nbytes // page_size, 1),
                                 prefill_tok_s=prefill_tok_s, max_tokens=max_tokens)
        self._aux_data = dict(aux_data or {})
        self._aux: list[tuple[int, TreeComponent, Payload]] = []
        self._port: CachePort | None = None
        if staging_bytes is None:
            staging_bytes = STAGING_PAGES * self._full.nbytes
        self._staging = Staging(staging_bytes)
        self._jobs = Jobs(self._prefetch_job, max_pending=PREFETCH_JOBS, name="l3-prefetch")

    @property
    def deadline_s(self) -> float:
        return self.budget.deadline_s

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    def bind(self, port: CachePort) -> None:
        """Attach to one cache through its port. Raises ValueError for a second cache, a page
        size other than the allocator's, or a component without its device data."""
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

    def lookup(self, token_ids, m) -> int:
        """Tokens past ``m``'s device prefix a :meth:`fetch` would ask the store about (0: it
        would not ask)."""
        last = m.last_device_node
        if last is None or m.best_match_node is not last or not self.store.up:
            return 0
        return self._pages_to_ask(len(token_ids) - m.prefix_len) * self.page_size

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
        b = self.budget
        return {**self.stats.as_dict(), **{f"store_{k}": v for k, v in self.store.stats.as_dict().items()},
                "up": self.store.up, "write_policy": self.write_policy,
                "staged_bytes": self._staging.nbytes, "staging_bytes": self._staging.cap_bytes,
                "read_bytes_per_s": b.read_bytes_per_s, "prefill_tok_s": b.prefill_tok_s}

    def _remember_refs(self, refs) -> None:
        known = self._known
        for r in refs:
            known[r] = None
        while len(known) > self._remember:
            del known[next(iter(known))]

    def write_node(self, nd) -> None:
        """Write-through: queue ``nd``'s values the store was not given recently (FULL pages and,
        with components, their data within the components' spans before ``nd``'s end)."""
        t = self.port.tree
        if not self._aux:
            self._write(self._full, t.hashes(nd), nd.value)
            return
        floor = nd.end - max(c.lock_span for _, c, _ in self._aux)
        x = nd
        while x is not t.root:
            hs = t.hashes(x)
            if x.end <= floor and ("", hs[-1]) in self._known:
                break
            if x.value is not None:
                self._write(self._full, hs, x.value)
            for i, c, pl in self._aux:
                if x.aux[i] is not None and (x.end > floor or not c.per_token):
                    self._write_aux(pl, c, hs, x.aux[i])
            x = x.parent

    def spill(self, spills: list) -> None:
        """Write-back: queue the values of the tree's ``spills`` records ``(hashes, FULL slots or
        None, on_host, ((component index, value, on_host),...))``; runs before the cache
        frees those slots and rows."""
        host = self.port.host
        if host is not None and any(r[2] or any(a[2] for a in r[3]) for r in spills):
            host.synchronize()              # host rows may still be landing (CUDA)
        by_index = {i: (c, pl) for i, c, pl in self._aux}
        now = self.port.now()
        for hashes, slots, on_host, aux, pin in spills:
            ttl = pin - now if pin > now else None    # a pinned page: the store keeps it until then
            if slots is not None:
                self._write(self._full, hashes, slots, host.pool.kv_data if on_host else None, ttl)
            for i, value, aux_on_host in aux:
                c, pl = by_index[i]
                self._write_aux(pl, c, hashes, value, host.stores[c.name].data if aux_on_host else None, ttl)

    def _write_aux(self, pl: Payload, comp, hashes: list[int], value, src=None, pin_ttl_s=None) -> None:
        if comp.per_token:
            self._write(pl, hashes, value, src, pin_ttl_s)
        else:
            self._write(pl, hashes[-1:], torch.tensor([int(value)], dtype=torch.int64), src, pin_ttl_s)

    def _write(self, pl: Payload, hashes: list[int], rows: torch.Tensor, src=None,
               pin_ttl_s: float | None = None) -> None:
        """Queue pages the store was not given recently; a pinned spill (``pin_ttl_s``) is queued
        again with its expiry even so (L3Store.put_async)."""
        u, kind = pl.units, pl.kind
        todo = [i for i, h in enumerate(hashes) if pin_ttl_s is not None or (kind, h) not in self._known]
        if not todo or not self.store.up:
            return
        idx = torch.cat([rows[i * u:(i + 1) * u] for i in todo])
        values = pl.gather(idx, src)
        pages = [(hashes[i], v) for i, v in zip(todo, values)]
        queued = self.store.put_async(pages, kind, pin_ttl_s=pin_ttl_s)
        self.stats.written_pages += queued
        self._remember_refs((kind, h) for h, _ in pages[:queued])

    def close(self) -> None:
        """Stop the prefetch thread, drop the staged values, close the store client. Idempotent."""
        self._jobs.close()
        self._staging.clear()
        self.store.close()
