"""DecodeWorker: preallocate pages, have a prefill worker WRITE the prompt's KV into them, decode.

Plain Python (no Ray; decode/actor.py is the Ray shell). Owns an :class:`Engine` and a
:class:`KVTransferAgent` over the engine's KV pool. Decode never imports prefill: it reaches a
prefill worker through a :class:`PrefillClient` the shell provides.

One request (``generate``)::

    peek the prefix cache: cached = match(prompt)         (decode-side radix match)
    uncached < local_prefill_threshold, or no prefill?  -> prefill here (engine.stream)
    reserve(req) -> (p, slots for [p, n))                  transfer ALLOCATED
    KVTransferRequest(dst pages)                           BOOTSTRAPPED
    client.prefill(req, xfer, p)  ... NIXL WRITE lands     TRANSFERRING
    wait for BOTH the notification (KVTransferDone) and the call's result, until the deadline
    activate(rid, first_token) -> stream the rest          DONE

Ownership of the reserved pages: they are freed (``cancel_reservation``) only when no write into
them can still be in flight: the transfer finished, the prefill call returned or raised (its
contract), or the prefill worker is dead. On a client abort or a timeout the request fails at
once (the caller gets a final chunk with ``error``), while a background task tells prefill to
abort, waits for its answer and only then frees the pages. A result with ``in_flight=True``
quarantines the pages (never freed; counted in ``stats()["quarantined_tokens"]``).

``PrefillClient`` (what the shell passes in): ``name`` (the prefill worker's agent name),
``async prefill(req_wire, xfer_bytes, dst_prefix_len) -> dict`` (see prefill/worker.py for the
result's keys) and ``async abort(rid, reason)``. An exception from ``prefill`` means the worker is
unreachable or dead: no write of it can land any more.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tandem.core.config import EngineConfig
from tandem.core.messages import GenerateRequest
from tandem.core.types import InvalidRequest, Req, StreamChunk
from tandem.engine.metrics import register_engine_metrics
from tandem.transfer.agent import KVTransferAgent, Region
from tandem.transfer.messages import (Handshake, KVTransferDone, KVTransferRequest, RegionPages,
                                      TransferStatus, decode_message)
from tandem.transfer.state import TransferRegistry, TransferState

log = logging.getLogger(__name__)

REGION = "kv"
_NOTIF_POLL_S = 0.0005
_RESERVE_RETRY_S = 0.01
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


ENGINE_CALL_TIMEOUT_S = 120.0


async def engine_call(engine, fn, fut=None):
    """``fn(scheduler)`` on the engine thread (or await ``fut``, an ``engine.call`` future).

    Raises instead of waiting forever on a dead engine thread. The engine's future is shielded:
    cancelling the caller must not cancel it (the engine thread would then fail to set it).
    """
    err = getattr(engine, "_error", None)   # set by the engine thread when it crashes
    if err is not None:
        raise RuntimeError(f"engine thread died: {err!r}")
    fut = fut if fut is not None else engine.call(fn)
    return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), ENGINE_CALL_TIMEOUT_S)


class PrefillClient(Protocol):
    name: str

    async def prefill(self, req_wire: dict, xfer: bytes, dst_prefix_len: int) -> dict: ...

    async def abort(self, rid: str, reason: str) -> None: ...


class TransferFailed(Exception):
    """The KV of a request could not be received; the message says why. ``redispatch``: the
    prefill worker died before its write started, so another one may fill the same pages."""

    def __init__(self, message: str, redispatch: bool = False):
        super().__init__(message)
        self.redispatch = redispatch


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


class DecodeWorker:
    """Owns an Engine and a NIXL agent. All methods run on one asyncio loop (the agent is not
    thread-safe); the engine runs on its own thread and is reached through ``engine.call``."""

    def __init__(self, name: str, config: EngineConfig | None = None, *, engine=None, loaded=None,
                 transfer_timeout_s: float = 30.0, local_prefill_threshold: int = 0,
                 agent_opts: dict | None = None):
        if engine is None:
            from tandem.engine.engine import Engine
            engine = Engine(config or EngineConfig(), loaded=loaded)
        self.name = name
        self.engine = engine
        self.page_size = engine.kv_pool.page_size
        self.transfer_timeout_s = transfer_timeout_s
        self.local_prefill_threshold = local_prefill_threshold
        self.agent = KVTransferAgent(name, [Region.of(REGION, engine.kv_pool.kv_data, self.page_size)],
                                     **(agent_opts or {}))
        self.transfers = TransferRegistry()
        self._jobs: dict[str, _Job] = {}
        self._waiters: dict[int, asyncio.Future] = {}     # transfer id -> KVTransferDone future
        self._poller: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._background: set[asyncio.Task] = set()
        self.counts = {"remote": 0, "local": 0, "ok": 0, "failed": 0, "aborted": 0,
                       "quarantined_tokens": 0, "late_notifs": 0, "redispatched": 0}
        self.last_timings: dict = {}
        self.metrics = CollectorRegistry()
        register_engine_metrics(engine, worker=name, role="decode", registry=self.metrics)
        self._path = Counter("tandem_decode_prefill_total",
                             "Requests by where their prompt was prefilled (remote, local).",
                             labelnames=("path",), registry=self.metrics)
        self._failures = Counter("tandem_kv_receive_failures_total",
                                 "Requests whose KV was not received, by reason.",
                                 labelnames=("reason",), registry=self.metrics)
        self._redispatch = Counter("tandem_prefill_redispatch_total",
                                   "Requests re-sent to another prefill worker after theirs died "
                                   "before writing.", registry=self.metrics)
        self._wait = Histogram("tandem_kv_receive_seconds",
                               "Decode side: pages reserved to KV received (prefill + transfer).",
                               buckets=_BUCKETS, registry=self.metrics)

    # ------------------------------------------------------------------ bootstrap
    def handshake(self) -> bytes:
        return self.agent.handshake().encode()

    def add_peer(self, handshake: bytes) -> str:
        hs = Handshake.decode(handshake)
        self.agent.add_peer(hs.agent_name, hs.agent_metadata, hs.regions)
        return hs.agent_name

    def remove_peer(self, name: str) -> None:
        self.agent.remove_peer(name)

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
        for t in greq.prompt_ids:
            if not 0 <= t < self.engine.arch.vocab_size:
                raise InvalidRequest(f"token id {t} is outside the vocabulary (0..{self.engine.arch.vocab_size - 1})")
        n = len(greq.prompt_ids)
        remote = prefill is not None and prefill.name in self.agent.peers
        if remote and self.local_prefill_threshold > 0:
            cached = await self._call(lambda s: self._peek(s, greq))
            remote = n - cached >= self.local_prefill_threshold
        if not remote:
            self.counts["local"] += 1
            self._path.labels("local").inc()
            inner = self.engine.stream(greq)
        else:
            self.counts["remote"] += 1
            self._path.labels("remote").inc()
            job = self._jobs[greq.rid] = _Job(greq.rid)
            inner = self._generate_remote(job, greq, prefill, alternate)
        try:
            async for c in inner:
                yield c
        finally:
            await inner.aclose()  # runs the inner cleanup now, not whenever it is collected
            if remote:
                self._jobs.pop(greq.rid, None)
                self.last_timings = job.timings

    async def _generate_remote(self, job: _Job, greq: GenerateRequest, prefill: PrefillClient,
                               alternate=None) -> AsyncIterator[StreamChunk]:
        rid, n = greq.rid, len(greq.prompt_ids)
        t0 = time.monotonic()
        deadline = t0 + self.transfer_timeout_s
        req = Req(list(greq.prompt_ids), greq.params, rid=rid, session_id=greq.session_id)
        reserved = await self._reserve(req, job, deadline)   # raises InvalidRequest on a bad prompt
        if reserved is None:
            why = job.reason or (f"no KV room on {self.name} for {n} prompt tokens within "
                                 f"{self.transfer_timeout_s:.1f}s")
            self._count_failure("aborted" if job.reason else "no_room")
            yield StreamChunk(rid, (), "", "abort", n, error=why)
            return
        prefix, slots = reserved
        dst = (slots[:: self.page_size] // self.page_size).tolist()

        def start(client: PrefillClient):
            """A fresh transfer into the same reserved pages, and the prefill call for it."""
            tid = job.transfer_id = secrets.randbits(63)
            self.transfers.add(tid, max(deadline - time.monotonic(), 0.0))      # ALLOCATED
            xfer = KVTransferRequest(tid, self.name, (RegionPages(REGION, tuple(dst)),),
                                     deadline=time.time() + max(deadline - time.monotonic(), 0.0))
            self.transfers.advance(tid, TransferState.BOOTSTRAPPED)
            notif = self._waiters[tid] = asyncio.get_running_loop().create_future()
            self._ensure_poller()
            call = asyncio.ensure_future(client.prefill(greq.to_wire(), xfer.encode(), prefix))
            self.transfers.advance(tid, TransferState.TRANSFERRING)   # a write may land from now on
            return tid, notif, call

        t1 = time.monotonic()
        tid, notif, call = start(prefill)
        redispatched = False
        finished = False
        try:
            while True:
                try:
                    result = await self._wait_transfer(job, notif, call, deadline, prefill.name)
                    break
                except TransferFailed as e:
                    alt = None
                    if e.redispatch and not redispatched and alternate is not None and not job.aborted.is_set():
                        alt = alternate(prefill.name)
                    if alt is None:
                        self._fail_transfer(job, call, prefill, str(e))
                        yield StreamChunk(rid, (), "", "abort", n, error=str(e))
                        finished = True
                        return
                    # the dead worker wrote nothing that can still land: same pages, another worker
                    log.warning("%s; re-dispatching %s to %s", e, rid, alt.name)
                    self.transfers.fail(tid, str(e))
                    self.transfers.remove(tid)
                    self._waiters.pop(tid, None)
                    self.counts["redispatched"] += 1
                    self._redispatch.inc()
                    redispatched, prefill = True, alt
                    tid, notif, call = start(prefill)
            self.transfers.advance(tid, TransferState.DONE)
            self.transfers.remove(tid)
            self._waiters.pop(tid, None)
            t2 = time.monotonic()
            self._wait.observe(t2 - t1)
            job.timings.update(reserve_s=t1 - t0, prefill_s=result["prefill_s"],
                               transfer_s=result["transfer_s"], receive_s=t2 - t1,
                               bytes=result["bytes"], prefix_len=prefix)
            # (3) activate and decode; from now on an abort goes to the engine
            job.phase = "decode"
            cached = result["cached_tokens"]
            q: asyncio.Queue[StreamChunk] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            fut = self.engine.call(lambda s: s.activate(rid, result["first_token"]),
                                   on_chunk=lambda c: loop.call_soon_threadsafe(q.put_nowait, c), rid=rid)

            def activated(f) -> None:   # activate raised: no chunk will come, say why
                if f.exception() is not None:
                    err = StreamChunk(rid, (), "", "abort", n, error=f"activate failed: {f.exception()!r}")
                    loop.call_soon_threadsafe(q.put_nowait, err)

            fut.add_done_callback(activated)
            self.counts["ok"] += 1
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
                    c = replace(c, cached_tokens=cached)
                yield c
        finally:
            if not finished:   # the consumer went away (or was cancelled) mid-request
                if job.phase == "decode":
                    self.engine.abort(rid)
                else:
                    self._fail_transfer(job, call, prefill, f"request {rid} aborted during KV transfer")

    async def abort(self, rid: str, reason: str = "") -> bool:
        """Abort ``rid`` here; a transfer in progress is failed and prefill is told to abort."""
        job = self._jobs.get(rid)
        if job is None:
            self.engine.abort(rid, error=reason or None)   # a locally prefilled request, if any
            return False
        if job.phase == "decode":
            self.engine.abort(rid, error=reason or None)
        else:
            job.reason = reason or f"request {rid} aborted"
            job.aborted.set()
        return True

    # ------------------------------------------------------------------ transfer steps
    async def _reserve(self, req: Req, job: _Job, deadline: float):
        """Row + pages for the prompt beyond the cached prefix; retried until the deadline."""
        while True:
            fut = self.engine.call(lambda s: s.reserve(req))
            try:
                res = await engine_call(self.engine, None, fut)
            except asyncio.CancelledError:  # the caller left while reserving: undo it when it lands
                fut.add_done_callback(lambda f: f.exception() is None and f.result() is not None
                                      and self.engine.call(lambda s: s.cancel_reservation(req.rid)))
                raise
            if res is not None:
                return res
            if job.aborted.is_set() or time.monotonic() + _RESERVE_RETRY_S > deadline:
                return None
            try:
                await asyncio.wait_for(job.aborted.wait(), _RESERVE_RETRY_S)
            except asyncio.TimeoutError:
                pass

    async def _wait_transfer(self, job: _Job, notif: asyncio.Future, call: asyncio.Future,
                             deadline: float, peer: str) -> dict:
        """Both the notification and the prefill call's result, or TransferFailed."""
        aborted = asyncio.ensure_future(job.aborted.wait())
        try:
            while not (notif.done() and call.done()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferFailed(
                        f"KV transfer of {job.rid} from {peer} timed out after {self.transfer_timeout_s:.1f}s")
                pending = [f for f in (notif, call) if not f.done()] + [aborted]
                await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if aborted.done():
                    raise TransferFailed(job.reason)
                if call.done():
                    if call.exception() is not None:
                        e = call.exception()
                        raise TransferFailed(f"prefill worker {peer} failed for {job.rid}: "
                                             f"{type(e).__name__}: {str(e)[:300]}",
                                             redispatch=isinstance(e, PrefillUnavailable) and not notif.done())
                    res = call.result()
                    if res["status"] != TransferStatus.OK:
                        raise TransferFailed(f"prefill worker {peer} failed for {job.rid}: {res['error']}")
                if notif.done() and notif.result().status != TransferStatus.OK:
                    raise TransferFailed(f"prefill worker {peer} reported failure for {job.rid}: "
                                         f"{notif.result().error}")
            res, done = call.result(), notif.result()
            if done.first_token != res["first_token"]:
                raise TransferFailed(f"transfer {job.transfer_id}: notification says first token "
                                     f"{done.first_token}, the call {res['first_token']}")
            return res
        finally:
            aborted.cancel()

    def _fail_transfer(self, job: _Job, call: asyncio.Future, prefill: PrefillClient, why: str) -> None:
        """The request failed before activation: fail the transfer now, free its pages once no
        write into them can be in flight (in the background)."""
        if job.phase != "transfer":
            return
        job.phase = "failed"
        self.transfers.fail(job.transfer_id, why)
        self._count_failure("aborted" if job.aborted.is_set() else
                            "timeout" if "timed out" in why else "prefill_failed")
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
            res = await asyncio.shield(call)
            in_flight = bool(res.get("in_flight"))
        except BaseException as e:  # noqa: BLE001 - the prefill call raised: nothing in flight
            log.info("prefill call for %s ended with %s", rid, type(e).__name__)
        self._waiters.pop(tid, None)
        if tid in self.transfers:
            self.transfers.remove(tid)
        if in_flight:  # never free pages a write may still land in: leave them reserved
            n = await self._call(lambda s: s.reserved[rid].req.seq_len - s.reserved[rid].locked_len
                                 if rid in s.reserved else 0)
            self.counts["quarantined_tokens"] += n
            log.error("transfer %d of %s may still be writing: %d tokens quarantined", tid, rid, n)
            return
        await self._call(lambda s: s.cancel_reservation(rid, why))

    # ------------------------------------------------------------------ notifications
    def _ensure_poller(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll_notifs())

    async def _poll_notifs(self) -> None:
        """Route KVTransferDone notifications to their waiters (one loop per worker)."""
        while True:
            if not self._waiters:
                self._wake.clear()
                await self._wake.wait()
            try:
                notifs = self.agent.get_notifs()
            except Exception:  # keep routing: a waiter times out rather than hangs
                log.exception("get_notifs failed on %s", self.name)
                notifs = {}
            for peer, msgs in notifs.items():
                for raw in msgs:
                    try:
                        msg = decode_message(raw)
                    except ValueError as e:
                        log.warning("dropped a malformed notification from %s: %s", peer, e)
                        continue
                    fut = self._waiters.get(getattr(msg, "transfer_id", -1))
                    if isinstance(msg, KVTransferDone) and fut is not None and not fut.done():
                        fut.set_result(msg)
                    else:
                        self.counts["late_notifs"] += 1
            await asyncio.sleep(_NOTIF_POLL_S)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _peek(s, greq: GenerateRequest) -> int:
        """Tokens of ``greq``'s prompt the prefix cache holds (read-only, nothing locked)."""
        usable = (len(greq.prompt_ids) - 1) // s.page_size * s.page_size
        slots = s.cache.match(list(greq.prompt_ids[:usable]), greq.session_id)[0]
        return min(len(slots), usable)

    def _count_failure(self, reason: str) -> None:
        key = "aborted" if reason == "aborted" else "failed"
        self.counts[key] += 1
        self._failures.labels(reason).inc()

    async def _call(self, fn):
        return await engine_call(self.engine, fn)

    # ------------------------------------------------------------------ observability
    async def stats(self) -> dict:
        def snap(s):
            return {"available_tokens": s.alloc.available_size(), "evictable_tokens": s.cache.evictable_size(),
                    "total_tokens": s.alloc.size, "reserved": len(s.reserved), "running": len(s.running),
                    "waiting": len(s.waiting), "rows_free": s.r2t.available_size()}
        return {"worker": self.name, "role": "decode", **(await self._call(snap)),
                "live_transfers": len(self.transfers), "jobs": len(self._jobs),
                "cleanups": len(self._background), **self.counts, "last_timings": dict(self.last_timings)}

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics)

    def check_alive(self) -> None:
        """Raise if the engine thread died (the cluster then replaces this worker)."""
        err = getattr(self.engine, "_error", None)
        if err is not None:
            raise RuntimeError(f"{self.name}: engine thread died: {err!r}")

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait for background cleanups (tests; shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        try:
            self.engine.shutdown()
        finally:
            self.agent.close()
