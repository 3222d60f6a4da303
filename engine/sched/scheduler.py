"""Continuous batching with chunked prefill: the scheduler plans, the engine loop executes."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from tandem.core.messages import Resume, SampleGroup
from tandem.core.types import InvalidRequest, Req, ReqStatus, StreamChunk, TokenLogprob
from tandem.engine.sched.admission import Admission
from tandem.engine.commands import Handoff, Land, LandResumed, Migrate, Release, Store
from tandem.engine.connector import KVConnector
from tandem.engine.sched.fill_budget import plan_admissions, plan_prefills, plan_receives, plan_restores
from tandem.engine.request_kv import RequestKV
from tandem.engine.sched.retraction import Retraction
from tandem.engine.sched.sample_groups import SampleGroups
from tandem.engine.sched.sched_types import SchedReq, SchedulerObserver, StepPlan, new_stats
from tandem.engine.sched.spec.speculator import Speculator

log = logging.getLogger(__name__)

_STATUS = {"stop": ReqStatus.FINISHED_STOP, "length": ReqStatus.FINISHED_LENGTH, "migrated": ReqStatus.MIGRATED,
           "stored": ReqStatus.FINISHED_STOP}


class Scheduler:
    def __init__(self, *, kv: RequestKV, tokenizer, max_context: int, chunked_prefill_size: int,
                 max_batch_tokens: int, schedule_policy: str = "fcfs",
                 retraction_policy: str = "default", host_backup: bool = True,
                 debug_invariants: bool = False, debug_retract_every: int = 0,
                 grammar: Callable[[], object] | None = None, connector: KVConnector | None = None,
                 speculator: Speculator | None = None):
        """``grammar``: the engine's GrammarCompiler (None: constraints are refused); ``connector``:
        the role's (engine/connector.py; default: nothing crosses workers); ``speculator``: drafts
        for decodes (engine/sched/spec/; None: every decode is one token)."""
        self.kv, self.chunk = kv, chunked_prefill_size
        self.max_batch_tokens, self.policy = max_batch_tokens, schedule_policy
        self.debug, self.debug_retract_every = debug_invariants, debug_retract_every
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.waiting: deque[SchedReq] = deque()
        self.running: dict[str, SchedReq] = {}
        self.connector = connector or KVConnector()
        self.detached: dict[str, SchedReq] = {}
        self.observers: list[SchedulerObserver] = []
        self._decode_steps = 0
        self._deferred: list[SchedReq] = []
        self.groups = SampleGroups()
        self.stats = kv.stats = new_stats()
        self.retraction = Retraction(kv, self.stats, policy=retraction_policy, host_backup=host_backup)
        self.spec = speculator
        if speculator is not None:
            speculator.stats = self.stats
        self.admission = Admission(kv, tokenizer, max_context, schedule_policy, grammar,
                                   self.connector, self.groups, self.stats)

    def validate(self, req: Req) -> None:
        self.admission.validate(req)

    def add(self, req: Req, group: SampleGroup | None = None, resume: Resume | None = None) -> SchedReq:
        """Queue ``req`` (validated first: raises InvalidRequest); ``group``: its ``n`` group;
        ``resume``: it continues another worker's ``req.output_ids`` (engine/sched/admission.py)."""
        sr = self.admission.track(req, group, resume)
        req.status = ReqStatus.WAITING
        self.waiting.append(sr)
        return sr

    def abort(self, rid: str, error: str | None = None) -> StreamChunk | None:
        """Finish ``rid`` "abort" wherever it waits, runs or receives (a received range is freed:
        the caller guarantees no write into it is in flight). None if absent or held."""
        sr = self.detached.get(rid)
        if sr is not None:
            if sr.req.status is not ReqStatus.WAITING_FOR_KV:
                return None
            del self.detached[rid]
            self.kv.free_range(sr, sr.locked_len, sr.req.computed_len)
            sr.req.computed_len = sr.locked_len
            return self._finish(sr, "abort", "", error=error)
        for sr in self.waiting:
            if sr.rid == rid:
                self.waiting.remove(sr)
                return self.finish_unstarted(sr, error)
        sr = self.retraction.abort(rid)
        if sr is not None:
            return self.finish_unstarted(sr, error)
        sr = self.running.get(rid)
        return None if sr is None else self._finish(sr, "abort", "", error=error)

    def live(self, rid: str) -> bool:
        """Whether ``rid`` is anywhere here: queued, running, retracted, receiving or held (its KV
        kept for a transfer). A request id is unique among the live ones: a second with the same id
        would take over the first's row, callback and hold."""
        return (rid in self.kv.holders          # every request with a row: running, receiving, held
                or any(sr.rid == rid for sr in self.waiting)
                or any(sr.rid == rid for sr in self.retraction.retracted))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.retraction.retracted or self._deferred)

    def wants_settled(self) -> bool:
        """Whether the next :meth:`schedule` may retract a decoding request (the retraction lever is
        due, or free plus evictable KV is short of a page per decode): with a step in flight, the
        engine applies it first, since an in-flight request is never a victim."""
        decodes = [sr for sr in self.running.values() if self._decoding(sr)]
        if not decodes:
            return False
        n = self.debug_retract_every
        if n and (self._decode_steps + 1) % n == 0:
            return True
        need = (len(decodes) + 1) * self.kv.page_size + 1
        return self.kv.alloc.available_size() < need and self.kv.room() < need

    @staticmethod
    def _decoding(sr: SchedReq) -> bool:
        return sr.req.computed_len == sr.req.seq_len - 1 + sr.ahead

    def _ends_in_flight(self, sr: SchedReq) -> bool:
        r = sr.req
        return sr.ahead > 0 and (len(r.output_ids) + sr.ahead >= r.params.max_tokens
                                 or r.seq_len + sr.ahead >= sr.tracker.max_context)

    def handoff(self, event: Handoff) -> StreamChunk | None:
        """The worker side of a KV handoff (engine/commands.py): the chunk it makes (first token,
        "stored", "migrated"), None if the request ended meanwhile; ValueError (no change) if it cannot."""
        if isinstance(event, Migrate):
            sr = self.running.get(event.rid)
            if sr is None or sr.req.computed_len != sr.req.seq_len - 1:
                raise ValueError(f"Migrate for {event.rid}, which is not decoding here")
            return self._finish(sr, "migrated", "")
        if (sr := self.detached.get(event.rid)) is None:
            return None
        r, landing = sr.req, sr.req.status is ReqStatus.WAITING_FOR_KV
        match event:
            case Land(first_token=tok, logprob=lp) if landing and not r.output_ids:
                self._land(sr)
                return self._on_token(sr, tok, sampled=False, logprob=lp)
            case LandResumed() if landing and r.output_ids:
                self._land(sr)
                return None
            case Store() if landing and not r.output_ids:
                del self.detached[r.rid]             # a prompt received only to be cached here
                self.kv.cache_prefix(sr)
                return self._finish(sr, "stored", "")
            case Release() if r.finished:
                self.kv.release(self.detached.pop(r.rid))
                return None
        raise ValueError(f"{type(event).__name__} for {event.rid}, which is {r.status.name}")

    def _land(self, sr: SchedReq) -> None:
        sr.receive, sr.req.status, sr.req.first_token_time = False, ReqStatus.RUNNING, time.monotonic()
        self.running[sr.rid] = self.detached.pop(sr.rid)
        self.kv.cache_prefix(sr)

    def schedule(self) -> StepPlan:
        """Decide the next step (allocating its slots, retracting or aborting as needed)."""
        plan = StepPlan()
        self._plan_decodes(plan)
        plan_receives(self, plan)
        budget = min(self.chunk, self.max_batch_tokens - len(plan.entries))
        budget = plan_prefills(self, plan, budget)
        budget = plan_restores(self, plan, budget)
        if not self.retraction.retracted:
            plan_admissions(self, plan, budget)
        return plan

    def _plan_decodes(self, plan: StepPlan) -> None:
        decodes = sorted((sr for sr in self.running.values()
                          if self._decoding(sr) and not self._ends_in_flight(sr)),
                         key=lambda s: s.req.arrival)
        if decodes:
            self._decode_steps += 1
            n = self.debug_retract_every
            if n and self._decode_steps % n == 0:
                victim = self.retraction.choose([d for d in decodes if not d.inflight],
                                                self.admission.session_seen)
                if victim is not None:
                    decodes.remove(victim)
                    self._retract(victim)
        if self.spec is not None and decodes:
            decodes = self.spec.plan(plan, decodes, self.kv)
        batch = self.kv.extend_decodes(decodes)
        for sr, slots in zip(decodes if batch is not None else (), batch or ()):
            plan.add(sr, 1, slots)
        while decodes and batch is None:
            sr = decodes.pop(0)
            if sr.rid not in self.running:
                continue
            slots = self.kv.extend(sr, 1)
            while slots is None:
                cands = [s for s in self.running.values()
                         if s is not sr and not plan.holds(s) and not s.inflight]
                victim = self.retraction.choose(cands, self.admission.session_seen)
                if victim is None:
                    break
                if victim in decodes:
                    decodes.remove(victim)
                self._retract(victim)
                slots = self.kv.extend(sr, 1)
            if slots is None:
                if plan.entries or len(self.kv.holders) > 1:
                    continue
                plan.chunks.append(self._finish(sr, "abort", "", error=(
                    f"KV pool exhausted: {self.kv.alloc.size} tokens cannot hold this request "
                    f"at {sr.req.seq_len} tokens")))
                continue
            plan.add(sr, 1, slots)

    def grammar_ready(self, sr: SchedReq, plan: StepPlan) -> bool:
        """Whether ``sr``'s grammar is compiled (its matcher made); one that cannot compile ends
        the request here (its chunk goes to ``plan``)."""
        try:
            return self.admission.grammar_ready(sr)
        except InvalidRequest as e:
            self.waiting.remove(sr)
            plan.chunks.append(self.finish_unstarted(sr, str(e)))
            return False

    def update(self, plan: StepPlan, tokens: list[int | None],
               logprobs: list[TokenLogprob | None] | None = None) -> list[StreamChunk]:
        """Apply a step's results: ``tokens[i]`` was sampled for ``plan.sampling[i]`` (None: its
        grammar allowed no token), with ``logprobs[i]`` when that request asked for them."""
        self.advance(plan)
        return self.apply(plan, tokens, logprobs)

    def advance(self, plan: StepPlan) -> None:
        """The step ``plan`` is launched: its requests' KV counts as computed from now on (its slots
        are written by the time any later step reads them), and each sampling request is one token
        ahead of its ``output_ids`` until :meth:`apply`."""
        computed = 0
        for e in plan.entries:
            sr, r = e.sr, e.sr.req
            computed += max(0, min(e.start + e.n, len(r.prompt_ids)) - e.start)
            r.computed_len = e.start + e.n
            self.kv.advanced(sr, len(e.draft))
            sr.inflight += 1
            sr.ahead += e.samples
        self.stats["prompt_tokens_computed"] += computed

    def apply(self, plan: StepPlan, tokens: list[int | None],
              logprobs: list[TokenLogprob | None] | None = None) -> list[StreamChunk]:
        """The results of the advanced step ``plan`` (as :meth:`update`)."""
        out: list[StreamChunk] = []
        for e in plan.entries:
            e.sr.inflight -= 1
            if e.n > 1 and not e.draft and not e.sr.req.finished:
                self.kv.cache_prefix(e.sr, end=e.start + e.n)
        now = time.monotonic()
        for i, (e, tok) in enumerate(zip(plan.sampling, tokens)):
            sr, r = e.sr, e.sr.req
            sr.ahead -= 1
            if r.finished:
                continue
            if r.first_token_time is None:
                r.first_token_time, r.status = now, ReqStatus.RUNNING
            lp = logprobs[i] if logprobs is not None else None
            if e.draft:
                out.extend(self._on_run(sr, e, tok, lp))
            else:
                out.append(self._on_token(sr, tok, logprob=lp))
        self._release_deferred()
        self.stats["steps"] += 1
        if self.debug:
            self.check_invariants()
        return out

    def _release_deferred(self) -> None:
        done = [sr for sr in self._deferred if not sr.inflight]
        if done:
            self._deferred = [sr for sr in self._deferred if sr.inflight]
            for sr in done:
                self.kv.release(sr)

    def _on_run(self, sr: SchedReq, e, run: tuple[int, ...], lps) -> list[StreamChunk]:
        """A verify step's accepted ``run`` (engine/sched/spec/speculator.py ``accepted_runs``): the KV of
        the rejected drafts rolls back, then each token goes the way of a decode's; a token that may
        finish the request is applied with the KV before it only, and ends the run."""
        self.spec.verified(sr, e.draft, run)
        out = []
        for t, tok in enumerate(run):
            last = (t == len(run) - 1 or sr.tracker.may_finish(tok)
                    or (sr.matcher is not None and sr.matcher.ends_at(tok)))
            if last:
                self.kv.roll_back(sr, e.start + 1 + t)
            out.append(self._on_token(sr, tok, logprob=lps[t] if lps is not None else None))
            if last or sr.req.finished:
                break
        return out

    def _on_token(self, sr: SchedReq, tok: int | None, sampled: bool = True,
                  logprob: TokenLogprob | None = None) -> StreamChunk:
        r, m = sr.req, sr.matcher
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
        first = len(r.output_ids) == 1
        plps = tuple(sr.prompt_logprobs) if first else ()
        if finish is not None:
            return self._finish(sr, finish, text, last_ids=(tok,), logprobs=lps, prompt_logprobs=plps)
        return StreamChunk(r.rid, (tok,), text, prompt_tokens=len(r.prompt_ids) if first else 0,
                           cached_tokens=r.cached_len if first else 0, logprobs=lps, prompt_logprobs=plps,
                           queue_s=_queued(r) if first else None)

    def admit(self, sr: SchedReq, running: bool = True) -> bool:
        """Give ``sr`` a request row and lock its cached prefix (False: no row); ``running``: it
        runs here (else it waits for KV another worker writes)."""
        if not self.kv.admit(sr):
            return False
        r = sr.req
        if r.admissions == 0:
            r.cached_len, r.admitted_time = r.computed_len, time.monotonic()
            self.stats["prompt_tokens"] += len(r.prompt_ids)
            self.stats["cached_tokens"] += r.computed_len
        r.admissions += 1
        r.status = ReqStatus.PREFILLING
        if running:
            self.running[r.rid] = sr
        for o in self.observers:
            o.admitted(sr)
        return True

    def unadmit(self, sr: SchedReq, requeue: bool = True) -> None:
        """Undo this step's :meth:`admit` of ``sr`` (no slots after all); back in the queue when
        ``requeue``."""
        r = sr.req
        if r.computed_len > sr.locked_len:
            self.kv.free_range(sr, sr.locked_len, r.computed_len)
        r.admissions -= 1
        if r.admissions == 0:
            self.stats["prompt_tokens"] -= len(r.prompt_ids)
            self.stats["cached_tokens"] -= r.cached_len
        self.kv.unadmit(sr)
        r.status = ReqStatus.WAITING if not r.output_ids else ReqStatus.RETRACTED
        self.running.pop(r.rid, None)
        if requeue:
            self.waiting.appendleft(sr)
        for o in self.observers:
            o.unadmitted(sr)

    def _retract(self, sr: SchedReq) -> None:
        for o in self.observers:
            o.retracted(sr)
        del self.running[sr.rid]
        if not self.retraction.retract(sr):
            self.waiting.appendleft(sr)

    def _finish(self, sr: SchedReq, reason: str, text: str, last_ids=(), error=None,
                logprobs=(), prompt_logprobs=()) -> StreamChunk:
        r = sr.req
        self.running.pop(r.rid, None)
        if self.spec is not None:
            self.spec.finished(sr)
        if self.connector.finished(sr, reason):
            self.detached[r.rid] = sr
        else:
            self.groups.remove(sr)
            if r.req_pool_idx is not None:
                if sr.inflight:
                    self._deferred.append(sr)
                else:
                    self.kv.release(sr)
        r.status = _STATUS.get(reason, ReqStatus.FINISHED_ABORT)
        r.finish_reason, r.error, r.finish_time = reason, error, time.monotonic()
        return StreamChunk(r.rid, tuple(last_ids), text, reason, len(r.prompt_ids), r.cached_len,
                           len(r.output_ids), error, logprobs=tuple(logprobs), prompt_logprobs=prompt_logprobs,
                           stop_str=sr.tracker.stop_str if reason == "stop" else None, queue_s=_queued(r),
                           spec_tokens=(sr.spec.drafted, sr.spec.accepted) if sr.spec else (0, 0))

    def finish_unstarted(self, sr: SchedReq, error: str | None) -> StreamChunk:
        """End ``sr`` with ``error`` before it ran (its last chunk)."""
        r = sr.req
        self.connector.finished(sr, "abort")
        self.groups.remove(sr)
        r.status, r.finish_reason, r.error, r.finish_time = ReqStatus.FINISHED_ABORT, "abort", error, time.monotonic()
        return StreamChunk(r.rid, (), "", "abort", len(r.prompt_ids), r.cached_len,
                           len(r.output_ids), error)

    def check_invariants(self) -> None:
        """Every allocated page is owned once: by the cache or one request (running, received or
        held); raises AssertionError listing violations."""
        self.kv.check()


def _queued(r: Req) -> float | None:
    """Seconds ``r`` waited in the queue before its first admission (None: never admitted)."""
    return None if r.admitted_time is None else r.admitted_time - r.arrival
