"""RequestKV: every KV operation on a request's row, in one place."""

from __future__ import annotations

import time

import torch

from tandem.core import tracing
from tandem.engine.batch_builder import PlanItem, build_forward_batch
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.hybrid import NO_HYBRID
from tandem.engine.sched.sched_types import SchedReq, StepPlan


def pages_of(slots: torch.Tensor, page_size: int) -> tuple[int, ...]:
    """Page ids of page-aligned, whole-page slot runs ``[n]`` (the first slot of each page)."""
    return tuple((slots[::page_size] // page_size).tolist())


class RequestKV:
    def __init__(self, *, req_to_token_pool, allocator, kv_pool, cache, hybrid=NO_HYBRID,
                 device="cpu", stats: dict | None = None):
        self.r2t = req_to_token_pool
        self.alloc = allocator
        self.kv_pool = kv_pool
        self.cache = cache
        self.hybrid = hybrid
        hybrid.attach(cache)
        self.device = device
        self.page_size = allocator.page_size
        self.stats = stats if stats is not None else {"evicted_tokens": 0}
        self.holders: dict[str, SchedReq] = {}

    def admit(self, sr: SchedReq) -> bool:
        """Give ``sr`` a row holding its longest reusable cached prefix (locked; tiers load past the
        match); False (nothing taken) when no row or no hybrid state row is free."""
        r = sr.req
        row = self.r2t.alloc()
        if row is None:
            return False
        ids = self._reusable(sr)
        m = self.cache.match(ids, session_id=r.session_id)
        jobs, sr.prefetches = sr.prefetches, None
        for tier in self.cache.tiers:
            job = jobs.pop(tier.name, None) if jobs else None
            if job is not None:
                job.stop()
            t0, before = time.time(), m.prefix_len
            if not tier.lookup(ids, m):
                continue
            if tier.load(ids, m, session_id=r.session_id):
                m = self.cache.match(ids, session_id=r.session_id)
            if r.trace:
                tracing.record(f"{tier.name} fetch", r.trace, t0, **{
                    "tandem.rid": r.rid, "tandem.prefix_before": before, "tandem.prefix_after": m.prefix_len})
        n = min(m.prefix_len, len(ids))
        self.cache.lock(m.last_device_node)
        r.req_pool_idx, r.last_node = row, m.last_device_node
        if not self.hybrid.claim(r, m.components, n):
            self.cache.unlock(m.last_device_node)
            r.last_node = r.req_pool_idx = None
            self.r2t.free(row)
            return False
        if n:
            self.r2t.write(row, 0, m.device_indices[:n])
        r.computed_len = sr.locked_len = n
        self.holders[r.rid] = sr
        return True

    def _reusable(self, sr: SchedReq) -> list[int]:
        """The tokens whose KV a request may reuse: whole pages of all but its last token (the last
        one must be computed to get logits); none for a request that still needs its prompt's
        logprobs and computes the prompt here (every position's logits are needed)."""
        r = sr.req
        if r.params.prompt_logprobs is not None and not r.output_ids and not sr.receive:
            return []
        return r.cache_ids[:(r.seq_len - 1) // self.page_size * self.page_size]

    def prefetch(self, sr: SchedReq) -> None:
        """A request was queued: start reading ahead, off the step, what :meth:`admit` would load
        for it from each tier that prefetches; a no-op when none does or the device holds it all."""
        tiers = [t for t in self.cache.tiers if t.prefetching]
        if not tiers:
            return
        ids = self._reusable(sr)
        if self.cache.peek(ids) >= len(ids):
            return
        m = self.cache.match(ids, session_id=sr.req.session_id)
        if m.prefix_len >= len(ids):
            return
        for tier in tiers:
            job = tier.prefetch(ids, m, session_id=sr.req.session_id)
            if job is not None:
                sr.prefetches = {**(sr.prefetches or {}), tier.name: job}

    def unadmit(self, sr: SchedReq) -> None:
        """Undo :meth:`admit` of a request that computed nothing since."""
        r = sr.req
        self.hybrid.release(r, sr.locked_len)
        self.cache.unlock(r.last_node)
        self._drop_row(sr)
        r.computed_len = 0

    def release(self, sr: SchedReq) -> None:
        """Hand the computed KV to the cache, free what it does not keep, unlock, free the row."""
        r = sr.req
        n = r.computed_len
        self.cache_prefix(sr, final=True)
        if n > sr.locked_len:
            self.alloc.free(self.r2t.read(r.req_pool_idx, sr.locked_len, n))
        for tokens, ttl_s in r.pins:    # past the tenant's cap: served unpinned (cache.pin_refused)
            self.cache.pin(r.last_node, tokens, ttl_s, tenant=r.tenant,
                           cap=None if r.pin_cap < 0 else r.pin_cap)
        self.cache.unlock(r.last_node)
        self.hybrid.release(r, sr.locked_len)
        self._drop_row(sr)

    def free_range(self, sr: SchedReq, start: int, end: int) -> None:
        """Free the request-owned slots (and hybrid rows) of positions ``[start, end)`` (a range
        never computed, e.g. a failed transfer's pages, or the partial last page of a backed-up
        request); the caller then sets ``computed_len = start``."""
        if end > start:
            self.hybrid.drop_range(sr.req, start, end)
            self.alloc.free(self.r2t.read(sr.req.req_pool_idx, start, end))

    def roll_back(self, sr: SchedReq, end: int) -> None:
        """Positions ``[end, computed_len)`` hold the KV of draft tokens a verification rejected (or
        that a finish cut off): free their hybrid rows and the pages wholly past ``end`` (the page
        holding position ``end - 1`` stays, the request's next token continues it); never cached.
        Sets ``computed_len = end``, then releases the SWA rows that left the window at ``end``
        (:meth:`advanced` kept those of the step's pending position)."""
        r = sr.req
        if r.computed_len > end:
            self.hybrid.drop_range(r, end, r.computed_len)
            first = -(-end // self.page_size) * self.page_size
            if first < r.computed_len:
                self.alloc.free(self.r2t.read(r.req_pool_idx, first, r.computed_len))
            r.computed_len = end
        self.hybrid.advanced(r, sr.locked_len)

    def back_up(self, sr: SchedReq):
        """Hand the request's page-aligned KV to the cache, move what only it holds to the host
        tier, free its partial last page; returns ``(node, device tokens freed)``."""
        r = sr.req
        n, locked = r.computed_len, sr.locked_len
        aligned = n // self.page_size * self.page_size
        node, freed = self.cache.host.backup(
            r.cache_ids[:aligned], self.r2t.read(r.req_pool_idx, 0, aligned), r.last_node,
            extra=lambda: self.hybrid.handover(r, locked, aligned, True), session_id=r.session_id)
        r.last_node, sr.locked_len = node, max(aligned, locked)
        self.free_range(sr, sr.locked_len, n)
        r.computed_len = sr.locked_len
        return node, freed

    def drop_backed_up(self, sr: SchedReq) -> None:
        """Free the row of a backed-up request (its backup keeps the node locked, not the row)."""
        r = sr.req
        r.last_node = None
        self.hybrid.release(r, sr.locked_len)
        self._drop_row(sr)

    def _drop_row(self, sr: SchedReq) -> None:
        r = sr.req
        self.r2t.free(r.req_pool_idx)
        r.req_pool_idx = r.last_node = None
        sr.locked_len = 0
        self.holders.pop(r.rid, None)

    def extend(self, sr: SchedReq, n: int, received: bool = False) -> torch.Tensor | None:
        """Slots ``[n]`` for positions ``[computed_len, computed_len + n)`` (not yet written to the
        row), evicting unlocked cache when short; None when there is no room."""
        r = sr.req
        need = n + self.page_size
        if self.alloc.available_size() < need:
            self.stats["evicted_tokens"] += self.cache.evict(need - self.alloc.available_size())
        c = r.computed_len
        last_loc = self.r2t.slot(r.req_pool_idx, c - 1) if c else -1
        return self.hybrid.alloc(r, n, lambda: self.alloc.alloc_extend(last_loc, c, n), received)

    def extend_decodes(self, srs: list[SchedReq]) -> list[torch.Tensor] | None:
        """One slot (``[1]``) each for the next position of every request of ``srs``, in one
        allocation and in ``srs`` order; None (nothing taken) when that would need an eviction, or
        for hybrid models: the caller then extends them one by one."""
        ps = self.page_size
        fresh = [sr.req.computed_len % ps == 0 for sr in srs]
        if self.hybrid.active or self.alloc.available_size() < (sum(fresh) + 1) * ps:
            return None
        pages = self.alloc.alloc_pages(sum(fresh))
        if pages is None:
            return None
        it = iter(pages.tolist())
        slots = [next(it) * ps if f else self.r2t.slot(sr.req.req_pool_idx, sr.req.computed_len - 1) + 1
                 for sr, f in zip(srs, fresh)]
        return list(torch.tensor(slots, dtype=torch.int64).split(1))

    def cache_prefix(self, sr: SchedReq, final: bool = False, end: int | None = None) -> None:
        """Hand the page-aligned computed prefix (of ``[0, end)``; default ``computed_len``) to the
        cache and adopt its canonical slots (the request then shares them with later requests; its
        lock moves to the new node)."""
        r = sr.req
        end = r.computed_len if end is None else end
        aligned = end // self.page_size * self.page_size
        if aligned <= sr.locked_len:
            return
        row, locked = r.req_pool_idx, sr.locked_len
        slots = self.r2t.read(row, 0, aligned)
        new_slots, node = self.cache.cache(
            r.cache_ids[:aligned], slots, r.last_node, session_id=r.session_id,
            extra=lambda: self.hybrid.handover(r, locked, aligned, final))
        if not final:
            self.r2t.write(row, 0, new_slots)
        r.last_node = node
        sr.locked_len = len(new_slots)

    def forward_batch(self, plan: StepPlan) -> ForwardBatch:
        """The device tensors of ``plan`` (the one place a plan becomes tensors)."""
        items = [PlanItem(e.sr.req.req_pool_idx, e.start, self._new_ids(e), e.slots)
                 for e in plan.entries]
        state_indices, state_pool = self.hybrid.state_batch([e.sr.req for e in plan.entries])
        return build_forward_batch(items, self.r2t, self.kv_pool, self.device,
                                   state_indices=state_indices, state_pool=state_pool)

    @staticmethod
    def _new_ids(e) -> list[int]:
        ids = e.sr.req.all_ids[e.start:e.start + e.n - len(e.draft)] + list(e.draft)
        return ids + [0] * (e.n - len(ids))

    def advanced(self, sr: SchedReq, drafted: int = 0) -> None:
        """After the forward moved ``computed_len`` (hybrid: SWA rows that left the window; of the
        ``drafted`` positions at its end, none counts: rejected, they roll back)."""
        r = sr.req
        r.computed_len -= drafted
        self.hybrid.advanced(r, sr.locked_len)
        r.computed_len += drafted

    def fork(self, sr: SchedReq, src: SchedReq, n: int) -> bool:
        """Copy ``src``'s KV of positions ``[0, n)`` into fresh slots of the just admitted ``sr``;
        False (nothing taken) when there is no room, or for hybrid models."""
        r = sr.req
        if self.hybrid.active or r.computed_len or n <= 0 or src.req.computed_len < n:
            return False
        slots = self.extend(sr, n)
        if slots is None:
            return False
        self.kv_pool.copy_slots(self.r2t.read(src.req.req_pool_idx, 0, n), slots)
        self.r2t.write(r.req_pool_idx, 0, slots)
        r.computed_len = n
        return True

    def pages(self, sr: SchedReq, start: int, end: int) -> tuple[int, ...]:
        """Page ids of positions ``[start, end)`` (``start`` page-aligned)."""
        slots = self.r2t.read(sr.req.req_pool_idx, start, end)
        if len(slots) and int(slots[0]) % self.page_size:
            raise AssertionError(f"{sr.rid}: position {start} maps to slot {int(slots[0])}, "
                                 f"not a page start (page_size {self.page_size})")
        return pages_of(slots, self.page_size)

    def transfer_rows(self, sr: SchedReq, start: int) -> dict[str, tuple[int, ...]]:
        """Hybrid rows a KV transfer of positions ``[start, computed_len)`` moves besides the full
        pages (``{"swa": rows, "state": (row,)}``; empty for FULL-only models)."""
        return self.hybrid.transfer_rows(sr.req, start)

    def room(self) -> int:
        """Tokens that could be allocated now (free + evictable cache)."""
        return self.alloc.available_size() + self.cache.stats().evictable

    def owned_slots(self) -> torch.Tensor:
        """Slots the holders own beyond their tree-locked prefixes."""
        parts = [self.r2t.read(sr.req.req_pool_idx, sr.locked_len, sr.req.computed_len)
                 for sr in self.holders.values() if sr.req.computed_len > sr.locked_len]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def check(self) -> None:
        """Every allocated page (and hybrid row) is owned exactly once: by the cache or by one
        holder. Raises AssertionError listing violations."""
        owned = self.owned_slots()
        aux = self.hybrid.owned([(sr.req, sr.locked_len) for sr in self.holders.values()])
        self.cache.check(extra_owned={"full": owned, **aux} if aux else owned)
