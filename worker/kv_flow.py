"""The KV handoff, written once for every flow: :class:`KVReceiver` (pages here, a peer writes
them) and :class:`KVSender` (KV held here, written into a peer's pages). Each owns its live
handoffs (transfer/handoff.py); the receiver runs the worker's one NIXL progress :class:`Pump`.
A flow (prompt P->D, migration D->D, reply push D->P, warm-up P->P) is a policy over them
(worker/README.md). Event-loop thread only (the agent is not thread-safe)."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from tandem.core.kv_messages import KVTransferRequest, PrefillResult, RegionPages
from tandem.core.messages import GenerateRequest
from tandem.core.transfer_state import TransferState
from tandem.core.types import StreamChunk
from tandem.engine.queries import HeldKV
from tandem.transfer.agent import KVTransferAgent
from tandem.transfer.handoff import Handoff
from tandem.transfer.pump import PUMP_S, Pump
from tandem.worker.kv_flow_types import Failed, KVSource, Landed, SourceUnavailable, Stop, WriteOutcome
from tandem.worker.receiving import ComputeHere, ReceivingHandle, Reservation

IN_FLIGHT_LIMIT = 10   # a write neither done nor failed after this many transfer timeouts: QUARANTINED
log = logging.getLogger(__name__)
_S = TransferState


class KVSender:
    """Writes held KV into a peer's reserved pages: held pages -> check -> digest -> write ->
    release. ``handoffs``: its live sends by request."""

    def __init__(self, name: str, handle: ReceivingHandle, agent: KVTransferAgent, timeout_s: float):
        self.name, self.handle, self.agent, self.timeout_s = name, handle, agent, timeout_s
        self.handoffs: dict[str, Handoff] = {}

    def open(self, rid: str, transfer_id: int) -> Handoff:
        """``rid``'s send, BOOTSTRAPPED and registered until :meth:`close` (a policy that computes
        the KV first opens it early, so ``live_transfers`` counts it)."""
        h = self.handoffs[rid] = Handoff(rid, transfer_id, _S.BOOTSTRAPPED,
                                         deadline=time.monotonic() + self.timeout_s)
        return h

    def close(self, rid: str) -> None:
        self.handoffs.pop(rid, None)

    async def send(self, rid: str, req: KVTransferRequest, start: int, *,
                   stopped: Callable[[], str] = lambda: "", delay_s: float = 0.0) -> PrefillResult:
        """WRITE held ``rid``'s KV from ``start`` into ``req``'s pages, then release it (on every
        path). Returns only when no write is in flight (but ``in_flight=True``). ``stopped()``: a
        reason to send nothing (ABORTED); ``delay_s``: the test lever, a wait before the write."""
        h = self.handoffs.get(rid) or self.open(rid, req.transfer_id)
        out = PrefillResult(req.transfer_id, _S.FAILED, self.name)
        try:
            if stopped():
                h.fail(stopped(), aborted=True)
                return replace(out, status=_S.ABORTED, error=stopped())
            try:
                held = await self.handle.held_pages(rid, start)
            except KeyError:
                h.fail("not held")
                return replace(out, error=f"{rid} holds no KV on {self.name}")
            out = replace(out, cached_tokens=held.cached_tokens)
            bad = [f"{n}: {len(held.source(n))} held, {len(req.pages(n))} reserved"
                   for n in req.regions if len(held.source(n)) != len(req.pages(n))]
            if bad:   # the two workers disagree on the window / page size: send nothing
                h.fail("region sizes differ")
                return replace(out, error=f"transfer {req.transfer_id}: source and destination "
                                          f"sizes differ ({'; '.join(bad)})")
            if req.digest:
                out = replace(out, digest=await self.handle.page_digest(
                    tuple(RegionPages(n, held.source(n)) for n in req.regions)))
            end = time.monotonic() + delay_s
            while time.monotonic() < end and not stopped():
                await asyncio.sleep(0.01)
            if stopped():
                h.fail(stopped(), aborted=True)
                return replace(out, status=_S.ABORTED, error=stopped())
            w = await self.write(h, req, held)
            out = replace(out, in_flight=w.state is _S.QUARANTINED, transfer_s=w.seconds)
            if w.state is not _S.DONE:
                return replace(out, error=f"transfer {req.transfer_id} to {req.agent_name} {w.error}")
            return replace(out, status=_S.DONE, bytes=w.nbytes, pages=len(held.pages))
        finally:
            self.close(rid)
            self.handle.release_held(rid)

    async def write(self, h: Handoff, req: KVTransferRequest, held: HeldKV) -> WriteOutcome:
        """One WRITE of ``held`` into ``req``'s pages, moving ``h`` to DONE, FAILED or QUARANTINED
        (past ``IN_FLIGHT_LIMIT`` timeouts); returns only when no write is in flight (but QUARANTINED)."""
        pages = {n: (list(held.source(n)), list(req.pages(n))) for n in req.regions}
        limit = self.timeout_s * IN_FLIGHT_LIMIT
        t0 = time.monotonic()
        try:
            w = self.agent.write(req.agent_name, pages, timeout_s=limit * 2)
        except (KeyError, ValueError) as e:
            h.fail(str(e))
            return WriteOutcome(_S.FAILED, error=f"not posted: {e}")
        h.send()
        state = self.agent.poll(w)
        while state is _S.TRANSFERRING:
            if time.monotonic() - t0 > limit:
                h.fail("write still in flight")
                h.settle(in_flight=True)
                log.error("transfer %d to %s still in flight after %.0fs; quarantined",
                          h.transfer_id, req.agent_name, limit)
                self.agent.release(w)
                return WriteOutcome(_S.QUARANTINED, seconds=time.monotonic() - t0,
                                    error=f"still in flight after {limit:.0f}s")
            await asyncio.sleep(PUMP_S)
            state = self.agent.poll(w)
        seconds = time.monotonic() - t0
        self.agent.release(w)
        if state is not _S.DONE:
            h.fail(w.error or f"write ended {state.name}")
            h.settle(in_flight=False)
            return WriteOutcome(_S.FAILED, seconds=seconds, error=f"failed: {w.error}")
        h.land()
        return WriteOutcome(_S.DONE, w.nbytes, seconds)

    @property
    def live(self) -> int:
        return sum(h.live for h in self.handoffs.values())


@dataclass(eq=False)
class _Inbound:
    rid: str
    handoff: Handoff
    reserved_tokens: int
    source: KVSource | None = None                       # set by the first ask
    call: asyncio.Future[PrefillResult] | None = None

    def asked(self) -> tuple[KVSource, asyncio.Future[PrefillResult]]:
        """The source asked last and its call (after ``KVReceiver._ask``)."""
        if self.source is None or self.call is None:
            raise RuntimeError(f"the KV of {self.rid} was never asked for")
        return self.source, self.call


class KVReceiver:
    """Receives a request's KV into pages reserved here: reserve -> bootstrap -> call -> pump ->
    verify -> land, or fail / settle / quarantine. ``handoffs``: its live receives by request.
    ``on_failure(reason)`` and ``on_redispatch()`` let the worker count; quarantined tokens go
    to ``counts["quarantined_tokens"]``."""

    def __init__(self, name: str, handle: ReceivingHandle, agent: KVTransferAgent, timeout_s: float,
                 counts: dict[str, int], *, digest: bool = False, corrupt: bool = False,
                 on_failure: Callable[[str], None] = lambda reason: None,
                 on_redispatch: Callable[[], None] = lambda: None):
        self.name, self.handle, self.timeout_s, self.counts = name, handle, timeout_s, counts
        self.digest, self.corrupt = digest, corrupt
        self.on_failure, self.on_redispatch = on_failure, on_redispatch
        self.handoffs: dict[str, Handoff] = {}
        self.pump = Pump(agent, name, lambda: self.live > 0)
        self.background: set[asyncio.Task[None]] = set()

    async def receive(self, greq: GenerateRequest, source: KVSource, *, on_chunk: Callable[[StreamChunk], None],
                      stop: Stop | None = None, deadline: float | None = None, bounded: bool = True,
                      wire: dict[str, Any] | None = None, check: Callable[[PrefillResult], str] = lambda r: "",
                      alternate: Callable[[str], KVSource | None] | None = None) -> Landed | Failed | ComputeHere:
        """Receive ``greq``'s KV (past this cache's match) from ``source``, asked with ``wire``
        (default: ``greq``'s). ``deadline`` (monotonic; default one timeout from now) bounds the
        reservation and, when ``bounded``, the source's call (else its own bound ends it).
        ``check(result)``: the policy's verdict ("" accepts). ``alternate(dead)``: one
        replacement source when ``source`` died before writing. Chunks go to ``on_chunk``.
        ``ComputeHere``: the role's connector prefills it here instead, nothing was asked."""
        stop, t0, cancelled = stop or Stop(), time.monotonic(), f"request {greq.rid} aborted during KV transfer"
        deadline = t0 + self.timeout_s if deadline is None else deadline
        try:
            res = await self._reserve(greq, on_chunk, stop, deadline)
        except asyncio.CancelledError:   # no write was posted: the engine frees it now
            self.handle.cancel(greq.rid, cancelled)
            raise
        if isinstance(res, Failed):
            self.on_failure(res.reason)
        if not isinstance(res, Reservation):
            return res
        t1 = time.monotonic()
        job = _Inbound(greq.rid, Handoff(greq.rid, deadline=deadline), len(greq.prompt_ids) - res.prefix_len)
        self.handoffs[greq.rid] = job.handoff
        try:
            result = await self._transfer(job, greq.to_wire() if wire is None else wire, res, source, stop,
                                          deadline if bounded else math.inf, check, alternate)
        except asyncio.CancelledError:
            self._fail(job, cancelled, "aborted")
            raise
        if isinstance(result, Failed):
            self._fail(job, result.error, result.reason)
            return result
        return Landed(res, result, job.asked()[0], t1 - t0, time.monotonic() - t1)

    async def _reserve(self, greq: GenerateRequest, on_chunk: Callable[[StreamChunk], None], stop: Stop,
                       deadline: float) -> Reservation | ComputeHere | Failed:
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[StreamChunk] = loop.create_future()

        def chunk(c: StreamChunk) -> None:
            if c.finish_reason is not None:
                loop.call_soon_threadsafe(end, c)
            on_chunk(c)

        def end(c: StreamChunk) -> None:
            if not ended.done():
                ended.set_result(c)

        reserved = asyncio.wrap_future(self.handle.receive(greq, chunk))
        stopped = asyncio.ensure_future(stop.event.wait())
        try:
            waits: list[asyncio.Future[Any]] = [reserved, ended, stopped]
            await asyncio.wait(waits, timeout=max(deadline - time.monotonic(), 0),
                               return_when=asyncio.FIRST_COMPLETED)
            got = reserved.result() if reserved.done() else None
            if got is not None and not stopped.done():
                return got
            if ended.done() or (reserved.done() and not stopped.done()):
                c = await asyncio.wait_for(ended, 5.0)
                error = c.error or f"request {greq.rid} ended before its KV was reserved"
                return Failed(error, "refused", final=replace(c, error=error))
        finally:
            stopped.cancel()
        self.handle.cancel(greq.rid, None)
        why = stop.reason or (f"no KV room on {self.name} for {len(greq.prompt_ids)} prompt tokens "
                              f"within {self.timeout_s:.1f}s")
        return Failed(why, "aborted" if stop.reason else "no_room")

    async def _transfer(self, job: _Inbound, wire: dict[str, Any], res: Reservation, source: KVSource,
                        stop: Stop, deadline: float, check: Callable[[PrefillResult], str],
                        alternate: Callable[[str], KVSource | None] | None) -> PrefillResult | Failed:
        self._ask(job, wire, res, source, deadline)
        redispatched = False
        while True:
            out = await self._result(job, stop, deadline)
            if not isinstance(out, Failed):
                out = await self._verify(job, res, out, check)
            if not isinstance(out, Failed):
                job.handoff.land()
                del self.handoffs[job.rid]
                return out
            alt = None
            if out.redispatch and not redispatched and alternate is not None and not stop.event.is_set():
                alt = alternate(job.asked()[0].name)
            if alt is None:
                return out
            log.warning("%s; re-dispatching %s to %s", out.error, job.rid, alt.name)
            self.on_redispatch()
            redispatched = True
            self._ask(job, wire, res, alt, deadline, redispatch=True)

    def _ask(self, job: _Inbound, wire: dict[str, Any], res: Reservation, source: KVSource, deadline: float,
             redispatch: bool = False) -> None:
        tid = secrets.randbits(63)
        job.handoff.redispatch(tid) if redispatch else job.handoff.bootstrap(tid)
        left = self.timeout_s if math.isinf(deadline) else max(deadline - time.monotonic(), 0.0)
        xfer = KVTransferRequest(tid, self.name, res.named(), digest=self.digest, deadline=time.time() + left)
        self.pump.start()
        job.source = source
        job.call = asyncio.ensure_future(source.prefill(wire, xfer.encode(), res.prefix_len))
        job.handoff.send()                                 # TRANSFERRING: a write may land from now on

    async def _result(self, job: _Inbound, stop: Stop, deadline: float) -> PrefillResult | Failed:
        source, call = job.asked()
        peer, tid = source.name, job.handoff.transfer_id
        stopped = asyncio.ensure_future(stop.event.wait())
        try:
            left = deadline - time.monotonic()
            if left > 0:
                waits: list[asyncio.Future[Any]] = [call, stopped]
                await asyncio.wait(waits, timeout=None if math.isinf(left) else left,
                                   return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():
                return Failed(stop.reason, "aborted")
            if not call.done():
                return Failed(f"KV transfer of {job.rid} from {peer} timed out after "
                              f"{self.timeout_s:.1f}s", "timeout")
            e = call.exception()
            if e is not None:
                return Failed(f"prefill worker {peer} failed for {job.rid}: {type(e).__name__}: "
                              f"{str(e)[:300]}", "prefill_failed", redispatch=isinstance(e, SourceUnavailable))
            r = call.result()
            if r.transfer_id != tid:
                return Failed(f"prefill worker {peer} answered transfer {r.transfer_id}, not {tid}", "prefill_failed")
            if not r.ok:
                return Failed(f"prefill worker {peer} failed for {job.rid}: {r.error}", "prefill_failed")
            return r
        finally:
            stopped.cancel()

    async def _verify(self, job: _Inbound, res: Reservation, result: PrefillResult,
                      check: Callable[[PrefillResult], str]) -> PrefillResult | Failed:
        why = check(result)
        if why:
            return Failed(why, "prefill_failed")
        if not self.digest:
            return result
        if self.corrupt:
            await self.handle.corrupt_page(res.named())
        got = await self.handle.page_digest(res.named())
        if got != result.digest:
            return Failed(f"KV digest mismatch for {job.rid} (transfer {job.handoff.transfer_id}): "
                          f"the source sent {result.digest or 'none'}, this worker received {got}; "
                          f"the request is failed rather than decoded from corrupt KV", "digest")
        return result

    def _fail(self, job: _Inbound, why: str, reason: str) -> None:
        h = job.handoff
        if not h.live:
            return
        self.on_failure(reason)
        if h.fail(why, aborted=reason == "aborted"):
            del self.handoffs[job.rid]
            self.handle.cancel(job.rid, why)
            return
        task = asyncio.ensure_future(self._settle(job, why))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _settle(self, job: _Inbound, why: str) -> None:
        """The source's call ended (abort it first): free the pages, or quarantine them."""
        rid, h = job.rid, job.handoff
        source, call = job.asked()
        if not call.done():
            try:
                await source.abort(rid, why)
            except Exception as e:
                log.info("abort of %s on %s failed: %s", rid, source.name, e)
        in_flight = False
        try:
            in_flight = (await asyncio.shield(call)).in_flight
        except BaseException as e:  # noqa: BLE001 - the source's call raised: nothing in flight
            log.info("the source's call for %s ended with %s", rid, type(e).__name__)
        self.handoffs.pop(rid, None)
        if h.settle(in_flight):
            self.handle.cancel(rid, why)
            return
        self.counts["quarantined_tokens"] = self.counts.get("quarantined_tokens", 0) + job.reserved_tokens
        log.error("transfer %d of %s may still be writing: %d tokens quarantined", h.transfer_id, rid,
                  job.reserved_tokens)

    @property
    def live(self) -> int:
        return sum(h.live for h in self.handoffs.values())

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the settles in progress."""
        if self.background:
            await asyncio.wait(list(self.background), timeout=timeout_s)
