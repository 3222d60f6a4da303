"""The engine thread's half of :class:`~tandem.engine.engine.Engine`: drain the inbox, then one
step (plan, forward, sample, update, stream; with overlap, launch step N+1, then apply step N)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from tandem.cache.null import NullCache
from tandem.cache.unified import UnifiedRadixCache

from tandem.core.types import InvalidRequest, StreamChunk
from tandem.engine.commands import (Abort, Command, Evict, Land, LandResumed, Migrate, Pause, Release, Store, Submit,
                                    Unpin)
from tandem.engine.logprobs import take_prompt_logprobs, wants_prompt_logprobs
from tandem.engine.model_runner import ModelRunner
from tandem.engine.overlap import DeviceLane, Launched, device_sampleable, fill_indices, fill_inputs
from tandem.engine.queries import Query, answer
from tandem.engine.request_kv import RequestKV
from tandem.engine.sampler import Sampler
from tandem.engine.sched.scheduler import Scheduler
from tandem.engine.sched.spec.speculator import accepted_runs, logit_layout

log = logging.getLogger("tandem.engine.engine")
_MOVES_KV = (Abort, Land, LandResumed, Store, Release, Migrate)   # commands that end or hand over KV


class StepLoop:
    # What the loop reads, set by Engine.__init__ (the loop is still the Engine's base class: issue 49
    # item 3 makes it an object the Engine owns, built from these).
    scheduler: Scheduler
    kv: RequestKV
    cache: UnifiedRadixCache | NullCache
    runner: ModelRunner
    sampler: Sampler
    device: torch.device
    overlap: bool
    _lane: DeviceLane | None
    _inflight: Launched | None
    _inbox: queue.SimpleQueue
    _callbacks: dict[str, Callable[[StreamChunk], None]]
    _wake: threading.Event
    _stop: bool
    _error: BaseException | None
    _step_started: float | None

    def _emit(self, chunks: list[StreamChunk]) -> None:
        for c in chunks:
            cb = self._callbacks.get(c.rid)
            if cb is None:
                continue
            if c.finish_reason is not None:
                del self._callbacks[c.rid]
            try:
                cb(c)
            except Exception:
                log.exception("stream callback for %s failed", c.rid)

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not isinstance(cmd, Submit):
                self._settle()
            self._apply(cmd)
            if self.scheduler.debug and isinstance(cmd, _MOVES_KV):
                self._check_after(cmd)

    def _check_after(self, cmd: Command) -> None:
        """``debug_invariants``: the recount after a command that moves KV ownership, so a leak is
        named by the command that made it (the per-step check would name the next step)."""
        try:
            self.scheduler.check_invariants()
        except AssertionError as e:
            raise AssertionError(f"after {type(cmd).__name__}({getattr(cmd, 'rid', '')!r}): {e}") from None

    def _settle(self) -> None:
        done, self._inflight = self._inflight, None
        if done is not None:
            self._emit(self.scheduler.apply(done.plan, done.host_tokens()))

    def _apply(self, cmd: Command) -> None:
        match cmd:
            case Submit(req=req, on_chunk=cb, group=group, resume=resume):
                if self.scheduler.live(req.rid):    # never take over a live request's row and hold
                    cb(StreamChunk(req.rid, (), "", "abort", len(req.prompt_ids), error=(
                        f"request id {req.rid} is still live on this worker (queued, running or its KV held)")))
                    return
                self._callbacks[req.rid] = cb
                try:
                    self.scheduler.add(req, group, resume)
                except InvalidRequest as e:
                    self._emit([StreamChunk(req.rid, (), "", "abort", len(req.prompt_ids), error=str(e))])
            case Abort(rid=rid, error=error):
                c = self.scheduler.abort(rid, error)
                if c is not None:
                    self._emit([c])
            case Land() | LandResumed() | Store() | Release():
                try:
                    c = self.scheduler.handoff(cmd)
                except ValueError as e:
                    log.error("%s", e)
                    c = StreamChunk(cmd.rid, (), "", "abort", error=f"handoff failed: {e}")
                if c is not None:
                    self._emit([c])
            case Migrate(future=fut):
                try:
                    c = self.scheduler.handoff(cmd)
                except ValueError as e:
                    fut.set_exception(e)
                    return
                self._emit([c])
                fut.set_result(True)
            case Evict(tokens=n, future=fut):
                if fut.set_running_or_notify_cancel():
                    fut.set_result(self.cache.evict(n))
            case Unpin(prefix_hash=h, tenant=tenant, future=fut):
                if fut.set_running_or_notify_cancel():
                    fut.set_result(self.cache.unpin(h, tenant))
            case Query(future=fut):
                if not fut.set_running_or_notify_cancel():
                    return
                try:
                    fut.set_result(answer(self, cmd))
                except Exception as e:
                    fut.set_exception(e)
            case Pause(resume=resume, timeout_s=t, future=fut):
                if fut.set_running_or_notify_cancel():
                    fut.set_result(None)
                    resume.wait(t)
            case _:
                raise TypeError(f"unknown engine command {cmd!r}")

    def step(self):
        """Drain the inbox, then run one step: plan, forward, sample, update, stream. Returns the
        :class:`~tandem.engine.sched.sched_types.StepPlan` (empty when nothing could run)."""
        self._drain_inbox()
        self._step_started = time.monotonic()
        try:
            return self._step_overlap() if self.overlap else self._step()
        finally:
            self._step_started = None

    def step_age(self) -> float:
        """Seconds the engine thread has been inside its current step (0 between steps): a thread
        that is alive but stuck in one step is what a hung device looks like."""
        started = self._step_started
        return 0.0 if started is None else max(time.monotonic() - started, 0.0)

    def _step(self):
        s = self.scheduler
        plan = s.schedule()
        chunks = plan.chunks
        if plan.entries:
            tokens, logprobs = self._forward_sample(plan, self.kv.forward_batch(plan))
            chunks = chunks + s.update(plan, tokens, logprobs)
        self._emit(chunks)
        return plan

    def _forward_sample(self, plan, fb) -> tuple[list, list | None]:
        spec = self.scheduler.spec
        if spec is None:
            return self._sample(plan, fb)
        t0 = time.perf_counter()
        out = self._verify(plan, fb) if plan.drafts else self._sample(plan, fb)
        spec.cost.observe(fb.num_tokens, time.perf_counter() - t0, plan.drafts)   # the cost rule's measure
        return out

    def _sample(self, plan, fb) -> tuple[list, list | None]:
        srs = [e.sr for e in plan.sampling]
        masks = self.sampler.prepare(srs)
        every = wants_prompt_logprobs(plan.entries)    # [T, V]: prompt logprobs need every position
        logits = self.runner.forward(fb, return_all_logits=every)     # [B, V]
        if every:
            logits = take_prompt_logprobs(plan.entries, logits)
        rows = plan.sample_rows
        if not rows:
            return [], None
        sampled = logits if len(rows) == len(plan.entries) else logits[rows]
        out = self.sampler.sample(sampled, srs, self.scheduler.eos, masks)
        return out.tokens, out.logprobs

    def _verify(self, plan, fb) -> tuple[list, list | None]:
        """A step with drafts (engine/sched/spec/): every draft position's logits are sampled as a decode
        there would be; each entry gets its accepted run (``accepted_runs``)."""
        idx, srs, offsets = logit_layout(plan)
        masks = self.sampler.prepare(srs, {id(e.sr): e.draft for e in plan.sampling if e.draft})
        if wants_prompt_logprobs(plan.entries):
            logits = self.runner.forward(fb, return_all_logits=True)      # [T, V]
            take_prompt_logprobs(plan.entries, logits)
            logits = logits[idx]
        else:
            fb.logit_rows = torch.tensor(idx, dtype=torch.int64).to(fb.input_ids.device)
            logits = self.runner.forward(fb)                               # [R, V]
        out = self.sampler.sample(logits, srs, self.scheduler.eos, masks, offsets)
        return accepted_runs(plan, out.tokens, out.logprobs)

    def _step_overlap(self):
        s = self.scheduler
        if self._inflight is not None and s.wants_settled():
            self._settle()
        plan = s.schedule()
        self._emit(plan.chunks)
        if not plan.entries:
            self._settle()
            return plan
        s.advance(plan)
        fb = self.kv.forward_batch(plan)
        if not device_sampleable(plan, self.device):
            prev = self._inflight
            dst, src = fill_indices(plan, prev)
            self._settle()
            if dst:
                fill_inputs(fb, dst, src, prev.device_tokens())
            tokens, logprobs = self._forward_sample(plan, fb)
            self._emit(s.apply(plan, tokens, logprobs))
            return plan
        prev, self._inflight = self._inflight, self._lane.launch(plan, fb, self._inflight)
        if prev is not None:
            self._emit(s.apply(prev.plan, prev.host_tokens()))
        return plan

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.scheduler.has_work() and self._inflight is None:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                plan = self.step()
                if not (plan.entries or plan.chunks):
                    self._wake.wait(0.005)
                    self._wake.clear()
        except BaseException as e:
            log.exception("engine thread crashed")
            self._error = e
        finally:
            try:
                self._settle()
            except BaseException:
                log.exception("the step in flight failed while stopping")
                self._inflight = None
            error = "engine stopped" if self._error is None else f"engine error: {self._error!r}"
            s = self.scheduler
            for rid in ([sr.rid for sr in s.waiting] + [sr.rid for sr in s.retraction.retracted]
                        + list(s.running)):
                try:
                    c = self.scheduler.abort(rid, error=error)
                except Exception:
                    log.exception("abort of %s failed while stopping", rid)
                    c = StreamChunk(rid, (), "", "abort", error=error)
                if c is not None:
                    self._emit([c])
            while True:
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, Query | Evict | Unpin | Migrate | Pause) and cmd.future.set_running_or_notify_cancel():
                    cmd.future.set_exception(RuntimeError(error))
            self._emit([StreamChunk(rid, (), "", "abort", error=error) for rid in list(self._callbacks)])
