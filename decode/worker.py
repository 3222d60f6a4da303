"""DecodeWorker: reserve pages, have a prefill worker WRITE the prompt's KV into them, decode."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from prometheus_client import Counter, Histogram

from tandem.core import tracing
from tandem.core.config import EngineConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, StreamChunk, TokenLogprob
from tandem.decode.connector import DecodeConnector, DecodeHandle, Reservation
from tandem.decode.groups import GroupGates
from tandem.decode.local_prefill import PrefillCosts, SentPrefixes, choose_local
from tandem.decode.migration import FrozenRequests, MigrationSource
from tandem.decode.reply_push import PUSH_FAULTS, ReplyPush
from tandem.transfer.handoff import Handoff
from tandem.transfer.messages import KVTransferRequest, PrefillResult, RegionPages
from tandem.transfer.state import TransferState
from tandem.worker.role_worker import REGION, RoleWorker, attach_tier, role_engine

log = logging.getLogger(__name__)

_PUMP_S = 0.0005
_REUSE_WAIT_S, _REUSE_WAIT_STEPS = 0.01, 200
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


@dataclass(eq=False)
class _Job:

    rid: str
    logprobs: bool = False
    prompt_logprobs: int = 0
    handoff: Handoff | None = None
    call: asyncio.Future | None = None
    peer: PrefillClient | None = None
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    ended: bool = False
    reserved_tokens: int = 0
    timings: dict = field(default_factory=dict)
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    gate: asyncio.Event | None = None

    @property
    def decoding(self) -> bool:
        return self.handoff is not None and self.handoff.state is TransferState.DONE


class DecodeWorker(ReplyPush, MigrationSource, RoleWorker):
    role = "decode"

    def __init__(self, name: str, config: EngineConfig | None = None, *, engine=None, loaded=None,
                 transfer_timeout_s: float = 30.0, local_prefill_threshold: int | None = 0,
                 agent_opts: dict | None = None, kv_digest: bool = False,
                 debug_corrupt_kv: bool = False, kv_events: bool = False,
                 kv_events_host: str = "127.0.0.1", l3: dict | None = None, reply_push: bool = True,
                 debug_push_fault: str = ""):
        """``kv_digest``: ask prefill for a digest of the pages it writes and verify it before
        decoding. ``debug_corrupt_kv``: test lever, corrupt every received page run before the
        check (so the digest must catch it). ``kv_events``: the decode cache publishes its KV
        events too (as prefill's, worker/role_worker.py ``kv_publisher``). ``l3``: the shared L3
        store's options (cache/tiers/l3/connect.py ``l3_options``), or None.

        ``local_prefill_threshold``: None, the cost rule (decode/local_prefill.py
        ``choose_local``); 0, every prompt goes to the prefill worker; N > 0, an uncached suffix
        shorter than N tokens is prefilled here.

        ``reply_push``: a request that finished normally has its sequence's KV pushed to the
        prefill worker it was given (decode/reply_push.py); ``debug_push_fault``: its test lever."""
        if debug_push_fault not in PUSH_FAULTS:
            raise ValueError(f"debug_push_fault must be one of {PUSH_FAULTS}, got {debug_push_fault!r}")
        self.reply_push, self.debug_push_fault = reply_push, debug_push_fault
        self._pushes = {}
        self.kv_publisher = None
        if engine is None:
            engine, self.kv_publisher = role_engine(name, "decode", DecodeConnector, config, loaded=loaded,
                                                    kv_events=kv_events, kv_events_host=kv_events_host)
        super().__init__(name, engine, DecodeHandle(engine), transfer_timeout_s=transfer_timeout_s,
                         agent_opts=agent_opts)
        self.l3 = attach_tier(engine, "l3", l3)
        self.handle: DecodeHandle
        self.local_prefill_threshold = local_prefill_threshold
        self.prefill_costs = PrefillCosts()
        self._sent = SentPrefixes(engine.kv.page_size)
        self.kv_digest = kv_digest
        self.debug_corrupt_kv = debug_corrupt_kv
        self._jobs: dict[str, _Job] = {}
        self.frozen = FrozenRequests(self.release_frozen, 2 * transfer_timeout_s)
        self._pump: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.counts = {"remote": 0, "local": 0, "ok": 0, "failed": 0, "aborted": 0,
                       "quarantined_tokens": 0, "redispatched": 0, "digest_failures": 0,
                       "kv_bytes_received": 0, "migrated_out": 0, "migrated_in": 0,
                       "migration_bytes": 0, "migration_reused_tokens": 0,
                       "pushed": 0, "push_failed": 0, "push_skipped": 0, "pushed_tokens": 0}
        self._groups = GroupGates()   # n > 1: the prompt's KV moves once per group (decode/groups.py)
        self.last_timings: dict = {}
        m = self.metrics
        self._path = Counter("tandem_decode_prefill_total",
                             "Requests by where their prompt was prefilled (remote, local).",
                             labelnames=("path",), registry=m)
        for path in ("remote", "local"):
            self._path.labels(path)
        self._failures = Counter("tandem_kv_receive_failures_total",
                                 "Requests whose KV was not received, by reason.",
                                 labelnames=("reason",), registry=m)
        self._redispatch = Counter("tandem_prefill_redispatch_total",
                                   "Requests re-sent to another prefill worker after theirs died "
                                   "before writing.", registry=m)
        self._digest_failures = Counter("tandem_kv_digest_failures_total",
                                        "Transfers whose received KV did not match prefill's digest.",
                                        registry=m)
        self._mig_bytes = Counter("tandem_decode_migration_bytes_total",
                                  "KV bytes received from another decode worker by migrated requests.",
                                  registry=m)
        self._mig_reused = Counter("tandem_decode_migration_reused_tokens_total",
                                   "Tokens of migrated requests found in this worker's own cache (the "
                                   "pre-copied prompt and generated pages, a shared prefix): not "
                                   "copied.", registry=m)
        self._wait = Histogram("tandem_kv_receive_seconds",
                               "Decode side: pages reserved to KV received (prefill + transfer).",
                               buckets=_BUCKETS, registry=m)

    async def generate(self, greq: GenerateRequest, prefill: PrefillClient | None = None,
                       alternate: Callable[[str], PrefillClient | None] | None = None
                       ) -> AsyncIterator[StreamChunk]:
        """Stream ``greq``'s chunks. Refusals (bad prompt) raise InvalidRequest before the first
        chunk; every other failure is a final chunk with finish_reason "abort" and
        ``error``."""
        for _ in range(_REUSE_WAIT_STEPS):   # a re-route may beat the old attempt's cleanup here
            if greq.rid not in self._jobs:
                break
            await asyncio.sleep(_REUSE_WAIT_S)
        else:
            raise InvalidRequest(f"request id {greq.rid} is already running on {self.name}")
        vocab = self.engine.arch.vocab_size
        for t in greq.prompt_ids:
            if not 0 <= t < vocab:
                raise InvalidRequest(f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        await self.handle.check_constraint(greq.params)
        n = len(greq.prompt_ids)
        await self._push_settled(greq)   # the session's previous reply is where it is going
        remote = prefill is not None and prefill.name in self.agent.peers
        if remote and self.local_prefill_threshold != 0 and greq.resume is None:
            remote = not await self._prefill_here(greq, prefill.name)
        path = "remote" if remote else "local"
        push = self._push_wanted(greq, prefill)
        if push:   # its KV is held when it finishes normally, then pushed (decode/reply_push.py)
            self.handle.connector.hold(greq.rid)
        self.counts[path] += 1
        self._path.labels(path).inc()
        if remote:
            fresh = greq.resume is None
            plps = len(greq.prompt_ids) - 1 if fresh and greq.params.prompt_logprobs is not None else 0
            job = self._jobs[greq.rid] = _Job(greq.rid, logprobs=greq.params.logprobs and fresh,
                                              prompt_logprobs=plps)
            inner = self._generate_remote(job, greq, prefill, alternate)
        else:
            inner = self.handle.stream(greq)
        t0, first, out_ids, spec = time.time(), None, [], (0, 0)
        try:
            async for c in inner:
                if c.token_ids:
                    out_ids.extend(c.token_ids)
                    first = first or time.time()
                if c.finish_reason is not None:
                    spec = c.spec_tokens
                yield c
        finally:
            await inner.aclose()  # runs the inner cleanup now, not whenever it is collected
            if push:
                self._push_ended(greq, prefill, out_ids)
            if remote:
                self._jobs.pop(greq.rid, None)
                self.last_timings = job.timings
                self._groups.open(greq, job.gate)
            if greq.trace:
                tracing.record("decode", greq.trace, t0, **{
                    "tandem.worker": self.name, "tandem.rid": greq.rid, "tandem.path": path,
                    "tandem.tokens": len(out_ids), "tandem.first_token_s": first - t0 if first else None,
                    "tandem.resumed": greq.resume is not None, "tandem.spec_drafted": spec[0],
                    "tandem.spec_accepted": spec[1]})

    async def _prefill_here(self, greq: GenerateRequest, peer: str) -> bool:
        ids = list(greq.cache_key)      # the tenant's salted key: what the caches hold
        cached = await self.handle.cached_prefix(ids)
        if self.local_prefill_threshold is not None:
            return len(ids) - cached < self.local_prefill_threshold
        if cached < self.engine.kv.page_size:      # nothing held here: no prefill worker holds less
            return False
        return choose_local(len(ids), cached, self._sent.held(peer, ids), self.prefill_costs,
                            self.engine.kv.page_size)

    async def _generate_remote(self, job: _Job, greq: GenerateRequest, prefill: PrefillClient,
                               alternate=None) -> AsyncIterator[StreamChunk]:
        rid, n = greq.rid, len(greq.prompt_ids)
        job.gate = await self._groups.enter(greq, job.aborted, self.transfer_timeout_s)
        t0 = time.monotonic()
        deadline = t0 + self.transfer_timeout_s
        try:
            res = await self._reserve(job, greq, deadline)
            if isinstance(res, StreamChunk):
                job.ended = True
                yield res
                return
            t1 = time.monotonic()
            try:
                result = await self._receive(job, greq, res, prefill, alternate, deadline)
            except TransferFailed as e:
                self._fail(job, str(e), e.reason)
                job.ended = True
                yield StreamChunk(rid, (), "", "abort", n, error=str(e), prefill_died=e.redispatch)
                return
            self._received(job, res, result, t0, t1)
            if greq.resume is not None:
                self._migrated_in(res, result)
            else:
                self._sent.add(job.peer.name, greq.cache_key)
                self.prefill_costs.observe(n - result.cached_tokens, result.prefill_s, job.timings["receive_s"])
            self.handle.activate(rid, result.first_token, None if result.first_logprob is None else
                                 TokenLogprob(result.first_token, result.first_logprob,
                                              result.first_top_logprobs))
            async for c in self._stream(job, greq, result):
                yield c
        finally:
            if not job.ended:
                if job.decoding:
                    self.handle.abort(rid)
                else:
                    self._fail(job, f"request {rid} aborted during KV transfer", "aborted")

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Abort ``rid`` here; a transfer in progress is failed and prefill is told to abort."""
        job = self._jobs.get(rid)
        if job is None or job.decoding:
            self.handle.abort(rid, error=reason or None)
            return job is not None
        job.reason = reason or f"request {rid} aborted"
        job.aborted.set()
        return True

    async def _reserve(self, job: _Job, greq: GenerateRequest, deadline: float) -> Reservation | StreamChunk:
        loop = asyncio.get_running_loop()
        fut = self.handle.receive(greq, lambda c: loop.call_soon_threadsafe(job.chunks.put_nowait, c))
        reserved = asyncio.wrap_future(fut)
        ended = asyncio.ensure_future(job.chunks.get())
        aborted = asyncio.ensure_future(job.aborted.wait())
        try:
            await asyncio.wait([reserved, ended, aborted], timeout=max(deadline - time.monotonic(), 0),
                               return_when=asyncio.FIRST_COMPLETED)
            if reserved.done() and reserved.result() is not None and not aborted.done():
                res = reserved.result()
                job.handoff = self.handoffs[job.rid] = Handoff(job.rid, deadline=deadline)
                job.reserved_tokens = len(greq.prompt_ids) - res.prefix_len
                return res
            if ended.done() or (reserved.done() and not aborted.done()):
                c = await asyncio.wait_for(ended, 5.0)
                self._count_failure("refused")
                return replace(c, error=c.error or f"request {job.rid} ended before its KV was reserved")
        finally:
            for f in (ended, aborted):
                f.cancel()
        self.handle.cancel(job.rid, None)
        self._count_failure("aborted" if job.reason else "no_room")
        why = job.reason or (f"no KV room on {self.name} for {len(greq.prompt_ids)} prompt tokens "
                             f"within {self.transfer_timeout_s:.1f}s")
        return StreamChunk(job.rid, (), "", "abort", len(greq.prompt_ids), error=why)

    async def _receive(self, job: _Job, greq: GenerateRequest, res: Reservation, prefill: PrefillClient,
                       alternate, deadline: float) -> PrefillResult:
        self._send(job, greq, res, prefill, deadline)
        redispatched = False
        while True:
            try:
                result = await self._wait_result(job, deadline)
                await self._verify(job, res, result)
                job.handoff.land()
                del self.handoffs[job.rid]
                return result
            except TransferFailed as e:
                alt = None
                if e.redispatch and not redispatched and alternate is not None and not job.aborted.is_set():
                    alt = alternate(job.peer.name)
                if alt is None:
                    raise
                log.warning("%s; re-dispatching %s to %s", e, job.rid, alt.name)
                self.counts["redispatched"] += 1
                self._redispatch.inc()
                redispatched = True
                self._send(job, greq, res, alt, deadline, redispatch=True)

    def _send(self, job: _Job, greq: GenerateRequest, res: Reservation, client: PrefillClient,
              deadline: float, redispatch: bool = False) -> None:
        tid = secrets.randbits(63)
        if redispatch:
            job.handoff.redispatch(tid)
        else:
            job.handoff.bootstrap(tid)
        left = max(deadline - time.monotonic(), 0.0)
        xfer = KVTransferRequest(tid, self.name, res.regions or (RegionPages(REGION, res.pages),),
                                 deadline=time.time() + left, digest=self.kv_digest)
        self._ensure_pump()
        job.peer = client
        job.call = asyncio.ensure_future(client.prefill(greq.to_wire(), xfer.encode(), res.prefix_len))
        job.handoff.send()                                     # TRANSFERRING: a write may land from now on

    def _received(self, job: _Job, res: Reservation, result: PrefillResult, t0: float, t1: float) -> None:
        t2 = time.monotonic()
        self._wait.observe(t2 - t1)
        job.timings.update(reserve_s=t1 - t0, prefill_s=result.prefill_s, transfer_s=result.transfer_s,
                           receive_s=t2 - t1, bytes=result.bytes, prefix_len=res.prefix_len, t2=t2)
        self.counts["ok"] += 1
        self.counts["kv_bytes_received"] += result.bytes

    def _migrated_in(self, res: Reservation, result: PrefillResult) -> None:
        self.counts["migrated_in"] += 1
        self.counts["migration_bytes"] += result.bytes
        self.counts["migration_reused_tokens"] += res.prefix_len
        self._mig_bytes.inc(result.bytes)
        self._mig_reused.inc(res.prefix_len)

    async def _stream(self, job: _Job, greq: GenerateRequest, result: PrefillResult) -> AsyncIterator[StreamChunk]:
        t2 = job.timings.pop("t2")
        while True:
            c = await job.chunks.get()
            if "activate_s" not in job.timings:
                job.timings["activate_s"] = time.monotonic() - t2
                self._groups.open(greq, job.gate)
                if c.finish_reason is None:
                    c = replace(c, prompt_tokens=len(greq.prompt_ids), cached_tokens=result.cached_tokens)
                if result.prompt_logprobs and c.token_ids:
                    c = replace(c, prompt_logprobs=result.prompt_logprobs)
            elif "first_decode_step_s" not in job.timings:
                job.timings["first_decode_step_s"] = time.monotonic() - t2 - job.timings["activate_s"]
            if c.finish_reason is not None:
                job.ended = True
                yield replace(c, cached_tokens=result.cached_tokens)
                return
            yield c

    async def _wait_result(self, job: _Job, deadline: float) -> PrefillResult:
        call, peer, tid = job.call, job.peer.name, job.handoff.transfer_id
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
            if res.transfer_id != tid:
                raise TransferFailed(f"prefill worker {peer} answered transfer {res.transfer_id}, not {tid}")
            if not res.ok:
                raise TransferFailed(f"prefill worker {peer} failed for {job.rid}: {res.error}")
            return res
        finally:
            aborted.cancel()

    async def _verify(self, job: _Job, res: Reservation, result: PrefillResult) -> None:
        if job.logprobs and result.first_logprob is None:
            raise TransferFailed(f"prefill worker {result.worker} sent no logprob for the first "
                                 f"token of {job.rid}, which asked for logprobs")
        if len(result.prompt_logprobs) != job.prompt_logprobs:
            raise TransferFailed(f"prefill worker {result.worker} sent {len(result.prompt_logprobs)} prompt "
                                 f"logprobs for {job.rid}, which needs {job.prompt_logprobs}")
        if not self.kv_digest:
            return
        regions = res.regions or (RegionPages(REGION, res.pages),)
        if self.debug_corrupt_kv:
            await self.handle.corrupt_page(regions)
        got = await self.handle.page_digest(regions)
        if got != result.digest:
            self.counts["digest_failures"] += 1
            self._digest_failures.inc()
            raise TransferFailed(f"KV digest mismatch for {job.rid} (transfer {job.handoff.transfer_id}): "
                                 f"prefill sent {result.digest or 'none'}, decode received {got}; "
                                 f"the request is failed rather than decoded from corrupt KV",
                                 reason="digest")

    def _fail(self, job: _Job, why: str, reason: str) -> None:
        h = job.handoff
        if h is None:      # queued, or reserved with no write posted: the engine frees it now
            self.handle.cancel(job.rid, why)
            return
        if not h.live:
            return
        self._count_failure(reason)
        if h.fail(why, aborted=reason == "aborted"):
            del self.handoffs[job.rid]
            self.handle.cancel(job.rid, why)
            return
        task = asyncio.ensure_future(self._settle(job, why))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _settle(self, job: _Job, why: str) -> None:
        rid, h = job.rid, job.handoff
        if not job.call.done():
            try:
                await job.peer.abort(rid, why)
            except Exception as e:
                log.info("abort of %s on %s failed: %s", rid, job.peer.name, e)
        in_flight = False
        try:
            in_flight = (await asyncio.shield(job.call)).in_flight
        except BaseException as e:  # noqa: BLE001 - the prefill call raised: nothing in flight
            log.info("prefill call for %s ended with %s", rid, type(e).__name__)
        self.handoffs.pop(rid, None)
        if h.settle(in_flight):
            self.handle.cancel(rid, why)
            return
        n = job.reserved_tokens
        self.counts["quarantined_tokens"] += n
        log.error("transfer %d of %s may still be writing: %d tokens quarantined", h.transfer_id, rid, n)

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._progress())

    async def _progress(self) -> None:
        while any(h.live for h in self.handoffs.values()):
            try:
                self.agent.progress()
            except Exception:
                log.exception("NIXL progress failed on %s", self.name)
            await asyncio.sleep(_PUMP_S)

    def _count_failure(self, reason: str) -> None:
        key = "aborted" if reason == "aborted" else "failed"
        self.counts[key] += 1
        self._failures.labels(reason).inc()

    def _extra_stats(self, snap) -> dict:
        c = self.prefill_costs
        return {"jobs": len(self._jobs), "cleanups": len(self._background),
                "prefill_costs": {"per_token_s": c.per_token_s, "overhead_s": c.overhead_s,
                                  "samples": c.samples},
                "reserved": snap.detached, "last_timings": dict(self.last_timings)}

    async def drain(self, timeout_s: float = 10.0) -> None:
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
