"""Continuous batching with chunked prefill, mixed prefill + decode steps, and the prefix cache.

One rule drives every request: each step a scheduled request extends its KV from
``computed_len`` by ``n <= seq_len - computed_len`` tokens; when that reaches ``seq_len`` the
logits of its last position sample the next token. A decode step is an extend of 1 (the last
sampled token has no KV yet); a prompt chunk is an extend of up to the chunk budget; a request
re-prefilled after retraction simply starts again from its cached prefix.

Step order: (1) decodes get one slot each, evicting cache and then retracting victims when short;
(2) unfinished prefills continue, then waiting requests are admitted (prefix match, lock, row),
within the step's prompt-token budget; (3) one forward over the mixed batch; (4) sampling, stop
checks, streaming; finished requests hand their KV to the prefix cache and free the rest.

Memory ownership: a slot is owned by exactly one of the allocator's free list, the prefix cache,
or one request's row range ``[cached_prefix, computed_len)``. ``check_invariants`` proves it.

Hybrid models (sliding-window / recurrent layers): ``self.hybrid`` (engine/hybrid.py) owns their
extra pools and is called at the hook points marked ``# hybrid:``; for FULL-only models it is
``NO_HYBRID`` and every hook is a no-op.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from tandem.core.types import InvalidRequest, Req, ReqStatus, StreamChunk
from tandem.engine.batch_builder import PlanItem, build_forward_batch
from tandem.engine.hybrid import NO_HYBRID
from tandem.engine.output import OutputTracker
from tandem.engine.sampler import Sampler

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Running:
    """Scheduler-private state of a request that holds a row."""

    req: Req
    tracker: OutputTracker
    locked_len: int = 0     # positions [0, locked_len) of the row are tree-owned slots (locked)


def pick_victim(cands: list[Req], policy: str = "default",
                session_seen: dict[str, float] | None = None) -> Req | None:
    """The request to retract. ``default`` (SGLang's order): fewest generated tokens, ties to the
    longest prompt. ``session``: requests of the least recently active sessions go first (a request
    with no session counts as least recent), then the default order; the sessions an agent is
    actively driving keep their KV longest."""
    if not cands:
        return None
    if policy == "session":
        seen = session_seen or {}
        return min(cands, key=lambda r: (seen.get(r.session_id, float("-inf")) if r.session_id else
                                         float("-inf"), len(r.output_ids), -len(r.prompt_ids)))
    return min(cands, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))


class _InStepPrefixes:
    """lpm: prompts admitted this step, so a request whose long prefix is not cached yet but is
    being computed by an earlier admission waits a step and then hits the cache instead."""

    THRESHOLD = 32  # tokens (SGLang's in-queue deprioritize threshold)

    def __init__(self, sched: "Scheduler"):
        from tandem.cache.unified import UnifiedRadixCache

        self.sched = sched
        self.tree = UnifiedRadixCache.simulated(page_size=sched.page_size)

    def should_wait(self, r: Req) -> bool:
        ids = r.all_ids
        if self.sched.cache.match_len(ids) <= self.THRESHOLD and \
                self.tree.match_prefix(ids).prefix_len >= self.THRESHOLD:
            return True
        self.tree.insert(ids)
        return False


class Scheduler:
    def __init__(self, *, runner, req_to_token_pool, allocator, kv_pool, cache, tokenizer,
                 max_context: int, chunked_prefill_size: int, max_batch_tokens: int,
                 schedule_policy: str = "fcfs", seed: int = 0, device="cpu",
                 debug_invariants: bool = False, hybrid=NO_HYBRID,
                 retraction_policy: str = "default"):
        self.runner = runner
        self.r2t = req_to_token_pool
        self.alloc = allocator
        self.kv_pool = kv_pool
        self.cache = cache
        self.hybrid = hybrid    # SWA / recurrent-state resources (engine/hybrid.py), or NO_HYBRID
        hybrid.attach(cache)
        self.tok = tokenizer
        self.max_context = max_context
        self.chunk = chunked_prefill_size
        self.max_batch_tokens = max_batch_tokens
        self.policy = schedule_policy
        self.device = device
        self.debug = debug_invariants
        self.page_size = allocator.page_size
        self.sampler = Sampler(seed)
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.running: dict[str, _Running] = {}
        self.retraction_policy = retraction_policy
        self._session_seen: dict[str, float] = {}   # session id -> when its latest request arrived
        # Disaggregation: a prefill worker holds finished requests' KV until it has been sent
        # (hold_finished=True); a decode worker reserves rows and slots for KV being received.
        self.hold_finished = False
        self.held: dict[str, _Running] = {}
        self.reserved: dict[str, _Running] = {}
        # Retraction with host backup: a retracted request's KV lives in the cache's host tier as
        # host-only nodes locked by ``backups[rid]`` until it is restored (or aborted).
        self.retracted: deque[Req] = deque()
        self.backups: dict[str, object] = {}
        # A retracted request keeps its _Running (its OutputTracker knows how much text was
        # already streamed) until it is re-admitted or aborted.
        self.parked: dict[str, _Running] = {}
        self.host_backup = bool(getattr(cache, "has_host_tier", False)) and not hybrid.active
        self.stats = {"steps": 0, "retractions": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "generated_tokens": 0, "evicted_tokens": 0, "retraction_restores": 0,
                      "retraction_recomputes": 0, "retraction_aborts": 0, "backup_tokens": 0,
                      "backup_seconds": 0.0, "restore_tokens": 0, "restore_seconds": 0.0}

    # ------------------------------------------------------------------ requests in and out
    def validate(self, req: Req) -> None:
        req.params.validate()
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        if n >= self.max_context:
            raise InvalidRequest(
                f"the prompt has {n} tokens but the context holds {self.max_context} "
                f"(prompt + at least 1 generated token must fit)")
        if n + 1 > self.alloc.size:
            raise InvalidRequest(
                f"the prompt has {n} tokens but the KV pool holds {self.alloc.size} tokens")

    def add(self, req: Req) -> None:
        self.validate(req)
        if req.session_id is not None:
            self._session_seen[req.session_id] = time.monotonic()
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def abort(self, rid: str, error: str | None = None) -> StreamChunk | None:
        for q in (self.waiting, self.retracted):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    self._drop_backup(r)   # its host copy returns to the (evictable) host cache
                    self.parked.pop(r.rid, None)
                    return self._finish_unstarted(r, error)
        st = self.running.get(rid)
        if st is None:
            return None
        return self._finish(st, "abort", "", error=error)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.retracted)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StreamChunk]:
        out: list[StreamChunk] = []
        plan: list[tuple[_Running, int, torch.Tensor]] = []   # (state, n_new, slots)
        budget_tokens = self.max_batch_tokens

        # (1) decodes: one slot each, oldest first; retract the newest when short
        decodes = [st for st in self.running.values() if st.req.computed_len == st.req.seq_len - 1]
        decodes.sort(key=lambda s: s.req.arrival)
        while decodes:
            st = decodes.pop(0)
            if st.req.rid not in self.running:
                continue
            slots = self._alloc(st.req, 1)
            while slots is None:
                victim = self._pick_victim(exclude={st, *(p[0] for p in plan)})
                if victim is None:
                    break
                if victim in decodes:
                    decodes.remove(victim)
                self._retract(victim)
                slots = self._alloc(st.req, 1)
            if slots is None:
                if plan:   # the rest of the pool is this step's other work: wait a step
                    continue
                out.append(self._finish(st, "abort", "", error=(
                    f"KV pool exhausted: {self.alloc.size} tokens cannot hold this request "
                    f"at {st.req.seq_len} tokens")))
                continue
            plan.append((st, 1, slots))
            budget_tokens -= 1

        # (2) prefill chunks: running prefills first, then admissions
        prompt_budget = min(self.chunk, budget_tokens)
        for st in list(self.running.values()):
            if prompt_budget <= 0:
                break
            r = st.req
            if r.computed_len < r.seq_len - 1 and all(p[0] is not st for p in plan):
                n = min(r.seq_len - r.computed_len, prompt_budget)
                slots = self._alloc(r, n)
                if slots is None:
                    continue
                plan.append((st, n, slots))
                prompt_budget -= n
        for r in self._restorable():
            if prompt_budget <= 0 or self.r2t.available_size() == 0:
                break
            st = self._restore(r)
            if st is None:
                break
            n = min(r.seq_len - r.computed_len, prompt_budget)
            slots = self._alloc(r, n)
            if slots is None:
                if not plan and len(self.running) == 1:   # alone and still no room: never will be
                    self.stats["retraction_aborts"] += 1
                    out.append(self._finish(st, "abort", "", error=(
                        f"KV pool exhausted: {self.alloc.size} tokens cannot hold this retracted "
                        f"request at {r.seq_len} tokens")))
                    continue
                self._unadmit(st)
                break
            plan.append((st, n, slots))
            prompt_budget -= n
        in_step = _InStepPrefixes(self) if self.policy == "lpm" and not self.cache.disabled else None
        # A retracted request waiting for room goes first: new requests would take that room
        # (and be retracted in turn), so none are admitted until it is restored.
        for r in (self._admission_order() if not self.retracted else ()):
            if prompt_budget <= 0 or self.r2t.available_size() == 0:
                break
            if in_step is not None and in_step.should_wait(r):
                continue   # an earlier request computes the shared prefix this step: hit it next step
            st = self._admit(r)
            if st is None:
                break
            n = min(r.seq_len - r.computed_len, prompt_budget)
            slots = self._alloc(r, n)
            if slots is None:
                self._unadmit(st)
                break
            plan.append((st, n, slots))
            prompt_budget -= n

        if not plan:
            return out
        # (3) forward
        items = [PlanItem(st.req.req_pool_idx, st.req.computed_len,
                          st.req.all_ids[st.req.computed_len: st.req.computed_len + n], slots)
                 for st, n, slots in plan]
        # hybrid: each sequence's recurrent-state row
        state_indices, state_pool = self.hybrid.batch_state([st.req for st, _, _ in plan])
        fb = build_forward_batch(items, self.r2t, self.kv_pool, self.device,
                                 state_indices=state_indices, state_pool=state_pool)
        logits = self.runner.forward(fb)  # [B, V]
        self.stats["steps"] += 1

        # (4) sample, stream, finish
        sample_rows, sample_states = [], []
        for i, (st, n, _) in enumerate(plan):
            st.req.computed_len += n
            self.hybrid.advanced(st.req, st.locked_len)   # hybrid: free SWA rows behind the window
            if st.req.computed_len == st.req.seq_len:
                sample_rows.append(i)
                sample_states.append(st)
            if n > 1:   # a prompt chunk (not a decode step): share it with later requests now
                self._cache_chunk(st)
        if sample_rows:
            rows = logits if len(sample_rows) == len(plan) else logits[sample_rows]  # no copy when all
            tokens = self.sampler.sample(rows, [s.req for s in sample_states], self.eos)
            now = time.monotonic()
            for st, tok in zip(sample_states, tokens):
                r = st.req
                if r.first_token_time is None:
                    r.first_token_time = now
                    r.status = ReqStatus.RUNNING
                r.output_ids.append(tok)
                self.stats["generated_tokens"] += 1
                text, finish = st.tracker.on_token(tok)
                if finish is not None:
                    out.append(self._finish(st, finish, text, last_ids=(tok,)))
                else:
                    out.append(StreamChunk(r.rid, (tok,), text))
        if self.debug:
            self.check_invariants()
        return out

    # ------------------------------------------------------------------ helpers
    def _admission_order(self) -> list[Req]:
        """``fcfs``: arrival order. ``lpm``: longest cached prefix first, and requests sharing a
        not-yet-cached prefix with an earlier one wait for it to be computed (SGLang's policy)."""
        if self.policy != "lpm" or self.cache.disabled or len(self.waiting) < 2:
            return list(self.waiting)
        from tandem.cache.schedule_policy import order
        return order(self.waiting, lambda r: self.cache.match_len(r.all_ids), "lpm",
                     token_ids_fn=lambda r: r.all_ids, page_size=self.page_size)

    def _admit(self, r: Req) -> _Running | None:
        row = self.r2t.alloc()
        if row is None:
            return None
        self.waiting.remove(r)
        r.req_pool_idx = row
        # Reuse at most seq_len - 1 tokens: the last one must be computed to get logits.
        usable = (r.seq_len - 1) // self.page_size * self.page_size
        slots, node, components = self.cache.match(r.all_ids[:usable], r.session_id)
        m = min(len(slots), usable)
        slots = slots[:m]
        self.cache.lock(node)
        r.last_node = node
        # hybrid: the working state row (the matched checkpoint copied in); none free -> not now
        if not self.hybrid.admit(r, components, m):
            self.cache.unlock(node)
            r.last_node = None
            self.r2t.free(row)
            r.req_pool_idx = None
            self.waiting.appendleft(r)
            return None
        if m:
            self.r2t.write(row, 0, slots)
        first_time = r.admissions == 0
        r.admissions += 1
        r.computed_len = m
        if first_time:
            r.cached_len = m
            self.stats["prompt_tokens"] += len(r.prompt_ids)
            self.stats["cached_tokens"] += m
        r.status = ReqStatus.PREFILLING
        st = (self.running.get(r.rid) or self.parked.pop(r.rid, None)
              or _Running(r, OutputTracker(r, self.tok, self.max_context)))
        st.locked_len = m
        self.running[r.rid] = st
        return st

    def _unadmit(self, st: _Running) -> None:
        """Undo _admit of a request that got no slots this step (nothing computed yet)."""
        r = st.req
        r.admissions -= 1
        if r.admissions == 0:  # the first admission is undone: so is its accounting
            self.stats["prompt_tokens"] -= len(r.prompt_ids)
            self.stats["cached_tokens"] -= r.cached_len
        self.hybrid.release(r, st.locked_len)             # hybrid: the state rows taken at admit
        self.cache.unlock(r.last_node)
        r.last_node = None
        self.r2t.free(r.req_pool_idx)
        r.req_pool_idx = None
        r.computed_len = 0
        r.status = ReqStatus.WAITING if not r.output_ids else ReqStatus.RETRACTED
        del self.running[r.rid]
        if r.output_ids:
            self.parked[r.rid] = st
        self.waiting.appendleft(r)

    def _alloc(self, r: Req, n: int) -> torch.Tensor | None:
        """Slots for the next n positions of r, evicting unlocked cache if short."""
        need = n + self.page_size  # a page of slack for the partial-page rounding
        if self.alloc.available_size() < need:
            freed = self.cache.evict(need - self.alloc.available_size())
            self.stats["evicted_tokens"] += freed
        # hybrid: SWA rows first (they free exactly; a half-used full page could not be given back)
        if not self.hybrid.reserve(n):
            return None
        last_loc = int(self.r2t.req_to_token[r.req_pool_idx, r.computed_len - 1]) if r.computed_len else -1
        slots = self.alloc.alloc_extend(last_loc, r.computed_len, n)
        self.hybrid.bind(r, slots)                        # hybrid: index_map[slots] = rows
        return slots

    def _pick_victim(self, exclude: set) -> _Running | None:
        """Retraction victim among requests not already planned for this step (they hold fresh
        slots); see :func:`pick_victim`."""
        cands = [s.req for s in self.running.values() if s not in exclude]
        victim = pick_victim(cands, self.retraction_policy, self._session_seen)
        return None if victim is None else self.running[victim.rid]

    def _retract(self, st: _Running) -> None:
        """Free the request's device KV and queue it to resume later; its stream stays open.

        With a host tier the KV is backed up there as host-only nodes that stay locked while the
        request is retracted, and restoring is a prefix match plus load-back (no recompute; at
        most the last partial page is recomputed). Without one, or when the host pool is full even
        after host eviction, the KV goes to the device cache unlocked and the request is
        re-prefilled from its tokens (whatever survives in the cache is still reused)."""
        r = st.req
        self.stats["retractions"] += 1
        del self.running[r.rid]
        self.parked[r.rid] = st
        backed_up = self._backup(st) if self.host_backup else False
        if backed_up:
            self.retracted.append(r)
        else:
            if r.req_pool_idx is not None:   # (a failed backup has released it already)
                self._release_kv(st)
            self.stats["retraction_recomputes"] += 1
            self.waiting.appendleft(r)
        r.status = ReqStatus.RETRACTED
        r.computed_len = 0

    def _backup(self, st: _Running) -> bool:
        r = st.req
        row, n = r.req_pool_idx, r.computed_len
        aligned = n // self.page_size * self.page_size
        t0 = time.perf_counter()
        node, freed = self.cache.backup(r.all_ids[:aligned], self.r2t.read(row, 0, aligned),
                                        r.last_node, r.session_id)
        if not self.cache.host_only(node):
            # Nothing to move, or the host pool is full even after host eviction: the KV stays as
            # device cache (unlocked) instead, and the request will be re-prefilled.
            r.last_node, st.locked_len = node, aligned
            if n > aligned:
                self.alloc.free(self.r2t.read(row, aligned, n))
            self.cache.unlock(node)
            r.last_node = None
            self.r2t.free(row)
            r.req_pool_idx, st.locked_len = None, 0
            return False
        if n > aligned:   # the partial last page: recomputed on restore
            self.alloc.free(self.r2t.read(row, aligned, n))
        self.backups[r.rid] = node
        r.last_node = None
        self.r2t.free(row)
        r.req_pool_idx, st.locked_len = None, 0
        self.stats["backup_tokens"] += freed
        self.stats["backup_seconds"] += time.perf_counter() - t0
        return True

    def _drop_backup(self, r: Req) -> None:
        node = self.backups.pop(r.rid, None)
        if node is not None:
            self.cache.unlock(node)

    def _restorable(self) -> list[Req]:
        """Retracted requests whose KV fits now, with a page of decode headroom each."""
        out, room = [], self.alloc.available_size() + self.cache.evictable_size()
        for r in self.retracted:
            need = r.seq_len + 2 * self.page_size
            if need > room:
                break
            room -= need
            out.append(r)
        if not out and self.retracted and not self.running:
            out.append(self.retracted[0])   # nothing else runs: try (and abort if it cannot fit)
        return out

    def _restore(self, r: Req) -> _Running | None:
        """Admit a retracted request: the match loads its host-only KV back to the device."""
        self.retracted.remove(r)
        self.waiting.appendleft(r)
        t0 = time.perf_counter()
        st = self._admit(r)
        if st is None:
            self.waiting.remove(r)
            self.retracted.appendleft(r)
            return None
        self._drop_backup(r)   # the request's own lock on the restored path now protects it
        self.stats["retraction_restores"] += 1
        self.stats["restore_tokens"] += r.computed_len
        self.stats["restore_seconds"] += time.perf_counter() - t0
        return st

    def _cache_chunk(self, st: _Running) -> None:
        """Insert a finished prompt chunk into the cache and adopt its canonical slots."""
        r = st.req
        if self.cache.disabled:
            return
        aligned = r.computed_len // self.page_size * self.page_size
        if aligned <= st.locked_len:
            return
        slots = self.r2t.read(r.req_pool_idx, 0, aligned)
        extra = self.hybrid.extra(r, st.locked_len, aligned, final=False)   # hybrid: rows, checkpoint
        new_slots, node = self.cache.cache(r.all_ids[:aligned], slots, r.last_node, r.session_id,
                                           extra=extra)
        self.r2t.write(r.req_pool_idx, 0, new_slots)
        r.last_node = node
        st.locked_len = len(new_slots)

    def _release_kv(self, st: _Running) -> None:
        """Hand the computed KV to the cache, free what it does not keep, unlock, free the row."""
        r = st.req
        row, n = r.req_pool_idx, r.computed_len
        if self.cache.disabled:
            if n:
                self.alloc.free(self.r2t.read(row, 0, n))
        else:
            aligned = n // self.page_size * self.page_size
            if aligned > st.locked_len:
                slots = self.r2t.read(row, 0, aligned)
                extra = self.hybrid.extra(r, st.locked_len, aligned, final=True)  # hybrid
                _, node = self.cache.cache(r.all_ids[:aligned], slots, r.last_node, r.session_id,
                                           extra=extra)
                r.last_node = node
                st.locked_len = aligned
            if n > st.locked_len:
                self.alloc.free(self.r2t.read(row, st.locked_len, n))
            self.cache.unlock(r.last_node)
        self.hybrid.release(r, st.locked_len)             # hybrid: SWA rows and state rows left
        r.last_node = None
        self.r2t.free(row)
        r.req_pool_idx = None
        st.locked_len = 0

    def _finish(self, st: _Running, reason: str, text: str, last_ids=(), error=None) -> StreamChunk:
        r = st.req
        del self.running[r.rid]
        if self.hold_finished and reason != "abort":
            self.held[r.rid] = st
        else:
            self._release_kv(st)
        self.sampler.forget(r.rid)
        r.status = {"stop": ReqStatus.FINISHED_STOP, "length": ReqStatus.FINISHED_LENGTH}.get(
            reason, ReqStatus.FINISHED_ABORT)
        r.finish_reason, r.error, r.finish_time = reason, error, time.monotonic()
        return StreamChunk(r.rid, tuple(last_ids), text, reason, len(r.prompt_ids), r.cached_len,
                           len(r.output_ids), error)

    def _finish_unstarted(self, r: Req, error: str | None) -> StreamChunk:
        r.status, r.finish_reason, r.error = ReqStatus.FINISHED_ABORT, "abort", error
        r.finish_time = time.monotonic()
        self.sampler.forget(r.rid)
        return StreamChunk(r.rid, (), "", "abort", len(r.prompt_ids), r.cached_len,
                           len(r.output_ids), error)

    # ------------------------------------------------------------------ disaggregation
    def held_slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) of a held (finished, not yet sent) request."""
        st = self.held[rid]
        return self.r2t.read(st.req.req_pool_idx, start, end)

    def release_held(self, rid: str) -> None:
        """The held request's KV was sent (or the send failed): give it to the cache / free it."""
        st = self.held.pop(rid, None)
        if st is not None:
            self._release_kv(st)

    def reserve(self, req: Req) -> tuple[int, torch.Tensor] | None:
        """Decode side: take a row, reuse the cached prefix and allocate slots for the rest of
        the prompt, to be filled by a KV transfer. Returns ``(prefix_len, slots)`` (slots cover
        positions ``[prefix_len, len(prompt))``) or None when there is no room now."""
        self.validate(req)
        if self.hybrid.active:   # hybrid: SWA rows / recurrent state are not transferred (yet)
            raise InvalidRequest("KV transfer does not support hybrid (SWA / recurrent) models")
        self.waiting.append(req)
        st = self._admit(req)
        if st is None:
            self.waiting.remove(req)
            return None
        del self.running[req.rid]
        n = req.seq_len - req.computed_len
        slots = self._alloc(req, n)
        if slots is None:
            self.running[req.rid] = st
            self._unadmit(st)
            self.waiting.remove(req)
            return None
        self.r2t.write(req.req_pool_idx, req.computed_len, slots)
        req.computed_len = req.seq_len
        self.reserved[req.rid] = st
        return st.locked_len, slots

    def activate(self, rid: str, first_token: int) -> list[StreamChunk]:
        """Decode side: the reserved request's KV arrived with its first token; start decoding."""
        st = self.reserved.pop(rid)
        r = st.req
        r.status = ReqStatus.RUNNING
        r.first_token_time = time.monotonic()
        r.output_ids.append(first_token)
        self.running[rid] = st
        self._cache_chunk(st)
        text, finish = st.tracker.on_token(first_token)
        if finish is not None:
            return [self._finish(st, finish, text, last_ids=(first_token,))]
        return [StreamChunk(rid, (first_token,), text)]

    def cancel_reservation(self, rid: str, error: str | None = None) -> StreamChunk | None:
        """Decode side: the transfer failed or was aborted; free the reservation."""
        st = self.reserved.pop(rid, None)
        if st is None:
            return None
        r = st.req
        # The received range never became valid KV: free it rather than caching it.
        if r.seq_len > st.locked_len:
            self.alloc.free(self.r2t.read(r.req_pool_idx, st.locked_len, r.seq_len))
        r.computed_len = st.locked_len
        self.running[rid] = st
        return self._finish(st, "abort", "", error=error)

    # ------------------------------------------------------------------ invariants
    def request_owned_slots(self) -> torch.Tensor:
        """Slots exclusively owned by requests (beyond their tree-locked prefix)."""
        states = [*self.running.values(), *self.held.values(), *self.reserved.values()]
        parts = [self.r2t.read(st.req.req_pool_idx, st.locked_len, st.req.computed_len)
                 for st in states if st.req.computed_len > st.locked_len]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def check_invariants(self) -> None:
        """Every allocated page is owned exactly once: by the cache or by one request."""
        owned = self.request_owned_slots()
        # hybrid: the SWA rows and state rows requests own, per cache component
        states = [*self.running.values(), *self.held.values(), *self.reserved.values()]
        aux = self.hybrid.owned([(st.req, st.locked_len) for st in states])
        self.cache.check(extra_owned={"full": owned, **aux} if aux else owned)
        if self.cache.disabled:
            self.hybrid.check_exact(aux)
            pages = torch.unique(owned // self.page_size) if len(owned) else owned
            allocated = self.alloc.allocated_pages()
            if len(pages) != len(allocated) or not torch.equal(torch.sort(pages).values, allocated):
                raise AssertionError(
                    f"slot ownership mismatch: requests own {len(pages)} pages, "
                    f"allocator has {len(allocated)} allocated")
