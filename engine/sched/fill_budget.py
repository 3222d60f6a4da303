"""How a step fills the token budget its decodes leave (Scheduler.schedule, after the decodes):
(3a) receives, (3b) prefill chunks, restores of retracted requests, (3c) admissions, in that
order. Each takes the scheduler ``s`` and adds its entries to the step's plan; none evicts for
another's sake except as admission's queue policy says."""

from __future__ import annotations

import time

from tandem.core.types import ReqStatus
from tandem.engine.hybrid import NO_HYBRID
from tandem.engine.sched.queue_policy import InStepPrefixes
from tandem.engine.sched.sched_types import StepPlan


def plan_receives(s, plan: StepPlan) -> None:
    """(3a) Requests whose KV another worker writes: a row and the slots it will land in."""
    for sr in [s for s in s.waiting if s.receive]:
        if s.kv.r2t.available_size() == 0:
            return
        if not s.grammar_ready(sr, plan) or not s.admit(sr, running=False):
            continue
        r = sr.req
        end = r.seq_len - 1 if r.output_ids else r.seq_len
        slots = s.kv.extend(sr, end - r.computed_len, received=True)
        if slots is None:
            s.unadmit(sr, requeue=False)
            continue
        s.waiting.remove(sr)
        s.kv.r2t.write(r.req_pool_idx, r.computed_len, slots)
        r.computed_len, r.status = end, ReqStatus.WAITING_FOR_KV
        s.detached[r.rid] = sr
        s.connector.reserved(sr)

def plan_prefills(s, plan: StepPlan, budget: int) -> int:
    """(3b) The next chunk of every running request still prefilling; returns the budget left."""
    for sr in list(s.running.values()):
        if budget <= 0:
            break
        r = sr.req
        if r.computed_len < r.seq_len - 1 and not plan.holds(sr):
            n = min(r.seq_len - r.computed_len, budget)
            slots = s.kv.extend(sr, n)
            if slots is None:
                continue
            plan.add(sr, n, slots)
            budget -= n
    return budget

def plan_restores(s, plan: StepPlan, budget: int) -> int:
    """Retracted requests coming back (their host copy restored, or recomputed); returns the
    budget left."""
    for sr in s.retraction.restorable(anything_held=bool(s.kv.holders)):
        if budget <= 0 or s.kv.r2t.available_size() == 0:
            break
        t0 = time.perf_counter()
        if not s.admit(sr):
            break
        r = sr.req
        n = min(r.seq_len - r.computed_len, budget)
        slots = s.kv.extend(sr, n)
        if slots is None:
            alone = not plan.entries and len(s.kv.holders) == 1
            s.unadmit(sr, requeue=False)
            if alone:
                s.retraction.abort(sr.rid)
                s.stats["retraction_aborts"] += 1
                plan.chunks.append(s.finish_unstarted(sr, (
                    f"KV pool exhausted: {s.kv.alloc.size} tokens cannot hold this "
                    f"retracted request at {r.seq_len} tokens")))
                continue
            break
        s.retraction.restored(sr, time.perf_counter() - t0)
        plan.add(sr, n, slots)
        budget -= n
    return budget

def plan_admissions(s, plan: StepPlan, budget: int) -> None:
    """(3c) Waiting requests, in the queue policy's order, while budget and rows last."""
    in_step = None
    if s.kv.cache.retains:   # a prefix being computed is worth waiting for only if it is cached
        in_step = InStepPrefixes(s.kv.cache.peek, s.kv.page_size,
                                 [sr.req.cache_ids for sr in s.running.values()
                                  if sr.req.computed_len < sr.req.seq_len - 1]
                                 if s.kv.hybrid is NO_HYBRID else (),   # hybrid: the vote decides reuse
                                 in_step=s.policy == "lpm")
    for sr in s.admission.order(s.waiting):
        if budget <= 0 or s.kv.r2t.available_size() == 0:
            break
        if sr.receive:
            continue
        if not s.grammar_ready(sr, plan):
            continue
        if s.groups.prefilling_sibling(sr, s.running) is not None:
            continue   # a sibling computes the shared prompt: hit it in the cache once cached
        if in_step is not None and in_step.should_wait(sr.req.cache_ids):
            continue   # another request computes the shared prefix: hit it once cached
        if not s.admit(sr):
            break
        s.waiting.remove(sr)
        if sr.group is not None and not s.kv.cache.retains:
            s.admission.fork_prompt(sr)
        r = sr.req
        n = min(r.seq_len - r.computed_len, budget)
        slots = s.kv.extend(sr, n)
        if slots is None:
            s.unadmit(sr)
            break
        plan.add(sr, n, slots)
        budget -= n
