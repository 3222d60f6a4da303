"""DecodeWorker: reserve pages, have a prefill worker WRITE the prompt's KV into them, decode.

Plain Python (no Ray; decode/actor.py is the Ray shell). An :class:`Engine` reached through a
:class:`DecodeHandle` (decode/inbox.py) and a NIXL agent over its KV pool (engine/role_worker.py).
Decode never imports prefill: it reaches a prefill worker through a :class:`PrefillClient`.

One request (``generate``)::

    cached = handle.cached_prefix(prompt)                  (decode-side radix hit; side-effect free)
    uncached < local_prefill_threshold, or no prefill?  -> prefill here (handle.stream)
    handle.reserve(req) -> Reservation(p, pages, regions)  transfer ALLOCATED -> BOOTSTRAPPED
    client.prefill(req, KVTransferRequest(regions), p)     TRANSFERRING ... NIXL WRITE lands
    PrefillResult (the one completion signal)              until the deadline
    [--kv-digest: the received pages' digest must equal the result's]
    handle.activate(rid, first_token) -> stream the rest   DONE

A hybrid model's reservation names more regions than "kv" (the SWA rows of the kept window,
the working state row; decode/inbox.py); they travel in the same KVTransferRequest and the same
WRITE, under the same ownership rules.

Ownership of the reserved pages: they are freed (``handle.cancel``) only when no write into them
can still be in flight: the prefill call returned or raised (its contract), or the prefill worker
is dead. On a client abort or a timeout the request fails at once (the caller gets a final chunk
with ``error``), while a background task tells prefill to abort, waits for its answer and only
then frees the pages. A result with ``in_flight=True`` quarantines the pages (never freed;
counted in ``stats()["quarantined_tokens"]``). While transfers are live a pump keeps the agent
progressing (writes over UCX tcp move only when the target progresses).

``PrefillClient`` (what the shell passes in): ``name`` (the prefill worker's agent name),
``async prefill(req_wire, xfer_bytes, dst_prefix_len) -> PrefillResult`` and
``async abort(rid, reason)``. :class:`PrefillUnavailable` from ``prefill`` means the worker is
dead: no write of it can land any more.

Sample groups (``n`` > 1): the prompt's KV moves once per group (decode/groups.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from prometheus_client import Counter, Histogram

from tandem.core.config import EngineConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, Req, StreamChunk, TokenLogprob
from tandem.decode.groups import GroupGates
from tandem.decode.inbox import DecodeHandle, Reservation
from tandem.engine.role_worker import REGION, RoleWorker
from tandem.transfer.messages import KVTransferRequest, PrefillResult, RegionPages
from tandem.transfer.state import TransferState

log = logging.getLogger(__name__)

_PUMP_S = 0.0005
_RESERVE_RETRY_S = 0.01
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PrefillClient(Protocol):
    name: str

    async def prefill(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult: ...

    async def abort(self, rid: str, reason: str) -> None: ...


class TransferFailed(Exception):
    """The KV of a request could not be received; the message says why. ``redispatch``: the
    prefill worker died before its write started, so another one may fill the same pages."""

    def __init__(self, message: str, redispatch: bool = False, reason: str = "prefill_failed"):
        super().__init__(message)
        self.redispatch = redispatch
        self.reason = reason


class PrefillUnavailable(Exception):
    """What a PrefillClient's ``prefill`` raises when the worker is dead (its process is gone:
    no write of it can land any more)."""


@dataclass
class _Job:
    """A request in this worker. ``phase``: "transfer" until activated, then "decode"."""

    rid: str
    transfer_id: int = 0
    phase: str = "transfer"
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    timings: dict = field(default_factory=dict)
    logprobs: bool = False     # the request asked for logprobs (prefill must send the first one's)
    gate: asyncio.Event | None = None   # a sample group's first member here: opened once it is activated


class DecodeWorker(RoleWorker):
    role = "decode"

    def __init__(self, name: str, config: EngineConfig | None = None, *, engine=None, loaded=None,
                 transfer_timeout_s: float = 30.0, local_prefill_threshold: int = 0,
                 agent_opts: dict | None = None, kv_digest: bool = False,
                 debug_corrupt_kv: bool = False, kv_events: bool = False,
                 kv_events_host: str = "127.0.0.1"):
        """``kv_digest``: ask prefill for a digest of the pages it writes and verify it before
        decoding. ``debug_corrupt_kv``: test lever, corrupt every received page run before the
        check (so the digest must catch it). ``kv_events``: the decode cache publishes its KV
        events too (as prefill's, engine/role_worker.py ``kv_publisher``)."""
        self.kv_publisher = None
        if engine is None:
            from tandem.engine.engine import Engine
            if kv_events:
                from tandem.engine.role_worker import kv_publisher
                self.kv_publisher = kv_publisher(name, (config or EngineConfig()).model, kv_events_host)
            engine = Engine(config or EngineConfig(), loaded=loaded, role="decode", name=name,
                            kv_events=self.kv_publisher)
        super().__init__(name, engine, DecodeHandle(engine), transfer_timeout_s=transfer_timeout_s,
                         agent_opts=agent_opts)
        self.handle: DecodeHandle
        self.local_prefill_threshold = local_prefill_threshold
        self.kv_digest = kv_digest
        self.debug_corrupt_kv = debug_corrupt_kv
        self._jobs: dict[str, _Job] = {}
        self._pump: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.counts = {"remote": 0, "local": 0, "ok": 0, "failed": 0, "aborted": 0,
                       "quarantined_tokens": 0, "redispatched": 0, "digest_failures": 0,
                       "kv_bytes_received": 0}
        self._groups = GroupGates()   # n > 1: the prompt's KV moves once per group (decode/groups.py)
        self.last_timings: dict = {}
        m = self.metrics
        self._path = Counter("tandem_decode_prefill_total",
                             "Requests by where their prompt was prefilled (remote, local).",
                             labelnames=("path",), registry=m)
        self._failures = Counter("tandem_kv_receive_failures_total",
                                 "Requests whose KV was not received, by reason.",
                                 labelnames=("reason",), registry=m)
        self._redispatch = Counter("tandem_prefill_redispatch_total",
                                   "Requests re-sent to another prefill worker after theirs died "
                                   "before writing.", registry=m)
        self._digest_failures = Counter("tandem_kv_digest_failures_total",
                                        "Transfers whose received KV did not match prefill's digest.",
                                        registry=m)
        self._wait = Histogram("tandem_kv_receive_seconds",
                               "Decode side: pages reserved to KV received (prefill + transfer).",
                               buckets=_BUCKETS, registry=m)

    # ------------------------------------------------------------------ one request
    async def generate(self, greq: GenerateRequest, prefill: PrefillClient | None = None,
                       alternate: Callable[[str], PrefillClient | None] | None = None
                       ) -> AsyncIterator[StreamChunk]:
        """Stream ``greq``'s chunks. Refusals (bad prompt) raise InvalidRequest before the first
        chunk; every other failure is a final chunk with finish_reason "abort" and ``error``.
        ``alternate(dead_name)``: another live prefill client, asked once when ``prefill`` dies
        (:class:`PrefillUnavailable`) before its write started; the pages stay reserved."""
        if greq.rid in self._jobs:
            raise InvalidRequest(f"request id {greq.rid} is already running on {self.name}")
        vocab = self.engine.arch.vocab_size
        for t in greq.prompt_ids:
            if not 0 <= t < vocab:
                raise InvalidRequest(f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        await self.handle.check_constraint(greq.params)   # a grammar that cannot compile: 400
        n = len(greq.prompt_ids)
        remote = prefill is not None and prefill.name in self.agent.peers
        if remote and self.local_prefill_threshold > 0:
            cached = await self.handle.cached_prefix(list(greq.prompt_ids))
            remote = n - cached >= self.local_prefill_threshold
        path = "remote" if remote else "local"
        self.counts[path] += 1
        self._path.labels(path).inc()
        if remote:
            job = self._jobs[greq.rid] = _Job(greq.rid, logprobs=greq.params.logprobs)
            inner = self._generate_remote(job, greq, prefill, alternate)
        else:
            inner = self.handle.stream(greq)
        try:
            async for c in inner:
                yield c
        finally:
            await inner.aclose()  # runs the inner cleanup now, not whenever it is collected
            if remote:
                self._jobs.pop(greq.rid, None)
                self.last_timings = job.timings
                self._groups.open(greq, job.gate)

    async def _generate_remote(self, job: _Job, greq: GenerateRequest, prefill: PrefillClient,
                               alternate=None) -> AsyncIterator[StreamChunk]:
        rid, n = greq.rid, len(greq.prompt_ids)
        job.gate = await self._groups.enter(greq, job.aborted, self.transfer_timeout_s)   # later members wait
        t0 = time.monotonic()
        deadline = t0 + self.transfer_timeout_s
        req = Req(list(greq.prompt_ids), greq.params, rid=rid, session_id=greq.session_id)
        res = await self._reserve(req, job, deadline)   # raises InvalidRequest on a bad prompt
        if res is None:
            why = job.reason or (f"no KV room on {self.name} for {n} prompt tokens within "
                                 f"{self.transfer_timeout_s:.1f}s")
            self._count_failure("aborted" if job.reason else "no_room")
            yield StreamChunk(rid, (), "", "abort", n, error=why)
            return

        def start(client: PrefillClient) -> asyncio.Future:
            """A fresh transfer into the same reserved pages, and the prefill call for it."""
            tid = job.transfer_id = secrets.randbits(63)
            left = max(deadline - time.monotonic(), 0.0)
            self.transfers.add(tid, left)                                          # ALLOCATED
            regions = res.regions or (RegionPages(REGION, res.pages),)
            xfer = KVTransferRequest(tid, self.name, regions,
                                     deadline=time.time() + left, digest=self.kv_digest)
            self.transfers.advance(tid, TransferState.BOOTSTRAPPED)
            self._ensure_pump()
            call = asyncio.ensure_future(client.prefill(greq.to_wire(), xfer.encode(), res.prefix_len))
            self.transfers.advance(tid, TransferState.TRANSFERRING)   # a write may land from now on
            return call

        t1 = time.monotonic()
        call = start(prefill)
        redispatched = finished = False
        try:
            while True:
                try:
                    result = await self._wait_result(job, call, deadline, prefill.name)
                    await self._verify(job, res, result)
                    break
                except TransferFailed as e:
                    alt = None
                    if e.redispatch and not redispatched and alternate is not None and not job.aborted.is_set():
                        alt = alternate(prefill.name)
                    if alt is None:
                        self._fail_transfer(job, call, prefill, str(e), e.reason)
                        yield StreamChunk(rid, (), "", "abort", n, error=str(e), prefill_died=e.redispatch)
                        finished = True
                        return
                    # the dead worker wrote nothing that can still land: same pages, another worker
                    log.warning("%s; re-dispatching %s to %s", e, rid, alt.name)
                    self.transfers.fail(job.transfer_id, str(e))
                    self.transfers.remove(job.transfer_id)
                    self.counts["redispatched"] += 1
                    self._redispatch.inc()
                    redispatched, prefill = True, alt
                    call = start(prefill)
            self.transfers.advance(job.transfer_id, TransferState.DONE)
            self.transfers.remove(job.transfer_id)
            t2 = time.monotonic()
            self._wait.observe(t2 - t1)
            job.timings.update(reserve_s=t1 - t0, prefill_s=result.prefill_s,
                               transfer_s=result.transfer_s, receive_s=t2 - t1,
                               bytes=result.bytes, prefix_len=res.prefix_len)
            # activate and decode; from now on an abort goes to the engine
            job.phase = "decode"
            q: asyncio.Queue[StreamChunk] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            first_lp = None if result.first_logprob is None else TokenLogprob(
                result.first_token, result.first_logprob, result.first_top_logprobs)
            fut = self.handle.activate(rid, result.first_token,
                                       lambda c: loop.call_soon_threadsafe(q.put_nowait, c), first_lp)

            def activated(f) -> None:   # activate raised: no chunk will come, say why
                if f.exception() is not None:
                    err = StreamChunk(rid, (), "", "abort", n, error=f"activate failed: {f.exception()!r}")
                    loop.call_soon_threadsafe(q.put_nowait, err)

            fut.add_done_callback(activated)
            if job.gate is not None:   # the prompt is in the tree once activation ran (engine order)
                fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._groups.open, greq, job.gate))
            self.counts["ok"] += 1
            self.counts["kv_bytes_received"] += result.bytes
            first = True
            while not finished:
                c = await q.get()
                if first:
                    job.timings["activate_s"] = time.monotonic() - t2
                    first = False
                elif "first_decode_step_s" not in job.timings:
                    job.timings["first_decode_step_s"] = time.monotonic() - t2 - job.timings["activate_s"]
                if c.finish_reason is not None:
                    finished = True
                    c = replace(c, cached_tokens=result.cached_tokens)
                yield c
        finally:
            if not finished:   # the consumer went away (or was cancelled) mid-request
                if job.phase == "decode":
                    self.handle.abort(rid)
                else:
                    self._fail_transfer(job, call, prefill, f"request {rid} aborted during KV transfer",
                                        "aborted")

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Abort ``rid`` here; a transfer in progress is failed and prefill is told to abort."""
        job = self._jobs.get(rid)
        if job is None:
            self.handle.abort(rid, error=reason or None)   # a locally prefilled request, if any
            return False
        if job.phase == "decode":
            self.handle.abort(rid, error=reason or None)
        else:
            job.reason = reason or f"request {rid} aborted"
            job.aborted.set()
        return True

    # ------------------------------------------------------------------ transfer steps
    async def _reserve(self, req: Req, job: _Job, deadline: float) -> Reservation | None:
        """Row + pages for the prompt beyond the cached prefix; retried until the deadline."""
        while True:
            task = asyncio.ensure_future(self.handle.reserve(req))
            try:
                res = await asyncio.shield(task)
            except asyncio.CancelledError:  # the caller left while reserving: undo it when it lands
                task.add_done_callback(lambda t: t.cancelled() or t.exception() is not None
                                       or t.result() is None or self.handle.cancel_later(req.rid))
                raise
            if res is not None:
                return res
            if job.aborted.is_set() or time.monotonic() + _RESERVE_RETRY_S > deadline:
                return None
            try:
                await asyncio.wait_for(job.aborted.wait(), _RESERVE_RETRY_S)
            except asyncio.TimeoutError:
                pass

    async def _wait_result(self, job: _Job, call: asyncio.Future, deadline: float,
                           peer: str) -> PrefillResult:
        """The prefill call's result (DONE), or TransferFailed."""
        aborted = asyncio.ensure_future(job.aborted.wait())
        try:
            left = deadline - time.monotonic()
            if left > 0:
                await asyncio.wait([call, aborted], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if aborted.done():
                raise TransferFailed(job.reason, reason="aborted")
            if not call.done():
                raise TransferFailed(f"KV transfer of {job.rid} from {peer} timed out after "
                                     f"{self.transfer_timeout_s:.1f}s", reason="timeout")
            if call.exception() is not None:
                e = call.exception()
                raise TransferFailed(f"prefill worker {peer} failed for {job.rid}: "
                                     f"{type(e).__name__}: {str(e)[:300]}",
                                     redispatch=isinstance(e, PrefillUnavailable))
            res = call.result()
            if res.transfer_id != job.transfer_id:
                raise TransferFailed(f"prefill worker {peer} answered transfer {res.transfer_id}, "
                                     f"not {job.transfer_id}")
            if not res.ok:
                raise TransferFailed(f"prefill worker {peer} failed for {job.rid}: {res.error}")
            return res
        finally:
            aborted.cancel()

    async def _verify(self, job: _Job, res: Reservation, result: PrefillResult) -> None:
        """``--kv-digest``: the received pages must hash to what prefill sent (no write is in
        flight any more: the result arrived). A request that asked for logprobs needs the first
        token's from prefill."""
        if job.logprobs and result.first_logprob is None:
            raise TransferFailed(f"prefill worker {result.worker} sent no logprob for the first "
                                 f"token of {job.rid}, which asked for logprobs")
        if not self.kv_digest:
            return
        regions = res.regions or (RegionPages(REGION, res.pages),)
        if self.debug_corrupt_kv:
            await self.handle.corrupt_page(regions)
        got = await self.handle.page_digest(regions)
        if got != result.digest:
            self.counts["digest_failures"] += 1
            self._digest_failures.inc()
            raise TransferFailed(f"KV digest mismatch for {job.rid} (transfer {job.transfer_id}): "
                                 f"prefill sent {result.digest or 'none'}, decode received {got}; "
                                 f"the request is failed rather than decoded from corrupt KV",
                                 reason="digest")

    def _fail_transfer(self, job: _Job, call: asyncio.Future, prefill: PrefillClient, why: str,
                       reason: str) -> None:
        """The request failed before activation: fail the transfer now, free its pages once no
        write into them can be in flight (in the background)."""
        if job.phase != "transfer":
            return
        job.phase = "failed"
        self.transfers.fail(job.transfer_id, why)
        self._count_failure(reason)
        task = asyncio.ensure_future(self._cleanup(job, call, prefill, why))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cleanup(self, job: _Job, call: asyncio.Future, prefill: PrefillClient, why: str) -> None:
        rid, tid = job.rid, job.transfer_id
        in_flight = False
        if not call.done():
            try:
                await prefill.abort(rid, why)
            except Exception as e:  # dead or unreachable: its write cannot land either way
                log.info("abort of %s on %s failed: %s", rid, prefill.name, e)
        try:
            in_flight = (await asyncio.shield(call)).in_flight
        except BaseException as e:  # noqa: BLE001 - the prefill call raised: nothing in flight
            log.info("prefill call for %s ended with %s", rid, type(e).__name__)
        if tid in self.transfers:
            self.transfers.remove(tid)
        if in_flight:  # never free pages a write may still land in: leave them reserved
            n = await self.handle.reserved_tokens(rid)
            self.counts["quarantined_tokens"] += n
            log.error("transfer %d of %s may still be writing: %d tokens quarantined", tid, rid, n)
            return
        await self.handle.cancel(rid, why)

    # ------------------------------------------------------------------ progress
    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._progress())

    async def _progress(self) -> None:
        """Keep the agent progressing while any transfer into this worker is live."""
        while len(self.transfers):
            try:
                self.agent.progress()
            except Exception:  # keep pumping: a transfer times out rather than hangs
                log.exception("NIXL progress failed on %s", self.name)
            await asyncio.sleep(_PUMP_S)

    # ------------------------------------------------------------------ helpers
    def _count_failure(self, reason: str) -> None:
        key = "aborted" if reason == "aborted" else "failed"
        self.counts[key] += 1
        self._failures.labels(reason).inc()

    def _extra_stats(self, snap) -> dict:
        return {"jobs": len(self._jobs), "cleanups": len(self._background),
                "reserved": snap.detached, "last_timings": dict(self.last_timings)}

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait for background cleanups (tests; shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        try:
            super().close()
        finally:
            if self.kv_publisher is not None:
                self.kv_publisher.close()
