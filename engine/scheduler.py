"""Continuous batching with chunked prefill: the scheduler plans, the engine loop executes.

One rule drives every request: each step a scheduled request extends its KV from
``computed_len`` by ``n <= seq_len - computed_len`` tokens; when that reaches ``seq_len`` the
logits of its last position sample the next token. A decode step is an extend of 1 (the last
sampled token has no KV yet); a prompt chunk is an extend of up to the chunk budget; a request
re-prefilled after retraction simply starts again from its cached prefix.

The loop (engine/engine.py) per step::

    plan = scheduler.schedule()                 # StepPlan: who extends by how much, into which slots
    logits = runner.forward(kv.forward_batch(plan))
    tokens = sampler.sample(logits[plan.sample_rows], ...)
    chunks = plan.finished + scheduler.update(plan, tokens)

``schedule`` order: (1) decodes get one slot each, evicting cache and then retracting victims
when short (engine/retraction.py); (2) unfinished prefills continue, retracted requests are
restored when they fit, then waiting requests are admitted (prefix match, lock, row), within the
step's prompt-token budget. ``update`` advances ``computed_len``, caches finished prompt chunks,
appends sampled tokens, checks stops and streams; finished requests hand their KV to the cache.

Row, slot and cache operations are :class:`RequestKV`'s (engine/request_kv.py); memory ownership
(each slot owned once: free list, cache, or one request's ``[locked_len, computed_len)``) is
proved by :meth:`check_invariants`.

Role entry points (disaggregation; the roles' code lives in decode/ and prefill/):
- decode: :meth:`admit_detached` takes a row and slots for a prompt whose KV another worker
  writes (status ``WAITING_FOR_KV``), :meth:`resume` starts decoding it once the KV arrived,
  :meth:`drop_detached` ends it (transfer failed or aborted);
- prefill: :attr:`on_finish` may keep a finished request's KV (``True``: the hook now holds it and
  releases it with ``kv.release`` once sent).

Constrained decoding (engine/grammar.py): ``add`` starts the constraint's compile (``grammar()``
returns the engine's GrammarCompiler; compiles run on its thread pool, cached per constraint); a
waiting request is not admitted until that future is done, and one that does not compile
finishes as "abort" with the compiler's message. The step loop never waits on a compile. After
each sampled token ``_on_token`` advances the request's matcher; a complete grammar finishes the
request with "stop" (over ``ignore_eos`` and ``min_tokens``).

OpenAI ``n`` (core.messages.SampleGroup, engine/sample_groups.py): a group member is not admitted
while a sibling here is still computing the prompt; then its admission matches the sibling's
cached prompt (with the prefix cache off: forks the sibling's prompt KV), so the group computes
the prompt once. ``stats["prompt_tokens_computed"]`` counts
prompt positions actually run through the model (the n = 4 vs n = 1 figure).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from tandem.core.messages import SampleGroup
from tandem.core.types import InvalidRequest, Req, ReqStatus, StreamChunk, TokenLogprob
from tandem.engine.output import OutputTracker
from tandem.engine.queue_policy import InStepPrefixes, order
from tandem.engine.request_kv import RequestKV
from tandem.engine.retraction import Retraction
from tandem.engine.sample_groups import SampleGroups
from tandem.engine.sched_types import SchedReq, StepPlan

log = logging.getLogger(__name__)

_STATUS = {"stop": ReqStatus.FINISHED_STOP, "length": ReqStatus.FINISHED_LENGTH}


class Scheduler:
    def __init__(self, *, kv: RequestKV, tokenizer, max_context: int, chunked_prefill_size: int,
                 max_batch_tokens: int, schedule_policy: str = "fcfs",
                 retraction_policy: str = "default", host_backup: bool = True,
                 debug_invariants: bool = False, debug_retract_every: int = 0,
                 grammar: Callable[[], object] | None = None):
        """``grammar``: returns the engine's GrammarCompiler (built on first use; None: this
        scheduler refuses constrained requests)."""
        self.kv = kv
        self.grammar = grammar
        self.tok = tokenizer
        self.max_context = max_context
        self.chunk = chunked_prefill_size
        self.max_batch_tokens = max_batch_tokens
        self.policy = schedule_policy
        self.debug = debug_invariants
        self.debug_retract_every = debug_retract_every
        self.page_size = kv.page_size
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.waiting: deque[SchedReq] = deque()
        self.running: dict[str, SchedReq] = {}
        self.on_finish: Callable[[SchedReq], bool] | None = None
        self._session_seen: dict[str, float] = {}   # session id -> when its latest request arrived
        self._decode_steps = 0
        self.groups = SampleGroups()
        self.stats = {"steps": 0, "retractions": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "prompt_tokens_computed": 0,
                      "generated_tokens": 0, "evicted_tokens": 0, "retraction_restores": 0,
                      "retraction_recomputes": 0, "retraction_aborts": 0, "backup_tokens": 0,
                      "backup_seconds": 0.0, "restore_tokens": 0, "restore_seconds": 0.0}
        kv.stats = self.stats
        self.retraction = Retraction(kv, self.stats, policy=retraction_policy, host_backup=host_backup)

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
        if n + 1 > self.kv.alloc.size:
            raise InvalidRequest(
                f"the prompt has {n} tokens but the KV pool holds {self.kv.alloc.size} tokens")

    def add(self, req: Req, group: SampleGroup | None = None) -> SchedReq:
        """Queue ``req`` (validated first: raises InvalidRequest); ``group``: its OpenAI ``n``
        group, if any."""
        sr = self._track(req, group)
        req.status = ReqStatus.WAITING
        self.waiting.append(sr)
        return sr

    def abort(self, rid: str, error: str | None = None) -> StreamChunk | None:
        """Finish ``rid`` with reason "abort" wherever it waits or runs (its KV is released);
        None if it is not here (detached requests are their role's to end)."""
        for sr in self.waiting:
            if sr.rid == rid:
                self.waiting.remove(sr)
                return self._finish_unstarted(sr, error)
        sr = self.retraction.abort(rid)
        if sr is not None:
            return self._finish_unstarted(sr, error)
        sr = self.running.get(rid)
        return None if sr is None else self._finish(sr, "abort", "", error=error)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.retraction.retracted)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan:
        """Decide the next step (allocating its slots, retracting or aborting as needed)."""
        plan = StepPlan()
        self._plan_decodes(plan)
        budget = min(self.chunk, self.max_batch_tokens - len(plan.entries))
        budget = self._plan_prefills(plan, budget)
        budget = self._plan_restores(plan, budget)
        if not self.retraction.retracted:
            # A retracted request waiting for room goes first: new requests would take that room
            # (and be retracted in turn), so none are admitted until it is restored.
            self._plan_admissions(plan, budget)
        return plan

    def _plan_decodes(self, plan: StepPlan) -> None:
        """(1) One slot per decoding request, oldest first; retract victims when short."""
        decodes = sorted((sr for sr in self.running.values()
                          if sr.req.computed_len == sr.req.seq_len - 1), key=lambda s: s.req.arrival)
        if decodes:
            self._decode_steps += 1
            n = self.debug_retract_every
            if n and self._decode_steps % n == 0:   # test lever: retract without pressure
                victim = self.retraction.choose(decodes, self._session_seen)
                decodes.remove(victim)
                self._retract(victim)
        while decodes:
            sr = decodes.pop(0)
            if sr.rid not in self.running:
                continue
            slots = self.kv.extend(sr, 1)
            while slots is None:
                cands = [s for s in self.running.values() if s is not sr and not plan.holds(s)]
                victim = self.retraction.choose(cands, self._session_seen)
                if victim is None:
                    break
                if victim in decodes:
                    decodes.remove(victim)
                self._retract(victim)
                slots = self.kv.extend(sr, 1)
            if slots is None:
                if plan.entries or len(self.kv.holders) > 1:
                    # The rest of the pool is this step's other work, or KV that others hold and
                    # will give back (reservations being filled, held KV being sent, requests
                    # not retractable this step): wait a step.
                    continue
                plan.finished.append(self._finish(sr, "abort", "", error=(
                    f"KV pool exhausted: {self.kv.alloc.size} tokens cannot hold this request "
                    f"at {sr.req.seq_len} tokens")))
                continue
            plan.add(sr, 1, slots)

    def _plan_prefills(self, plan: StepPlan, budget: int) -> int:
        """(2a) Running requests with prompt left (chunked prefill) continue."""
        for sr in list(self.running.values()):
            if budget <= 0:
                break
            r = sr.req
            if r.computed_len < r.seq_len - 1 and not plan.holds(sr):
                n = min(r.seq_len - r.computed_len, budget)
                slots = self.kv.extend(sr, n)
                if slots is None:
                    continue
                plan.add(sr, n, slots)
                budget -= n
        return budget

    def _plan_restores(self, plan: StepPlan, budget: int) -> int:
        """(2b) Retracted requests that fit again are admitted; their match loads the backup."""
        for sr in self.retraction.restorable(anything_held=bool(self.kv.holders)):
            if budget <= 0 or self.kv.r2t.available_size() == 0:
                break
            t0 = time.perf_counter()
            if not self._admit(sr):
                break
            r = sr.req
            n = min(r.seq_len - r.computed_len, budget)
            slots = self.kv.extend(sr, n)
            if slots is None:
                alone = not plan.entries and len(self.kv.holders) == 1
                self._unadmit(sr, requeue=False)    # its backup still holds the host copy
                if alone:                           # the whole pool cannot hold it: never will
                    self.retraction.abort(sr.rid)
                    self.stats["retraction_aborts"] += 1
                    plan.finished.append(self._finish_unstarted(sr, (
                        f"KV pool exhausted: {self.kv.alloc.size} tokens cannot hold this "
                        f"retracted request at {r.seq_len} tokens")))
                    continue
                break
            self.retraction.restored(sr, time.perf_counter() - t0)
            plan.add(sr, n, slots)
            budget -= n
        return budget

    def _plan_admissions(self, plan: StepPlan, budget: int) -> None:
        """(2c) Waiting requests, in the queue policy's order, while budget and rows last."""
        in_step = InStepPrefixes(self.kv.cache.peek, self.page_size) if self.policy == "lpm" else None
        for sr in self._admission_order():
            if budget <= 0 or self.kv.r2t.available_size() == 0:
                break
            if not self._grammar_ready(sr, plan):
                continue   # compiling (off the loop), or failed (finished into plan.finished)
            if self.groups.prefilling_sibling(sr, self.running) is not None:
                continue   # a sibling computes the shared prompt: hit it in the cache once cached
            if in_step is not None and in_step.should_wait(sr.req.all_ids):
                continue   # an earlier request computes the shared prefix this step: hit it next step
            if not self._admit(sr):
                break
            self.waiting.remove(sr)
            if sr.group is not None and not self.kv.cache.retains:
                self._fork_prompt(sr)
            r = sr.req
            n = min(r.seq_len - r.computed_len, budget)
            slots = self.kv.extend(sr, n)
            if slots is None:
                self._unadmit(sr)
                break
            plan.add(sr, n, slots)
            budget -= n

    def _grammar_ready(self, sr: SchedReq, plan: StepPlan) -> bool:
        """True when ``sr`` needs no grammar or its matcher is made. A failed compile finishes
        the request (abort, the compiler's message) into ``plan.finished``."""
        if sr.grammar is None or sr.matcher is not None:
            return True
        if not sr.grammar.done():
            return False
        try:
            sr.matcher = sr.grammar.result().matcher()
        except InvalidRequest as e:
            self.waiting.remove(sr)
            plan.finished.append(self._finish_unstarted(sr, str(e)))
            return False
        return True

    def _fork_prompt(self, sr: SchedReq) -> None:
        """No prefix cache: copy a computed sibling's prompt KV (all but the last token) into
        ``sr``'s row; counted as cached (it was not computed)."""
        src = self.groups.computed_sibling(sr, self.kv.holders)
        n = len(sr.req.prompt_ids) - 1
        if src is not None and self.kv.fork(sr, src, n):
            sr.req.cached_len += n
            self.stats["cached_tokens"] += n

    def _admission_order(self) -> list[SchedReq]:
        """``fcfs``: arrival order. ``lpm``: longest cached prefix first, and requests sharing a
        not-yet-cached prefix with an earlier one wait for it to be computed (SGLang's policy)."""
        if self.policy != "lpm" or len(self.waiting) < 2:
            return list(self.waiting)
        return order(self.waiting, lambda sr: self.kv.cache.peek(sr.req.all_ids), "lpm",
                     token_ids_fn=lambda sr: sr.req.all_ids, page_size=self.page_size)

    # ------------------------------------------------------------------ after the forward
    def update(self, plan: StepPlan, tokens: list[int | None],
               logprobs: list[TokenLogprob | None] | None = None) -> list[StreamChunk]:
        """Apply a step's results: ``tokens[i]`` was sampled for ``plan.sampling[i]`` (None: its
        grammar allowed no token), with ``logprobs[i]`` when that request asked for them."""
        out: list[StreamChunk] = []
        computed = 0
        for e in plan.entries:
            r = e.sr.req
            computed += max(0, min(r.computed_len + e.n, len(r.prompt_ids)) - r.computed_len)
            e.sr.req.computed_len += e.n
            self.kv.advanced(e.sr)
            if e.n > 1:   # a prompt chunk (not a decode step): share it with later requests now
                self.kv.cache_prefix(e.sr)
        self.stats["prompt_tokens_computed"] += computed
        now = time.monotonic()
        for i, (e, tok) in enumerate(zip(plan.sampling, tokens)):
            sr, r = e.sr, e.sr.req
            if r.first_token_time is None:
                r.first_token_time = now
                r.status = ReqStatus.RUNNING
            out.append(self._on_token(sr, tok, logprob=logprobs[i] if logprobs is not None else None))
        self.stats["steps"] += 1
        if self.debug:
            self.check_invariants()
        return out

    def _on_token(self, sr: SchedReq, tok: int | None, sampled: bool = True,
                  logprob: TokenLogprob | None = None) -> StreamChunk:
        r = sr.req
        m = sr.matcher
        if m is not None and (tok is None or not m.accept(tok)):
            what = "no token" if tok is None else f"token {tok}"
            return self._finish(sr, "abort", "", error=(
                f"the {m.constraint.kind} constraint allows {what} at output position "
                f"{len(r.output_ids)}: {m.error or 'rejected'}"))
        r.output_ids.append(tok)
        if sampled:
            self.stats["generated_tokens"] += 1
        text, finish = sr.tracker.on_token(tok, grammar_done=m is not None and m.is_terminated())
        lps = (logprob,) if logprob is not None else ()
        if finish is not None:
            return self._finish(sr, finish, text, last_ids=(tok,), logprobs=lps)
        return StreamChunk(r.rid, (tok,), text, logprobs=lps)

    # ------------------------------------------------------------------ role entry points
    def admit_detached(self, req: Req) -> SchedReq | None:
        """Decode: a row holding the cached prefix plus slots for the rest of the prompt, for a
        KV transfer to fill. The request waits (``WAITING_FOR_KV``) outside the step loop until
        :meth:`resume` or :meth:`drop_detached`. None when there is no room now."""
        sr = self._track(req)
        if not self._admit(sr, running=False):
            self.groups.remove(sr)
            return None
        n = req.seq_len - req.computed_len
        slots = self.kv.extend(sr, n, received=True)   # hybrid: SWA rows of the kept window only
        if slots is None:
            self._unadmit(sr, requeue=False)
            self.groups.remove(sr)
            return None
        self.kv.r2t.write(req.req_pool_idx, req.computed_len, slots)
        req.computed_len = req.seq_len
        req.status = ReqStatus.WAITING_FOR_KV
        return sr

    def resume(self, sr: SchedReq, first_token: int,
               logprob: TokenLogprob | None = None) -> StreamChunk:
        """Decode: the detached request's KV arrived with its first token (and, when the request
        asked, that token's logprob as prefill computed it); it decodes from now. A constrained
        request's matcher starts here and accepts the first token (``matcher_from(c, [first])``);
        a grammar the first token completes finishes the request at once. The compile was
        awaited before the reservation (decode/worker.py), so ``result()`` does not block unless
        the grammar cache dropped it since (then it recompiles, sub-millisecond for typical
        schemas)."""
        r = sr.req
        r.status = ReqStatus.RUNNING
        r.first_token_time = time.monotonic()
        self.running[r.rid] = sr
        self.kv.cache_prefix(sr)           # the received prompt is shareable now
        if sr.grammar is not None and sr.matcher is None:
            try:
                sr.matcher = sr.grammar.result().matcher()
            except InvalidRequest as e:
                return self._finish(sr, "abort", "", error=str(e))
        return self._on_token(sr, first_token, sampled=False, logprob=logprob)   # prefill sampled it

    def drop_detached(self, sr: SchedReq, error: str | None = None) -> StreamChunk:
        """Decode: the transfer failed or was aborted. The received range never became valid
        KV: it is freed rather than cached."""
        r = sr.req
        self.kv.free_range(sr, sr.locked_len, r.seq_len)
        r.computed_len = sr.locked_len
        return self._finish(sr, "abort", "", error=error)

    # ------------------------------------------------------------------ helpers
    def _track(self, req: Req, group: SampleGroup | None = None) -> SchedReq:
        self.validate(req)
        c = req.params.constraint
        if c is not None and self.grammar is None:
            raise InvalidRequest("this engine has no grammar engine: constrained decoding is off")
        if req.session_id is not None:
            self._session_seen[req.session_id] = time.monotonic()
        sr = SchedReq(req, OutputTracker(req, self.tok, self.max_context), group=group)
        if c is not None:
            sr.grammar = self.grammar().compile(c)    # a done future on a cache hit
        self.groups.add(sr, self.kv.holders)
        return sr

    def _admit(self, sr: SchedReq, running: bool = True) -> bool:
        if not self.kv.admit(sr):
            return False
        r = sr.req
        if r.admissions == 0:
            r.cached_len = r.computed_len
            self.stats["prompt_tokens"] += len(r.prompt_ids)
            self.stats["cached_tokens"] += r.computed_len
        r.admissions += 1
        r.status = ReqStatus.PREFILLING
        if running:
            self.running[r.rid] = sr
        return True

    def _unadmit(self, sr: SchedReq, requeue: bool = True) -> None:
        """Undo :meth:`_admit` of a request that got no slots this step (nothing computed; a
        forked prompt's slots are freed)."""
        r = sr.req
        if r.computed_len > sr.locked_len:
            self.kv.free_range(sr, sr.locked_len, r.computed_len)
        r.admissions -= 1
        if r.admissions == 0:  # the first admission is undone: so is its accounting
            self.stats["prompt_tokens"] -= len(r.prompt_ids)
            self.stats["cached_tokens"] -= r.cached_len
        self.kv.unadmit(sr)
        r.status = ReqStatus.WAITING if not r.output_ids else ReqStatus.RETRACTED
        self.running.pop(r.rid, None)
        if requeue:
            self.waiting.appendleft(sr)

    def _retract(self, sr: SchedReq) -> None:
        del self.running[sr.rid]
        if not self.retraction.retract(sr):
            self.waiting.appendleft(sr)   # recompute: first in line

    def _finish(self, sr: SchedReq, reason: str, text: str, last_ids=(), error=None,
                logprobs=()) -> StreamChunk:
        r = sr.req
        self.running.pop(r.rid, None)
        held = reason != "abort" and self.on_finish is not None and self.on_finish(sr)
        if not held:   # a held member stays a fork source for its siblings (sample_groups.py)
            self.groups.remove(sr)
        if not held and r.req_pool_idx is not None:
            self.kv.release(sr)
        r.status = _STATUS.get(reason, ReqStatus.FINISHED_ABORT)
        r.finish_reason, r.error, r.finish_time = reason, error, time.monotonic()
        return StreamChunk(r.rid, tuple(last_ids), text, reason, len(r.prompt_ids), r.cached_len,
                           len(r.output_ids), error, logprobs=tuple(logprobs),
                           stop_str=sr.tracker.stop_str if reason == "stop" else None)

    def _finish_unstarted(self, sr: SchedReq, error: str | None) -> StreamChunk:
        r = sr.req
        self.groups.remove(sr)
        r.status, r.finish_reason, r.error = ReqStatus.FINISHED_ABORT, "abort", error
        r.finish_time = time.monotonic()
        return StreamChunk(r.rid, (), "", "abort", len(r.prompt_ids), r.cached_len,
                           len(r.output_ids), error)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Every allocated page is owned exactly once: by the cache or by one request (running,
        detached or held); raises AssertionError listing violations."""
        self.kv.check()
