"""PrefillWorker: run a prompt, then WRITE its KV pages into a decode worker's reserved pages."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram

from tandem.core import tracing
from tandem.core.config import EngineConfig
from tandem.core.kv_messages import KVTransferRequest, PrefillResult
from tandem.core.messages import GenerateRequest
from tandem.core.transfer_state import TransferState
from tandem.core.types import StreamChunk, TandemError
from tandem.prefill.connector import PrefillHandle
from tandem.prefill.store import ReplyStore
from tandem.prefill.warmup import warm_up
from tandem.worker.kv_flow import KVReceiver
from tandem.worker.kv_flow_types import Handoff, KVSource
from tandem.worker.kv_regions import KV
from tandem.worker.role_worker import RoleWorker

log = logging.getLogger(__name__)

ABORT_TOMBSTONE_S = 120.0     # an abort that arrives before its request is remembered this long

_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0)


@dataclass
class _Job:

    rid: str
    handoff: Handoff
    aborted: str = ""
    writing_since: float | None = None


class _Result:

    def __init__(self, worker: str, transfer_id: int):
        self.f: dict[str, Any] = {"transfer_id": transfer_id, "worker": worker}   # PrefillResult's fields
        self.queue_s: float | None = None

    def done(self) -> PrefillResult:
        return PrefillResult(status=TransferState.DONE, **self.f)

    def fail(self, error: str, status: TransferState = TransferState.FAILED) -> PrefillResult:
        return PrefillResult(status=status, **{**self.f, "error": error})


class PrefillWorker(RoleWorker):
    """A prefill engine composed with the worker's :class:`KVSender` (a prompt's held KV to the
    decode worker that reserved it) and a :class:`KVReceiver` (a decode worker's pushed reply:
    prefill/store.py)."""

    role, HANDLE = "prefill", PrefillHandle

    def __init__(self, name: str, config: EngineConfig | None = None, **kw):
        """RoleWorker's arguments; of core/config.py ``WorkerOptions`` this role reads
        ``transfer_timeout_s``, ``kv_events``, ``l3``, the ``debug_transfer_*`` levers and
        ``prefix_warmup``."""
        super().__init__(name, config, **kw)
        self.handle: PrefillHandle
        self._jobs: dict[str, _Job] = {}
        self._tombstones: dict[str, float] = {}   # rid -> monotonic time of an early abort
        self.counts = {"ok": 0, "failed": 0, "aborted": 0, "bytes": 0, "pages": 0,
                       "stored_tokens": 0, "store_failed": 0, "store_skipped": 0, "quarantined_tokens": 0}
        self.receiver = KVReceiver(name, self.handle, self.agent, self.transfer_timeout_s, self.counts)
        self.store_flow = ReplyStore(self.receiver, self.handle, self.counts, self.metrics)
        m = self.metrics
        self._bytes = Counter("tandem_kv_transfer_bytes_total",
                              "KV bytes written to decode workers.", registry=m)
        self._seconds = Histogram("tandem_kv_transfer_seconds",
                                  "One KV transfer: WRITE posted to completion.",
                                  buckets=_TRANSFER_BUCKETS, registry=m)
        self._outcomes = Counter("tandem_kv_transfers_total", "KV transfers by outcome.",
                                 labelnames=("status",), registry=m)

    async def store(self, req_wire: dict, source: KVSource) -> int:
        """Reply push, the receiving side (prefill/store.py): the tokens received and cached."""
        return await self.store_flow.store(req_wire, source)

    async def warm(self, prefix_ids: list[int], source: KVSource) -> int:
        """P->P warm-up (``prefix_warmup``; prefill/warmup.py): the tokens received and cached."""
        if not self.options.prefix_warmup:
            raise ValueError(f"{self.name}: prefix_warmup is off")
        return await warm_up(self.store_flow, prefix_ids, source)

    async def prefill(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> PrefillResult:
        """Prefill ``req_wire`` (a GenerateRequest on the wire) and write positions
        ``[dst_prefix_len, len(prompt))`` into ``xfer``'s (a KVTransferRequest) pages. Returns (or
        raises) only when no WRITE of it can still be in flight, except a result with
        ``in_flight=True`` (QUARANTINED); the source KV stays held until the write has ended."""
        greq = GenerateRequest.from_wire(req_wire)
        req = KVTransferRequest.decode(xfer)
        rid, tid = greq.rid, req.transfer_id
        out = _Result(self.name, tid)
        self._expire_tombstones()
        if rid in self._jobs:
            return self._count(out.fail(f"request {rid} is already being prefilled on {self.name}"))
        if self._tombstones.pop(rid, None) is not None:
            return self._count(out.fail(f"request {rid} was aborted before it reached {self.name}",
                                        TransferState.ABORTED))
        err = self._check(greq, req, dst_prefix_len)
        if err:
            return self._count(out.fail(err))
        job = self._jobs[rid] = _Job(rid, self.sender.open(rid, tid))
        task = asyncio.ensure_future(self._run_job(job, greq, req, dst_prefix_len, out))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            job.aborted = job.aborted or f"prefill of {rid} cancelled"
            self.handle.abort(rid, error=job.aborted)
            raise

    async def _run_job(self, job: _Job, greq: GenerateRequest, req: KVTransferRequest, start: int,
                       out: _Result) -> PrefillResult:
        t0 = time.time()
        try:
            return self._count(await self._run(job, greq, req, start, out))
        finally:
            del self._jobs[job.rid]
            self.sender.close(job.rid)
            if greq.trace:
                self._trace(greq, start, out, t0)

    def _trace(self, greq: GenerateRequest, start: int, out: _Result, t0: float) -> None:
        f = out.f
        n, cached = len(greq.prompt_ids), f.get("cached_tokens", 0)
        parent = tracing.record("prefill", greq.trace, t0, **{
            "tandem.worker": self.name, "tandem.rid": greq.rid, "tandem.prompt_tokens": n,
            "tandem.cached_tokens": cached, "tandem.computed_tokens": n - cached,
            "tandem.queue_s": out.queue_s, "tandem.compute_s": _less(f.get("prefill_s"), out.queue_s),
            "tandem.dst_prefix_len": start})
        if "transfer_s" in f:
            tracing.record("kv transfer", parent, time.time() - f["transfer_s"], **{
                "tandem.bytes": f.get("bytes"), "tandem.pages": f.get("pages"),
                "tandem.seconds": f["transfer_s"]})

    async def _run(self, job: _Job, greq: GenerateRequest, req: KVTransferRequest, start: int,
                   out: _Result) -> PrefillResult:
        rid, h = job.rid, job.handoff
        # (1) the prompt, one sampled token (its params: temperature, seed, min_tokens)
        p = greq.params
        params = dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        t0 = time.monotonic()
        try:
            last = await self._run_prompt(dataclasses.replace(greq, params=params))
        except TandemError as e:
            h.fail(str(e))
            return out.fail(f"prefill of {rid} on {self.name} refused: {e}")
        out.f["prefill_s"] = time.monotonic() - t0
        out.queue_s = last.queue_s
        if last.finish_reason == "abort":  # aborted or failed inside the engine: KV already freed
            h.fail(last.error or "aborted", aborted=bool(job.aborted))
            if job.aborted:
                return out.fail(job.aborted, TransferState.ABORTED)
            return out.fail(f"prefill of {rid} on {self.name} failed: {last.error or 'aborted'}")
        out.f["first_token"] = last.token_ids[-1]
        if last.logprobs:
            out.f["first_logprob"] = last.logprobs[-1].logprob
            out.f["first_top_logprobs"] = last.logprobs[-1].top
        out.f["prompt_logprobs"] = last.prompt_logprobs
        # (2) from here the request's KV is held: the sender releases it on every path
        job.writing_since = time.monotonic()
        o = self.options
        r = await self.sender.send(rid, req, start, stopped=lambda: job.aborted,
                                   delay_s=math.inf if o.debug_transfer_stall else o.debug_transfer_delay_ms / 1e3)
        out.f.update(cached_tokens=r.cached_tokens, digest=r.digest, in_flight=r.in_flight, bytes=r.bytes,
                     pages=r.pages, **({"transfer_s": r.transfer_s} if r.transfer_s else {}))
        if r.status is not TransferState.DONE:
            return out.fail(r.error, r.status)
        self._bytes.inc(r.bytes)
        self._seconds.observe(r.transfer_s)
        self.counts["bytes"] += r.bytes
        self.counts["pages"] += r.pages
        if job.aborted:  # aborted while writing: the bytes landed but decode no longer wants them
            return out.fail(job.aborted, TransferState.ABORTED)
        return out.done()

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Stop ``rid``: in the engine it is aborted (KV freed); while its write is in flight the
        write finishes first and the result says ABORTED."""
        why = reason or f"request {rid} aborted"
        job = self._jobs.get(rid)
        if job is None:
            self._tombstones[rid] = time.monotonic()
            return False
        job.aborted = why
        self.handle.abort(rid, error=why)
        return True

    def _check(self, greq: GenerateRequest, req: KVTransferRequest, start: int) -> str:
        n, ps = len(greq.prompt_ids), self.page_size
        if not 0 <= start < n or start % ps:
            return f"dst_prefix_len={start} must be a multiple of page_size={ps} below the prompt length {n}"
        if set(req.regions) != set(self.regions):
            return (f"transfer {req.transfer_id} names regions {list(req.regions)}, this worker "
                    f"sends {sorted(self.regions)}")
        need = -(-(n - start) // ps)
        if KV in self.regions and len(req.pages(KV)) != need:
            return (f"transfer {req.transfer_id}: positions [{start}, {n}) need {need} pages of "
                    f"{ps}, got {len(req.pages(KV))}")
        if req.agent_name not in self.agent.peers:
            return f"decode worker {req.agent_name!r} is not a peer of {self.name} (peers: {self.agent.peers})"
        return ""

    async def _run_prompt(self, greq: GenerateRequest) -> StreamChunk:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[StreamChunk] = loop.create_future()

        def on_chunk(c: StreamChunk) -> None:
            if c.finish_reason is not None:
                loop.call_soon_threadsafe(resolve, c)

        def resolve(c: StreamChunk) -> None:
            if not done.done():
                done.set_result(c)

        self.handle.check_alive()
        self.handle.submit(greq, on_chunk)
        return await done

    def _count(self, res: PrefillResult) -> PrefillResult:
        key = {TransferState.DONE: "ok", TransferState.ABORTED: "aborted"}.get(res.status, "failed")
        self.counts[key] += 1
        self._outcomes.labels(key).inc()
        return res

    def _expire_tombstones(self) -> None:
        cutoff = time.monotonic() - ABORT_TOMBSTONE_S
        for rid in [r for r, t in self._tombstones.items() if t < cutoff]:
            del self._tombstones[rid]

    def _extra_stats(self, snap) -> dict:
        now = time.monotonic()
        return {"held": snap.detached, "writing": {j.rid: round(now - j.writing_since, 3)
                                                   for j in self._jobs.values() if j.writing_since is not None}}

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.kv_publisher.endpoint if self.kv_publisher is not None else None


def _less(total: float | None, part: float | None) -> float | None:
    return None if total is None else total - (part or 0.0)
